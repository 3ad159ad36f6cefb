"""Which kernel runs single-device attention on a strided `[B, S, H, D]` layout (plain
tensors, and the batch-1 all-to-all receive buffers of the Triton path): our Triton
kernel (`triton`), torch SDPA pinned to cuDNN (`sdpa_cudnn`) or to its flash backend
(`sdpa_flash`), or the `flash_attn` package (`flash`). See docs/architecture.md,
"Attention kernels: choice per layout".

Every backend computes the same thing: GQA (query head h reads KV head h // (Hq/Hkv)),
causal masks aligned bottom-right (query i sees key j iff j <= i + Sk - Sq). A backend is
offered for a call only where it keeps those semantics (`candidates`); everything else
(packed documents, an LSE for the ring merge, batch > 1 in the all-to-all buffer, float32,
empty sequences) stays on the Triton kernel.

`ULYSSES_KERNELS_ATTENTION` = auto (default) | triton | sdpa | flash:
- auto: on CUDA, the fastest candidate, timed once per `Key` (GPU, dtype, head dim, causal,
  varlen, power-of-two length bucket, forward or forward+backward) on random inputs of the
  bucket's length, and cached in the process and in a JSON file; on CPU, triton (no timing).
- sdpa: the faster of the eligible SDPA backends (timed and cached like auto) on CUDA, the
  first eligible one elsewhere (on CPU SDPA runs unrestricted, i.e. its math backend).
- triton / flash: that backend.
A named backend that is not eligible for a call falls back to triton, with one warning.
"""

import functools
import json
import math
import os
import tempfile
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import env
from ..extensions import require_triton_kernels, triton_kernels
from ..variants import PLAIN, Variant, band_lengths

ENV_VAR = env.ATTENTION.name
CACHE_DIR_VAR = env.CACHE_DIR.name
CHOICES = env.ATTENTION.choices
BACKENDS = ("triton", "sdpa_cudnn", "sdpa_flash", "flash")
# What each override value allows; "auto" allows every backend.
_FAMILY = {"triton": ("triton",), "sdpa": ("sdpa_cudnn", "sdpa_flash"), "flash": ("flash",), "auto": BACKENDS}
# External kernels take 16-bit inputs only (cuDNN and flash refuse float32; SDPA would
# silently run its math backend instead).
_HALF = ("float16", "bfloat16")
# Largest head dim each external backend takes (all need a multiple of 8): cuDNN's
# documented SDPA limit on most GPUs, and FlashAttention-2's (also torch's flash backend).
_MAX_HEAD_DIM = {"sdpa_cudnn": 128, "sdpa_flash": 256, "flash": 256}
WARMUP, REPS = 2, 5  # timing: compile/autotune runs, then the timed runs
# Longer buckets are timed at this length: the kernels' relative speed has settled by
# then, and a million-token bucket timed at full length would double the call's memory.
MAX_TIMED_LENGTH = 32768


@dataclass(frozen=True)
class Key:
    """The class of calls that share one timed choice."""
    device: str  # GPU name, or "cpu"
    dtype: str
    head_dim: int
    causal: bool
    varlen: bool
    bucket: int  # next power of two of max(Sq, Sk)
    grad: bool  # timed forward+backward (True) or forward only
    variant: Variant = PLAIN  # a window band / softcap (variants.py): only flash_attn computes those too

    def text(self) -> str:
        parts = [self.device, self.dtype, f"d{self.head_dim}", "causal" if self.causal else "full",
                 "varlen" if self.varlen else "dense", f"S{self.bucket}", "fwd+bwd" if self.grad else "fwd"]
        if not self.variant.plain:
            parts.append(self.variant.describe().replace(" ", ""))
        return "|".join(parts)


