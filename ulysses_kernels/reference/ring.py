"""Ring attention over the ring group of the Ulysses x Ring hybrid (docs/architecture.md,
"Ulysses x Ring").

After the Ulysses all-to-all, every rank holds its heads for its ring rank's *portion* of
the sequence (`zigzag.py`). Ring attention computes those queries against every
portion's keys: the K/V of the portion in hand go to the next ring rank while the blocks
of `zigzag.ring_blocks` are computed, and the partial outputs are merged by their
log-sum-exp in float32 (float64 for float64 inputs). The backward passes K/V around the
ring again, and with them an fp32 accumulator of their dK/dV, which comes home after a
full turn (the scheme of ring-flash-attn); dQ accumulates locally. Summation orders are
fixed, so results are deterministic.

The block computations are pluggable (`RingSpec.block_ops`): `TorchBlockOps` here (plain
torch, the semantics, any dtype, used by the reference path), the Triton kernels of
`triton_path.py` (Triton and fused paths). So are the transfers (`RingSpec.shift`):
torch.distributed P2P here, the ring engine's transport on the fused path.
"""

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

from ..zigzag import Block, portion_lengths, ring_blocks


@dataclass(frozen=True)
class RingSpec:
    """One ring attention call: the ring group (None: a single ring rank) and the global
    problem every ring rank agreed on."""

    group: object
    world: int
    rank: int
    total: int                                  # global sequence length
    causal: bool
    softmax_scale: float
    documents: Optional[Tuple[int, ...]] = None  # global cu_seqlens, on the host
    # How blocks are computed (the caller's path chooses; None: TorchBlockOps) and how a
    # buffer moves to the next ring rank: shift(send, recv) -> object with wait() (None:
    # torch.distributed P2P, `RingShift`; the fused path passes its engine's transport).
    block_ops: object = None
    shift: Optional[Callable] = None

    def portion(self, ring_rank: int) -> int:
        return portion_lengths(self.total, self.world)[ring_rank]

    def blocks(self, kv_rank: int) -> Tuple[Block, ...]:
        return ring_blocks(self.total, self.world, self.rank, kv_rank, self.causal, self.documents)


# ------------------------------------------------------------------------- block ops

def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_partial(acc_out, acc_lse, out, lse):
    """acc <- the softmax-weighted merge of (acc_out, acc_lse) and a block's (out, lse).

    acc_out `[B, n, H, D]` and acc_lse `[B, H, n]` are views into the accumulators,
    updated in place in their (fp32/fp64) dtype; rows with -inf on both sides stay 0/-inf.
    """
    new_lse = torch.logaddexp(acc_lse, lse.to(acc_lse.dtype))
    safe = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_acc = torch.exp(acc_lse - safe).transpose(1, 2).unsqueeze(-1)  # [B, n, H, 1]
    w_new = torch.exp(lse.to(acc_lse.dtype) - safe).transpose(1, 2).unsqueeze(-1)
    acc_out.copy_(acc_out * w_acc + out.to(acc_out.dtype) * w_new)
    acc_lse.copy_(new_lse)


