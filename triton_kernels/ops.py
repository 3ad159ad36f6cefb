"""torch.library custom ops, autograd glue and the Python API of the Triton attention.

Custom ops (namespace ``ulysses_kernels``):

* ``triton_flash_fwd(q, k, v, causal, softmax_scale, cu_seqlens, deterministic=False) -> (out, lse)``
  (deterministic only travels to the backward)
* ``triton_flash_bwd(do, q, k, v, out, lse, causal, softmax_scale, cu_seqlens, deterministic=False)
  -> (dq, dk, dv)``
* ``triton_flash_fwd_out(q, k, v, out!, lse!, causal, softmax_scale, cu_seqlens, seq_splits, batch) -> ()``
* ``triton_flash_bwd_out(do, q, k, v, out, lse, dq!, dk!, dv!, causal, softmax_scale, cu_seqlens,
  seq_splits, batch, deterministic=False) -> ()``

Backward modes: by default dQ is accumulated with fp32 atomics (5 GEMMs, run-to-run
differences of rounding order); ``deterministic=True`` (or the environment variable
``ULYSSES_KERNELS_DETERMINISTIC=1``) uses the separate dQ kernel (7 GEMMs, bitwise
reproducible).

The functional pair (4-D ``[B, S, H, D]`` tensors, any strides) carries the autograd
formula used by :func:`flash_attention`; the in-place pair backs the low-level
:func:`flash_attention_forward` / :func:`flash_attention_backward` used by the Ulysses
layer on the all-to-all buffers.
"""

import math
from typing import List, Optional, Tuple

import torch

from ._common import MAX_ROW_STRIDE, block_d, interpreting, split_mode
from .flash_bwd import deterministic_default, launch_bwd
from .flash_fwd import launch_fwd

_NS = "ulysses_kernels"
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------- helpers


