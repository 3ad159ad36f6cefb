"""torch.library custom ops, autograd glue and the Python API of the Triton attention.

Custom ops (namespace ``ulysses_kernels``, registered so that ``torch.compile`` sees the
kernels; the package calls them, user code calls the Python functions below). They take
the window as the package's internal *band* ``band_left``, ``band_right`` (int of any sign,
or None: unbounded; the Python functions take flash_attn's ``window_size`` and convert it,
``variants.band_of_window_size``); ``softcap`` (float, 0: off) and ``sinks`` (``[Hq]`` or
None) default to plain attention:

* ``triton_flash_fwd(q, k, v, causal, softmax_scale, cu_seqlens, deterministic=False,
  band_left=None, band_right=None, softcap=0.0, sinks=None) -> (out, lse)``
  (deterministic only travels to the backward)
* ``triton_flash_bwd(do, q, k, v, out, lse, causal, softmax_scale, cu_seqlens, deterministic=False,
  band_left=None, band_right=None, softcap=0.0, sinks=None) -> (dq, dk, dv, dsinks)``
  (dsinks fp32 ``[Hq]``; an empty ``[0]`` tensor without sinks)
* ``triton_flash_fwd_out(q, k, v, out!, lse!, causal, softmax_scale, cu_seqlens, seq_splits, batch,
  band_left=None, band_right=None, softcap=0.0, sinks=None) -> ()``
* ``triton_flash_bwd_out(do, q, k, v, out, lse, dq!, dk!, dv!, dsinks!, causal, softmax_scale,
  cu_seqlens, seq_splits, batch, deterministic=False, band_left=None, band_right=None,
  softcap=0.0, sinks=None) -> ()`` (dsinks: None without sinks)

No argument an op writes has a default value: before torch 2.14 the ADInplaceOrView kernel of
a custom op indexed its written arguments by position in an argument list from which the
dispatcher had dropped the trailing defaults, so a written ``dsinks=None`` at the end raised
IndexError on every backward (the second GPU run, torch 2.11; tests/triton/test_triton_ops.py
checks the rule).

Variants (docs/architecture.md, "Attention variants"), each a compile-time switch of the
kernels, so a call without them runs exactly the plain kernels:

* window band ``(left, right)``: with off = Sk - Sq, query i sees key j iff
  ``i + off - left <= j <= i + off + right`` (a side None: unbounded; any int, negative
  ones give the shifted bands of off-diagonal ring blocks), and, if causal,
  ``j <= i + off``; the kernels skip the key/query blocks outside the band.
* ``softcap = c > 0``: scores ``c * tanh(softmax_scale * q.k / c)``.
* ``sinks``: ``[Hq]`` logits (any float dtype, read as fp32) in every row's softmax
  denominator; the LSE includes them and their gradient is
  ``dsinks[h] = -sum_{b,i} exp(sinks[h] - lse[b,h,i]) * rowsum(dO * O)[b,h,i]``.
* v, out, dO and dv with a head dim Dv of their own (multiple of 16 up to 256).

A row that sees no key gives out 0 and LSE -inf (the sink's logit with sinks).

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
from typing import List, NamedTuple, Optional, Tuple

import torch

from ..env import interpreting
from ..variants import Band, band_of_window_size, band_problem, sinks_problem, softcap_problem, window_problem
from .addressing import MAX_ROW_STRIDE, split_mode
from .flash_bwd import deterministic_default, launch_bwd
from .flash_fwd import launch_fwd
from .kernel_call import KernelCall, Target, VisitCounter, kernel_band

_NS = "ulysses_kernels"
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------- helpers


class _Geom:
    """Shapes and (batch, seq, head, dim) strides of one call."""

    def __init__(self, q, k, v, seq_splits, batch):
        self.split = q.dim() == 3
        self.dv = v.shape[-1]
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
        if abs(t.stride(-3)) > MAX_ROW_STRIDE:  # tile offsets are int32 (see addressing.seq_offsets)
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
    float16/bfloat16/float32, one head dim for q and k that is a multiple of 16 up to
    256, and a head dim for v (Dv, may differ) that is one too."""
    if any(t.dtype != q.dtype for t in (k, v)) or q.dtype not in _FLOAT_DTYPES:
        return (f"the kernels take float16/bfloat16/float32 inputs of one dtype, got "
                f"{'/'.join(str(t.dtype).replace('torch.', '') for t in (q, k, v))}")
    d = q.shape[-1]
    if k.shape[-1] != d or not _supported_head_dim(d):
        return (f"the kernels need a head dim that is a multiple of 16 up to 256, equal for q and k, "
                f"got {d} and {k.shape[-1]}")
    if not _supported_head_dim(v.shape[-1]):
        return f"the kernels need a head dim of v that is a multiple of 16 up to 256, got {v.shape[-1]}"
    return None