class TorchBlockOps:
    """Block attention in plain torch (float64 for float64 inputs, else float32); memory
    O(rows x keys) per block: the reference, not for long sequences."""

    merge = staticmethod(merge_partial)

    @staticmethod
    def _scores(q, k, block: Block, scale):
        compute = accumulate_dtype(q.dtype)
        group = q.shape[2] // k.shape[2]
        qc = q.to(compute).permute(0, 2, 1, 3)                                # [B, H, n, D]
        kc = k.to(compute).permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
        scores = torch.matmul(qc, kc.transpose(-1, -2)) * scale
        mask = _block_mask(block, q.shape[1], k.shape[1], q.device)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return scores, compute, group

    @staticmethod
    def forward(q, k, v, block: Block, scale: float):
        scores, compute, group = TorchBlockOps._scores(q, k, block, scale)
        lse = torch.logsumexp(scores, dim=-1)                                 # [B, H, n]
        p = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
        vc = v.to(compute).permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
        return torch.matmul(p, vc).permute(0, 2, 1, 3), lse

    @staticmethod
    def backward(do, q, k, v, out, lse, block: Block, scale: float):
        """Gradients of this block's share of the final attention, from the final output
        and LSE (so P is the final softmax restricted to the block)."""
        scores, compute, group = TorchBlockOps._scores(q, k, block, scale)
        lse = lse.to(compute)
        p = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
        p = torch.where(torch.isinf(lse).unsqueeze(-1), torch.zeros_like(p), p)
        doc = do.to(compute).permute(0, 2, 1, 3)
        vc = v.to(compute).permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
        qc = q.to(compute).permute(0, 2, 1, 3)
        kc = k.to(compute).permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
        delta = (doc * out.to(compute).permute(0, 2, 1, 3)).sum(-1, keepdim=True)
        ds = p * (torch.matmul(doc, vc.transpose(-1, -2)) - delta)
        dq = torch.matmul(ds, kc) * scale
        dk = torch.matmul(ds.transpose(-1, -2), qc) * scale                   # [B, H, nk, D]
        dv = torch.matmul(p.transpose(-1, -2), doc)
        B, H, nk, D = dk.shape
        fold = lambda t: t.view(B, H // group, group, nk, D).sum(2).permute(0, 2, 1, 3)  # noqa: E731
        return dq.permute(0, 2, 1, 3), fold(dk), fold(dv)


def _block_mask(block: Block, rows: int, keys: int, device):
    """Boolean [rows, keys] mask inside a diagonal block (None: dense)."""
    if not block.diagonal:
        return None
    mask = None
    if block.causal:
        i = torch.arange(rows, device=device)[:, None]
        mask = torch.arange(keys, device=device)[None, :] <= i + (keys - rows)
    if block.documents is not None:
        bounds = torch.tensor(block.documents[1:], device=device)
        doc_q = torch.searchsorted(bounds, torch.arange(rows, device=device), right=True)
        doc_k = torch.searchsorted(bounds, torch.arange(keys, device=device), right=True)
        same = doc_q[:, None] == doc_k[None, :]
        mask = same if mask is None else mask & same
    return mask


# ---------------------------------------------------------------------- ring transfers

class RingShift:
    """Send one flat buffer to the next ring rank and receive the previous rank's, in the
    background (torch.distributed P2P: NCCL runs it on its own stream, so it overlaps
    with the block computations; gloo uses its own threads). The send and the receive are
    one batch (`batch_isend_irecv`): NCCL groups them, so no rank's send waits for a
    receive that its peer has not posted yet (a ring of sends first can deadlock)."""

    def __init__(self, spec: RingSpec, send: torch.Tensor, recv: torch.Tensor, tag: int):
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


def _shift(spec: RingSpec, send, recv, tag):
    return spec.shift(send, recv) if spec.shift is not None else RingShift(spec, send, recv, tag)


def _ops(spec: RingSpec):
    return spec.block_ops if spec.block_ops is not None else TorchBlockOps


def _kv_numel(k, length):
    B, _, H, D = k.shape
    return 2 * B * length * H * D


def _split_kv(flat, like, length):
    B, _, H, D = like.shape
    n = B * length * H * D
    return flat[:n].view(B, length, H, D), flat[n:2 * n].view(B, length, H, D)


def _rows(t, start, stop):
    return t[:, start:stop]


# --------------------------------------------------------------------- forward, backward

def ring_forward(q, k, v, spec: RingSpec):
    """(out `[B, L, H, D]` in q's dtype, lse `[B, H, L]` fp32/fp64) of this rank's queries."""
    B, L, H, D = q.shape
    ops = _ops(spec)
    acc = accumulate_dtype(q.dtype)
    out = torch.zeros(B, L, H, D, dtype=acc, device=q.device)
    lse = torch.full((B, H, L), float("-inf"), dtype=acc, device=q.device)
    kv = torch.cat([k.reshape(-1), v.reshape(-1)])
    for step in range(spec.world):
        src = (spec.rank - step) % spec.world
        shift = None
        if step + 1 < spec.world:  # the next block travels while this one is computed
            incoming = kv.new_empty(_kv_numel(k, spec.portion((src - 1) % spec.world)))
            shift = _shift(spec, kv, incoming, tag=1)
        kb, vb = _split_kv(kv, k, spec.portion(src))
        for b in spec.blocks(src):
            o, l_ = ops.forward(_rows(q, b.q_start, b.q_stop), _rows(kb, b.k_start, b.k_stop),
                                _rows(vb, b.k_start, b.k_stop), b, spec.softmax_scale)
            ops.merge(out[:, b.q_start:b.q_stop], lse[:, :, b.q_start:b.q_stop], o, l_)
        if shift is not None:
            shift.wait()
            kv = incoming
    return out.to(q.dtype), lse


def ring_backward(do, q, k, v, out, lse, spec: RingSpec):
    """(dq, dk, dv) of this rank's q/k/v: dQ locally, dK/dV travelling with their K/V."""
    ops = _ops(spec)
    acc = accumulate_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.cat([k.reshape(-1), v.reshape(-1)])
    travelling = None  # (shift, buffer) of the dK/dV sum arriving for the block in hand
    for step in range(spec.world):
        src = (spec.rank - step) % spec.world
        length = spec.portion(src)
        shift = None
        if step + 1 < spec.world:
            incoming = kv.new_empty(_kv_numel(k, spec.portion((src - 1) % spec.world)))
            shift = _shift(spec, kv, incoming, tag=2)
        kb, vb = _split_kv(kv, k, length)
        dkv = torch.zeros(_kv_numel(k, length), dtype=acc, device=q.device)
        dkb, dvb = _split_kv(dkv, k, length)
        for b in spec.blocks(src):
            rows = slice(b.q_start, b.q_stop)
            dq_b, dk_b, dv_b = ops.backward(
                do[:, rows], q[:, rows], _rows(kb, b.k_start, b.k_stop), _rows(vb, b.k_start, b.k_stop),
                out[:, rows], lse[:, :, rows].contiguous(), b, spec.softmax_scale)
            dq[:, rows] += dq_b
            dkb[:, b.k_start:b.k_stop] += dk_b
            dvb[:, b.k_start:b.k_stop] += dv_b
        if travelling is not None:  # the sum over the ring ranks that held this block before
            travelling[0].wait()
            dkv += travelling[1]
        home = dkv.new_empty(_kv_numel(k, spec.portion((src - 1) % spec.world)))
        travelling = (_shift(spec, dkv, home, tag=3), home)
        if shift is not None:
            shift.wait()
            kv = incoming
    travelling[0].wait()  # after a full turn, the sum for this rank's own block
    dk, dv = _split_kv(travelling[1], k, k.shape[1])
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Differentiable ring attention of head-sharded portions `[B, L, H, D]`."""

    @staticmethod
    def forward(ctx, q, k, v, spec: RingSpec):
        out, lse = ring_forward(q, k, v, spec)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec = spec
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(grad_out.contiguous(), q, k, v, out, lse, ctx.spec)
        return dq, dk, dv, None


def ring_attention(q, k, v, spec: RingSpec) -> torch.Tensor:
    """Ring attention of head-sharded portions q `[B, L, Hq, D]`, k/v `[B, L, Hkv, D]`
    (differentiable), with the spec's block ops and transfers."""
    return RingAttention.apply(q, k, v, spec)
