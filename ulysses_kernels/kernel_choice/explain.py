"""What the kernel choice says about itself: doctor's lines (the setting, the candidates
installed here, the cache) and `doctor --explain`'s (for one call class: every candidate,
considered or excluded with the reason, and the choice with its timings)."""

import dataclasses
from typing import List, Optional, Tuple

from .call import Call
from .candidates import CANDIDATES
from .choice import ENV_VAR, allowed_by, cache_path, consider, decisions, read_cache, requested
from .table import excluded

Lines = List[Tuple[str, str]]


def describe() -> Lines:
    """doctor's lines: the override, each candidate's library and version here, the cache."""
    try:
        wanted = requested()
    except ValueError as exc:
        wanted = f"INVALID: {exc}"
    lines = [("attention kernel", f"{ENV_VAR}={wanted} (auto, sdpa, flash or a candidate's name)")]
    for name, candidate in CANDIDATES.items():
        ok, version = candidate.importable()
        lines.append((f"  {name}", f"{candidate.library}: " + (version if ok else f"unavailable ({version})")))
    entries = read_cache()
    lines.append(("  choice cache", f"{cache_path()} ({len(entries)} timed classes)"))
    return lines


def _timings(entry_ms) -> str:
    return ", ".join(f"{n} {t:.3g} ms" for n, t in sorted(entry_ms.items(), key=lambda item: item[1]))


def _recorded(call: Call) -> Optional[str]:
    """The choice this process or the disk cache holds for `call` (None: not timed yet)."""
    for decision in decisions():
        if decision.call == call:
            return f"{decision.choice} ({decision.how}" + (f"; {_timings(decision.ms)})" if decision.ms else ")")
    prefix = call.text() + " |"
    for key, entry in sorted(read_cache().items()):
        if key.startswith(prefix):
            return f"{entry.get('choice')} (cached in {cache_path()}; {_timings(entry.get('ms', {}))})"
    return None


def explain(call: Call) -> Lines:
    """doctor --explain's lines for one class on this machine: every candidate considered
    or excluded (and why), then the choice: forced, recorded, or what the first call does."""
    try:
        wanted = requested()
    except ValueError as exc:
        return [("kernel choice", f"INVALID: {exc}")]
    eligible, reasons = consider(call)
    lines = [("kernel choice", f"{call.text()} ({ENV_VAR}={wanted})")]
    for name in CANDIDATES:
        lines.append((f"  {name}", "considered" if name in eligible else f"excluded: {reasons[name]}"))
    wanted_names = [n for n in eligible if n in allowed_by(wanted)]
    recorded = _recorded(call)
    if not wanted_names:
        verdict = f"REFUSED: {ENV_VAR}={wanted} cannot compute this class (the same ValueError on every rank)"
    elif recorded:
        verdict = recorded
    elif len(wanted_names) == 1:
        verdict = f"{wanted_names[0]} (the only candidate)"
    elif call.device == "cpu":
        verdict = f"{wanted_names[0]} (no timing on CPU)"
    else:
        verdict = (f"not timed yet: the first call times {', '.join(wanted_names)} on its shape and every rank "
                   "of the group takes the fastest at its slowest rank")
    return lines + [("  choice", verdict)]


# The per-rank call classes users run (SP 8, B 1 unless said; bfloat16; fwd + bwd): the rows of
# docs/kernels.md. (label, changes to `_BASE`.)
_BASE = dict(dtype="bfloat16", head_dim=128, value_dim=128, q_heads=4, kv_heads=1, causal=True,
             alignment="square", bucket=131072, grad=True)
USER_CLASSES = (
    ("Llama-3-8B / Qwen3-32B at SP 8, one document", {}),
    ("the same, packed documents (cu_seqlens)", dict(packed=True)),
    ("GPT-OSS full layers: D 64, sinks", dict(head_dim=64, value_dim=64, q_heads=8, sinks=True)),
    ("GPT-OSS sliding layers: window 128, sinks", dict(head_dim=64, value_dim=64, q_heads=8, sinks=True,
                                                      window=(128, None))),
    ("Mistral / Qwen2 sliding window 4096", dict(window=(4096, None))),
    ("Gemma 2: D 256, softcap 50, window 4096", dict(head_dim=256, value_dim=256, q_heads=2, softcap=50.0,
                                                     window=(4096, None))),
    ("DeepSeek MLA: D 192, value D 128", dict(head_dim=192, q_heads=16, kv_heads=16)),
    ("batch 2 across ranks (the buffer's block rows)", dict(batch=2, rows_layout=True)),
    ("Ulysses x Ring (the ring merges LSEs)", dict(lse=True)),
    ("ULYSSES_KERNELS_DETERMINISTIC=1 (reproducible backward)", dict(deterministic=True)),
    ("float32", dict(dtype="float32")),
    ("a chunk of queries over a longer cache (generation)", dict(alignment="short_queries", grad=False)),
)
GPUS = (("NVIDIA H100 / H200", (9, 0)), ("NVIDIA B200", (10, 0)), ("NVIDIA A100", (8, 0)))

# The tables docs/kernels.md shows are those of the newest library releases the package
# supports, whatever is installed where it is generated; what older releases lack, in words.
NEWEST = {"flash2": dict(softcap=True), "torch_varlen": dict(gqa=True)}
OLDER = ("`flash2`: softcap from flash_attn 2.6. `torch_varlen`: grouped-query heads from torch 2.12 "
         "(torch 2.11's `varlen_attn` has no `enable_gqa`).")


def documented_table(name: str):
    """Candidate `name`'s table with the newest supported release of its library."""
    return dataclasses.replace(CANDIDATES[name].table(), **NEWEST.get(name, {}))


def markdown() -> str:
    """docs/kernels.md: for each GPU generation, which candidate's table covers which of the
    user classes (every library installed); `auto` times the covered ones on the first call."""
    names = list(CANDIDATES)
    out = ["# Which attention kernel computes which call", "",
           "Generated from the candidates' capability tables (`ulysses_kernels/kernel_choice/candidates.py`) by",
           "`ulysses-kernels kernels > docs/kernels.md`. A ✓ means the candidate computes the class exactly as",
           "the reference defines it, so `ULYSSES_KERNELS_ATTENTION=auto` times it on the first call of the class",
           "and every rank of the group takes the fastest ✓ at its slowest rank; otherwise the cell says why not.",
           "Only installed libraries are timed (`ulysses-kernels doctor` lists them here). Per-rank shapes at",
           "SP 8, batch 1, bfloat16, forward and backward unless the row says otherwise. Our Triton kernel covers",
           "every row: it is the fallback, never the default where a ✓ kernel is faster. Which one `auto` picked",
           "on a machine: `ulysses-kernels doctor --explain` (docs/architecture.md, \"The kernel choice\").", "",
           "The tables are those of the newest supported releases; older ones lack: " + OLDER, ""]
    for gpu, capability in GPUS:
        out += [f"## {gpu} (compute capability {capability[0]}.{capability[1]})", "",
                "| call class | " + " | ".join(f"`{n}`" for n in names) + " |",
                "|---|" + "---|" * len(names)]
        for label, changes in USER_CLASSES:
            call = Call(device=gpu, capability=capability, **{**_BASE, **changes})
            cells = []
            for name in names:
                why = excluded(documented_table(name), call)
                cells.append("✓" if why is None else why)
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)