def _supported_head_dim(d: int) -> bool:
    return 0 < d <= 256 and d % 16 == 0


def _check_inputs(q, k, v, split: bool, name="flash_attention"):
    want = 3 if split else 4
    for n, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != want:
            raise ValueError(f"{name}: {n} must be {want}-D, got shape {tuple(t.shape)}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"{name}: k and v differ in more than the head dim: {tuple(k.shape)} vs "
                         f"{tuple(v.shape)}")
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


def _variant_args(q, window_size, band, softcap, sinks, dsinks=None, name="flash_attention") -> Tuple[Band, float]:
    """(band, softcap) of a call's variant arguments (softcap None: 0.0); ValueError (``name: why``) for values the
    kernels cannot take. The checks are ``variants.py``'s, the ones every path runs:
    ``window_size`` is flash_attn's public window (-1 unbounded); ``band`` (the private
    ``_band`` keyword) is the package's own form, a pair of ints of any sign or None, for the
    ring's shifted bands. A call gives one of them."""
    softcap = 0.0 if softcap is None else softcap
    if band is None:
        problem = window_problem(window_size) or softcap_problem(softcap)
        band = None if problem else band_of_window_size(window_size)
    elif not (isinstance(window_size, (tuple, list)) and tuple(window_size) == (-1, -1)):
        problem = "give window_size or the package's _band, not both"
    else:
        problem = band_problem(band) or softcap_problem(softcap)
    problem = problem or sinks_problem(sinks, q.shape[-2], q.device)
    if problem is None and dsinks is not None:
        problem = None if sinks is not None else "dsinks (the sinks' gradient) needs sinks"
    if problem:
        raise ValueError(f"{name}: {problem}")
    if dsinks is not None:
        _check_out("dsinks", dsinks, (q.shape[-2],), torch.float32, q.device)
    return tuple(band), float(softcap)


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


def _kernel_sinks(sinks):
    """The sinks as the forward kernel reads them: fp32, contiguous (Hq values)."""
    return None if sinks is None else sinks.detach().to(torch.float32).contiguous()


class CallOptions(NamedTuple):
    """A call's options after its tensors, as ``_run_fwd`` / ``_run_bwd`` take them (the
    custom ops and ``plan.plan_attention`` build one)."""

    causal: bool
    softmax_scale: float
    cu_seqlens: Optional[torch.Tensor] = None
    seq_splits: int = 1
    batch: Optional[int] = None     # the batch of 3-D all-to-all buffer views
    band: Band = (None, None)       # the package's band (variants.py), causal not folded yet
    softcap: float = 0.0
    sinks: Optional[torch.Tensor] = None
    deterministic: bool = False     # the backward only


def _kernel_call(g: "_Geom", o: CallOptions, target) -> KernelCall:
    """The launchers' record of one call: the mask after kernel_band, the documents' table."""
    causal, band = kernel_band(o.causal, o.band, g.sq, g.sk)
    docs, table = _kernel_cu_seqlens(o.cu_seqlens, g.sk)
    return KernelCall(batch=g.batch, seqlen_q=g.sq, seqlen_k=g.sk, num_q_heads=g.hq, num_kv_heads=g.hkv,
                      head_dim=g.d, head_dim_v=g.dv, split=g.mode, seq_splits=g.seq_splits, causal=causal,
                      band=band, softcap=float(o.softcap), softmax_scale=o.softmax_scale, docs=docs,
                      cu_seqlens=table, target=target)