def bucket(length: int) -> int:
    """The power of two at or above `length` (at least 16): calls in one bucket share a choice."""
    return max(16, 1 << max(0, int(length) - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def key_for(q: torch.Tensor, k: torch.Tensor, *, causal: bool, varlen: bool = False, grad: bool = False,
            variant: Variant = PLAIN) -> Key:
    device = _device_name(q.device)
    return Key(device, str(q.dtype).replace("torch.", ""), int(q.shape[-1]), bool(causal), bool(varlen),
               bucket(max(q.shape[1], k.shape[1])), bool(grad), variant)


# ------------------------------------------------------------------- eligibility

@functools.lru_cache(maxsize=None)
def _flash_attn() -> Tuple[Optional[Callable], str]:
    """(flash_attn_func, version) when flash_attn >= 2.1 imports (bottom-right causal since
    2.1), else (None, why not)."""
    try:
        import flash_attn
        from flash_attn import flash_attn_func
    except Exception as exc:  # noqa: BLE001 - missing or built for another torch
        return None, f"not importable ({type(exc).__name__})"
    version = getattr(flash_attn, "__version__", "0")
    major_minor = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
    if major_minor < (2, 1):
        return None, f"{version} is older than 2.1 (top-left causal)"
    return flash_attn_func, version


def _sdpa_importable() -> bool:
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
    except ImportError:
        return False
    return hasattr(SDPBackend, "CUDNN_ATTENTION")


@functools.lru_cache(maxsize=None)
def available(device: str) -> Tuple[str, ...]:
    """The backends that can run on `device` (a Key's device): flash_attn needs CUDA."""
    names = ["triton"]
    if _sdpa_importable():
        names += ["sdpa_cudnn", "sdpa_flash"]
    if device != "cpu" and _flash_attn()[0] is not None:
        names.append("flash")
    return tuple(names)


def _backend_fits(name: str, key: Key, q_len: int, k_len: int) -> bool:
    d = key.head_dim
    if d % 8 or d > _MAX_HEAD_DIM[name]:
        return False
    if not key.variant.plain:
        # flash_attn has window_size and softcap with our meaning (bottom-right windows);
        # SDPA has neither (an explicit mask would be another, slower computation).
        return name == "flash" and (not key.causal or q_len <= k_len)
    if key.causal and name.startswith("sdpa"):
        return q_len == k_len  # SDPA's is_causal is top-left: the same mask only when Sq == Sk
    if key.causal:
        return q_len <= k_len  # flash_attn is bottom-right; no row may be left without keys
    return True


def candidates(key: Key, *, q_len: int, k_len: int, need_lse: bool = False, split_layout: bool = False,
               deterministic: bool = False, backends: Optional[Sequence[str]] = None) -> Tuple[str, ...]:
    """The backends that compute exactly this call, triton first (always eligible).

    need_lse: the caller needs the log-sum-exp (the ring merge); SDPA's public API has none.
    split_layout: batch > 1 in an all-to-all receive buffer (not a `[B, S, H, D]` view).
    deterministic: a bitwise-reproducible backward is asked for (`key.grad`), which only
    our kernel promises.
    backends: those importable here (default `available(key.device)`)."""
    if (key.varlen or need_lse or split_layout or (deterministic and key.grad) or key.dtype not in _HALF
            or min(q_len, k_len) < 1):
        return ("triton",)
    backends = available(key.device) if backends is None else backends
    return ("triton",) + tuple(n for n in BACKENDS[1:] if n in backends and _backend_fits(n, key, q_len, k_len))


# ---------------------------------------------------------------------- running


def _sdpa(q, k, v, *, causal: bool, scale: float, backend: str) -> torch.Tensor:
    """torch SDPA on `[B, S, H, D]` views (transposed, not copied), pinned to one backend
    on CUDA; on CPU unrestricted (the math backend), so CPU tests check the semantics."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    options = dict(is_causal=causal, scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    if q.device.type != "cuda":
        out = torch.nn.functional.scaled_dot_product_attention(*args, **options)
    else:
        pinned = SDPBackend.CUDNN_ATTENTION if backend == "sdpa_cudnn" else SDPBackend.FLASH_ATTENTION
        with sdpa_kernel([pinned]):
            out = torch.nn.functional.scaled_dot_product_attention(*args, **options)
    return out.transpose(1, 2).contiguous()  # usually already contiguous: a no-op


def run(name: str, q, k, v, *, causal: bool, softmax_scale: Optional[float] = None,
        cu_seqlens: Optional[torch.Tensor] = None, deterministic: Optional[bool] = None,
        variant: Variant = PLAIN, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention on backend `name` (differentiable), whether or not it is eligible: the
    caller (`attention`, tests) decides. `deterministic` reaches our kernel's backward."""
    if name == "triton":
        return require_triton_kernels().flash_attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                                        cu_seqlens=cu_seqlens, deterministic=deterministic,
                                                        _band=variant.window, softcap=variant.softcap, sinks=sinks)
    if cu_seqlens is not None or sinks is not None:
        raise ValueError(f"attention backend {name!r} takes neither cu_seqlens nor sinks")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if name == "flash":
        extra = {}
        if not variant.plain:
            extra = dict(window_size=band_lengths(variant.window), softcap=variant.softcap)
        return _flash_attn()[0](q, k, v, softmax_scale=scale, causal=causal, **extra)
    if not variant.plain:
        raise ValueError(f"attention backend {name!r} computes neither windows nor softcap")
    if name in ("sdpa_cudnn", "sdpa_flash"):
        return _sdpa(q, k, v, causal=causal, scale=scale, backend=name)
    raise ValueError(f"unknown attention backend {name!r}; one of {', '.join(BACKENDS)}")


# ----------------------------------------------------------------------- timing

def cuda_timer(name: str, fn: Callable[[], None]) -> float:
    """Milliseconds per call of `fn` (CUDA events after WARMUP untimed calls). Tests
    replace the module's `timer` with fake timings; `name` is for them."""
    for _ in range(WARMUP):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(REPS):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / REPS


timer: Callable[[str, Callable[[], None]], float] = cuda_timer


def workload(name: str, key: Key, heads: Tuple[int, int], device) -> Callable[[], None]:
    """One call of `name` on fresh random inputs of the key's representative shape
    (batch 1, Sq = Sk = bucket up to MAX_TIMED_LENGTH, the caller's head counts); with the backward when the key
    times training. Random, never zeros: a kernel may skip work on special values."""
    dtype = getattr(torch, key.dtype)
    hq, hkv = heads
    length = min(key.bucket, MAX_TIMED_LENGTH)
    q = torch.randn(1, length, hq, key.head_dim, device=device, dtype=dtype, requires_grad=key.grad)
    k, v = (torch.randn(1, length, hkv, key.head_dim, device=device, dtype=dtype, requires_grad=key.grad)
            for _ in range(2))
    grad_out = torch.randn_like(q) if key.grad else None

    def call():
        with torch.enable_grad() if key.grad else torch.no_grad():
            out = run(name, q, k, v, causal=key.causal, variant=key.variant)
            if grad_out is not None:
                torch.autograd.grad(out, (q, k, v), grad_out)
    return call


# ------------------------------------------------------------------------ cache

_choices: Dict[str, str] = {}  # cache key -> backend; filled from the disk file on first use
_loaded = False


def cache_path() -> str:
    base = os.path.expanduser(env.text(env.CACHE_DIR) or env.CACHE_DIR.default)
    return os.path.join(base, "attention_choice.json")


def read_cache() -> Dict[str, dict]:
    """The disk cache's entries {cache key: {"choice": name, "ms": {name: ms}}}; {} when the
    file is missing or unreadable (a corrupt file is ignored and rewritten on the next save)."""
    try:
        with open(cache_path()) as f:
            data = json.load(f)
        entries = data.get("choices", {}) if isinstance(data, dict) else {}
        return {k: e for k, e in entries.items() if isinstance(e, dict) and e.get("choice") in BACKENDS}
    except (OSError, ValueError, AttributeError):
        return {}


def _write_cache(entry_key: str, entry: dict) -> None:
    """Merge one entry into the disk cache: re-read (other processes may have added some),
    write a temp file in the same folder, os.replace it (readers never see half a file)."""
    path = cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        entries = read_cache()
        entries[entry_key] = entry
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".attention_choice.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"version": 1, "choices": entries}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home must not break training: keep the in-process choice
        _warn_once(f"cache:{path}", f"could not write the attention choice cache {path}: {exc}")


def clear_memory_cache() -> None:
    """Forget the in-process choices (the next lookup re-reads the disk file); for tests."""
    global _loaded
    _choices.clear()
    _loaded = False


def cache_key(key: Key, names: Sequence[str]) -> str:
    # The candidate list and torch version are part of the key: installing flash_attn or
    # upgrading torch re-times instead of reusing a choice made without them.
    return f"{key.text()}|{','.join(names)}|torch {torch.__version__}"


def pick(key: Key, names: Sequence[str], make_workload: Callable[[str], Callable[[], None]],
         can_time: bool = True) -> str:
    """The cached choice among `names`, else the fastest by `timer` (cached in the process
    and on disk). A candidate that fails to run is skipped; without timing, names[0]."""
    global _loaded
    if len(names) == 1:
        return names[0]
    entry_key = cache_key(key, names)
    if not _loaded:
        _choices.update({k: e["choice"] for k, e in read_cache().items()})
        _loaded = True
    if entry_key in _choices:
        return _choices[entry_key]
    if not can_time:
        return names[0]
    times = {name: _time_one(name, make_workload) for name in names}
    best = min(names, key=lambda n: times[n])  # ties and all-failed: the first, triton
    _choices[entry_key] = best
    _write_cache(entry_key, {"choice": best, "ms": {n: t for n, t in times.items() if math.isfinite(t)}})
    return best


def _time_one(name: str, make_workload) -> float:
    try:
        return float(timer(name, make_workload(name)))
    except (RuntimeError, ValueError, TypeError) as exc:  # e.g. "No available kernel", out of memory
        _warn_once(f"time:{name}", f"attention backend {name!r} failed while timed, skipped: {exc}")
        return math.inf


# ----------------------------------------------------------------------- choice

_warned = set()


def _warn_once(tag: str, message: str) -> None:
    if tag not in _warned:
        _warned.add(tag)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def requested() -> str:
    """The `ULYSSES_KERNELS_ATTENTION` value (ValueError naming the choices when invalid)."""
    return env.choice(ENV_VAR, CHOICES, "auto")


def choose(q: torch.Tensor, k: torch.Tensor, *, causal: bool, varlen: bool = False, need_lse: bool = False,
           split_layout: bool = False, grad: bool = False, deterministic: Optional[bool] = None,
           variant: Variant = PLAIN, sinks: bool = False, value_dim: Optional[int] = None) -> str:
    """The backend for attention of q `[B, Sq, Hq, D]` over k `[B, Sk, Hkv, D]` (see the
    module docstring); `grad`: the call will be differentiated (timed forward+backward);
    `deterministic` (None: `ULYSSES_KERNELS_DETERMINISTIC`): a reproducible backward.
    `variant`, `sinks` (whether the call has them) and `value_dim` (v's head dim): only our
    kernel has sinks and a value head dim of its own."""
    wanted = requested()
    if wanted == "triton" or sinks or (value_dim is not None and value_dim != q.shape[-1]):
        return "triton"
    if deterministic is None:
        deterministic = env.flag(env.DETERMINISTIC)
    key = key_for(q, k, causal=causal, varlen=varlen, grad=grad, variant=variant)
    eligible = candidates(key, q_len=q.shape[1], k_len=k.shape[1], need_lse=need_lse, split_layout=split_layout,
                          deterministic=deterministic)
    names = [n for n in eligible if n in _FAMILY[wanted]]
    if not names:
        _warn_once(f"override:{wanted}:{key.text()}", f"{ENV_VAR}={wanted} cannot run this attention call "
                   f"({key.text()}, Sq={q.shape[1]}, Sk={k.shape[1]}, need_lse={need_lse}, "
                   f"split_layout={split_layout}); using the Triton kernel")
        return "triton"
    if q.device.type != "cuda":
        return "triton" if wanted == "auto" else names[0]  # timing only on the device
    capturing = torch.cuda.is_current_stream_capturing()  # no timing inside a CUDA graph capture
    return pick(key, names, lambda n: workload(n, key, (q.shape[2], k.shape[2]), q.device), can_time=not capturing)


def attention(q, k, v, *, causal: bool = False, softmax_scale: Optional[float] = None,
              cu_seqlens: Optional[torch.Tensor] = None, deterministic: Optional[bool] = None,
              variant: Variant = PLAIN, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention over `[B, S, H, D]` views on the chosen backend, differentiable."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, sinks) if t is not None)
    name = choose(q, k, causal=causal, varlen=cu_seqlens is not None, grad=grad, deterministic=deterministic,
                  variant=variant, sinks=sinks is not None, value_dim=v.shape[-1])
    return run(name, q, k, v, causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
               deterministic=deterministic, variant=variant, sinks=sinks)


# ----------------------------------------------------------------------- doctor

def describe() -> List[Tuple[str, str]]:
    """(name, value) lines for `ulysses-kernels doctor`: the override, the backends and
    the cached choices."""
    try:
        wanted = requested()
    except ValueError as exc:
        wanted = f"INVALID: {exc}"
    lines = [("attention kernel", f"{ENV_VAR}={wanted} (one of {', '.join(CHOICES)})")]
    kernels, why = triton_kernels()
    _, flash_info = _flash_attn()
    lines.append(("  backends", ", ".join([
        "triton" if kernels is not None else f"triton (unavailable: {why})",
        "sdpa_cudnn, sdpa_flash" if _sdpa_importable() else "sdpa (needs torch >= 2.5)",
        f"flash (flash_attn {flash_info})"])))
    if not torch.cuda.is_available():
        lines.append(("  this machine", "no CUDA: auto runs triton untimed; sdpa runs torch's math backend"))
    entries = read_cache()
    lines.append(("  choice cache", f"{cache_path()} ({len(entries)} choices)"))
    for entry_key in sorted(entries)[:20]:
        entry = entries[entry_key]
        ms = ", ".join(f"{n} {t:.3g} ms" for n, t in sorted(entry.get("ms", {}).items()))
        lines.append(("    " + entry_key.split("|torch")[0], f"{entry['choice']} ({ms})"))
    return lines
