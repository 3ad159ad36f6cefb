"""Public attention entry points: `flash_attention`, `ulysses_attention`, `UlyssesAttention`."""

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
from torch import nn

from . import _backend
from ._checks import build_descriptor, check_table, exchange_and_check, lengths_error
from ._layout import head_plan_error
from .comm import heads_to_seq_with_lengths, qkv_seq_to_heads_checked, resolve_group
from .reference import reference_attention


def _as_cu_seqlens(cu_seqlens, device):
    if cu_seqlens is None or isinstance(cu_seqlens, torch.Tensor):
        return cu_seqlens
    return torch.tensor(list(cu_seqlens), dtype=torch.int32, device=device)


def _local_attention(path: str, q, k, v, causal, softmax_scale, cu_seqlens):
    """Single-device attention on `[B, S, H, D]` tensors (views with any strides)."""
    if path == "reference":
        return reference_attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                   cu_seqlens=cu_seqlens)[0]
    kernels, _ = _backend.triton_kernels()
    return kernels.flash_attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                   cu_seqlens=cu_seqlens)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    softmax_scale: Optional[float] = None, cu_seqlens=None,
                    backend: Optional[str] = None) -> torch.Tensor:
    """Exact single-device attention over `[B, S, H, D]` with GQA/MQA, causal (bottom-right
    aligned when Sq != Sk) and packed documents (`cu_seqlens`, B == 1, Sq == Sk).

    backend: None/"auto" (Triton on CUDA when available, else reference), "reference",
    or "triton" (on CPU tensors only with TRITON_INTERPRET=1). "fused" means the
    distributed exchange and is treated as "triton" here.
    """
    cu_seqlens = _as_cu_seqlens(cu_seqlens, q.device)
    names = ["q", "k", "v"]
    row = build_descriptor("ulysses_attention", [q, k, v], causal=causal,
                           softmax_scale=softmax_scale, cu_seqlens=cu_seqlens)
    # Reuse the distributed checks with a world of one; Sq != Sk is allowed here.
    err = _flash_shape_error(q, k, v) or check_table("ulysses_attention", [row], names,
                                                     same_length=False)
    if not err and cu_seqlens is not None and q.shape[1] != k.shape[1]:
        err = f"cu_seqlens needs equal query and key lengths, got {q.shape[1]} and {k.shape[1]}"
    if err:
        raise ValueError(f"flash_attention: {err}")
    path = _backend.resolve_backend(backend, q.device, distributed=False, tensors=(q, k, v))
    if path == "fused":
        path = "triton"
    return _local_attention(path, q, k, v, causal, softmax_scale, cu_seqlens)


def _flash_shape_error(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            return f"{name} must be a 4-D tensor [batch, seq, heads, head_dim]"
    if k.shape != v.shape:
        return f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}"
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        return f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim"
    if q.shape[2] % k.shape[2] != 0:
        return f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})"
    return None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None,
                      causal: bool = False, softmax_scale: Optional[float] = None,
                      seq_lens: Optional[Sequence[int]] = None, cu_seqlens=None,
                      backend: Optional[str] = None) -> torch.Tensor:
    """Exact attention over the global sequence, each rank holding a contiguous slice.

    q `[B, S_local, Hq, D]`, k/v `[B, S_local, Hkv, D]`; slices follow
    `torch.tensor_split(x, P, dim=1)`. See DESIGN.md for the full contract. Returns
    `[B, S_local, Hq, D]`, differentiable with respect to q, k and v.
    """
    call = _prepare(q, k, v, group, causal, softmax_scale, seq_lens, cu_seqlens, backend)
    return _run(call, q, k, v)


@dataclass(frozen=True)
class _Call:
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