class _Geom:
    """Shapes and (batch, seq, head, dim) strides of one call."""

    def __init__(self, q, k, seq_splits, batch):
        self.split = q.dim() == 3
        if self.split:
            self.batch = int(batch) if batch is not None else 1
            rows_q, self.hq, self.d = q.shape
            rows_k, self.hkv = k.shape[0], k.shape[1]
            if self.batch < 1 or rows_q % self.batch or rows_k % self.batch:
                raise ValueError(f"flash_attention: {rows_q} query rows / {rows_k} key rows are not "
                                 f"divisible by batch={self.batch}")
            self.sq = rows_q // self.batch
            self.sk = rows_k // self.batch
        else:
            if seq_splits != 1:
                raise ValueError("flash_attention: seq_splits > 1 needs 3-D [B*S, H, D] buffer views")
            self.batch, self.sq, self.hq, self.d = q.shape
            self.sk, self.hkv = k.shape[1], k.shape[2]
        self.seq_splits = int(seq_splits)
        # The kernels' SPLIT constexpr: strided, buffer with affine tiles, or per token.
        self.mode = split_mode(self.split, self.batch, self.seq_splits, (self.sq, self.sk))
        if self.batch * self.hq > 65535:
            raise ValueError(f"flash_attention: batch * heads = {self.batch * self.hq} exceeds the "
                             f"CUDA grid limit of 65535")

    def strides(self, t):
        """(batch, seq, head, dim) element strides of t as the kernels' SPLIT mode reads them."""
        if abs(t.stride(-3)) > MAX_ROW_STRIDE:  # tile offsets are int32 (see _common.seq_offsets)
            raise ValueError(f"flash_attention: a sequence stride of {t.stride(-3)} elements exceeds "
                             f"{MAX_ROW_STRIDE}; pass contiguous tensors")
        if self.split:
            # A buffer read as strided (mode 0: batch 1, or one block) is [B, S] rows.
            stride_b = (t.shape[0] // self.batch) * t.stride(0) if self.mode == 0 else 0
            return (stride_b, t.stride(0), t.stride(1), t.stride(2))
        return tuple(t.stride())


def inputs_problem(q, k, v) -> Optional[str]:
    """Why the kernels cannot take these q, k, v (None when they can): THE rule of what the
    kernels support, which the Ulysses paths ask before choosing them. One dtype among
    float16/bfloat16/float32, and one head dim for q and k that is a multiple of 16 up to
    256."""
    if any(t.dtype != q.dtype for t in (k, v)) or q.dtype not in _FLOAT_DTYPES:
        return (f"the kernels take float16/bfloat16/float32 inputs of one dtype, got "
                f"{'/'.join(str(t.dtype).replace('torch.', '') for t in (q, k, v))}")
    d = q.shape[-1]
    if k.shape[-1] != d or d % 16 != 0 or d > 256 or d == 0:
        return (f"the kernels need a head dim that is a multiple of 16 up to 256, equal for q and k, "
                f"got {d} and {k.shape[-1]}")
    return None


def _check_inputs(q, k, v, split: bool, name="flash_attention"):
    want = 3 if split else 4
    for n, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != want:
            raise ValueError(f"{name}: {n} must be {want}-D, got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"{name}: k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    problem = inputs_problem(q, k, v)
    if problem:
        raise ValueError(f"{name}: {problem}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"{name}: query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if not split and q.shape[0] != k.shape[0]:
        raise ValueError(f"{name}: batch sizes differ: {q.shape[0]} vs {k.shape[0]}")
    if q.device.type == "cpu" and not interpreting():
        raise RuntimeError(f"{name}: CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)")


def _kernel_cu_seqlens(cu_seqlens, total):
    """Document ids per position and the boundary table the kernels index.

    Without a host sync, the table is made safe: ``[0, cu[1:-1]..., total]`` plus
    ``cu[-1]`` when it is short of ``total``, i.e. the semantics of
    ``reference.document_ids`` (positions past ``cu[-1]`` form one last document).
    """
    if cu_seqlens is None:
        return None, None
    cu = cu_seqlens.to(device=cu_seqlens.device, dtype=torch.int64)
    bounds = cu[1:]
    positions = torch.arange(total, device=cu.device, dtype=torch.int64)
    docs = torch.searchsorted(bounds, positions, right=True).to(torch.int32)
    table = torch.cat([torch.zeros(1, dtype=torch.int64, device=cu.device), bounds,
                       torch.full((1,), total, dtype=torch.int64, device=cu.device)])
    return docs.contiguous(), table.to(torch.int32).contiguous()


def _deterministic(value: Optional[bool]) -> bool:
    return deterministic_default() if value is None else bool(value)


def _resolve_scale(softmax_scale, d):
    return float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)


def _run_fwd(q, k, v, out, lse, causal, softmax_scale, cu_seqlens, seq_splits, batch):
    g = _Geom(q, k, seq_splits, batch)
    if cu_seqlens is not None and g.batch != 1:
        raise ValueError(f"flash_attention: cu_seqlens needs batch 1, got {g.batch}")
    if cu_seqlens is not None and g.sq != g.sk:
        raise ValueError(f"flash_attention: cu_seqlens needs equal query and key lengths, "
                         f"got {g.sq} and {g.sk}")
    if g.sq == 0 or g.batch == 0 or g.hq == 0:
        return
    if g.sk == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return
    docs, table = _kernel_cu_seqlens(cu_seqlens, g.sk)
    launch_fwd(q, k, v, out, lse, sq_strides=g.strides(q), sk_strides=g.strides(k),
               sv_strides=g.strides(v), so_strides=g.strides(out),
               batch=g.batch, seqlen_q=g.sq, seqlen_k=g.sk, num_q_heads=g.hq, num_kv_heads=g.hkv,
               head_dim=g.d, causal=causal, softmax_scale=softmax_scale, docs=docs,
               cu_seqlens=table, split=g.mode, seq_splits=g.seq_splits)


def _run_bwd(do, q, k, v, out, lse, dq, dk, dv, causal, softmax_scale, cu_seqlens, seq_splits, batch,
             deterministic):
    g = _Geom(q, k, seq_splits, batch)
    if g.batch == 0 or g.hq == 0:
        return
    if g.sq == 0 or g.sk == 0:
        dq.zero_()
        dk.zero_()
        dv.zero_()
        return
    docs, table = _kernel_cu_seqlens(cu_seqlens, g.sk)
    launch_bwd(do, q, k, v, out, lse, dq, dk, dv, docs, table, strides_of=g.strides, batch=g.batch,
               seqlen_q=g.sq, seqlen_k=g.sk, num_q_heads=g.hq, num_kv_heads=g.hkv, head_dim=g.d,
               block_d=block_d(g.d), causal=causal, softmax_scale=softmax_scale, split=g.mode,
               seq_splits=g.seq_splits, deterministic=deterministic)


# ------------------------------------------------------------------------ custom ops


@torch.library.custom_op(f"{_NS}::triton_flash_fwd", mutates_args=())
def triton_flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                     softmax_scale: float, cu_seqlens: Optional[torch.Tensor],
                     deterministic: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    B, Sq, Hq, D = q.shape
    out = torch.empty((B, Sq, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
    _run_fwd(q, k, v, out, lse, causal, softmax_scale, cu_seqlens, 1, None)
    return out, lse


@triton_flash_fwd.register_fake
def _(q, k, v, causal, softmax_scale, cu_seqlens, deterministic=False):
    B, Sq, Hq, D = q.shape
    return (q.new_empty((B, Sq, Hq, D)), q.new_empty((B, Hq, Sq), dtype=torch.float32))


@torch.library.custom_op(f"{_NS}::triton_flash_bwd", mutates_args=())
def triton_flash_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, lse: torch.Tensor, causal: bool, softmax_scale: float,
                     cu_seqlens: Optional[torch.Tensor], deterministic: bool = False
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    _run_bwd(do, q, k, v, out, lse, dq, dk, dv, causal, softmax_scale, cu_seqlens, 1, None, deterministic)
    return dq, dk, dv


@triton_flash_bwd.register_fake
def _(do, q, k, v, out, lse, causal, softmax_scale, cu_seqlens, deterministic=False):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))


@torch.library.custom_op(f"{_NS}::triton_flash_fwd_out", mutates_args=("out", "lse"))
def triton_flash_fwd_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, causal: bool, softmax_scale: float,
                         cu_seqlens: Optional[torch.Tensor], seq_splits: int, batch: int) -> None:
    _run_fwd(q, k, v, out, lse, causal, softmax_scale, cu_seqlens, seq_splits, batch)


@triton_flash_fwd_out.register_fake
def _(q, k, v, out, lse, causal, softmax_scale, cu_seqlens, seq_splits, batch):
    return None


@torch.library.custom_op(f"{_NS}::triton_flash_bwd_out", mutates_args=("dq", "dk", "dv"))
def triton_flash_bwd_out(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
                         dv: torch.Tensor, causal: bool, softmax_scale: float,
                         cu_seqlens: Optional[torch.Tensor], seq_splits: int, batch: int,
                         deterministic: bool = False) -> None:
    _run_bwd(do, q, k, v, out, lse, dq, dk, dv, causal, softmax_scale, cu_seqlens, seq_splits, batch,
             deterministic)


@triton_flash_bwd_out.register_fake
def _(do, q, k, v, out, lse, dq, dk, dv, causal, softmax_scale, cu_seqlens, seq_splits, batch,
      deterministic=False):
    return None


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, cu_seqlens, *rest = inputs
    out, lse = output
    ctx.deterministic = bool(rest[0]) if rest else False
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.causal = causal
    ctx.softmax_scale = softmax_scale
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    if grad_out is None:
        return None, None, None, None, None, None, None
    dq, dk, dv = triton_flash_bwd(grad_out, q, k, v, out, lse, ctx.causal, ctx.softmax_scale,
                                  cu_seqlens, ctx.deterministic)
    return dq, dk, dv, None, None, None, None


triton_flash_fwd.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------- Python API


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    softmax_scale: Optional[float] = None,
                    cu_seqlens: Optional[torch.Tensor] = None,
                    deterministic: Optional[bool] = None) -> torch.Tensor:
    """Exact attention (flash, Triton), differentiable w.r.t. q, k, v.

    q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]`` with any strides (views into larger
    buffers are read in place), ``Hq % Hkv == 0`` (query head h uses KV head
    ``h // (Hq // Hkv)``), D a multiple of 16 up to 256, fp16/bf16 (fp32 for tests).
    causal: bottom-right aligned (query i sees key j iff ``j <= i + Sk - Sq``).
    cu_seqlens: int32 document boundaries (B == 1, Sq == Sk); attention stays within a
    document. Rows that see no key give zeros. Returns ``[B, Sq, Hq, D]`` in q's dtype.
    deterministic: backward without atomics (None: ``ULYSSES_KERNELS_DETERMINISTIC``).
    Runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``.
    """
    _check_inputs(q, k, v, split=False)
    scale = _resolve_scale(softmax_scale, q.shape[-1])
    out, _ = triton_flash_fwd(q, k, v, bool(causal), scale, cu_seqlens, _deterministic(deterministic))
    return out


