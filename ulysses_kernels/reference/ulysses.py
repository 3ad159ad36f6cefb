"""The reference path of `ulysses_attention` (docs/architecture.md, "Reference path"):
one q/k/v exchange, exact torch attention over the whole sequence for this rank's heads
(with a ring group: ring attention over the ring, `ring.py`), one exchange back. Every
step is differentiable."""

from .attention import reference_attention
from .exchange import HeadsToSeq, SeqToHeads
from .ring import ring_attention


def ulysses_attention(q, k, v, *, group, rank, seq_lens, causal, softmax_scale, cu_seqlens, ring=None):
    """Called by `ulysses_kernels.ulysses_attention` after it validated the inputs:
    `seq_lens` is every rank's local length, `group` None a single process, `ring` the
    `RingSpec` of a Ulysses x Ring call (None: pure Ulysses)."""
    qh, kh, vh = SeqToHeads.apply(group, rank, seq_lens, q, k, v)
    if ring is not None:
        out = ring_attention(qh, kh, vh, ring)
    else:
        out, _ = reference_attention(qh, kh, vh, causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens)
    return HeadsToSeq.apply(group, rank, seq_lens, out)
