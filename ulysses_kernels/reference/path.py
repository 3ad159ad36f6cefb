"""The reference path (docs/architecture.md, "Reference path"): the torch exchange
(`ulysses_kernels/exchange/`), exact torch attention over the whole sequence for this
rank's heads (torch SDPA where it computes the same result, sdpa.py; else the reference
attention, attention.py), the exchange back. Every step is differentiable; it runs anywhere (CPU
with gloo included) and defines the semantics every faster path is tested against."""

from typing import Optional

import torch

from .. import env
from ..exchange import heads
from ..variants import PLAIN
from .attention import attend
from .block_ops import TorchBlockOps
from .sdpa import sdpa_attention, sdpa_problem


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
                          sinks=None, engine=None):
        qh, kh, vh = heads.exchange_qkv(heads.seq_to_heads, q, k, v, group=group, rank=rank, seq_lens=seq_lens)
        out, _ = _attention(qh, kh, vh, causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
                            variant=variant, sinks=heads.local_sinks(sinks, rank, len(seq_lens)),
                            deterministic=None)
        return heads.heads_to_seq(out, group=group, rank=rank, seq_lens=seq_lens)

    @staticmethod
    def attention(q, k, v, *, causal, softmax_scale, cu_seqlens=None, deterministic=None, with_lse=False,
                  variant=PLAIN, sinks=None):
        """Exact torch attention (differentiable; a reproducible backward on CPU, and
        elsewhere when `deterministic` asks for one)."""
        return _attention(q, k, v, causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
                          variant=variant, sinks=sinks, with_lse=with_lse, deterministic=deterministic)

    @staticmethod
    def ring_shift(group, world, rank, device):
        return None  # torch.distributed P2P


def _attention(q, k, v, *, causal, softmax_scale, cu_seqlens, variant, sinks, deterministic, with_lse=False):
    """(out, lse or None): torch SDPA where it computes the reference's result (sdpa.py),
    else the reference attention itself. `deterministic` None: `ULYSSES_KERNELS_DETERMINISTIC`."""
    if deterministic is None:
        deterministic = env.flag(env.DETERMINISTIC)
    if sdpa_problem(q, k, v, causal=causal, variant=variant, sinks=sinks, with_lse=with_lse,
                    deterministic=deterministic) is None:
        return sdpa_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
                              variant=variant), None
    out, lse = attend(q, k, v, causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
                      variant=variant, sinks=sinks)
    return out, (lse if with_lse else None)


PATH = ReferencePath()
