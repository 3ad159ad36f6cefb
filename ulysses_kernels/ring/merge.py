"""THE log-sum-exp merge of attention partials (docs/architecture.md, "Ulysses x Ring").

Two attentions of the same queries over disjoint key sets, (acc, lse_acc) and (out, lse),
combine to the attention over the union:

    lse_new = log(exp(lse_acc) + exp(lse))
    acc_new = acc * exp(lse_acc - lse_new) + out * exp(lse - lse_new)

This is the torch version: the reference path's ring merges with it, HF inference merges
the ring ranks' partials with it, and the Triton merge kernel
(`ulysses_kernels/triton/merge.py`, used by the Triton and fused paths' ring) is tested against
it. Accumulators are float32 (float64 for float64 inputs); rows with -inf on both sides
(no key seen yet) stay 0 / -inf.
"""

from typing import Sequence, Tuple

import torch

from ..variants import sinks_gradient


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial attentions are accumulated in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_partial(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """acc <- the softmax-weighted merge of (acc_out, acc_lse) and a partial (out, lse), in place.

    acc_out `[B, n, H, D]` and acc_lse `[B, H, n]` are views into the accumulators (in their
    fp32/fp64 dtype); out in any float dtype, lse natural-log `[B, H, n]`.
    """
    new_lse = torch.logaddexp(acc_lse, lse.to(acc_lse.dtype))
    safe = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_acc = torch.exp(acc_lse - safe).transpose(1, 2).unsqueeze(-1)  # [B, n, H, 1]
    w_new = torch.exp(lse.to(acc_lse.dtype) - safe).transpose(1, 2).unsqueeze(-1)
    acc_out.copy_(acc_out * w_acc + out.to(acc_out.dtype) * w_new)
    acc_lse.copy_(new_lse)


def merge_partials(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the union of the partials `outs[i]` `[B, n, H, D]` / `lses[i]`
    `[B, H, n]`, merged in order in the accumulation dtype of `outs[0]`."""
    acc = accumulate_dtype(outs[0].dtype)
    out = torch.zeros(outs[0].shape, dtype=acc, device=outs[0].device)
    lse = torch.full(lses[0].shape, float("-inf"), dtype=acc, device=outs[0].device)
    for o, s in zip(outs, lses):
        merge_partial(out, lse, o, s)
    return out, lse


def merge_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of attention whose softmax denominator also holds `exp(sinks[h])`
    (docs/architecture.md, "Attention variants"): the merge with a partial of value 0 and
    LSE `sinks[h]`, applied once after every key has been merged. out `[B, n, H, Dv]`,
    lse `[B, H, n]`, sinks `[H]` (differentiable through this function)."""
    sink = sinks.to(lse.dtype).view(1, -1, 1).expand_as(lse)
    new_lse = torch.logaddexp(lse, sink)
    weight = torch.exp(lse - new_lse).transpose(1, 2).unsqueeze(-1)  # rows without keys: 0
    return out * weight.to(out.dtype), new_lse


def sink_gradient(sinks: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks `[H]` (in sinks' dtype) from the final (sink-inclusive) lse `[B, H, n]`,
    output and its gradient `[B, n, H, Dv]`: `variants.sinks_gradient` with `delta =
    rowsum(dO * O)` accumulated in lse's dtype."""
    delta = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1).transpose(1, 2)  # [B, H, n]
    return sinks_gradient(sinks, lse, delta).to(sinks.dtype)