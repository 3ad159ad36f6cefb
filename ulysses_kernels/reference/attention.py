"""Pure-torch attention: the semantics every faster path is tested against.

Conventions (shared with the Triton kernels):
- q `[B, Sq, Hq, D]`, k/v `[B, Sk, Hkv, D]`, `Hq % Hkv == 0`; query head h reads KV head
  `h // (Hq / Hkv)`.
- causal masks are bottom-right aligned (FlashAttention >= 2.1): query i sees key j iff
  `j <= i + Sk - Sq`, so rows with `i + Sk - Sq < 0` see nothing.
- `cu_seqlens` (B == 1, Sq == Sk): packed documents; a query sees only keys of its own
  document (and, if causal, not after itself).
- the variants (`ulysses_kernels/variants.py`): a window band `(left, right)` (query i
  sees key j iff `i + Sk - Sq - left <= j <= i + Sk - Sq + right`, inside its document),
  softcapped scores `c * tanh(s / c)`, sink logits in the denominator, and v with a head
  dim `Dv` of its own (the output has Dv).
- a row that sees no key outputs zeros and has LSE = -inf, or the sink's logit with
  sinks (no NaN anywhere).
- softmax is computed in float32 for 16-bit inputs and in float64 for float64 inputs;
  the LSE is natural-log, `[B, Hq, Sq]`.
"""

import math
from typing import Optional, Tuple

import torch

from ..variants import PLAIN, Band, Variant, make_variant, sinks_problem

# Bound the transient [chunk, Sk] score matrix to about this many elements per head.
_SCORE_ELEMENTS = 1 << 24


def document_ids(cu_seqlens: torch.Tensor, total: int, device) -> torch.Tensor:
    """Document index of every position of a packed sequence."""
    positions = torch.arange(total, device=device)
    bounds = cu_seqlens.to(device=device, dtype=torch.int64)[1:]
    return torch.searchsorted(bounds, positions, right=True)


def attention_mask(sq: int, sk: int, q_start: int, rows: int, causal: bool, doc_q=None, doc_k=None,
                   device=None, band: Band = (None, None)):
    """Boolean `[rows, Sk]` mask for query rows `[q_start, q_start + rows)`; None = all visible."""
    i = torch.arange(q_start, q_start + rows, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    left, right = band
    mask = None
    for keep in ((j <= i) if causal else None,
                 (j >= i - left) if left is not None else None,
                 (j <= i + right) if right is not None else None,
                 (doc_q[:, None] == doc_k[None, :]) if doc_q is not None else None):
        if keep is not None:
            mask = keep if mask is None else mask & keep
    return mask


def softcapped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """`c * tanh(scores / c)` (c > 0), else the scores."""
    return softcap * torch.tanh(scores / softcap) if softcap else scores


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                        softmax_scale: Optional[float] = None, cu_seqlens: Optional[torch.Tensor] = None,
                        window_size=(-1, -1), softcap: float = 0.0,
                        sinks: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact attention with autograd; returns (out `[B, Sq, Hq, Dv]`, lse `[B, Hq, Sq]`).

    window_size: flash_attn's `(left, right)`, -1 unbounded. softcap: `c > 0` caps the
    scaled scores at `c * tanh(s / c)`. sinks: `[Hq]` logits in every row's softmax
    denominator (differentiable). Memory is O(chunk * Sk) per head in the forward;
    autograd keeps the probabilities, so the backward is O(Sq * Sk): this path is for
    correctness, not for long sequences.
    """
    variant = make_variant(window_size, softcap, causal=causal)
    err = sinks_problem(sinks, q.shape[2], q.device)
    if err:
        raise ValueError(f"reference_attention: {err}")
    return attend(q, k, v, causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens, variant=variant,
                  sinks=sinks)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, softmax_scale: Optional[float],
           cu_seqlens: Optional[torch.Tensor] = None, variant: Variant = PLAIN,
           sinks: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """`reference_attention` on validated arguments (the paths' entry)."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = Hq // Hkv
    qc = q.to(compute).permute(0, 2, 1, 3)  # [B, Hq, Sq, D]
    kc = k.to(compute).permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    vc = v.to(compute).permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    sink = sinks.to(compute).view(1, Hq, 1, 1) if sinks is not None else None
    doc = None
    if cu_seqlens is not None:
        doc = document_ids(cu_seqlens, Sk, q.device)
    chunk = max(1, min(Sq, _SCORE_ELEMENTS // max(1, Sk * Hq * B)))
    outs, lses = [], []
    for start in range(0, Sq, chunk):
        stop = min(Sq, start + chunk)
        scores = softcapped(torch.matmul(qc[:, :, start:stop], kc.transpose(-1, -2)) * scale, variant.softcap)
        mask = attention_mask(Sq, Sk, start, stop - start, causal,
                              doc[start:stop] if doc is not None else None, doc, q.device, variant.window)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        # The row max only shifts the exponent; detaching it leaves gradients exact.
        row_max = scores.amax(dim=-1, keepdim=True)
        if sink is not None:
            row_max = torch.maximum(row_max, sink.expand_as(row_max))
        row_max = row_max.detach()
        row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
        p = torch.exp(scores - row_max)
        denom = p.sum(dim=-1, keepdim=True)
        if sink is not None:
            denom = denom + torch.exp(sink - row_max)
        empty = denom == 0
        safe_denom = torch.where(empty, torch.ones_like(denom), denom)  # no 0/0 in backward
        out = torch.matmul(p, vc) / safe_denom
        lse = torch.where(empty, torch.full_like(denom, float("-inf")), row_max + torch.log(safe_denom))
        outs.append(out)
        lses.append(lse.squeeze(-1))
    out = torch.cat(outs, dim=2).permute(0, 2, 1, 3).to(q.dtype)
    lse = torch.cat(lses, dim=2)
    return out, lse.to(torch.float32) if compute == torch.float32 else lse
