"""The reference path (docs/architecture.md, "Reference path"): the torch exchange
(`ulysses_kernels/exchange/`), exact torch attention over the whole sequence for this
rank's heads, the exchange back. Every step is differentiable; it runs anywhere (CPU
with gloo included) and defines the semantics every faster path is tested against."""

from typing import Optional

import torch

from ..exchange import heads
from ..variants import PLAIN
from .attention import attend
from .block_ops import TorchBlockOps


class ReferencePath:
    """`Path` (distributed/dispatch.py) on torch ops and torch.distributed."""

    name = "reference"
    block_ops = TorchBlockOps
    seq_to_heads = staticmethod(heads.seq_to_heads)
    heads_to_seq = staticmethod(heads.heads_to_seq)

    @staticmethod
    def problem(device: torch.device, tensors) -> Optional[str]:
        return None  # any device, any float dtype

    @staticmethod
    def ulysses_attention(q, k, v, *, group, rank, seq_lens, causal, softmax_scale, cu_seqlens, variant=PLAIN,
                          sinks=None):
        qh, kh, vh = heads.exchange_qkv(heads.seq_to_heads, q, k, v, group=group, rank=rank, seq_lens=seq_lens)
        out, _ = attend(qh, kh, vh, causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
                        variant=variant, sinks=heads.local_sinks(sinks, rank, len(seq_lens)))
        return heads.heads_to_seq(out, group=group, rank=rank, seq_lens=seq_lens)

    @staticmethod
    def attention(q, k, v, *, causal, softmax_scale, cu_seqlens=None, deterministic=None, with_lse=False,
                  variant=PLAIN, sinks=None):
        """Exact torch attention (differentiable; always deterministic)."""
        out, lse = attend(q, k, v, causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
                          variant=variant, sinks=sinks)
        return out, (lse if with_lse else None)

    @staticmethod
    def ring_shift(group, world, rank, device):
        return None  # torch.distributed P2P


PATH = ReferencePath()
