"""The candidate kernels (docs/architecture.md, "The kernel choice"): each is a name, the
library that provides it, its capability table (table.py) and a runner that computes
attention of `[B, S, H, D]` views with the package's semantics: GQA (query head h reads KV
head h // (Hq / Hkv)), bottom-right causal alignment, bands and softcap as variants.py
defines them, packed documents at batch 1 (`cu_seqlens`, int32 on the device).

Runners are differentiable through torch autograd (the paths record the graph in the
forward and replay it in the backward). A candidate with `lse` in its table also has the
ring's two block functions: a forward that returns the LSE `[B, Hq, Sq]` (float32) and a
backward from a merged output and LSE.

The external libraries are imported on first use only; `importable()` says whether one is
here and which version.
"""

import functools
import inspect
import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from ..extensions import require_triton_kernels
from ..variants import Band, band_lengths
from .table import HALF, Capabilities

Availability = Tuple[bool, str]  # (importable, version or why not)


@dataclass(frozen=True)
class Candidate:
    name: str
    library: str
    table: Callable[[], Capabilities]          # may depend on the installed version
    importable: Callable[[], Availability]
    run: Callable[..., torch.Tensor]           # (q, k, v, *, causal, scale, cu_seqlens, variant, sinks, deterministic)
    forward_lse: Optional[Callable] = None     # (q, k, v, *, causal, scale, cu_seqlens, band, softcap) -> (out, lse)
    backward_lse: Optional[Callable] = None    # (do, q, k, v, out, lse, *, same) -> (dq, dk, dv)


@functools.lru_cache(maxsize=None)
def _import(module: str, attribute: str = None) -> Tuple[Optional[object], str]:
    """(module or its attribute, version) or (None, why not); once per process (a failed
    import of a CUDA library can take seconds, and what is installed does not change)."""
    try:
        mod = __import__(module, fromlist=["_"])
        found = getattr(mod, attribute) if attribute else mod
    except Exception as exc:  # noqa: BLE001 - missing, or built for another torch or CUDA
        return None, f"not importable ({type(exc).__name__}: {str(exc)[:80]})"
    root = __import__(module.split(".")[0])
    return found, str(getattr(mod, "__version__", getattr(root, "__version__", "?")))


def _scale(q, scale) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _flash_window(band: Band, causal: bool) -> Tuple[int, int]:
    """flash_attn's `window_size` of a band: -1 unbounded, and causal bounds the right side at 0."""
    left, right = band_lengths(band)
    return (left, 0) if causal else (left, right)


def _packed_rows(t: torch.Tensor) -> torch.Tensor:
    """A batch-1 `[1, S, H, D]` view as `[S, H, D]` (a view: the buffer's rows stay in place)."""
    return t[0]


# ------------------------------------------------------------------------- triton

def _triton_run(q, k, v, *, causal, scale, cu_seqlens, variant, sinks, deterministic):
    return require_triton_kernels().flash_attention(q, k, v, causal=causal, softmax_scale=scale,
                                                    cu_seqlens=cu_seqlens, deterministic=deterministic,
                                                    _band=variant.window, softcap=variant.softcap, sinks=sinks)


def _triton_forward_lse(q, k, v, *, causal, scale, cu_seqlens, band, softcap):
    return require_triton_kernels().flash_attention_forward(q, k, v, causal=causal, softmax_scale=scale,
                                                            cu_seqlens=cu_seqlens, _band=band, softcap=softcap)


def _triton_backward_lse(do, q, k, v, out, lse, *, causal, scale, cu_seqlens, band, softcap):
    return require_triton_kernels().flash_attention_backward(do, q, k, v, out, lse, causal=causal,
                                                             softmax_scale=scale, cu_seqlens=cu_seqlens,
                                                             _band=band, softcap=softcap)


def _triton_importable() -> Availability:
    from ..extensions import triton_kernels

    module, why = triton_kernels()
    if module is None:
        return False, why
    import triton
    return True, triton.__version__


