"""Ring attention over the ring group of the Ulysses x Ring hybrid (docs/architecture.md,
"Ulysses x Ring"): the ring schedule every path runs.

After the Ulysses all-to-all, every rank holds its heads for its ring rank's *portion* of
the sequence (`layout.py`). Ring attention computes those queries against every
portion's keys: the K/V of the portion in hand go to the next ring rank while the blocks
of `plan.ring_blocks` are computed, and the partial outputs are merged by their
log-sum-exp in float32 (float64 for float64 inputs). The backward passes K/V around the
ring again, and with them an fp32 accumulator of their dK/dV, which comes home after a
full turn (the scheme of ring-flash-attn); dQ accumulates locally. Summation orders are
fixed, so results are deterministic. The variants (docs/architecture.md, "Attention
variants"): the window is part of the block plan, the softcap part of every block's
scores, and the sinks join the merged (out, lse) once, after every key has been merged.

What differs between paths is declared here and passed in by the path: how a block is
computed (`BlockOps`: the reference path's torch ops, the Triton kernels of the Triton
and fused paths) and how a buffer moves to the next ring rank (`RingSpec.shift`:
torch.distributed P2P by default, the ring engine's transport on the fused path).
`ulysses_ring_attention` is the whole hybrid call on one path: the path's exchange to
head shards, ring attention, the path's exchange back.
"""

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Tuple

import torch
import torch.distributed as dist

from ..exchange.heads import exchange_qkv, local_sinks
from ..variants import PLAIN, Variant
from .layout import portion_lengths
from .merge import accumulate_dtype, merge_sinks, sink_gradient
from .plan import Block, ring_blocks


class BlockOps(Protocol):
    """The block computations of one path. q `[B, n, Hq, D]`, k/v `[B, m, Hkv, D]` are row
    ranges of head-sharded portions; `block` says which mask applies inside and `softcap`
    (0: none) caps the block's scores."""

    def forward(self, q, k, v, block: Block, scale: float, softcap: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
        """(out `[B, n, Hq, Dv]`, lse `[B, Hq, n]`) of the block alone."""

    def backward(self, do, q, k, v, out, lse, block: Block, scale: float, softcap: float = 0.0):
        """(dq, dk, dv) of this block's share of the final attention, from the final
        output and LSE (so P is the final softmax restricted to the block)."""

    def merge(self, acc_out, acc_lse, out, lse) -> None:
        """Merge a block's (out, lse) into the fp32/fp64 accumulators in place (merge.py)."""


class Transfer(Protocol):
    def wait(self) -> None:
        """Make the caller's stream (or the host) wait until the buffer has arrived."""


# shift(send, recv, tag) -> Transfer: send `send` to the next ring rank, receive the
# previous one's into `recv`, in the background.
Shift = Callable[[torch.Tensor, torch.Tensor, int], Transfer]


@dataclass(frozen=True)
class RingSpec:
    """One ring attention call: the ring group (None: a single ring rank), the global
    problem every ring rank agreed on, and the path's block ops and transfers."""

    group: object
    world: int
    rank: int
    total: int                                  # global sequence length
    causal: bool
    softmax_scale: float
    documents: Optional[Tuple[int, ...]] = None  # global cu_seqlens, on the host
    block_ops: Optional[BlockOps] = None         # the path's (ulysses_ring_attention sets them); required
    shift: Optional[Shift] = None                # None: torch.distributed P2P (RingShift)
    variant: Variant = PLAIN                     # the window (in the block plan) and the softcap
    # The dtype dK/dV partial sums travel in (None: the fp32/fp64 accumulator, the package's choice;
    # docs/architecture.md, "Ulysses x Ring"). bench/ring_numerics.py --dkv-wire measures the input
    # dtype instead: half the backward's dK/dV bytes, one rounding per hop.
    dkv_wire: Optional[torch.dtype] = None

    def portion(self, ring_rank: int) -> int:
        return portion_lengths(self.total, self.world)[ring_rank]

    def blocks(self, kv_rank: int) -> Tuple[Block, ...]:
        return ring_blocks(self.total, self.world, self.rank, kv_rank, self.causal, self.documents,
                           self.variant.window)

    def transfer(self, send: torch.Tensor, recv: torch.Tensor, tag: int) -> Transfer:
        return self.shift(send, recv, tag) if self.shift is not None else RingShift(self, send, recv, tag)


# ---------------------------------------------------------------------- ring transfers

class RingShift:
    """Send one flat buffer to the next ring rank and receive the previous rank's, in the
    background (torch.distributed P2P: NCCL runs it on its own stream, so it overlaps
    with the block computations; gloo uses its own threads). The send and the receive are
    one batch (`batch_isend_irecv`): NCCL groups them, so no rank's send waits for a
    receive that its peer has not posted yet (a ring of sends first can deadlock)."""

    def __init__(self, spec: "RingSpec", send: torch.Tensor, recv: torch.Tensor, tag: int):
        self.works = []
        if spec.group is None or spec.world == 1:
            recv.copy_(send)
            return
        nxt = dist.get_global_rank(spec.group, (spec.rank + 1) % spec.world)
        prv = dist.get_global_rank(spec.group, (spec.rank - 1) % spec.world)
        self.works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, spec.group, tag),
                                             dist.P2POp(dist.irecv, recv, prv, spec.group, tag)])

    def wait(self):
        for w in self.works:
            w.wait()
        self.works = []


