"""THE attention variants (docs/architecture.md, "Attention variants"): what a call computes
beyond softmax(q·kᵀ·scale + causal/document mask)·v, as one small value every path, the
ring and the checks share.

- A window band (flash_attn's `window_size=(left, right)`, -1 unbounded): with
  off = Sk - Sq (bottom-right alignment), query i sees key j iff
  `i + off - left <= j <= i + off + right`; with `causal=True` the right side is 0;
  with packed documents the band applies inside each document.
- Logit softcapping (`softcap=c > 0`): scaled scores become `c * tanh(scores / c)`.
- Attention sinks (`sinks`, one logit per query head): they join the softmax
  denominator, `p_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij))`. Sinks are a tensor
  (differentiable), so they travel beside the `Variant`, not in it.
- A value head dim of its own (MLA): a shape, checked with the others.

Inside the package a window is a *band* `(left, right)`, each side an int or None
(unbounded). Public values are non-negative; the ring's blocks use shifted bands
(`ring/plan.py`), whose sides may be negative.
"""

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

Band = Tuple[Optional[int], Optional[int]]


@dataclass(frozen=True)
class Variant:
    """A window band and a softcap (0.0: none). `Variant()` is plain attention."""

    window: Band = (None, None)
    softcap: float = 0.0

    @property
    def windowed(self) -> bool:
        return self.window != (None, None)

    @property
    def plain(self) -> bool:
        return not self.windowed and not self.softcap

    def describe(self) -> str:
        parts = []
        if self.windowed:
            left, right = (-1 if side is None else side for side in self.window)
            parts.append(f"window_size=({left}, {right})")
        if self.softcap:
            parts.append(f"softcap={self.softcap}")
        return ", ".join(parts) or "plain attention"


PLAIN = Variant()


def window_problem(window_size) -> Optional[str]:
    """Why `window_size` is not a flash_attn window (None when it is)."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        return f"window_size must be a pair (left, right) of ints, got {window_size!r}"
    for name, side in (("left", left), ("right", right)):
        if isinstance(side, bool) or not isinstance(side, int):
            return f"window_size {name} side must be an int (-1: unbounded), got {side!r}"
        if side < -1:
            return f"window_size {name} side must be >= 0 or -1 (unbounded), got {side}"
    return None


def softcap_problem(softcap) -> Optional[str]:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        return f"softcap must be a number, got {softcap!r}"
    if not math.isfinite(softcap) or softcap < 0:
        return f"softcap must be > 0 (0 or None: off), got {softcap}"
    return None


def band_of_window_size(window_size) -> Band:
    """The band of a valid public `window_size` (-1 becomes None, unbounded)."""
    return tuple(None if side == -1 else int(side) for side in window_size)


def band_problem(band) -> Optional[str]:
    """Why `band` is not a band (a pair of ints of any sign, or None for an unbounded side)."""
    if not isinstance(band, (tuple, list)) or len(band) != 2:
        return f"a band must be a pair (left, right) of ints or None, got {band!r}"
    for name, side in (("left", band[0]), ("right", band[1])):
        if side is not None and (isinstance(side, bool) or not isinstance(side, int)):
            return f"band {name} side must be an int or None (unbounded), got {side!r}"
    return None


def fold_causal(band: Band, causal: bool) -> Band:
    """THE causal rule for a band (every path and the kernels use it): causal attention
    bounds the right side at 0, so a right side >= 0 (or None) adds nothing and becomes
    None; a negative one (the ring's shifted bands) stays, it hides more than causal."""
    left, right = band
    if causal and (right is None or right >= 0):
        right = None
    return (left, right)


def make_variant(window_size=(-1, -1), softcap: Optional[float] = 0.0, *, causal: bool = False) -> Variant:
    """The Variant of public arguments; raises ValueError on bad values. Causal attention
    bounds the right side at 0 (flash_attn's rule, `fold_causal`)."""
    softcap = 0.0 if softcap is None else softcap
    err = window_problem(window_size) or softcap_problem(softcap)
    if err:
        raise ValueError(err)
    return Variant(window=fold_causal(band_of_window_size(window_size), causal), softcap=float(softcap))


def band_lengths(band: Band) -> Tuple[int, int]:
    """The band as two ints with -1 for an unbounded side (descriptors, messages)."""
    return tuple(-1 if side is None else int(side) for side in band)


def sinks_problem(sinks, num_heads: int, device) -> Optional[str]:
    """Why `sinks` cannot be the sink logits of `num_heads` query heads on `device`."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        return f"sinks must be a tensor [{num_heads}] of per-head logits, got {type(sinks).__name__}"
    if sinks.dim() != 1 or sinks.shape[0] != num_heads:
        return f"sinks must have shape [{num_heads}] (one logit per query head), got {tuple(sinks.shape)}"
    if not sinks.dtype.is_floating_point:
        return f"sinks must be a floating-point tensor, got {sinks.dtype}"
    if device is not None and sinks.device != device:
        return f"sinks are on {sinks.device} but q is on {device}"
    return None


def sinks_gradient(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks `[H]`, the one rule every path uses: a sink is a key of value 0 with
    probability `P_sink = exp(sink_h - lse)` (`lse [B, H, n]` includes it), so its score gets
    `P_sink * (0 - delta)` like any key's, `delta [B, H, n] = rowsum(dO * O)`:
    `-sum_{b,i} P_sink[b,h,i] * delta[b,h,i]`, in lse's dtype. A row with lse = -inf (no key
    and a sink of -inf) contributes 0, not NaN."""
    p_sink = torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse)
    p_sink = torch.where(torch.isneginf(lse), torch.zeros_like(p_sink), p_sink)
    return -(p_sink * delta.to(lse.dtype)).sum(dim=(0, 2))
