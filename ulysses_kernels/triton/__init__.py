"""Triton flash-attention kernels over strided and all-to-all buffer layouts.

``ulysses_kernels.triton``, imported lazily (``extensions.require_triton_kernels``: the package imports without Triton). Public API:

* :func:`flash_attention` (differentiable, ``[B, S, H, D]`` with any strides)
* :func:`flash_attention_forward` / :func:`flash_attention_backward` (low level, no
  autograd; read/write the Ulysses all-to-all buffers in place via ``seq_splits``)
* :func:`inputs_problem` (what the kernels support: dtypes and head dims)

Variants (keyword arguments of all three, compile-time switches of the kernels, so the
plain kernels are built unchanged when they are off): a window ``window_size=(left,
right)`` in flash_attn's convention, as ``uk.*`` take it (-1 unbounded; the loops skip the
blocks outside it), logit softcapping ``softcap=c``, attention sinks ``sinks`` (``[Hq]``
logits in the softmax denominator, differentiable), and v with a head dim of its own. The
package's own callers pass the ring's shifted bands (negative sides) through the private
``_band=`` keyword instead (docs/architecture.md, "Attention variants").

The ops are registered as ``torch.ops.ulysses_kernels.triton_flash_fwd`` /
``triton_flash_bwd`` / ``triton_flash_fwd_out`` / ``triton_flash_bwd_out`` (for
``torch.compile``; they take the band form, ``band_left`` / ``band_right``).
On CPU tensors the kernels run only in the Triton interpreter (``TRITON_INTERPRET=1``,
set before this module is imported).
"""

from .merge import merge_attention
from .ops import (
    flash_attention,
    flash_attention_backward,
    flash_attention_forward,
    inputs_problem,
    triton_flash_bwd,
    triton_flash_bwd_out,
    triton_flash_fwd,
    triton_flash_fwd_out,
)

__all__ = [
    "flash_attention",
    "flash_attention_forward",
    "flash_attention_backward",
    "inputs_problem",
    "triton_flash_fwd",
    "triton_flash_bwd",
    "triton_flash_fwd_out",
    "triton_flash_bwd_out",
    "merge_attention",
]
