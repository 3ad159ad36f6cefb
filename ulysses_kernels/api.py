"""The public functions (docs/architecture.md, "One call"): each resolves the group,
validates the inputs on every rank (validate.py), picks a path (dispatch.py) and hands the
work to it (reference/, triton_path.py, fused/). The paths below never validate or
dispatch; this module never computes.

- `ulysses_attention`, `UlyssesAttention`: exact attention over a sequence sharded on the group.
- `flash_attention`: single-device attention with the same semantics.
- `seq_to_heads`, `heads_to_seq`, `qkv_seq_to_heads`: the exchanges on their own.
- `shard_sequence`, `gather_sequence`: differentiable sharding along the sequence.
"""

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from . import attention_select, dispatch, fused, reference, triton_path
from .extensions import triton_kernels
from .groups import collective_device, resolve_group
from .layout import head_plan_error, split_heads_error, split_lengths
from .reference.exchange import HeadsToSeq, SeqToHeads
from .reference.ring import RingSpec, TorchBlockOps
from .reference.sequence import GatherSequence, RingShard, ShardSequence, zigzag_restore
from .validate import (
    build_descriptor,
    check_single,
    check_table,
    checked_lengths,
    exchange_and_check,
    shape_error,
    trusted_attention_lengths,
)
from .validate_ring import exchange_and_check_ring, trusted_ring_lengths
from .zigzag import portion_lengths

# The `ulysses_attention` of each path: same arguments, validated inputs.
_PATHS = {"reference": reference.ulysses_attention, "triton": triton_path.ulysses_attention,
          "fused": fused.ulysses_attention}


def resolve_path(backend: Optional[str], device: torch.device, *, distributed: bool, tensors=()) -> str:
    """The path that runs q/k/v `tensors` on `device` (see dispatch.py): each faster path
    says why it cannot run them, dispatch picks or raises."""
    problems = {"triton": lambda: triton_path.problem(device, tensors),
                "fused": lambda: fused.problem(device, tensors)}
    return dispatch.resolve_backend(backend, device, distributed=distributed, problems=problems)


def _as_cu_seqlens(cu_seqlens, device):
    if cu_seqlens is None or isinstance(cu_seqlens, torch.Tensor):
        return cu_seqlens
    return torch.tensor(list(cu_seqlens), dtype=torch.int32, device=device)


# ------------------------------------------------------------------- flash_attention

def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    softmax_scale: Optional[float] = None, cu_seqlens=None,
                    backend: Optional[str] = None) -> torch.Tensor:
    """Exact single-device attention over `[B, S, H, D]` with GQA/MQA, causal (bottom-right
    aligned when Sq != Sk) and packed documents (`cu_seqlens`, B == 1, Sq == Sk).

    backend: None/"auto" (Triton on CUDA when available, else reference), "reference",
    or "triton" (on CPU tensors only with TRITON_INTERPRET=1). "fused" means the
    distributed exchange and is treated as "triton" here. On the Triton path the kernel
    itself is chosen by `ULYSSES_KERNELS_ATTENTION` (attention_select.py): ours, or torch
    SDPA / flash_attn where they give the same result and were timed faster.
    """
    cu_seqlens = _as_cu_seqlens(cu_seqlens, q.device)
    row = build_descriptor("ulysses_attention", [q, k, v], causal=causal,
                           softmax_scale=softmax_scale, cu_seqlens=cu_seqlens)
    # Reuse the distributed checks with a world of one; Sq != Sk is allowed here.
    err = shape_error(q, k, v) or check_table("ulysses_attention", [row], ["q", "k", "v"], same_length=False)
    if not err and cu_seqlens is not None and q.shape[1] != k.shape[1]:
        err = f"cu_seqlens needs equal query and key lengths, got {q.shape[1]} and {k.shape[1]}"
    if err:
        raise ValueError(f"flash_attention: {err}")
    path = resolve_path(backend, q.device, distributed=False, tensors=(q, k, v))
    if path == "reference":
        return reference.reference_attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                             cu_seqlens=cu_seqlens)[0]
    kernels, reason = triton_kernels()
    if kernels is None:
        raise RuntimeError(f"flash_attention: the Triton kernels cannot be used: {reason}")
    # The Triton path's kernel: ours, or torch SDPA / flash_attn where they compute the same
    # thing and were timed faster (attention_select.py, ULYSSES_KERNELS_ATTENTION).
    return attention_select.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens)


# ----------------------------------------------------------------- ulysses_attention