def _run_fwd(q, k, v, out, lse, options: CallOptions, *, counter=None, target=None, plan=None):
    o = options
    g = _Geom(q, k, v, o.seq_splits, o.batch)
    if o.cu_seqlens is not None and g.batch != 1:
        raise ValueError(f"flash_attention: cu_seqlens needs batch 1, got {g.batch}")
    if o.cu_seqlens is not None and g.sq != g.sk:
        raise ValueError(f"flash_attention: cu_seqlens needs equal query and key lengths, "
                         f"got {g.sq} and {g.sk}")
    if g.sq == 0 or g.batch == 0 or g.hq == 0:
        return
    if g.sk == 0:  # no key: out 0, LSE -inf or the sink's logit
        out.zero_()
        lse.copy_(o.sinks.float().view(1, -1, 1).expand_as(lse) if o.sinks is not None else
                  torch.full_like(lse, float("-inf")))
        return
    call = _kernel_call(g, o, target or Target.of(q))
    launch_fwd(q, k, v, out, lse, call, strides=[g.strides(t) for t in (q, k, v, out)], sinks=_kernel_sinks(o.sinks),
               counter=counter, plan=plan)


def _run_bwd(do, q, k, v, out, lse, grads, options: CallOptions, *, dsinks=None, counter=None, target=None,
             plan=None):
    """grads: (dq, dk, dv), written in place; dsinks (with sinks): overwritten."""
    o = options
    g = _Geom(q, k, v, o.seq_splits, o.batch)
    if g.batch == 0 or g.hq == 0 or g.sq == 0 or g.sk == 0:
        # Nothing to attend: zero gradients. (No key: out = 0, so delta = 0 and the sinks'
        # gradient is 0 too.)
        for t in (*grads, dsinks):
            if t is not None:
                t.zero_()
        return
    call = _kernel_call(g, o, target or Target.of(q))
    launch_bwd(do, q, k, v, out, lse, grads, call, strides_of=g.strides, deterministic=o.deterministic,
               sinks=_kernel_sinks(o.sinks), dsinks=dsinks, counter=counter, plan=plan)


# ------------------------------------------------------------------------ custom ops


def _out_shape(q, v):
    """out (and dO): q's shape with v's head dim."""
    return (*q.shape[:-1], v.shape[-1])


@torch.library.custom_op(f"{_NS}::triton_flash_fwd", mutates_args=())
def triton_flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                     softmax_scale: float, cu_seqlens: Optional[torch.Tensor],
                     deterministic: bool = False, band_left: Optional[int] = None,
                     band_right: Optional[int] = None, softcap: float = 0.0,
                     sinks: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    B, Sq, Hq, _ = q.shape
    out = torch.empty(_out_shape(q, v), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
    _run_fwd(q, k, v, out, lse, CallOptions(causal, softmax_scale, cu_seqlens, band=(band_left, band_right),
                                            softcap=softcap, sinks=sinks))
    return out, lse


@triton_flash_fwd.register_fake
def _(q, k, v, causal, softmax_scale, cu_seqlens, deterministic=False, band_left=None, band_right=None,
      softcap=0.0, sinks=None):
    B, Sq, Hq, _ = q.shape
    return (q.new_empty(_out_shape(q, v)), q.new_empty((B, Hq, Sq), dtype=torch.float32))


def _dsinks_like(q, sinks):
    """The functional backward's sinks gradient: fp32 [Hq], or an empty [0] without sinks."""
    return q.new_empty((q.shape[-2] if sinks is not None else 0,), dtype=torch.float32)


@torch.library.custom_op(f"{_NS}::triton_flash_bwd", mutates_args=())
def triton_flash_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, lse: torch.Tensor, causal: bool, softmax_scale: float,
                     cu_seqlens: Optional[torch.Tensor], deterministic: bool = False,
                     band_left: Optional[int] = None, band_right: Optional[int] = None,
                     softcap: float = 0.0, sinks: Optional[torch.Tensor] = None
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    dsinks = _dsinks_like(q, sinks)
    _run_bwd(do, q, k, v, out, lse, (dq, dk, dv),
             CallOptions(causal, softmax_scale, cu_seqlens, band=(band_left, band_right), softcap=softcap, sinks=sinks,
                         deterministic=deterministic), dsinks=dsinks if sinks is not None else None)
    return dq, dk, dv, dsinks


@triton_flash_bwd.register_fake
def _(do, q, k, v, out, lse, causal, softmax_scale, cu_seqlens, deterministic=False, band_left=None,
      band_right=None, softcap=0.0, sinks=None):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), _dsinks_like(q, sinks))