def _check_out(name, t, shape, dtype, device):
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
        raise ValueError(f"flash_attention: {name} must be {tuple(shape)} {dtype} on {device}, got "
                         f"{tuple(t.shape)} {t.dtype} on {t.device}")


def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                            softmax_scale: Optional[float], cu_seqlens: Optional[torch.Tensor] = None,
                            out: Optional[torch.Tensor] = None, seq_splits: int = 1,
                            batch: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Low-level forward (no autograd) over ordinary or all-to-all buffer layouts.

    Layouts:
      * 4-D: q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]``, any strides; ``seq_splits``
        must be 1; out (if given) ``[B, Sq, Hq, D]``.
      * 3-D (all-to-all receive/send buffers): q ``[B*S, Hq, D]``, k/v ``[B*S, Hkv, D]``,
        out ``[B*S, Hq, D]``, any row/head/dim strides, ``batch=B``. The rows form
        ``P = seq_splits`` adjacent blocks; block i is a contiguous ``[B, S_i]`` row range
        holding global positions ``[start_i, start_i + S_i)``, with ``S_i`` the
        ``torch.tensor_split`` lengths of S over P (the first ``S % P`` blocks one longer).
        Token (b, s) of block i is row ``B*start_i + b*S_i + (s - start_i)``. With P == 1
        this is plain ``[B, S]`` row order. q/k/v may be head slices of one packed q|k|v
        buffer (e.g. ``buf.view(B*S, Hq + 2*Hkv, D)[:, :Hq]``).
    out is written in place when given (else allocated contiguous). Returns (out, lse)
    with lse ``[B, Hq, Sq]`` fp32 contiguous, natural log, -inf for rows that see no key.
    cu_seqlens: int32 global document boundaries (B == 1).
    """
    split = q.dim() == 3
    _check_inputs(q, k, v, split=split)
    if seq_splits < 1:
        raise ValueError(f"flash_attention: seq_splits must be >= 1, got {seq_splits}")
    g = _Geom(q, k, seq_splits, batch)
    scale = _resolve_scale(softmax_scale, g.d)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    else:
        _check_out("out", out, q.shape, q.dtype, q.device)
    lse = torch.empty((g.batch, g.hq, g.sq), dtype=torch.float32, device=q.device)
    triton_flash_fwd_out(q, k, v, out, lse, bool(causal), scale, cu_seqlens, int(seq_splits),
                         int(g.batch))
    return out, lse


def flash_attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                             softmax_scale: Optional[float],
                             cu_seqlens: Optional[torch.Tensor] = None,
                             dq: Optional[torch.Tensor] = None, dk: Optional[torch.Tensor] = None,
                             dv: Optional[torch.Tensor] = None, seq_splits: int = 1,
                             batch: Optional[int] = None, deterministic: Optional[bool] = None
                             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Low-level backward (no autograd); same layouts as :func:`flash_attention_forward`.

    do/out/dq have q's shape, dk/dv k's shape; lse is the forward's ``[B, Hq, Sq]`` fp32.
    dq/dk/dv are written in place when given (e.g. views into the reverse all-to-all send
    buffer), else allocated contiguous. deterministic: no atomics (7 GEMMs instead of 5;
    None: ``ULYSSES_KERNELS_DETERMINISTIC``). Returns (dq, dk, dv).
    """
    split = q.dim() == 3
    _check_inputs(q, k, v, split=split)
    g = _Geom(q, k, seq_splits, batch)
    scale = _resolve_scale(softmax_scale, g.d)
    _check_out("do", do, q.shape, q.dtype, q.device)
    _check_out("out", out, q.shape, q.dtype, q.device)
    _check_out("lse", lse, (g.batch, g.hq, g.sq), torch.float32, q.device)
    if not lse.is_contiguous():
        raise ValueError("flash_attention: lse must be contiguous")
    bufs: List[torch.Tensor] = []
    for name, t, ref in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if t is None:
            t = torch.empty(ref.shape, dtype=ref.dtype, device=ref.device)
        else:
            _check_out(name, t, ref.shape, ref.dtype, ref.device)
        bufs.append(t)
    dq, dk, dv = bufs
    triton_flash_bwd_out(do, q, k, v, out, lse, dq, dk, dv, bool(causal), scale, cu_seqlens,
                         int(seq_splits), int(g.batch), _deterministic(deterministic))
    return dq, dk, dv
