"""The public functions (docs/architecture.md, "One call"): each resolves the group,
validates the inputs on every rank (distributed/validate.py, ring/validate.py), picks a path
(distributed/dispatch.py) and hands the work to it (reference/, triton_path/, fused/). The paths
never validate or dispatch; this module never computes.

- `ulysses_attention`: exact attention over a sequence sharded on the group (pure
  Ulysses, or Ulysses x Ring with a ring group); `prepare_attention` and `run_attention`
  are its two halves, which `UlyssesSelfAttention` (modules.py) and the HF integration use.
- `flash_attention`: single-device attention with the same semantics.
- `seq_to_heads`, `heads_to_seq`, `qkv_seq_to_heads`: the exchanges on their own.
- `ulysses_head_parallel`: a per-head token mixer (linear attention, a state-space layer)
  over the whole sequence of this rank's heads, the exchange around it.
- `shard_sequence`, `gather_sequence`: differentiable sharding along the sequence.
"""

import math
from dataclasses import dataclass
from typing import Callable, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from . import fused, reference, triton_path
from .distributed.collectives import gather_ints, gather_objects
from .distributed.dispatch import BACKENDS, Path, resolve_backend
from .distributed.groups import resolve_group
from .distributed.validate import (
    build_descriptor,
    check_single,
    check_table,
    checked_lengths,
    exchange_and_check,
    shape_error,
    trusted_attention_lengths,
)
from .exchange.heads import HeadsToSeq, SeqToHeads
from .exchange.sequence import GatherSequence, ShardSequence
from .layout import LocalHeads, head_plan_error, place_heads, split_heads_error, split_lengths
from .ring.schedule import RingSpec, ulysses_ring_attention
from .ring.shard import RingShard, gather_ring
from .ring.validate import exchange_and_check_ring, trusted_ring_lengths
from .variants import Variant, make_variant, sinks_problem

# The execution paths, by name (distributed/dispatch.py, `Path`).
PATHS = {"reference": reference.PATH, "triton": triton_path.PATH, "fused": fused.PATH}


def resolve_path(backend: Optional[str], device: torch.device, *, distributed: bool, tensors=()) -> str:
    """The name of the path that runs q/k/v `tensors` on `device` (distributed/dispatch.py): each
    faster path says why it cannot run them, dispatch picks or raises."""
    return resolve_backend(backend, device, distributed=distributed, paths=PATHS, tensors=tensors)


def path_for(backend: Optional[str], tensors: Sequence[torch.Tensor], *, distributed: bool) -> Path:
    """The `Path` object that runs `tensors` (an integration's entry: HF inference)."""
    return PATHS[resolve_path(backend, tensors[0].device, distributed=distributed, tensors=tuple(tensors))]


def _as_cu_seqlens(cu_seqlens, device):
    if cu_seqlens is None or isinstance(cu_seqlens, torch.Tensor):
        return cu_seqlens
    return torch.tensor(list(cu_seqlens), dtype=torch.int32, device=device)


def _collect(errors: List[str], find: Callable, what: str = "", default=None):
    """`find()`, or `default` with its error (prefixed by `what`) appended to `errors`.
    Before the checked exchange nothing may raise on one rank only (its peers would wait in
    the collective): problems are collected and shared instead (the one exception policy of
    the calls)."""
    try:
        return find()
    except Exception as exc:  # noqa: BLE001 - whatever it is, every rank must hear of it
        errors.append(f"{what}{exc}")
        return default


# ------------------------------------------------------------------- flash_attention