def _prepare(q, k, v, group, causal, softmax_scale, seq_lens, cu_seqlens, backend,
             local_errors: Sequence[str] = ()) -> _Call:
    """Resolve the group and the path and validate the inputs on every rank (see
    ulysses_attention). q/k/v only need the right shapes, dtype and device here;
    `local_errors` are the caller's own findings, raised on every rank like the others."""
    group, world, rank = resolve_group(group)
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
            path = _backend.resolve_backend(backend, q.device, distributed=group is not None,
                                            tensors=(q, k, v))
    except (ValueError, RuntimeError) as exc:
        local_errors.append(str(exc))
    if seq_lens is None:
        options = dict(causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
                       backend=backend if backend in _backend.BACKENDS else None)
        if group is None:
            if local_errors:
                raise ValueError(f"ulysses_attention: {local_errors[0]}")
            err = check_table("ulysses_attention",
                              [build_descriptor("ulysses_attention", [q, k, v], **options)], ["q", "k", "v"])
            if err:
                raise ValueError(f"ulysses_attention: {err}")
            lens = [q.shape[1]]
        else:
            lens = exchange_and_check("ulysses_attention", group, ["q", "k", "v"], [q, k, v],
                                      local_errors=local_errors, **options)
    else:
        if local_errors:
            raise ValueError(f"ulysses_attention: {local_errors[0]}")
        lens = _trusted_lengths(seq_lens, world, rank, q, k, v)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    return _Call(path, group, world, rank, list(lens), bool(causal), float(softmax_scale), cu_seqlens)


def _run(call: _Call, q, k, v) -> torch.Tensor:
    kw = dict(group=call.group, rank=call.rank, seq_lens=call.lens, causal=call.causal,
              softmax_scale=call.softmax_scale, cu_seqlens=call.cu_seqlens)
    if call.path == "fused":
        from . import fused
        return fused.ulysses_attention(q, k, v, **kw)
    if call.path == "triton":
        from . import _triton_path
        return _triton_path.ulysses_attention(q, k, v, **kw)
    qh, kh, vh = qkv_seq_to_heads_checked(q, k, v, call.group, call.world, call.rank, call.lens)
    out = _local_attention(call.path, qh, kh, vh, call.causal, call.softmax_scale, call.cu_seqlens)
    return heads_to_seq_with_lengths(out, call.group, call.rank, call.lens)


def _trusted_lengths(seq_lens, world, rank, q, k, v):
    """Fast path: checks that need no peer (the caller vouches for cross-rank agreement)."""
    lens = [int(n) for n in seq_lens]
    err = None
    if len(lens) != world:
        err = f"seq_lens has {len(lens)} entries but the group has {world} ranks"
    elif _flash_shape_error(q, k, v):
        err = _flash_shape_error(q, k, v)
    elif not (q.shape[1] == k.shape[1] == lens[rank]):
        err = (f"seq_lens[{rank}] = {lens[rank]} but this rank's q/k local lengths are "
               f"{q.shape[1]}/{k.shape[1]}")
    else:
        err = lengths_error(lens) or head_plan_error(world, q.shape[2], k.shape[2])
    if err:
        raise ValueError(f"ulysses_attention: {err}")
    return lens


class UlyssesAttention(nn.Module):
    """`nn.Module` around `ulysses_attention` for a fixed group and options.

    forward(q, k, v, *, seq_lens=None, cu_seqlens=None) with q `[B, S_local, Hq, D]`.
    """

    def __init__(self, group=None, *, causal: bool = False, softmax_scale: Optional[float] = None,
                 backend: Optional[str] = None):
        super().__init__()
        self.group = group
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.backend = backend

    def forward(self, q, k, v, *, seq_lens=None, cu_seqlens=None):
        return ulysses_attention(q, k, v, group=self.group, causal=self.causal,
                                 softmax_scale=self.softmax_scale, seq_lens=seq_lens,
                                 cu_seqlens=cu_seqlens, backend=self.backend)

    def extra_repr(self):
        return f"causal={self.causal}, softmax_scale={self.softmax_scale}, backend={self.backend}"