@torch.library.custom_op(f"{_NS}::triton_flash_fwd_out", mutates_args=("out", "lse"))
def triton_flash_fwd_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, causal: bool, softmax_scale: float,
                         cu_seqlens: Optional[torch.Tensor], seq_splits: int, batch: int,
                         band_left: Optional[int] = None, band_right: Optional[int] = None,
                         softcap: float = 0.0, sinks: Optional[torch.Tensor] = None) -> None:
    _run_fwd(q, k, v, out, lse, CallOptions(causal, softmax_scale, cu_seqlens, seq_splits, batch,
                                            band=(band_left, band_right), softcap=softcap, sinks=sinks))


@triton_flash_fwd_out.register_fake
def _(q, k, v, out, lse, causal, softmax_scale, cu_seqlens, seq_splits, batch, band_left=None,
      band_right=None, softcap=0.0, sinks=None):
    return None


@torch.library.custom_op(f"{_NS}::triton_flash_bwd_out", mutates_args=("dq", "dk", "dv", "dsinks"))
def triton_flash_bwd_out(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
                         dv: torch.Tensor, dsinks: Optional[torch.Tensor], causal: bool, softmax_scale: float,
                         cu_seqlens: Optional[torch.Tensor], seq_splits: int, batch: int,
                         deterministic: bool = False, band_left: Optional[int] = None,
                         band_right: Optional[int] = None, softcap: float = 0.0,
                         sinks: Optional[torch.Tensor] = None) -> None:
    _run_bwd(do, q, k, v, out, lse, (dq, dk, dv),
             CallOptions(causal, softmax_scale, cu_seqlens, seq_splits, batch, band=(band_left, band_right),
                         softcap=softcap, sinks=sinks, deterministic=deterministic), dsinks=dsinks)


@triton_flash_bwd_out.register_fake
def _(do, q, k, v, out, lse, dq, dk, dv, dsinks, causal, softmax_scale, cu_seqlens, seq_splits, batch,
      deterministic=False, band_left=None, band_right=None, softcap=0.0, sinks=None):
    return None


class _ForwardOptions(NamedTuple):
    """triton_flash_fwd's arguments after q, k, v, in the op's order (setup_context gets them
    positionally, the trailing defaults possibly left out)."""

    causal: bool
    softmax_scale: float
    cu_seqlens: Optional[torch.Tensor]
    deterministic: bool = False
    band_left: Optional[int] = None
    band_right: Optional[int] = None
    softcap: float = 0.0
    sinks: Optional[torch.Tensor] = None


def _setup_context(ctx, inputs, output):
    q, k, v, *rest = inputs
    options = _ForwardOptions(*rest)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, options.cu_seqlens, options.sinks)
    ctx.options = options._replace(cu_seqlens=None, sinks=None)  # the tensors travel as saved tensors
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens, sinks = ctx.saved_tensors
    no_grads = _ForwardOptions(*(None,) * len(_ForwardOptions._fields))
    if grad_out is None:
        return (None, None, None, *no_grads)
    o = ctx.options
    dq, dk, dv, dsinks = triton_flash_bwd(grad_out, q, k, v, out, lse, o.causal, o.softmax_scale, cu_seqlens,
                                          o.deterministic, o.band_left, o.band_right, o.softcap, sinks)
    return (dq, dk, dv, *no_grads._replace(sinks=dsinks.to(sinks.dtype) if sinks is not None else None))


