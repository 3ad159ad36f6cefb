"""One kernel choice for every path (docs/architecture.md, "The kernel choice"): the fused
pipeline, the Triton path, the ring and the Hugging Face layer ask this package which
kernel computes an attention call, among our Triton kernels, torch SDPA (cuDNN, flash),
FlashAttention 2 / 3 / 4, torch's varlen_attn and FlexAttention.

- `call.py`: `Call`, the class of a call (what the tables and the timing are keyed by).
- `table.py`: `Capabilities`, a candidate's table, and `excluded`, THE rule.
- `candidates.py`: the candidates (table, runner, LSE functions) and their registry.
- `choice.py`: `choose`: forced or timed, agreed over the caller's groups, cached.
- `explain.py`: doctor's lines and `--explain`.
"""

from typing import Optional, Sequence

import torch

from ..variants import PLAIN, Variant
from .call import ALIGNMENTS, Call, alignment_of, bucket, call_for, call_of, device_facts
from .candidates import CANDIDATES, FAMILIES, Candidate, register, unregister
from .choice import Decision, choose, clear_memory_cache, requested
from .table import Capabilities, excluded

__all__ = ["ALIGNMENTS", "CANDIDATES", "FAMILIES", "Call", "Candidate", "Capabilities", "Decision", "alignment_of",
           "attention", "bucket", "call_for", "call_of", "choose", "clear_memory_cache", "device_facts", "excluded", "register", "requested",
           "run", "unregister"]


def run(name: str, q, k, v, *, causal: bool, softmax_scale: Optional[float] = None, cu_seqlens=None,
        variant: Variant = PLAIN, sinks=None, deterministic: Optional[bool] = None) -> torch.Tensor:
    """Attention on candidate `name` (differentiable), whether or not its table covers the
    call: the caller (`attention`, the paths, the tests) decided."""
    out = CANDIDATES[name].run(q, k, v, causal=causal, scale=softmax_scale, cu_seqlens=cu_seqlens, variant=variant,
                               sinks=sinks, deterministic=deterministic)
    return out.contiguous()  # usually contiguous already: a no-op


def attention(q, k, v, *, causal: bool = False, softmax_scale: Optional[float] = None, cu_seqlens=None,
              deterministic: Optional[bool] = None, variant: Variant = PLAIN, sinks=None,
              groups: Sequence = ()) -> torch.Tensor:
    """Single-device attention over `[B, S, H, D]` views on the chosen kernel, differentiable;
    `groups`: the ranks that must agree on the kernel (they all make this call)."""
    from .. import env

    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, sinks) if t is not None)
    if deterministic is None:
        deterministic = env.flag(env.DETERMINISTIC)
    call = call_of(q, k, v, causal=causal, packed=cu_seqlens is not None, variant=variant, sinks=sinks is not None,
                   deterministic=deterministic, grad=grad)
    name = choose(call, groups=groups, device=q.device).choice
    return run(name, q, k, v, causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens, variant=variant,
               sinks=sinks, deterministic=deterministic)