def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    softmax_scale: Optional[float] = None, cu_seqlens=None, backend: Optional[str] = None,
                    deterministic: Optional[bool] = None, window_size=(-1, -1), softcap: float = 0.0,
                    sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Exact single-device attention over `[B, S, H, D]` with GQA/MQA, causal (bottom-right
    aligned when Sq != Sk) and packed documents (`cu_seqlens`, B == 1, Sq == Sk).

    The variants (docs/api.md, "Attention variants"): `window_size=(left, right)`
    (flash_attn's convention, -1 unbounded), `softcap` (> 0: scores `c * tanh(s / c)`),
    `sinks` (`[Hq]` logits in every row's softmax denominator, differentiable), and v
    with a head dim of its own (the output has v's).

    backend: None/"auto" (Triton on CUDA when available, else reference), "reference",
    or "triton" (on CPU tensors only with TRITON_INTERPRET=1). "fused" means the
    distributed exchange and is treated as "triton" here. On the Triton path the kernel
    itself is chosen by `ULYSSES_KERNELS_ATTENTION` (triton_path/select.py): ours, or torch
    SDPA / flash_attn where they give the same result and were timed faster.
    deterministic: a bitwise-reproducible backward (None: `ULYSSES_KERNELS_DETERMINISTIC`);
    True keeps the Triton kernel (its two-kernel backward); the reference path always is.
    """
    cu_seqlens = _as_cu_seqlens(cu_seqlens, q.device)
    errors: List[str] = []
    variant = _collect(errors, lambda: make_variant(window_size, softcap, causal=causal))
    err = errors[0] if errors else shape_error(q, k, v)
    if not err:
        err = sinks_problem(sinks, q.shape[2], q.device)
    if not err:
        row = build_descriptor("ulysses_attention", [q, k, v], causal=causal,
                               softmax_scale=softmax_scale, cu_seqlens=cu_seqlens)
        # Reuse the distributed checks with a world of one; Sq != Sk is allowed here.
        err = check_table("ulysses_attention", [row], ["q", "k", "v"], same_length=False)
    if not err and cu_seqlens is not None and q.shape[1] != k.shape[1]:
        err = f"cu_seqlens needs equal query and key lengths, got {q.shape[1]} and {k.shape[1]}"
    if err:
        raise ValueError(f"flash_attention: {err}")
    name = resolve_path(backend, q.device, distributed=False, tensors=(q, k, v))
    out, _ = PATHS[name].attention(q, k, v, causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
                                   deterministic=deterministic, variant=variant, sinks=sinks)
    return out


# ----------------------------------------------------------------- ulysses_attention

def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None,
                      causal: bool = False, softmax_scale: Optional[float] = None,
                      seq_lens: Optional[Sequence[int]] = None, cu_seqlens=None,
                      backend: Optional[str] = None, ring_group=None, window_size=(-1, -1),
                      softcap: float = 0.0, sinks: Optional[torch.Tensor] = None, engine=None) -> torch.Tensor:
    """Exact attention over the global sequence, each rank holding a contiguous slice.

    q `[B, S_local, Hq, D]`, k `[B, S_local, Hkv, D]`, v `[B, S_local, Hkv, Dv]`; slices
    follow `torch.tensor_split(x, P, dim=1)`. See docs/api.md for the full contract.
    Returns `[B, S_local, Hq, Dv]`, differentiable with respect to q, k, v and sinks.

    The variants (docs/api.md, "Attention variants"), as in `flash_attention`:
    `window_size=(left, right)` over global positions (inside each document with
    `cu_seqlens`), `softcap`, and `sinks` `[Hq]` over the global heads (the same tensor
    on every rank; each rank uses its heads' slice, so its gradient is its share and the
    sum over the group is the full gradient).

    cu_seqlens: a tensor or a host sequence of ints (which a ring's block plan then uses
    without reading the device; a tensor is read once and its boundaries kept on it).

    ring_group: the Ulysses x Ring hybrid. `group` is then this rank's Ulysses group and
    `ring_group` its ring group (both from `init_sequence_parallel(sp, ring_size=R)`);
    slices follow the zigzag layout of `shard_sequence(..., ring_group=...)`, `seq_lens`
    (if given) lists every SP rank's length, ring rank major, and `cu_seqlens` covers
    the global sequence. A ring group of one rank is pure Ulysses.

    engine: a `ulysses_kernels.fused.Engine` the caller holds (`Engine.create(group)`, in the
    manner of DeepEP's Buffer: its communicator and buffers live as long as the caller
    keeps it); the fused path runs on it instead of the group's default engine, the other
    paths need none. An engine of another group, rank or device is refused on every rank.
    """
    call = prepare_attention(q, k, v, group=group, ring_group=ring_group, causal=causal,
                             softmax_scale=softmax_scale, seq_lens=seq_lens, cu_seqlens=cu_seqlens, backend=backend,
                             window_size=window_size, softcap=softcap, sinks=sinks, engine=engine)
    return run_attention(call, q, k, v, sinks=sinks)


@dataclass(frozen=True)
class AttentionCall:
    """A validated ulysses_attention call: every rank agreed on it (or the caller vouched
    for that by passing seq_lens)."""
    path: Path
    group: object
    world: int
    rank: int
    lens: List[int]          # every rank's local length in this rank's Ulysses group
    causal: bool
    softmax_scale: float
    cu_seqlens: Optional[torch.Tensor]
    ring: Optional[RingSpec] = None  # the ring of a Ulysses x Ring call
    variant: Variant = Variant()     # the window band and the softcap (variants.py)
    sinks: bool = False              # whether the call has sink logits (the tensor goes to run_attention)
    engine: object = None            # the caller's fused.Engine (None: the group's default engine)


def prepare_attention(q, k, v, *, group=None, ring_group=None, causal: bool = False,
                      softmax_scale: Optional[float] = None, seq_lens: Optional[Sequence[int]] = None,
                      cu_seqlens=None, backend: Optional[str] = None, window_size=(-1, -1),
                      softcap: float = 0.0, sinks: Optional[torch.Tensor] = None,
                      local_errors: Sequence[str] = (), engine=None) -> AttentionCall:
    """Resolve the groups and the path and validate the inputs on every rank (see
    ulysses_attention): the one preparation of pure Ulysses and Ulysses x Ring calls. q/k/v
    only need the right shapes, dtype and device here (the self-attention module passes
    stand-ins before projecting); `local_errors` are the caller's own findings, raised on
    every rank like the others."""
    group, world, rank = resolve_group(group)
    ring_group, ring_world, ring_rank = resolve_group(ring_group) if ring_group is not None else (None, 1, 0)
    ring = ring_world > 1
    errors = list(local_errors)
    device = getattr(q, "device", None)
    host_documents = cu_seqlens if cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor) else None
    cu_seqlens = _collect(errors, lambda: _as_cu_seqlens(cu_seqlens, device), "cu_seqlens could not be read: ")
    variant = _collect(errors, lambda: make_variant(window_size, softcap, causal=causal), default=Variant())
    heads = q.shape[2] if isinstance(q, torch.Tensor) and q.dim() == 4 else 0
    err = sinks_problem(sinks, heads, device)
    if err:
        errors.append(err)
        sinks = None  # not described: the message reaches every rank
    name = None
    if isinstance(q, torch.Tensor):
        name = _collect(errors, lambda: resolve_path(backend, q.device, distributed=group is not None or ring,
                                                     tensors=(q, k, v)))
        if engine is not None:
            err = _engine_problem(engine, group, world, rank, q.device)
            errors += [err] if err else []
    if seq_lens is None:
        options = dict(causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
                       backend=backend if backend in BACKENDS else None, variant=variant, sinks=sinks)
        names = ["q", "k", "v"]
        if ring:
            all_lens = exchange_and_check_ring("ulysses_attention", group, ring_group, names, [q, k, v],
                                               local_errors=errors, **options)
        elif group is None:
            if errors:
                raise ValueError(f"ulysses_attention: {errors[0]}")
            check_single("ulysses_attention", names, [q, k, v], **options)
            all_lens = [q.shape[1]]
        else:
            all_lens = exchange_and_check("ulysses_attention", group, names, [q, k, v], local_errors=errors,
                                          **options)
    else:
        if errors:
            raise ValueError(f"ulysses_attention: {errors[0]}")
        if ring:
            all_lens = trusted_ring_lengths(seq_lens, world, ring_world, ring_rank * world + rank, q, k, v)
        else:
            all_lens = trusted_attention_lengths(seq_lens, world, rank, q, k, v)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    spec = None
    if ring:
        spec = RingSpec(ring_group, ring_world, ring_rank, sum(all_lens), bool(causal), float(softmax_scale),
                        _ring_documents(cu_seqlens, sum(all_lens), q.shape[0], host_documents), variant=variant)
    lens = list(all_lens[ring_rank * world:(ring_rank + 1) * world])
    return AttentionCall(PATHS[name], group, world, rank, lens, bool(causal), float(softmax_scale), cu_seqlens, spec,
                         variant, sinks is not None, engine)


def _engine_problem(engine, group, world: int, rank: int, device) -> Optional[str]:
    """Why `engine` cannot serve this call (None when it can): collected before the checked
    exchange, so every rank hears of it."""
    if not callable(getattr(engine, "problem", None)):
        return f"engine= must be a ulysses_kernels.fused.Engine (Engine.create(group)), got {type(engine).__name__}"
    return engine.problem(group, world, rank, device)


def _ring_documents(cu_seqlens, total: int, batch: int, given=None):
    """The global document boundaries on the host, for the ring's block plan. `given`: the
    caller's own host sequence (no read). A tensor is read once (a device sync) and the
    boundaries kept on it for the next calls with the same tensor (every layer of a forward),
    until the tensor changes. The checked exchange has refused bad ones on every rank already;
    with trusted `seq_lens` they are checked here."""
    if cu_seqlens is None:
        return None
    if given is not None:
        documents = tuple(int(x) for x in given)
    else:
        kept = getattr(cu_seqlens, _HOST_DOCUMENTS, None)
        if kept is not None and kept[0] == cu_seqlens._version:
            return kept[1]
        documents = tuple(int(x) for x in cu_seqlens.reshape(-1).tolist())
    if documents[0] != 0 or documents[-1] != total or list(documents) != sorted(documents):
        raise ValueError(f"ulysses_attention: cu_seqlens must rise from 0 to the global length {total}")
    if batch != 1:
        raise ValueError(f"ulysses_attention: cu_seqlens (packed documents) needs batch size 1, got {batch}")
    if given is None:
        setattr(cu_seqlens, _HOST_DOCUMENTS, (cu_seqlens._version, documents))
    return documents


# The attribute a cu_seqlens tensor keeps its host boundaries in: (the tensor's version, boundaries).
_HOST_DOCUMENTS = "_ulysses_host_documents"


def run_attention(call: AttentionCall, q, k, v, *, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Run a prepared call on its path; `sinks` are the tensor the call was prepared with."""
    if (sinks is not None) != call.sinks:
        raise ValueError("run_attention: pass the sinks the call was prepared with (and only then)")
    if call.ring is not None:
        return ulysses_ring_attention(call.path, q, k, v, group=call.group, rank=call.rank, seq_lens=call.lens,
                                      spec=call.ring, sinks=sinks)
    return call.path.ulysses_attention(q, k, v, group=call.group, rank=call.rank, seq_lens=call.lens,
                                       causal=call.causal, softmax_scale=call.softmax_scale,
                                       cu_seqlens=call.cu_seqlens, variant=call.variant, sinks=sinks,
                                       engine=call.engine)


# ------------------------------------------------------------------------ exchanges

def seq_to_heads(x: torch.Tensor, group=None, *, seq_lens: Optional[Sequence[int]] = None) -> torch.Tensor:
    """`[B, S_local, H, D]` sequence shard -> `[B, S, H/P, D]` head shard (differentiable)."""
    group, world, rank = resolve_group(group)
    lens = checked_lengths("seq_to_heads", group, world, rank, x, seq_lens, ["x"], [x])
    err = split_heads_error(x.shape[2], world)  # checked by the exchange too; the seq_lens path needs it here
    if err:
        raise ValueError(f"seq_to_heads: {err}")
    return SeqToHeads.apply(group, rank, lens, x)[0]


def heads_to_seq(x: torch.Tensor, group=None, *, seq_lens: Optional[Sequence[int]] = None) -> torch.Tensor:
    """`[B, S, H/P, D]` head shard -> `[B, S_local, H, D]` sequence shard (differentiable).

    Rank r receives `torch.tensor_split`'s r-th slice of the sequence. By default one small
    collective first checks that every rank holds the same batch, sequence length, heads,
    head dim and dtype (a clear ValueError on every rank instead of a hang); passing
    `seq_lens` (every rank's output length, summing to S) skips it.
    """
    group, world, rank = resolve_group(group)
    if seq_lens is None:
        if group is None:
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                raise ValueError(f"heads_to_seq: x must be a 4-D tensor [batch, seq, heads_local, head_dim], "
                                 f"got {tuple(getattr(x, 'shape', ()))}")
        else:
            exchange_and_check("heads_to_seq", group, ["x"], [x])
        lens = split_lengths(x.shape[1], world)
    else:
        lens = [int(n) for n in seq_lens]
        if len(lens) != world or sum(lens) != x.shape[1] or min(lens) < 0:
            raise ValueError(f"heads_to_seq: seq_lens {lens} must have one entry per rank ({world}) "
                             f"summing to the sequence length {x.shape[1]}")
    return HeadsToSeq.apply(group, rank, lens, x)


def qkv_seq_to_heads(q, k, v, group=None, *, seq_lens: Optional[Sequence[int]] = None):
    """q `[B, S_local, Hq, D]`, k/v `[B, S_local, Hkv, D]` -> head shards over the whole
    sequence, moved by one collective. KV heads are split when `Hkv % P == 0`, else
    replicated to the `P / Hkv` ranks that need them (gradients summed back)."""
    group, world, rank = resolve_group(group)
    lens = checked_lengths("qkv_seq_to_heads", group, world, rank, q, seq_lens, ["q", "k", "v"], [q, k, v])
    if seq_lens is not None:
        err = head_plan_error(world, q.shape[2], k.shape[2])
        if err:
            raise ValueError(f"qkv_seq_to_heads: {err}")
    return SeqToHeads.apply(group, rank, lens, q, k, v)


# ------------------------------------------------------------- head-parallel token mixers

def ulysses_head_parallel(fn: Callable, tensors: Mapping[str, torch.Tensor], group=None, *,
                          seq_lens: Optional[Sequence[int]] = None, ring_group=None):
    """Run a per-head token mixer over the whole sequence (docs/api.md, "Head-parallel
    token mixers"): the attention's rule, for any layer whose heads mix tokens
    independently (a linear-attention or state-space layer).

    `tensors`: named sequence shards `[B, S_local, H_t, D_t]` (head dims and dtypes may
    differ; every rank passes the same names). They go to the head layout in one exchange
    per dtype, `[B, S, Hl_t, D_t]` over the whole sequence: a tensor's heads are split over the P ranks when
    `H_t % P == 0`, else replicated (`P % H_t == 0`; each head to the `P / H_t` consecutive
    ranks, gradients summed back), as for attention's key/value heads. Then
    `fn(local, heads)` runs on this rank's heads: `local` the dict of head shards, `heads`
    a `layout.LocalHeads` (`heads.heads(name)` the global heads of each tensor,
    `heads.output_heads(H)` those this rank must return). `fn` returns a tensor `[B, S,
    H_out / P, D]` (its output heads are split: `H_out % P == 0`), or a dict or tuple of
    them; each comes back as `[B, S_local, H_out, D]`. Differentiable.

    By default one small collective checks that every rank passes the same names, batch,
    head counts, head dims, dtype and device (a ValueError on every rank otherwise);
    passing `seq_lens` (every rank's local length) skips it. `fn` must not raise on some
    ranks only (its peers would wait in the return exchange). With a ring of more than
    one rank (`ring_group`), a ValueError: the recurrence of these layers does not run
    across ring chunks.
    """
    group, world, rank = resolve_group(group)
    _, ring_world, _ = _resolve_ring("ulysses_head_parallel", group, ring_group)
    if ring_world > 1:
        raise ValueError("ulysses_head_parallel: a ring_group of more than one rank is not supported: a head-parallel "
                         "token mixer needs the whole sequence of its heads on one rank; use Ulysses only "
                         "(ring_size=1) with sp_size dividing (or divided by) the head counts")
    names = list(tensors)
    values = [tensors[name] for name in names]
    lens = _head_parallel_lengths(group, world, rank, names, values, seq_lens)
    placements = {name: place_heads(t.shape[2], world) for name, t in zip(names, values)}
    local = {}
    for dtype in dict.fromkeys(t.dtype for t in values):   # one exchange per dtype, in first-seen order
        same = [name for name in names if tensors[name].dtype == dtype]
        local.update(zip(same, SeqToHeads.apply(group, rank, lens, *(tensors[name] for name in same))))
    local = {name: local[name] for name in names}
    out = fn(local, LocalHeads(rank, world, tuple(lens), placements))
    back = lambda x: HeadsToSeq.apply(group, rank, lens, x)  # noqa: E731
    if isinstance(out, torch.Tensor):
        return back(out)
    if isinstance(out, Mapping):
        return {name: back(x) for name, x in out.items()}
    return tuple(back(x) for x in out)


def _head_parallel_lengths(group, world: int, rank: int, names, values, seq_lens) -> List[int]:
    """Every rank's local length; the checked exchange (`gather_objects`) unless `seq_lens`."""
    if seq_lens is not None:
        lens = [int(n) for n in seq_lens]
        err = None if len(lens) == world and lens[rank] == values[0].shape[1] and min(lens) >= 0 else \
            f"seq_lens {lens} must have one entry per rank ({world}) with this rank's length {values[0].shape[1]}"
        err = err or _head_parallel_problem([_head_parallel_row(names, values)], world)
        if err:
            raise ValueError(f"ulysses_head_parallel: {err}")
        return lens
    rows = gather_objects(_head_parallel_row(names, values), group)
    err = _head_parallel_problem(rows, world)
    if err:
        raise ValueError(f"ulysses_head_parallel: {err}")
    return [row["length"] for row in rows]


def _head_parallel_row(names, values) -> dict:
    """What the ranks must agree on, described without raising (a bad input is reported to
    every rank by the check, not raised on this one)."""
    row = {"names": list(names), "length": -1, "tensors": [], "error": None}
    for name, t in zip(names, values):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            row["error"] = (f"{name} must be a 4-D tensor [batch, seq_local, heads, head_dim], got "
                            f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
            return row
        row["tensors"].append((t.shape[0], t.shape[2], t.shape[3], str(t.dtype), t.device.type))
        if row["length"] not in (-1, t.shape[1]):
            row["error"] = f"{name} has {t.shape[1]} positions but {names[0]} has {row['length']}"
        row["length"] = t.shape[1]
    return row


def _head_parallel_problem(rows, world: int) -> Optional[str]:
    if not rows[0]["names"]:
        return "no tensors to exchange"
    for r, row in enumerate(rows):
        if row["error"]:
            return f"rank {r}: {row['error']}"
        if row["names"] != rows[0]["names"]:
            return f"the ranks pass different tensors: rank 0 {rows[0]['names']}, rank {r} {row['names']}"
    first = rows[0]
    for i, name in enumerate(first["names"]):
        batch, heads, head_dim, dtype, device = first["tensors"][i]
        if first["tensors"][0][4] != device:
            return f"{name} is on {device} but {first['names'][0]} is on {first['tensors'][0][4]}"
        if batch != first["tensors"][0][0]:
            return f"{name} has batch size {batch} but {first['names'][0]} has {first['tensors'][0][0]}"
        for r, row in enumerate(rows[1:], start=1):
            if row["tensors"][i] != first["tensors"][i]:
                return (f"rank {r} and rank 0 disagree on {name}: (batch, heads, head dim, dtype, device) "
                        f"{row['tensors'][i]} vs {first['tensors'][i]}")
        try:
            place_heads(heads, world)
        except ValueError as exc:
            return f"{name}: {exc}"
    return None


# ---------------------------------------------------------- sharding along the sequence

def shard_sequence(x: torch.Tensor, group=None, dim: int = 1, *, ring_group=None) -> torch.Tensor:
    """This rank's `torch.tensor_split(x, P, dim)[rank]` of a tensor every rank holds.

    With `ring_group` (the Ulysses x Ring hybrid; `group` is then the Ulysses group):
    this rank's slice of the zigzag layout (docs/architecture.md, "Ulysses x Ring"):
    the sequence is cut into 2R chunks by `torch.tensor_split`, ring rank i keeps chunks
    i and 2R-1-i, and its Ulysses ranks `tensor_split` that portion.

    Differentiable: the backward all-gathers, so each rank gets the full gradient.
    """
    group, world, rank = resolve_group(group)
    dim = dim % x.dim()
    ring_group, ring_world, ring_rank = _resolve_ring("shard_sequence", group, ring_group)
    if ring_world > 1:
        x = RingShard.apply(ring_group, ring_world, ring_rank, dim, x)
    return ShardSequence.apply(group, world, rank, dim, x)


def gather_sequence(x: torch.Tensor, group=None, dim: int = 1,
                    seq_lens: Optional[Sequence[int]] = None, *, ring_group=None) -> torch.Tensor:
    """Concatenate every rank's shard along `dim` (inverse of `shard_sequence`).

    Local lengths follow `torch.tensor_split`; pass `seq_lens` to skip the small length
    exchange. Differentiable: the backward sums the gradients all ranks computed for each
    shard (so compute a loss on one rank, or on each rank's own shard, not P copies of it).
    """
    group, world, rank = resolve_group(group)
    dim = dim % x.dim()
    ring = _resolve_ring("gather_sequence", group, ring_group)
    if ring[1] > 1:
        return gather_ring(x, group, world, rank, ring, dim, seq_lens)
    if seq_lens is None:
        seq_lens = [n for (n,) in gather_ints([x.shape[dim]], group)]
    seq_lens = [int(n) for n in seq_lens]
    if len(seq_lens) != world or seq_lens[rank] != x.shape[dim]:
        raise ValueError(f"gather_sequence: seq_lens {seq_lens} do not match the group size {world} "
                         f"or this rank's length {x.shape[dim]}")
    return GatherSequence.apply(group, world, rank, dim, seq_lens, x)


def _resolve_ring(kind: str, group, ring_group):
    """(ring group, size, rank); with a ring, `group` must be the Ulysses group (the
    default group contains the ring's ranks: it cannot be, and the layout would be wrong)."""
    if ring_group is None:
        return None, 1, 0
    ring = resolve_group(ring_group)
    if ring[1] > 1 and (group is None or group is dist.group.WORLD):
        raise ValueError(f"{kind}: with a ring_group, pass this rank's Ulysses group as `group` (e.g. "
                         "init_sequence_parallel(...).ulysses_group), not the default group")
    return ring