triton_flash_fwd.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------- Python API


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    softmax_scale: Optional[float] = None,
                    cu_seqlens: Optional[torch.Tensor] = None,
                    deterministic: Optional[bool] = None, window_size: Tuple[int, int] = (-1, -1),
                    softcap: float = 0.0, sinks: Optional[torch.Tensor] = None,
                    _band: Optional[Band] = None) -> torch.Tensor:
    """Exact attention (flash, Triton), differentiable w.r.t. q, k, v and sinks.

    q ``[B, Sq, Hq, D]``, k ``[B, Sk, Hkv, D]``, v ``[B, Sk, Hkv, Dv]`` with any strides
    (views into larger buffers are read in place), ``Hq % Hkv == 0`` (query head h uses KV
    head ``h // (Hq // Hkv)``), D and Dv multiples of 16 up to 256, fp16/bf16 (fp32 for
    tests). causal: bottom-right aligned (query i sees key j iff ``j <= i + Sk - Sq``).
    cu_seqlens: int32 document boundaries (B == 1, Sq == Sk); attention stays within a
    document. window_size: flash_attn's ``(left, right)``, query i sees key j iff
    ``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` (-1: that side unbounded; with
    causal the right side is 0). softcap: c > 0 caps the scores at ``c * tanh(s / c)``. sinks:
    ``[Hq]`` logits in every row's softmax denominator. Rows that see no key give zeros.
    Returns ``[B, Sq, Hq, Dv]`` in q's dtype.
    deterministic: backward without atomics (None: ``ULYSSES_KERNELS_DETERMINISTIC``).
    Runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``.
    """
    _check_inputs(q, k, v, split=False)
    band, softcap = _variant_args(q, window_size, _band, softcap, sinks)
    scale = _resolve_scale(softmax_scale, q.shape[-1])
    out, _ = triton_flash_fwd(q, k, v, bool(causal), scale, cu_seqlens, _deterministic(deterministic),
                              band[0], band[1], softcap, sinks)
    return out


def _check_out(name, t, shape, dtype, device):
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
        raise ValueError(f"flash_attention: {name} must be {tuple(shape)} {dtype} on {device}, got "
                         f"{tuple(t.shape)} {t.dtype} on {t.device}")