TRITON_TABLE = Capabilities(
    devices=("cuda", "cpu"), dtypes=HALF + ("float32",), head_dims=(16, 256, 16), own_value_dim=True,
    causal_alignments=("square", "short_queries", "long_queries"), windows=True, shifted_bands=True, softcap=True,
    sinks=True, packed=True, packed_batches=True, lse=True, rows_layout=True, deterministic=True, empty=True,
    min_capability=(0, 0))

# ---------------------------------------------------------------------- torch SDPA

def _sdpa_run(backend: str):
    def run(q, k, v, *, causal, scale, cu_seqlens, variant, sinks, deterministic):
        """SDPA on `[B, S, H, D]` views (transposed, not copied), pinned to one backend on CUDA;
        on CPU unrestricted (the math backend), so the CPU tests check the semantics."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        options = dict(is_causal=causal, scale=_scale(q, scale), enable_gqa=q.shape[2] != k.shape[2])
        if q.device.type != "cuda":
            return torch.nn.functional.scaled_dot_product_attention(*args, **options).transpose(1, 2)
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            return torch.nn.functional.scaled_dot_product_attention(*args, **options).transpose(1, 2)
    return run


def _sdpa_importable() -> Availability:
    try:
        from torch.nn.attention import SDPBackend
    except ImportError:
        return False, "torch.nn.attention is missing"
    return hasattr(SDPBackend, "CUDNN_ATTENTION"), torch.__version__


# SDPA's is_causal is top-left: the package's mask only where Sq == Sk. cuDNN: head dims up to
# 128 (its documented limit on most GPUs); SDPA's flash backend is FlashAttention-2's (up to 256).
SDPA_CUDNN_TABLE = Capabilities(head_dims=(8, 128, 8), causal_alignments=("square",))
SDPA_FLASH_TABLE = Capabilities(head_dims=(8, 256, 8), causal_alignments=("square",))

# ------------------------------------------------------------ FlashAttention 2/3/4

def _flash2_importable() -> Availability:
    mod, version = _import("flash_attn")
    if mod is None:
        return False, version
    if _version(version) < (2, 1):
        return False, f"{version} is older than 2.1 (top-left causal)"
    return True, version


def _version(text: str) -> Tuple[int, ...]:
    return tuple(int(x) for x in text.split("+")[0].split(".")[:3] if x.isdigit())


@functools.lru_cache(maxsize=None)
def _flash2_table() -> Capabilities:
    ok, version = _flash2_importable()
    softcap = ok and _version(version) >= (2, 6)
    return Capabilities(head_dims=(8, 256, 8), windows=True, softcap=softcap, packed=True, batch=True)


def _flash_family_run(func_module: str, first_only: bool):
    """The runner of FlashAttention 2 (`flash_attn`) or 3 (`flash_attn_interface`):
    `flash_attn_func` dense, `flash_attn_varlen_func` for packed documents (q, k, v,
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k positional in both; max_seqlen:
    the row count, an upper bound, so no host read); windows as (left, right) with -1
    unbounded. FA3 returns the output alone or (out, lse) depending on its version
    (`first_only`)."""
    def run(q, k, v, *, causal, scale, cu_seqlens, variant, sinks, deterministic):
        mod, _ = _import(func_module)
        extra = {}
        if variant.windowed:
            extra["window_size"] = _flash_window(variant.window, causal)
        if variant.softcap:
            extra["softcap"] = variant.softcap
        if cu_seqlens is None:
            out = mod.flash_attn_func(q, k, v, softmax_scale=_scale(q, scale), causal=causal, **extra)
        else:
            out = mod.flash_attn_varlen_func(_packed_rows(q), _packed_rows(k), _packed_rows(v), cu_seqlens,
                                             cu_seqlens, q.shape[1], k.shape[1], softmax_scale=_scale(q, scale),
                                             causal=causal, **extra)
        out = out[0] if first_only and isinstance(out, tuple) else out
        return out if cu_seqlens is None else out.unsqueeze(0)
    return run


def _fa4_run(q, k, v, *, causal, scale, cu_seqlens, variant, sinks, deterministic):
    """FlashAttention 4 (`flash_attn.cute`): every argument by keyword (its varlen function's
    fourth positional parameter is `qv`), a window side unbounded as None (a -1 is a literal
    offset there), and always an (out, lse) pair back."""
    mod, _ = _import("flash_attn.cute")
    extra = dict(softmax_scale=_scale(q, scale), causal=causal)
    if variant.windowed:
        left, right = variant.window
        extra["window_size"] = (left, 0 if causal else right)
    if variant.softcap:
        extra["softcap"] = variant.softcap
    if cu_seqlens is None:
        return mod.flash_attn_func(q, k, v, **extra)[0]
    out = mod.flash_attn_varlen_func(_packed_rows(q), _packed_rows(k), _packed_rows(v), cu_seqlens_q=cu_seqlens,
                                     cu_seqlens_k=cu_seqlens, max_seqlen_q=q.shape[1], max_seqlen_k=k.shape[1],
                                     **extra)[0]
    return out.unsqueeze(0)


def _fa3_importable() -> Availability:
    mod, version = _import("flash_attn_interface")
    return (mod is not None), version


def _fa4_importable() -> Availability:
    mod, version = _import("flash_attn.cute")
    return (mod is not None), version


# FA3: Hopper (its fp16/bf16 kernels also build for Ampere; only Hopper is claimed). FA4 (CuTe
# DSL): Hopper (head dims 8-256) and Blackwell (8-128, and a few pairs above): 8-128 claimed.
FA3_TABLE = Capabilities(head_dims=(8, 256, 8), windows=True, softcap=True, packed=True, capabilities=(9,))
FA4_TABLE = Capabilities(head_dims=(8, 128, 8), windows=True, softcap=True, packed=True, capabilities=(9, 10))

# ------------------------------------------------------------- torch varlen_attn

def _varlen_importable() -> Availability:
    mod, version = _import("torch.nn.attention.varlen", "varlen_attn")
    return (mod is not None), (torch.__version__ if mod is not None else version)


@functools.lru_cache(maxsize=None)
def _varlen_takes_gqa() -> bool:
    """torch >= 2.12's varlen_attn has enable_gqa; 2.11's has not."""
    mod, _ = _import("torch.nn.attention.varlen", "varlen_attn")
    return mod is not None and "enable_gqa" in inspect.signature(mod).parameters


@functools.lru_cache(maxsize=None)
def _varlen_table() -> Capabilities:
    return Capabilities(head_dims=(8, 256, 8), gqa=_varlen_takes_gqa(), windows=True, packed=True)


def _varlen_run(q, k, v, *, causal, scale, cu_seqlens, variant, sinks, deterministic):
    """torch.nn.attention.varlen.varlen_attn over the rows `[B*S, H, D]` (documents: the
    call's cu_seqlens; dense: one document per batch row). Causal is the window (-1, 0)."""
    from torch.nn.attention.varlen import varlen_attn

    B, Sq, Hq, _ = q.shape
    Sk = k.shape[1]
    if cu_seqlens is not None:
        cu_q = cu_k = cu_seqlens
    else:
        cu_q = torch.arange(0, (B + 1) * Sq, Sq, dtype=torch.int32, device=q.device)
        cu_k = torch.arange(0, (B + 1) * Sk, Sk, dtype=torch.int32, device=q.device)
    extra = dict(enable_gqa=True) if k.shape[2] != Hq else {}
    out = varlen_attn(q.reshape(B * Sq, Hq, q.shape[3]), k.reshape(B * Sk, *k.shape[2:]),
                      v.reshape(B * Sk, *v.shape[2:]), cu_q, cu_k, Sq, Sk, scale=_scale(q, scale),
                      window_size=_flash_window(variant.window, causal), **extra)
    return out.view(B, Sq, Hq, v.shape[3])

# -------------------------------------------------------------------- FlexAttention

def _flex_importable() -> Availability:
    mod, version = _import("torch.nn.attention.flex_attention", "flex_attention")
    return (mod is not None), (torch.__version__ if mod is not None else version)


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def _flex_masks(q, k, *, causal, cu_seqlens, band):
    """The mask_mod of a call (None: every key), from the same rule as the reference:
    bottom-right alignment, the band inside each document."""
    Sq, Sk = q.shape[1], k.shape[1]
    off = Sk - Sq
    left, right = band
    right = 0 if causal and (right is None or right > 0) else right
    document = None
    if cu_seqlens is not None:
        bounds = cu_seqlens.to(torch.long)
        document = torch.bucketize(torch.arange(Sq, device=q.device), bounds[1:], right=True)
    if left is None and right is None and document is None:
        return None

    def mask_mod(b, h, i, j):
        keep = j >= 0
        if right is not None:
            keep = keep & (j <= i + off + right)
        if left is not None:
            keep = keep & (j >= i + off - left)
        if document is not None:
            keep = keep & (document[i] == document[j])
        return keep
    return mask_mod


def _flex_run(q, k, v, *, causal, scale, cu_seqlens, variant, sinks, deterministic):
    """FlexAttention with a mask_mod for causal / band / documents and a score_mod for the
    softcap; compiled on CUDA (its fused kernel), eager elsewhere (the CPU tests)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask_mod = _flex_masks(q, k, causal=causal, cu_seqlens=cu_seqlens, band=variant.window)
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, None, None, q.shape[1], k.shape[1], device=q.device)
    score_mod = None
    if variant.softcap:
        cap = float(variant.softcap)

        def score_mod(score, b, h, i, j):
            return cap * torch.tanh(score / cap)
    flex = _compiled_flex() if q.device.type == "cuda" else flex_attention
    out = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=score_mod, block_mask=block_mask,
               scale=_scale(q, scale), enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


# Flex takes every alignment (rows without keys give 0, like the reference), bands, softcap and
# documents; on CPU it is the eager (unfused) forward, which the tests run in float32.
FLEX_TABLE = Capabilities(devices=("cuda", "cpu"), dtypes=HALF + ("float32",), head_dims=(16, 256, 16),
                          causal_alignments=("square", "short_queries", "long_queries"), windows=True, softcap=True,
                          packed=True, cpu_backward=False)

# ------------------------------------------------------------------------ registry

CANDIDATES: Dict[str, Candidate] = {}


def register(candidate: Candidate) -> None:
    """Add a candidate (the package's below; tests add stand-ins). Its table decides where it
    is considered; the order of registration breaks timing ties."""
    CANDIDATES[candidate.name] = candidate


def unregister(name: str) -> None:
    CANDIDATES.pop(name, None)


for _candidate in (
    Candidate("triton", "ulysses_kernels.triton", lambda: TRITON_TABLE, _triton_importable, _triton_run,
              _triton_forward_lse, _triton_backward_lse),
    Candidate("sdpa_cudnn", "torch SDPA (cuDNN backend)", lambda: SDPA_CUDNN_TABLE, _sdpa_importable,
              _sdpa_run("CUDNN_ATTENTION")),
    Candidate("sdpa_flash", "torch SDPA (flash backend)", lambda: SDPA_FLASH_TABLE, _sdpa_importable,
              _sdpa_run("FLASH_ATTENTION")),
    Candidate("flash2", "flash_attn (FlashAttention 2)", _flash2_table, _flash2_importable,
              _flash_family_run("flash_attn", first_only=False)),
    Candidate("fa3", "flash_attn_interface (FlashAttention 3)", lambda: FA3_TABLE, _fa3_importable,
              _flash_family_run("flash_attn_interface", first_only=True)),
    Candidate("fa4", "flash_attn.cute (FlashAttention 4)", lambda: FA4_TABLE, _fa4_importable, _fa4_run),
    Candidate("torch_varlen", "torch.nn.attention.varlen.varlen_attn", _varlen_table, _varlen_importable,
              _varlen_run),
    Candidate("flex", "torch FlexAttention", lambda: FLEX_TABLE, _flex_importable, _flex_run),
):
    register(_candidate)

# The ULYSSES_KERNELS_ATTENTION values that name a family of candidates.
FAMILIES = {"sdpa": ("sdpa_cudnn", "sdpa_flash"), "flash": ("flash2", "fa3", "fa4")}
