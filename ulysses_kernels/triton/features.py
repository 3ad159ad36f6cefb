"""Hopper features of the attention kernels: opt-in compile-time switches, off by default.

Each feature is a constexpr of a kernel; with all of them off the kernels build the
instructions they always did (bench/sass_report.py). They stay opt-in
(``ULYSSES_KERNELS_HOPPER_FEATURES``, or ``features=`` of the launchers) until the GPU
tests and the benchmark have shown them exact and faster (docs/architecture.md, "Hopper
kernel features"). The forward's (``flash_fwd._flash_fwd_kernel``):

* ``desc`` (``KV_DESC``): K and V tiles through device-side tensor descriptors (TMA on
  Hopper) instead of pointer loads. The descriptor's bounds zero-fill keys past the
  sequence and dims past the head dim, so no load needs a mask. Only the strided (SPLIT 0)
  and affine all-to-all (SPLIT 1) layouts, and only where TMA's rules hold
  (:func:`descriptor_ok`); the per-token layout keeps pointers.
* ``fma_scale`` (``FMA_SCALE``): the row max over the raw scores, then one FFMA per score
  (``qk * scale - m``). Needs a positive scale; softcapped scores are scaled inside the
  tanh already, so it is dropped there.
* ``lazy_rescale`` (``LAZY_RESCALE``): the accumulator is rescaled only when some row's
  maximum grows by more than 8 (log2 units), a branch the whole tile takes or skips. The
  final ``acc / l`` and the LSE use the same maxima, so the softmax is the same up to
  rounding.
* ``warp_specialize`` (``WARP_SPECIALIZE``): Triton's warp-specialized key loop
  (``tl.range(..., warp_specialize=True)``: a producer partition issues the TMA loads).
  Triton (3.6 to 3.9) builds it on sm_90 only for a 4-warp program whose one loop follows
  descriptor loads (a second loop, or a pointer load of q, fails its pass), so the kernel
  then reads q through a descriptor too and visits every key block in one masked loop,
  and the launcher takes 4-warp tiles (``configs.FORWARD.warp_specialize``). Not with packed
  documents (their loads fail the pass either). The interpreter runs the same single
  loop, without the partitions.

``fma_scale``, ``lazy_rescale`` and ``warp_specialize`` build on ``desc``: they were sized
with descriptor loads (with pointer loads the default 128x128 tile spills 24 B for either of
the first two), so a call that cannot take ``desc`` runs none of them.

The backward's (``flash_bwd_dkdv._flash_bwd_dkdv_kernel``, atomic mode):

* ``dq_reduce`` (``DQ_REDUCE``): each dQ tile is added to the fp32 accumulator by one TMA
  reduce-add from shared memory instead of BLOCK_M x D atomics issued by the compute warps.
  GPU only: Triton's interpreter has no descriptor reduce, so there it is dropped.
* ``bwd_warp_specialize`` (``WARP_SPECIALIZE`` of the dK/dV and dQ kernels): the backward
  runs as the warp-specialized dK/dV kernel (4 warps, 64-row query tiles: every wgmma
  N >= 64; descriptor loads only, one masked loop) and the warp-specialized dQ kernel: the
  deterministic two-kernel backward, 7 GEMMs, whatever ``deterministic`` says. Triton
  does not warp-specialize a dK/dV loop that also adds dQ (atomics or the reduce-add),
  hence the separate dQ pass. Strided and affine layouts, no packed documents, 16-bit on
  a GPU (:func:`bwd_warp_specialize`); the interpreter runs their single loops.

A feature that does not apply to a call is dropped for that call: the kernel then runs
as without it. The call's :class:`Switches` record keeps each dropped feature with the
reason (:func:`forward_features`, :func:`dq_reduce_feature`,
:func:`bwd_warp_specialize_feature`); ``ulysses-kernels doctor --explain`` prints them.
"""

from typing import Dict, Optional

import torch
import triton

from ..env import HOPPER_FEATURES, text
from .kernel_call import Target, block_d

FORWARD = ("desc", "fma_scale", "lazy_rescale", "warp_specialize")
BACKWARD = ("dq_reduce", "bwd_warp_specialize")
FEATURES = FORWARD + BACKWARD
ALL = "hopper"  # the features that build together
HOPPER = ("desc", "fma_scale", "warp_specialize", "dq_reduce")
CONSTEXPRS = {"desc": "KV_DESC", "fma_scale": "FMA_SCALE", "lazy_rescale": "LAZY_RESCALE",
              "warp_specialize": "WARP_SPECIALIZE", "dq_reduce": "DQ_REDUCE",
              "bwd_warp_specialize": "WARP_SPECIALIZE"}
# TMA: 16-byte aligned addresses and strides; coordinates are int32.
_TMA_ALIGN = 16
_TMA_MAX_ROWS = 2**31 - 1


