"""THE kernel choice (docs/architecture.md, "The kernel choice"): for a call class, the
candidates whose tables cover it, the forced one (`ULYSSES_KERNELS_ATTENTION`) or the
fastest by timing, the same on every rank of the caller's groups.

The rule, on the first call of a class in this process:
1. Every rank lists its eligible candidates (importable here, table covers the call) and,
   on a GPU with more than one, their timings (from the disk cache, else timed now on the
   class's representative shape, forward or forward + backward as the call needs).
2. One object all-gather per group (the SP group; the ring's group too): the candidates
   every rank can run, each timed at its slowest rank (the group waits for the slowest).
   A rank that may not time (a CUDA graph capture) contributes no timings; when no rank
   timed, the first eligible candidate (ours) is used.
3. The fastest of those; ties and untimed: the registry's order (ours first). A forced
   name that no rank can run for this class is the same ValueError on every rank.
The choice is kept in memory (no collective on later calls) and on disk, keyed by the GPU,
its driver and the libraries' versions. Every rank of a group derives the same class
(call.py), so every rank misses the memory cache on the same call and the gathers match.
"""

import json
import math
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import env
from ..distributed.collectives import gather_objects
from ..distributed.groups import resolve_group
from .call import Call
from .candidates import CANDIDATES, FAMILIES
from .table import excluded

ENV_VAR = env.ATTENTION.name
MAX_TIMED_LENGTH = 32768  # longer classes are timed at this length: the ranking has settled, and memory stays small
WARMUP, REPS = 2, 5


@dataclass
class Decision:
    """What the choice found for one class (doctor --explain prints it)."""

    call: Call
    wanted: str
    eligible: Tuple[str, ...]                 # in registry order, agreed over the groups
    reasons: Dict[str, str]                   # candidate -> why it is not considered here
    choice: str
    how: str                                  # "forced", "timed", "cached", "untimed", "only candidate"
    ms: Dict[str, float] = field(default_factory=dict)


# ----------------------------------------------------------------------- request

def requested() -> str:
    """The `ULYSSES_KERNELS_ATTENTION` value: auto, a family (sdpa, flash) or a candidate's
    name (ValueError naming the choices otherwise)."""
    allowed = tuple(dict.fromkeys(env.ATTENTION.choices + tuple(CANDIDATES)))
    return env.choice(ENV_VAR, allowed, "auto")


def allowed_by(wanted: str) -> Tuple[str, ...]:
    if wanted == "auto":
        return tuple(CANDIDATES)
    return FAMILIES.get(wanted, (wanted,))


def consider(call: Call) -> Tuple[Tuple[str, ...], Dict[str, str]]:
    """The candidates that compute `call` exactly here, and why each other one does not."""
    eligible, reasons = [], {}
    for name, candidate in CANDIDATES.items():
        ok, version = candidate.importable()
        why = excluded(candidate.table(), call) if ok else f"not installed here: {version}"
        if why:
            reasons[name] = why
        else:
            eligible.append(name)
    return tuple(eligible), reasons


# ------------------------------------------------------------------------ timing

def cuda_timer(name: str, fn: Callable[[], None]) -> float:
    """Milliseconds per call of `fn` (CUDA events after WARMUP untimed calls). Tests
    replace the module's `timer`; `name` is for them."""
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