def _kv_numel(k, v, length):
    B, _, H, D = k.shape
    return B * length * H * (D + v.shape[3])


def _split_kv(flat, k, v, length):
    """K `[B, length, H, D]` and V `[B, length, H, Dv]` views of one flat buffer."""
    B, _, H, D = k.shape
    n = B * length * H * D
    m = B * length * H * v.shape[3]
    return flat[:n].view(B, length, H, D), flat[n:n + m].view(B, length, H, v.shape[3])


def _rows(t, start, stop):
    return t[:, start:stop]


# --------------------------------------------------------------------- forward, backward

def ring_forward(q, k, v, spec: RingSpec, sinks=None):
    """(out `[B, L, H, Dv]` in q's dtype, lse `[B, H, L]` fp32/fp64) of this rank's queries;
    `sinks` `[H]` (this rank's heads) join the merged result once."""
    B, L, H, _ = q.shape
    ops = spec.block_ops
    acc = accumulate_dtype(q.dtype)
    softcap = spec.variant.softcap
    out = torch.zeros(B, L, H, v.shape[3], dtype=acc, device=q.device)
    lse = torch.full((B, H, L), float("-inf"), dtype=acc, device=q.device)
    kv = torch.cat([k.reshape(-1), v.reshape(-1)])
    for step in range(spec.world):
        src = (spec.rank - step) % spec.world
        shift = None
        if step + 1 < spec.world:  # the next block travels while this one is computed
            incoming = kv.new_empty(_kv_numel(k, v, spec.portion((src - 1) % spec.world)))
            shift = spec.transfer(kv, incoming, tag=1)
        kb, vb = _split_kv(kv, k, v, spec.portion(src))
        for b in spec.blocks(src):
            o, l_ = ops.forward(_rows(q, b.q_start, b.q_stop), _rows(kb, b.k_start, b.k_stop),
                                _rows(vb, b.k_start, b.k_stop), b, spec.softmax_scale, softcap)
            ops.merge(out[:, b.q_start:b.q_stop], lse[:, :, b.q_start:b.q_stop], o, l_)
        if shift is not None:
            shift.wait()
            kv = incoming
    if sinks is not None:
        out, lse = merge_sinks(out, lse, sinks)
    return out.to(q.dtype), lse


