"""The Triton path (docs/architecture.md, "Triton path"): the shared torch exchange
(`ulysses_kernels/exchange/`) around the attention kernels, which read the all-to-all
buffers in place (`ulysses.py`), the kernel chosen by the kernel choice
(`ulysses_kernels/kernel_choice/`), and the ring's blocks (`block_ops.py`)."""

from typing import Optional

import torch

from .. import env, kernel_choice
from ..exchange import heads
from ..extensions import require_triton_kernels, triton_kernels
from ..variants import PLAIN
from . import ulysses
from .block_ops import TritonBlockOps


def kernels_problem(device: torch.device, tensors) -> Optional[str]:
    """Why the Triton attention kernels cannot run q/k/v `tensors` on `device` (None when
    they can; no tensors: whether they run there at all), phrased to follow
    "backend='<path>' ". The fused path runs these kernels too and asks the same."""
    # Check before importing: kernels imported without the interpreter cannot run on CPU.
    if device.type != "cuda" and not env.interpreting():
        return ("on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 before "
                "importing ulysses_kernels")
    module, reason = triton_kernels()
    if module is None:
        return f"needs the Triton kernels, which cannot be used: {reason}"
    if len(tensors) != 3 or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in tensors):
        return None  # no inputs, or malformed ones (the shape checks report those)
    why = module.inputs_problem(*tensors)
    return f"cannot run these inputs: {why}" if why else None


class TritonPath:
    """`Path` (distributed/dispatch.py) on the Triton kernels and the torch exchange."""

    name = "triton"
    block_ops = TritonBlockOps
    seq_to_heads = staticmethod(heads.seq_to_heads)
    heads_to_seq = staticmethod(heads.heads_to_seq)
    ulysses_attention = staticmethod(ulysses.ulysses_attention)
    problem = staticmethod(kernels_problem)

    @staticmethod
    def attention(q, k, v, *, causal, softmax_scale, cu_seqlens=None, deterministic=None, with_lse=False,
                  variant=PLAIN, sinks=None):
        """The chosen kernel (kernel_choice), differentiable; with the LSE: our kernel's forward
        (no autograd)."""
        if with_lse:
            return require_triton_kernels().flash_attention_forward(
                q, k, v, causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens, _band=variant.window,
                softcap=variant.softcap, sinks=sinks)
        out = kernel_choice.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
                               deterministic=deterministic, variant=variant, sinks=sinks)
        return out, None

    @staticmethod
    def ring_shift(group, world, rank, device):
        return None  # torch.distributed P2P


PATH = TritonPath()