def parse(spec) -> frozenset:
    """The features named by ``spec``: a comma-separated string ("" for none, "hopper" for
    desc, fma_scale, warp_specialize and dq_reduce) or an iterable of names. Raises
    ValueError naming unknown features, and for lazy_rescale with warp_specialize (Triton
    does not warp-specialize a loop holding lazy_rescale's branch: the 4-warp tile then
    spills)."""
    if spec is None:
        return frozenset()
    names = [n.strip().lower() for n in spec.split(",")] if isinstance(spec, str) else [str(n) for n in spec]
    names = {n for n in names if n}
    if ALL in names:
        names = (names - {ALL}) | set(HOPPER)
    unknown = sorted(names - set(FEATURES))
    if unknown:
        raise ValueError(f"unknown kernel feature(s) {', '.join(unknown)}: use {', '.join(FEATURES)} or {ALL}")
    if {"lazy_rescale", "warp_specialize"} <= names:
        raise ValueError("forward features lazy_rescale and warp_specialize cannot be combined: Triton does not "
                         "warp-specialize a loop with lazy_rescale's branch (bench/sass_report.py)")
    return frozenset(names)


def requested() -> frozenset:
    """The features ``ULYSSES_KERNELS_HOPPER_FEATURES`` asks for (read at every launch)."""
    try:
        return parse(text(HOPPER_FEATURES))
    except ValueError as error:
        raise ValueError(f"{HOPPER_FEATURES.name}: {error}") from None


class Switches:
    """The features of one launch: ``on`` (the requested features it runs, in the order of
    ``names``) and ``dropped`` (each requested feature it does not run, with the reason).
    ``names``: the features of the kernel the record is for."""

    def __init__(self, names, requested):
        self.names = tuple(names)
        self.on = [n for n in self.names if n in requested]
        self.dropped: Dict[str, str] = {}

    def drop(self, names, reason: str) -> None:
        """Drop `names` (those still on) for `reason`."""
        for name in [n for n in self.on if n in names]:
            self.on.remove(name)
            self.dropped[name] = reason

    def constexprs(self) -> Dict[str, bool]:
        return {CONSTEXPRS[name]: name in self.on for name in self.names}

    def describe(self) -> str:
        if not self.on and not self.dropped:
            return f"none requested ({HOPPER_FEATURES.name})"
        dropped = "; ".join(f"{name} dropped: {why}" for name, why in self.dropped.items())
        return ", ".join(self.on or ["none on"]) + (f" ({dropped})" if dropped else "")


def descriptor_problem(tensor, strides, rows: int, width: int, split: int, batch: int) -> Optional[str]:
    """Why ``tensor`` (an operand with (batch, seq, head, dim) element ``strides``) cannot be
    read through the kernels' tensor descriptors, or None: SPLIT 0 or 1, unit dim stride,
    16-byte aligned base and batch/seq/head strides (every program's view starts at
    ``base + b*stride_b + h*stride_h``), a row at least 16 bytes wide, and int32 rows."""
    if split not in (0, 1):
        return "the per-token all-to-all layout (SPLIT 2) has no 2-D view"
    stride_b, stride_s, stride_h, stride_d = strides
    size = tensor.element_size()
    if int(stride_d) != 1:
        return "its head dim is strided"
    if not all((int(s) * size) % _TMA_ALIGN == 0
               for s in (stride_s, stride_h) + ((stride_b,) if split == 0 and batch > 1 else ())):
        return "a batch, sequence or head stride is not a multiple of 16 bytes"
    if tensor.data_ptr() % _TMA_ALIGN:
        return "its address is not 16-byte aligned"
    if width * size < _TMA_ALIGN:
        return "its rows are narrower than 16 bytes"
    if not 0 < rows <= _TMA_MAX_ROWS:
        return "its row count does not fit TMA's int32 coordinates"
    return None


def descriptor_ok(tensor, strides, rows: int, width: int, split: int, batch: int) -> bool:
    """Whether ``tensor`` can be read through the kernels' tensor descriptors
    (:func:`descriptor_problem`)."""
    return descriptor_problem(tensor, strides, rows, width, split, batch) is None


_FP32_REASON = "fp32 inputs on a GPU run the measured tf32x3 configs only"


def forward_features(features, *, q, k, v, sq_strides, sk_strides, sv_strides, split, batch, seqlen_q, seqlen_k,
                     head_dim, head_dim_v, varlen, softmax_scale, softcap, target: Optional[Target] = None
                     ) -> Switches:
    """The requested forward ``features`` (names) this call runs, and why it drops the others
    (module docstring)."""
    target = target or Target.of(q)
    switches = Switches(FORWARD, parse(features))
    if target.device_type == "cuda" and q.dtype == torch.float32:
        switches.drop(FORWARD, _FP32_REASON)
    rows_q, rows_k = (batch * seqlen_q, batch * seqlen_k) if split == 1 else (seqlen_q, seqlen_k)
    problem = (descriptor_problem(k, sk_strides, rows_k, head_dim, split, batch)
               or descriptor_problem(v, sv_strides, rows_k, head_dim_v, split, batch))
    if problem:  # every other feature was sized with descriptor loads (module docstring)
        switches.drop(FORWARD, f"k or v cannot be read through a TMA descriptor: {problem}")
    # The warp-specialized loop reads q, k and v through descriptors, and nothing else
    # (VARLEN's document loads fail Triton's pass).
    if varlen:
        switches.drop(["warp_specialize"], "packed documents: their loads fail Triton's warp-specialization pass")
    problem = descriptor_problem(q, sq_strides, rows_q, head_dim, split, batch)
    if problem:
        switches.drop(["warp_specialize"], f"q cannot be read through a TMA descriptor: {problem}")
    if softcap:
        switches.drop(["fma_scale"], "softcapped scores are scaled inside the tanh already")
    elif not softmax_scale > 0:
        switches.drop(["fma_scale"], "it needs a positive softmax scale")
    if "desc" not in switches.on:
        switches.drop(FORWARD, "it builds on desc, which this call does not run")
    else:
        ensure_allocator(k.device)
    return switches