def ring_backward(do, q, k, v, out, lse, spec: RingSpec):
    """(dq, dk, dv) of this rank's q/k/v: dQ locally, dK/dV travelling with their K/V. The
    final lse holds the sinks, so the blocks need nothing else of them."""
    ops = spec.block_ops
    softcap = spec.variant.softcap
    acc = accumulate_dtype(q.dtype)
    wire = spec.dkv_wire or acc
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.cat([k.reshape(-1), v.reshape(-1)])
    travelling = None  # (shift, buffer) of the dK/dV sum arriving for the block in hand
    for step in range(spec.world):
        src = (spec.rank - step) % spec.world
        length = spec.portion(src)
        shift = None
        if step + 1 < spec.world:
            incoming = kv.new_empty(_kv_numel(k, v, spec.portion((src - 1) % spec.world)))
            shift = spec.transfer(kv, incoming, tag=2)
        kb, vb = _split_kv(kv, k, v, length)
        dkv = torch.zeros(_kv_numel(k, v, length), dtype=acc, device=q.device)
        dkb, dvb = _split_kv(dkv, k, v, length)
        for b in spec.blocks(src):
            rows = slice(b.q_start, b.q_stop)
            dq_b, dk_b, dv_b = ops.backward(
                do[:, rows], q[:, rows], _rows(kb, b.k_start, b.k_stop), _rows(vb, b.k_start, b.k_stop),
                out[:, rows], lse[:, :, rows].contiguous(), b, spec.softmax_scale, softcap)
            dq[:, rows] += dq_b
            dkb[:, b.k_start:b.k_stop] += dk_b
            dvb[:, b.k_start:b.k_stop] += dv_b
        if travelling is not None:  # the sum over the ring ranks that held this block before
            travelling[0].wait()
            dkv += travelling[1]
        home = torch.empty(_kv_numel(k, v, spec.portion((src - 1) % spec.world)), dtype=wire, device=q.device)
        travelling = (spec.transfer(dkv.to(wire), home, tag=3), home)
        if shift is not None:
            shift.wait()
            kv = incoming
    travelling[0].wait()  # after a full turn, the sum for this rank's own block
    dk, dv = _split_kv(travelling[1], k, v, k.shape[1])
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Differentiable ring attention of head-sharded portions `[B, L, H, D]` (and of the
    sinks of these heads, when given)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, spec: RingSpec):
        out, lse = ring_forward(q, k, v, spec, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.spec = spec
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dq, dk, dv = ring_backward(grad_out, q, k, v, out, lse, ctx.spec)
        dsinks = sink_gradient(sinks, lse, out, grad_out) if sinks is not None else None
        return dq, dk, dv, dsinks, None


def ring_attention(q, k, v, spec: RingSpec, sinks=None) -> torch.Tensor:
    """Ring attention of head-sharded portions q `[B, L, Hq, D]`, k `[B, L, Hkv, D]`, v
    `[B, L, Hkv, Dv]` (differentiable), with the spec's block ops and transfers; `sinks`
    `[Hq]`: these heads' sink logits."""
    if spec.block_ops is None:
        raise ValueError("ring_attention: the RingSpec has no block_ops; a path's call sets them "
                         "(ulysses_ring_attention), or pass block_ops= (reference.block_ops.TorchBlockOps)")
    return RingAttention.apply(q, k, v, sinks, spec)


def ulysses_ring_attention(path, q, k, v, *, group, rank: int, seq_lens, spec: RingSpec,
                           sinks=None) -> torch.Tensor:
    """A validated Ulysses x Ring call on `path` (distributed/dispatch.py, `Path`): the path's
    exchange to head shards of the portion over the Ulysses group, ring attention over the
    ring group with the path's block ops and transfers, the path's exchange back. `sinks`
    `[Hq]` (global heads) are sliced to this rank's query heads."""
    lens = list(seq_lens)
    alone = len(lens) == 1   # a pure ring: the Ulysses exchanges would copy the tensors to themselves
    with torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext():
        if alone:
            qh, kh, vh = (t.contiguous() for t in (q, k, v))
        else:
            qh, kh, vh = exchange_qkv(path.seq_to_heads, q, k, v, group=group, rank=rank, seq_lens=lens)
        block_ops = path.block_ops
        if hasattr(block_ops, "for_call"):  # a path whose blocks run on the kernel choice's pick
            groups = tuple(g for g, n in ((group, len(lens)), (spec.group, spec.world)) if n > 1)
            block_ops = block_ops.for_call(qh, kh, vh, spec=spec, groups=groups)
        spec = dataclasses.replace(spec, block_ops=block_ops,
                                   shift=path.ring_shift(spec.group, spec.world, spec.rank, q.device))
        out = ring_attention(qh, kh, vh, spec, local_sinks(sinks, rank, len(lens)))
        return out if alone else path.heads_to_seq(out, group=group, rank=rank, seq_lens=lens)

