"""The reference path's fast attention: torch's `scaled_dot_product_attention` for the calls
it computes with the reference's exact semantics (docs/architecture.md, "Reference path").

The reference attention (attention.py) materialises the scores and autograd keeps the
probabilities: O(S^2) memory and several times SDPA's time. SDPA's fused kernels (on CPU
the flash kernel) keep O(S) memory and compute the same softmax in float32 for 16-bit
inputs. What SDPA cannot express keeps the reference (`sdpa_problem` says why):

- float64 inputs: the float64 semantics every test compares against stay one code;
- sink logits and softcapped scores (not in SDPA's interface);
- a value head dim of its own (SDPA's flash kernels need one head dim; its math fallback
  is the O(S^2) computation again);
- the LSE (the ring's and the inference merges' input);
- a deterministic backward off the CPU (the CPU flash kernel's backward is reproducible,
  not every CUDA one is);
- rows that may see no key (a causal or windowed call with more queries than keys): the
  reference outputs zeros there, SDPA's kernels do not all agree on it.

Masks: causal with Sq == Sk is SDPA's own `is_causal` (top-left and bottom-right alignment
coincide); every other mask (bottom-right causal with Sq < Sk, a window band, packed
documents) is the reference's boolean mask, built on the device from `cu_seqlens` (no host
read), O(Sq * Sk) bytes against the reference's O(H * Sq * Sk) float scores.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from ..variants import PLAIN, Variant
from .attention import attention_mask, document_ids


def sdpa_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, variant: Variant = PLAIN,
                 sinks: Optional[torch.Tensor] = None, with_lse: bool = False,
                 deterministic: bool = False) -> Optional[str]:
    """Why SDPA cannot compute this call exactly as the reference does (None: it can).
    `deterministic`: the call asks for a bitwise-reproducible backward."""
    if q.dtype == torch.float64:
        return "float64 inputs run the reference attention (the float64 semantics the tests compare against)"
    if sinks is not None:
        return "sink logits are not in SDPA's interface"
    if variant.softcap:
        return "softcapped scores are not in SDPA's interface"
    if v.shape[-1] != q.shape[-1]:
        return "a value head dim of its own (MLA) has no fused SDPA kernel"
    if with_lse:
        return "SDPA does not return the LSE"
    if deterministic and q.device.type != "cpu":
        return "a deterministic backward was asked for (not every CUDA SDPA backward is reproducible)"
    if any(side is not None and side < 0 for side in variant.window):
        return "a shifted band (a ring block's) may leave rows without keys"
    if (causal or variant.windowed) and q.shape[1] > k.shape[1]:
        return "a causal or windowed call with more queries than keys has rows that see no key"
    return None


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                   softmax_scale: Optional[float], cu_seqlens: Optional[torch.Tensor] = None,
                   variant: Variant = PLAIN) -> torch.Tensor:
    """The reference attention's output on `[B, S, H, D]` inputs (differentiable) for a call
    `sdpa_problem` accepts: `[B, Sq, Hq, D]` in q's dtype."""
    Sq, Sk = q.shape[1], k.shape[1]
    mask = None
    if cu_seqlens is not None or variant.windowed or (causal and Sq != Sk):
        doc = document_ids(cu_seqlens, Sk, q.device) if cu_seqlens is not None else None
        mask = attention_mask(Sq, Sk, 0, Sq, causal, doc, doc, q.device, variant.window)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))     # [B, H, S, D] views
    group = q.shape[2] // k.shape[2]
    gqa = {}
    if group > 1:
        if q.device.type == "cpu":
            gqa = {"enable_gqa": True}                       # the CPU flash kernel reads KV heads in place
        else:
            # Not every CUDA SDPA kernel takes enable_gqa; repeated heads run on all of them.
            kt, vt = (t.repeat_interleave(group, dim=1) for t in (kt, vt))
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=causal and mask is None,
                                         scale=softmax_scale, **gqa)
    return out.transpose(1, 2)