def forward_switches(features, **call) -> dict:
    """The constexprs of a forward launch (:func:`forward_features`)."""
    return forward_features(features, **call).constexprs()


def bwd_warp_specialize_feature(features, *, tensors, strides, split, batch, seqlen_q, seqlen_k, varlen,
                                target: Optional[Target] = None) -> Switches:
    """Whether a backward runs the warp-specialized dK/dV and dQ kernels: requested, strided
    or affine layout, no packed documents, 16-bit inputs on a GPU (any in the interpreter),
    padded head dims up to 128 (at 256 the 4-warp tiles spill over a kilobyte), and q, k, v
    and dO (``tensors``, their ``strides``) through TMA descriptors."""
    q = tensors[0]
    target = target or Target.of(q)
    switches = Switches(["bwd_warp_specialize"], parse(features))
    if varlen:
        switches.drop(["bwd_warp_specialize"], "packed documents: their loads fail Triton's warp-specialization pass")
    if max(block_d(tensors[0].shape[-1]), block_d(tensors[2].shape[-1])) > 128:
        switches.drop(["bwd_warp_specialize"], "a padded head dim above 128 (its 4-warp tiles spill)")
    if target.device_type == "cuda" and q.dtype == torch.float32:
        switches.drop(["bwd_warp_specialize"], _FP32_REASON)
    rows_q, rows_k = (batch * seqlen_q, batch * seqlen_k) if split == 1 else (seqlen_q, seqlen_k)
    for name, t, st, n in zip(("q", "k", "v", "dO"), tensors, strides, (rows_q, rows_k, rows_k, rows_q)):
        problem = descriptor_problem(t, st, n, t.shape[-1], split, batch)
        if problem:
            switches.drop(["bwd_warp_specialize"], f"{name} cannot be read through a TMA descriptor: {problem}")
    if switches.on:
        ensure_allocator(q.device)
    return switches


def bwd_warp_specialize(features, **call) -> bool:
    """Whether a backward runs the warp-specialized kernels (:func:`bwd_warp_specialize_feature`)."""
    return bool(bwd_warp_specialize_feature(features, **call).on)


def dq_reduce_feature(features, *, q, dq_acc, target: Optional[Target] = None) -> Switches:
    """``DQ_REDUCE`` of a dK/dV launch: in atomic mode (``dq_acc``, the
    ``[B, Hq, Sq, block_d]`` fp32 accumulator, or None) with 16-bit inputs on a GPU, for
    padded head dims up to 128 (at 256 the default tile spills 184 B with it, 120 B
    without), when the accumulator's 3-D view fits TMA's int32 coordinates and strides."""
    target = target or Target.of(q)
    switches = Switches(["dq_reduce"], parse(features))
    if dq_acc is None:
        switches.drop(["dq_reduce"], "this backward adds no dQ atomics (the two-kernel backward)")
    elif not target.gpu:
        switches.drop(["dq_reduce"], "GPU only (Triton's interpreter has no descriptor reduce)")
    elif q.dtype == torch.float32:
        switches.drop(["dq_reduce"], _FP32_REASON)
    elif dq_acc.shape[3] > 128:
        switches.drop(["dq_reduce"], "a padded head dim above 128 (the default tile spills with it)")
    elif dq_acc.shape[0] * dq_acc.shape[1] > _TMA_MAX_ROWS or dq_acc.shape[2] * dq_acc.shape[3] > _TMA_MAX_ROWS:
        switches.drop(["dq_reduce"], "the accumulator does not fit TMA's int32 coordinates")
    if switches.on:
        ensure_allocator(q.device)
    return switches


def backward_switches(features, **call) -> dict:
    """The constexprs of a dK/dV launch (:func:`dq_reduce_feature`)."""
    return dq_reduce_feature(features, **call).constexprs()


class _ScratchAllocator:
    """Global scratch for device-side tensor descriptors (Triton asks for it at launch)."""

    def __call__(self, size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator(device) -> None:
    """Device-side tensor descriptors need Triton's launch allocator: set a torch one
    when none is set (a caller's own allocator is left alone). Not needed in the
    interpreter."""
    if device.type != "cuda":
        return
    try:
        from triton.runtime import _allocation
        current = _allocation._allocator.get()
        unset = isinstance(current, _allocation.NullAllocator)
    except (ImportError, AttributeError):  # another Triton layout: set ours
        unset = True
    if unset:
        triton.set_allocator(_ScratchAllocator())
