"""What a candidate kernel computes exactly as the reference defines it: one capability
table per candidate, and THE rule that checks a call class against a table
(docs/architecture.md, "The kernel choice"). A candidate is considered only for the calls
its table covers; the float64 reference stays the definition, and the tests run every
candidate that runs on CPU against it for every class its table claims.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

from .call import ALIGNMENTS, Call

HALF = ("float16", "bfloat16")


@dataclass(frozen=True)
class Capabilities:
    """One candidate's table. A field that is False means "not computed exactly", never
    "computed another way": a window SDPA would take as an explicit mask is not a window."""

    devices: Tuple[str, ...] = ("cuda",)
    dtypes: Tuple[str, ...] = HALF
    head_dims: Tuple[int, int, int] = (8, 256, 8)  # (smallest, largest, multiple of)
    own_value_dim: bool = False       # v's head dim may differ from q's (MLA)
    gqa: bool = True                  # fewer KV heads than query heads
    causal_alignments: Tuple[str, ...] = ("square", "short_queries")   # also where a window applies
    windows: bool = False             # bottom-right bands with non-negative sides
    shifted_bands: bool = False       # a ring block's shifted bands (negative sides)
    softcap: bool = False
    sinks: bool = False
    packed: bool = False              # cu_seqlens documents, at batch 1
    packed_batches: bool = False      # cu_seqlens documents with batch > 1 (ours: the documents of each row)
    lse: bool = False                 # returns the LSE and runs a backward from a merged out and LSE
    rows_layout: bool = False         # reads the all-to-all buffer's block rows in place
    deterministic: bool = False       # a bitwise-reproducible backward
    batch: bool = True                # batch > 1
    empty: bool = False               # Sq or Sk 0 (nothing to compute)
    cpu_backward: bool = True         # differentiable on CPU too (FlexAttention's CPU path is forward-only)
    capabilities: Optional[Tuple[int, ...]] = None  # GPU major versions (None: any from min_capability)
    min_capability: Tuple[int, int] = (8, 0)


def excluded(table: Capabilities, call: Call) -> Optional[str]:
    """Why a candidate with `table` does not compute `call` exactly (None when it does).
    The order of the checks is the order of the reasons doctor --explain prints."""
    device_type = "cpu" if call.device == "cpu" else "cuda"
    if device_type not in table.devices:
        return f"does not run on {device_type}"
    if device_type == "cuda":
        if call.capability < table.min_capability:
            return "needs compute capability {}.{}+".format(*table.min_capability)
        if table.capabilities is not None and call.capability[0] not in table.capabilities:
            return "runs on compute capability {} only".format(
                " / ".join(f"{major}.x" for major in table.capabilities))
    if device_type == "cpu" and call.grad and not table.cpu_backward:
        return "no backward on cpu"
    if call.dtype not in table.dtypes:
        return f"takes {'/'.join(table.dtypes)}, not {call.dtype}"
    low, high, multiple = table.head_dims
    for name, dim in (("head dim", call.head_dim), ("value head dim", call.value_dim)):
        if not low <= dim <= high or dim % multiple:
            return f"{name} {dim} is not a multiple of {multiple} in [{low}, {high}]"
    reasons = (
        (call.value_dim != call.head_dim and not table.own_value_dim, "v's head dim must equal q's"),
        (call.kv_heads != call.q_heads and not table.gqa, "no grouped-query heads"),
        ((call.causal or call.windowed) and call.alignment not in table.causal_alignments,
         f"causal masks and windows only where {' / '.join(a for a in ALIGNMENTS if a in table.causal_alignments)} "
         f"(this call: {call.alignment})"),
        (call.windowed and not table.windows, "no window bands"),
        (call.windowed and (call.lse or any(s is not None and s < 0 for s in call.window))
         and not table.shifted_bands, "no shifted bands (a ring's blocks shift the window)"),
        (bool(call.softcap) and not table.softcap, "no softcap"),
        (call.sinks and not table.sinks, "no attention sinks"),
        (call.packed and not table.packed, "no packed documents"),
        (call.packed and call.batch > 1 and not table.packed_batches, "packed documents at batch 1 only"),
        (call.lse and not table.lse, "no LSE for the ring merge"),
        (call.rows_layout and not table.rows_layout, "cannot read the all-to-all buffer's block rows (batch > 1)"),
        (call.deterministic and call.grad and not table.deterministic, "no bitwise-reproducible backward"),
        (call.batch > 1 and not table.batch, "batch 1 only"),
        (call.empty and not table.empty, "no empty sequences"),
    )
    return next((why for bad, why in reasons if bad), None)