def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                            softmax_scale: Optional[float], cu_seqlens: Optional[torch.Tensor] = None,
                            out: Optional[torch.Tensor] = None, seq_splits: int = 1,
                            batch: Optional[int] = None, window_size: Tuple[int, int] = (-1, -1),
                            softcap: float = 0.0, sinks: Optional[torch.Tensor] = None,
                            _band: Optional[Band] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Low-level forward (no autograd) over ordinary or all-to-all buffer layouts.

    Layouts:
      * 4-D: q ``[B, Sq, Hq, D]``, k ``[B, Sk, Hkv, D]``, v ``[B, Sk, Hkv, Dv]``, any
        strides; ``seq_splits`` must be 1; out (if given) ``[B, Sq, Hq, Dv]``.
      * 3-D (all-to-all receive/send buffers): q ``[B*S, Hq, D]``, k ``[B*S, Hkv, D]``, v
        ``[B*S, Hkv, Dv]``, out ``[B*S, Hq, Dv]``, any row/head/dim strides, ``batch=B``.
        The rows form ``P = seq_splits`` adjacent blocks; block i is a contiguous
        ``[B, S_i]`` row range holding global positions ``[start_i, start_i + S_i)``, with
        ``S_i`` the ``torch.tensor_split`` lengths of S over P (the first ``S % P`` blocks
        one longer). Token (b, s) of block i is row ``B*start_i + b*S_i + (s - start_i)``.
        With P == 1 this is plain ``[B, S]`` row order. q/k/v may be head slices of one
        packed q|k|v buffer (e.g. ``buf.view(B*S, Hq + 2*Hkv, D)[:, :Hq]``).
    out is written in place when given (else allocated contiguous). Returns (out, lse)
    with lse ``[B, Hq, Sq]`` fp32 contiguous, natural log, -inf for rows that see no key;
    with sinks the LSE includes them (a row that sees no key has LSE = its sink).
    cu_seqlens: int32 global document boundaries (B == 1). window_size, softcap, sinks: the
    variants of :func:`flash_attention`.
    """
    split = q.dim() == 3
    _check_inputs(q, k, v, split=split)
    band, softcap = _variant_args(q, window_size, _band, softcap, sinks)
    if seq_splits < 1:
        raise ValueError(f"flash_attention: seq_splits must be >= 1, got {seq_splits}")
    g = _Geom(q, k, v, seq_splits, batch)
    scale = _resolve_scale(softmax_scale, g.d)
    if out is None:
        out = torch.empty(_out_shape(q, v), dtype=q.dtype, device=q.device)
    else:
        _check_out("out", out, _out_shape(q, v), q.dtype, q.device)
    lse = torch.empty((g.batch, g.hq, g.sq), dtype=torch.float32, device=q.device)
    triton_flash_fwd_out(q, k, v, out, lse, bool(causal), scale, cu_seqlens, int(seq_splits),
                         int(g.batch), band[0], band[1], softcap, sinks)
    return out, lse


def flash_attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                             softmax_scale: Optional[float],
                             cu_seqlens: Optional[torch.Tensor] = None,
                             dq: Optional[torch.Tensor] = None, dk: Optional[torch.Tensor] = None,
                             dv: Optional[torch.Tensor] = None, seq_splits: int = 1,
                             batch: Optional[int] = None, deterministic: Optional[bool] = None,
                             window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                             sinks: Optional[torch.Tensor] = None, dsinks: Optional[torch.Tensor] = None,
                             _band: Optional[Band] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Low-level backward (no autograd); same layouts as :func:`flash_attention_forward`.

    do/out have out's shape (q's with Dv), dq q's, dk k's and dv v's shape; lse is the
    forward's ``[B, Hq, Sq]`` fp32 (sink-inclusive with sinks). dq/dk/dv are written in
    place when given (e.g. views into the reverse all-to-all send buffer), else allocated
    contiguous. deterministic: no atomics (7 GEMMs instead of 5; None:
    ``ULYSSES_KERNELS_DETERMINISTIC``). window_size, softcap, sinks: the forward's variants.
    dsinks: an fp32 ``[Hq]`` tensor, overwritten with the sinks' gradient (needs sinks).
    Returns (dq, dk, dv).
    """
    split = q.dim() == 3
    _check_inputs(q, k, v, split=split)
    band, softcap = _variant_args(q, window_size, _band, softcap, sinks, dsinks)
    g = _Geom(q, k, v, seq_splits, batch)
    scale = _resolve_scale(softmax_scale, g.d)
    _check_out("do", do, _out_shape(q, v), q.dtype, q.device)
    _check_out("out", out, _out_shape(q, v), q.dtype, q.device)
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
    triton_flash_bwd_out(do, q, k, v, out, lse, dq, dk, dv, dsinks, bool(causal), scale, cu_seqlens,
                         int(seq_splits), int(g.batch), _deterministic(deterministic), band[0], band[1],
                         softcap, sinks)
    return dq, dk, dv


def _count_visited_blocks(q, k, v, *, causal=False, band=(None, None), cu_seqlens=None, deterministic=True):
    """Tests: how many blocks each program of the kernels visits, on 4-D inputs.

    Runs the forward and the backward (``deterministic``: the dK/dV and dQ kernels; else
    the atomic dK/dV kernel) with the COUNT switch and returns ``{kernel: (counts, config)}``
    for "fwd" and "dq" (key blocks per query tile, counts ``[B*Hq, query tiles]``) and
    "dkdv" (query blocks times query heads per key tile, ``[B*Hkv*head splits, key tiles]``).
    config: the (BLOCK_M, BLOCK_N, warps, stages) the kernel ran (never autotuned).
    """
    _check_inputs(q, k, v, split=False)
    band, _ = _variant_args(q, (-1, -1), band, 0.0, None)
    B, Sq, Hq, D = q.shape
    Sk = k.shape[1]
    counter = VisitCounter(q.device, B * Hq * -(-max(Sq, Sk) // 16))  # tiles are >= 16 rows
    scale = _resolve_scale(None, D)
    out = torch.empty(_out_shape(q, v), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
    options = CallOptions(causal, scale, cu_seqlens, band=band, deterministic=deterministic)
    _run_fwd(q, k, v, out, lse, options, counter=counter)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    _run_bwd(torch.ones_like(out), q, k, v, out, lse, grads, options, counter=counter)
    result = {}
    for name, counts in counter.counts.items():
        tiles, programs = counter.grids[name]
        result[name] = (counts[:programs * tiles].view(programs, tiles), counter.configs[name])
    return result