def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None,
                      causal: bool = False, softmax_scale: Optional[float] = None,
                      seq_lens: Optional[Sequence[int]] = None, cu_seqlens=None,
                      backend: Optional[str] = None, ring_group=None) -> torch.Tensor:
    """Exact attention over the global sequence, each rank holding a contiguous slice.

    q `[B, S_local, Hq, D]`, k/v `[B, S_local, Hkv, D]`; slices follow
    `torch.tensor_split(x, P, dim=1)`. See the README for the full contract. Returns
    `[B, S_local, Hq, D]`, differentiable with respect to q, k and v.

    ring_group: the Ulysses x Ring hybrid. `group` is then this rank's Ulysses group and
    `ring_group` its ring group (both from `init_sequence_parallel(sp, ring_size=R)`);
    slices follow the zigzag layout of `shard_sequence(..., ring_group=...)`, `seq_lens`
    (if given) lists every SP rank's length, ring rank major, and `cu_seqlens` covers
    the global sequence. A ring group of one rank is pure Ulysses.
    """
    call = prepare_attention(q, k, v, group, causal, softmax_scale, seq_lens, cu_seqlens, backend,
                             ring_group=ring_group)
    return run_attention(call, q, k, v)


@dataclass(frozen=True)
class AttentionCall:
    """A validated ulysses_attention call: every rank agreed on it (or the caller vouched
    for that by passing seq_lens)."""
    path: str
    group: object
    world: int
    rank: int
    lens: List[int]
    causal: bool
    softmax_scale: float
    cu_seqlens: Optional[torch.Tensor]
    ring: Optional[RingSpec] = None  # the ring of a Ulysses x Ring call


def prepare_attention(q, k, v, group, causal, softmax_scale, seq_lens, cu_seqlens, backend,
                      local_errors: Sequence[str] = (), ring_group=None) -> AttentionCall:
    """Resolve the group and the path and validate the inputs on every rank (see
    ulysses_attention). q/k/v only need the right shapes, dtype and device here (the
    self-attention module passes stand-ins before projecting); `local_errors` are the
    caller's own findings, raised on every rank like the others."""
    group, world, rank = resolve_group(group)
    ring_group, ring_world, ring_rank = resolve_group(ring_group) if ring_group is not None else (None, 1, 0)
    if ring_world > 1:
        return _prepare_ring(q, k, v, group, world, rank, (ring_group, ring_world, ring_rank), causal,
                             softmax_scale, seq_lens, cu_seqlens, backend, local_errors)
    # Nothing below may raise on one rank only before the checked exchange (its peers
    # would wait in the collective): local problems are collected and shared instead.
    local_errors = list(local_errors)
    path = None
    try:
        cu_seqlens = _as_cu_seqlens(cu_seqlens, getattr(q, "device", None))
    except Exception as exc:  # noqa: BLE001
        local_errors.append(f"cu_seqlens could not be read: {exc}")
        cu_seqlens = None
    try:
        if isinstance(q, torch.Tensor):
            path = resolve_path(backend, q.device, distributed=group is not None, tensors=(q, k, v))
    except (ValueError, RuntimeError) as exc:
        local_errors.append(str(exc))
    if seq_lens is None:
        options = dict(causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
                       backend=backend if backend in dispatch.BACKENDS else None)
        if group is None:
            if local_errors:
                raise ValueError(f"ulysses_attention: {local_errors[0]}")
            check_single("ulysses_attention", ["q", "k", "v"], [q, k, v], **options)
            lens = [q.shape[1]]
        else:
            lens = exchange_and_check("ulysses_attention", group, ["q", "k", "v"], [q, k, v],
                                      local_errors=local_errors, **options)
    else:
        if local_errors:
            raise ValueError(f"ulysses_attention: {local_errors[0]}")
        lens = trusted_attention_lengths(seq_lens, world, rank, q, k, v)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    return AttentionCall(path, group, world, rank, list(lens), bool(causal), float(softmax_scale), cu_seqlens)