def representative_inputs(call: Call, device, *, documents: int = 8):
    """Random (never zero) q, k, v of the class's shape at min(bucket, MAX_TIMED_LENGTH), and
    cu_seqlens of `documents` equal documents for a packed class."""
    length = min(call.bucket, MAX_TIMED_LENGTH)
    q_len = length if call.alignment != "short_queries" else max(16, length // 2)
    k_len = length if call.alignment != "long_queries" else max(16, length // 2)
    dtype = getattr(torch, call.dtype)
    q = torch.randn(call.batch, q_len, call.q_heads, call.head_dim, device=device, dtype=dtype)
    k = torch.randn(call.batch, k_len, call.kv_heads, call.head_dim, device=device, dtype=dtype)
    v = torch.randn(call.batch, k_len, call.kv_heads, call.value_dim, device=device, dtype=dtype)
    cu = None
    if call.packed:
        cu = torch.linspace(0, length, documents + 1, device=device).round().to(torch.int32)
    return q, k, v, cu


def workload(name: str, call: Call, device) -> Callable[[], None]:
    """One call of candidate `name` on the class's representative inputs, with the backward
    when the class is differentiated (the ring's classes through the LSE functions)."""
    candidate = CANDIDATES[name]
    q, k, v, cu = representative_inputs(call, device)
    sinks = torch.randn(call.q_heads, device=device, dtype=torch.float32) if call.sinks else None
    options = dict(causal=call.causal, scale=None, cu_seqlens=cu)
    if call.lse:
        def ring_block():
            out, lse = candidate.forward_lse(q, k, v, band=call.window, softcap=call.softcap, **options)
            if call.grad:
                candidate.backward_lse(torch.randn_like(out), q, k, v, out, lse, band=call.window,
                                       softcap=call.softcap, **options)
        return ring_block
    leaves = [t.requires_grad_(call.grad) for t in (q, k, v)]
    grad_out = torch.randn(call.batch, q.shape[1], call.q_heads, call.value_dim, device=device, dtype=q.dtype)

    def step():
        with torch.enable_grad() if call.grad else torch.no_grad():
            out = candidate.run(*leaves, variant=call.variant, sinks=sinks, deterministic=call.deterministic,
                                **options)
            if call.grad:
                torch.autograd.grad(out, leaves, grad_out)
    return step


def _time(names: Sequence[str], call: Call, device) -> Dict[str, float]:
    times = {}
    for name in names:
        try:
            times[name] = float(timer(name, workload(name, call, device)))
        except Exception as exc:  # noqa: BLE001 - any failure (OOM, a compile error, a library's assert) drops
            # the candidate on this rank and never leaves before the group's gather (a rank that raised here
            # would leave the others waiting in it)
            _warn_once(f"time:{name}:{call.text()}", f"attention kernel {name!r} failed while timed for "
                       f"{call.text()}, not considered: {str(exc)[:200]}")
            times[name] = math.inf
    return times

# ------------------------------------------------------------------------- cache

_memory: Dict[tuple, Decision] = {}


def cache_path() -> str:
    base = os.path.expanduser(env.text(env.CACHE_DIR) or env.CACHE_DIR.default)
    return os.path.join(base, "attention_choice.json")


def versions(names: Sequence[str]) -> str:
    """What a timing depends on besides the class: torch, CUDA, cuDNN, the driver and each
    candidate's library version."""
    parts = [f"ulysses_kernels {_package_version()}", f"torch {torch.__version__}", f"cuda {torch.version.cuda}"]
    if torch.cuda.is_available():
        parts.append(f"cudnn {torch.backends.cudnn.version()}")
        driver = getattr(torch._C, "_cuda_getDriverVersion", None)
        parts.append(f"driver {driver() if driver else '?'}")
    parts += [f"{n} {CANDIDATES[n].importable()[1]}" for n in names]
    return ", ".join(parts)


def _package_version() -> str:
    """The installed package's version (read from its metadata: importing the package root
    from here would import every path)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("ulysses-kernels")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def disk_key(call: Call, names: Sequence[str]) -> str:
    return f"{call.text()} | {','.join(names)} | {versions(names)}"


def read_cache() -> Dict[str, dict]:
    """The disk entries {key: {"choice": name, "ms": {name: ms}}}; {} when missing or
    unreadable (a corrupt file is ignored and rewritten on the next save)."""
    try:
        with open(cache_path()) as f:
            data = json.load(f)
        entries = data.get("choices", {}) if isinstance(data, dict) else {}
        return {k: e for k, e in entries.items() if isinstance(e, dict) and isinstance(e.get("ms"), dict)}
    except (OSError, ValueError, AttributeError):
        return {}


def _write_cache(key: str, entry: dict) -> None:
    """Merge one entry into the disk file: re-read, write a temp file beside it, os.replace."""
    path = cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        entries = read_cache()
        entries[key] = entry
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".attention_choice.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"version": 2, "choices": entries}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home must not stop training: the in-process choice stays
        _warn_once(f"cache:{path}", f"could not write the attention choice cache {path}: {exc}")


def clear_memory_cache() -> None:
    """Forget this process's choices (tests; the next call of a class decides again)."""
    _memory.clear()


def decisions() -> List[Decision]:
    return list(_memory.values())

# ------------------------------------------------------------------------ choice

_warned = set()


def _warn_once(tag: str, message: str) -> None:
    if tag not in _warned:
        _warned.add(tag)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _local_report(call: Call, wanted: str, device, can_time: bool, use_disk: bool = True) -> dict:
    """What this rank brings to the agreement: its eligible candidates among those wanted,
    its reasons, and its timings (None: none). `use_disk`: read the disk cache (not inside a
    graph capture, where no gather evens out what each rank's disk holds)."""
    eligible, reasons = consider(call)
    names = tuple(n for n in eligible if n in allowed_by(wanted))
    ms, how = None, "untimed"
    if len(names) > 1 and call.device != "cpu":
        key = disk_key(call, names)
        ms = _cached_timings(key, names) if use_disk else None
        if ms is not None:
            how = "cached"
        elif can_time:
            ms, how = _time(names, call, device), "timed"
            finite = {n: t for n, t in ms.items() if math.isfinite(t)}
            if len(finite) == len(names):   # a failure may be passing (out of memory mid-training): not kept
                _write_cache(key, {"choice": min(finite, key=finite.get), "ms": finite})
    return dict(names=names, reasons=reasons, ms=ms, how=how)


def _cached_timings(key: str, names) -> Optional[Dict[str, float]]:
    """The disk entry's timings of `names`, or None (missing, or not all numbers)."""
    entry = read_cache().get(key)
    try:
        return {n: float(entry["ms"][n]) for n in names} if entry is not None else None
    except (KeyError, TypeError, ValueError):
        return None


def _combine(reports: Sequence[dict]) -> dict:
    """One report of several ranks': the candidates all of them can run, each timed at its
    slowest rank (ranks without timings do not vote), the first rank's reasons plus any
    other rank's for a candidate it lacks."""
    names = tuple(n for n in reports[0]["names"] if all(n in r["names"] for r in reports))
    reasons = dict(reports[0]["reasons"])
    for rank, r in enumerate(reports):
        for n in reports[0]["names"]:
            if n not in r["names"]:
                reasons.setdefault(n, f"rank {rank}: {r['reasons'].get(n, 'not eligible')}")
    timed = [r["ms"] for r in reports if r["ms"] is not None]
    ms = {n: max(t.get(n, math.inf) for t in timed) for n in names} if timed else None
    how = "timed" if any(r["how"] == "timed" for r in reports) else ("cached" if timed else "untimed")
    return dict(names=names, reasons=reasons, ms=ms, how=how)


def _groups_key(groups) -> tuple:
    return tuple(id(g) for g in groups)


def choose(call: Call, *, groups: Sequence = (), device=None, can_time: Optional[bool] = None) -> Decision:
    """The kernel for `call` (module docstring), the same on every rank of `groups` (process
    groups, None the default one, each entered by all its ranks on this call; empty: this
    process alone).
    `device`: where the timing runs (the call's tensors' device)."""
    wanted = requested()
    groups = tuple(g for g, world, _ in map(resolve_group, groups or ()) if world > 1)
    memo = (call, wanted, _groups_key(groups))
    if memo in _memory:
        return _memory[memo]
    if can_time is None:
        can_time = device is not None and torch.device(device).type == "cuda" and \
            not torch.cuda.is_current_stream_capturing()
    capturing = device is not None and torch.device(device).type == "cuda" and \
        torch.cuda.is_current_stream_capturing()
    report = _local_report(call, wanted, device, can_time and not capturing, use_disk=not capturing)
    if not capturing:  # no collective inside a graph capture: every rank decides from the same class alone
        for group in groups:
            report = _combine(gather_objects(report, group))
    names, ms = report["names"], report["ms"]
    if not names:
        raise ValueError(_refusal(call, wanted, report["reasons"]))
    if wanted not in ("auto",) and len(names) == 1:
        choice, how = names[0], "forced"
    elif ms:
        finite = [n for n in names if math.isfinite(ms[n])]
        choice, how = (min(finite, key=ms.get), report["how"]) if finite else (names[0], "untimed")
    else:
        choice, how = names[0], ("only candidate" if len(names) == 1 else "untimed")
    if wanted != "auto" and how != "forced":
        how = f"forced {wanted}, {how}"
    decision = Decision(call=call, wanted=wanted, eligible=names, reasons=report["reasons"], choice=choice, how=how,
                        ms={n: t for n, t in (ms or {}).items() if math.isfinite(t)})
    _memory[memo] = decision
    return decision


def _refusal(call: Call, wanted: str, reasons: Dict[str, str]) -> str:
    why = "; ".join(f"{n}: {reasons.get(n, 'not eligible')}" for n in allowed_by(wanted))
    return (f"{ENV_VAR}={wanted} cannot compute this attention call ({call.text()}): {why}. "
            f"Unset it (auto) or choose a kernel whose capability table covers the call "
            f"(ulysses-kernels doctor --explain lists them).")