def _prepare_ring(q, k, v, group, world, rank, ring, causal, softmax_scale, seq_lens, cu_seqlens, backend,
                  local_errors) -> AttentionCall:
    """prepare_attention for a Ulysses x Ring call (validate_ring.py checks the grid)."""
    ring_group, ring_world, ring_rank = ring
    local_errors = list(local_errors)
    path = None
    try:
        cu_seqlens = _as_cu_seqlens(cu_seqlens, getattr(q, "device", None))
        if isinstance(q, torch.Tensor):
            path = resolve_path(backend, q.device, distributed=True, tensors=(q, k, v))
    except (ValueError, RuntimeError, TypeError) as exc:
        local_errors.append(str(exc))
    if seq_lens is None:
        options = dict(causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
                       backend=backend if backend in dispatch.BACKENDS else None)
        all_lens = exchange_and_check_ring("ulysses_attention", group, ring_group, ["q", "k", "v"], [q, k, v],
                                           local_errors=local_errors, **options)
    else:
        if local_errors:
            raise ValueError(f"ulysses_attention: {local_errors[0]}")
        all_lens = trusted_ring_lengths(seq_lens, world, ring_world, ring_rank * world + rank, q, k, v)
    total = sum(all_lens)
    documents = None
    if cu_seqlens is not None:  # the ring's block plan needs the boundaries on the host
        documents = tuple(int(x) for x in cu_seqlens.reshape(-1).tolist())
        if documents[0] != 0 or documents[-1] != total or list(documents) != sorted(documents):
            raise ValueError(f"ulysses_attention: cu_seqlens must rise from 0 to the global length {total}")
        if q.shape[0] != 1:  # checked exchange: already refused on every rank; trusted path: here
            raise ValueError(f"ulysses_attention: cu_seqlens (packed documents) needs batch size 1, got {q.shape[0]}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    # The ring's blocks run on the path's attention: torch math, or the Triton kernels
    # (the fused path too; it brings its own transfers, fused/ring.py).
    block_ops = TorchBlockOps if path == "reference" else triton_path.TritonBlockOps
    spec = RingSpec(ring_group, ring_world, ring_rank, total, bool(causal), float(softmax_scale), documents,
                    block_ops)
    lens = all_lens[ring_rank * world:(ring_rank + 1) * world]
    return AttentionCall(path, group, world, rank, list(lens), bool(causal), float(softmax_scale), cu_seqlens,
                         spec)


def run_attention(call: AttentionCall, q, k, v) -> torch.Tensor:
    """Run a prepared call on its path."""
    return _PATHS[call.path](q, k, v, group=call.group, rank=call.rank, seq_lens=call.lens, causal=call.causal,
                             softmax_scale=call.softmax_scale, cu_seqlens=call.cu_seqlens, ring=call.ring)


class UlyssesAttention(nn.Module):
    """`nn.Module` around `ulysses_attention` for a fixed group and options.

    forward(q, k, v, *, seq_lens=None, cu_seqlens=None) with q `[B, S_local, Hq, D]`.
    """

    def __init__(self, group=None, *, causal: bool = False, softmax_scale: Optional[float] = None,
                 backend: Optional[str] = None, ring_group=None):
        super().__init__()
        self.group = group
        self.ring_group = ring_group
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.backend = backend

    def forward(self, q, k, v, *, seq_lens=None, cu_seqlens=None):
        return ulysses_attention(q, k, v, group=self.group, causal=self.causal,
                                 softmax_scale=self.softmax_scale, seq_lens=seq_lens,
                                 cu_seqlens=cu_seqlens, backend=self.backend, ring_group=self.ring_group)

    def extra_repr(self):
        return f"causal={self.causal}, softmax_scale={self.softmax_scale}, backend={self.backend}"


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
    ring_group, ring_world, ring_rank = _resolve_ring("gather_sequence", group, ring_group)
    if ring_world > 1:
        return _gather_ring(x, group, world, rank, (ring_group, ring_world, ring_rank), dim, seq_lens)
    if seq_lens is None:
        if group is None:
            seq_lens = [x.shape[dim]]
        else:
            mine = torch.tensor([x.shape[dim]], dtype=torch.int64, device=collective_device(group))
            got = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(got, mine, group=group)
            seq_lens = [int(g.item()) for g in got]
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


def _all_lengths(n: int, group) -> List[int]:
    mine = torch.tensor([n], dtype=torch.int64, device=collective_device(group))
    got = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(got, mine, group=group)
    return [int(g.item()) for g in got]


def _gather_ring(x, group, world, rank, ring, dim, seq_lens):
    """gather_sequence over the Ulysses x Ring grid: Ulysses group, then ring group, then
    the zigzag portions back in global order. seq_lens: every SP rank's, ring rank major."""
    ring_group, ring_world, ring_rank = ring
    if seq_lens is None:
        ulysses_lens = _all_lengths(x.shape[dim], group) if group is not None else [x.shape[dim]]
        portions = _all_lengths(sum(ulysses_lens), ring_group)
    else:
        seq_lens = [int(n) for n in seq_lens]
        if len(seq_lens) != world * ring_world:
            raise ValueError(f"gather_sequence: with a ring group seq_lens must list all {world * ring_world} "
                             f"SP ranks' lengths (ring rank major), got {len(seq_lens)}")
        ulysses_lens = seq_lens[ring_rank * world:(ring_rank + 1) * world]
        portions = [sum(seq_lens[r * world:(r + 1) * world]) for r in range(ring_world)]
    total = sum(portions)
    if ulysses_lens[rank] != x.shape[dim] or portions != portion_lengths(total, ring_world):
        raise ValueError(f"gather_sequence: local lengths {ulysses_lens} / ring portions {portions} are not the "
                         f"Ulysses x Ring layout of {total} tokens (see shard_sequence(..., ring_group=...))")
    portion = GatherSequence.apply(group, world, rank, dim, ulysses_lens, x)
    whole = GatherSequence.apply(ring_group, ring_world, ring_rank, dim, portions, portion)
    return zigzag_restore(whole, total, ring_world, dim)
