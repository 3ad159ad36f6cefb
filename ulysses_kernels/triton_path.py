"""The Triton path of `ulysses_attention`: the attention kernels read the all-to-all
receive buffer in place and write into the reverse send buffer (no unpack copy).

Forward (docs/architecture.md, "Triton path"):
  pack q|k|v -> send `[P, B, S_r, Hc, D]` -> all-to-all -> receive buffer, whose rows are
  the blocks `[B, S_i]` of every source rank i in order. q/k/v are 3-D views
  `[B*S, Hl, D]` of it (a channel offset into each row), which the kernels address with
  `seq_splits=P` (two-level sequence addressing). The output is written into `[B*S, Hl_q, D]`,
  which has the block layout the reverse all-to-all sends from, then unpacked to
  `[B, S_r, Hq, D]`.
Backward: dO takes the same route as q; the kernels write dq|dk|dv into one buffer in
the send layout; one all-to-all returns them; unpack sums replicated KV heads.

Exchanges and packing are the reference torch ones (`reference/exchange.py`, this
path's declared interface to the reference path); the fused path replaces them with CUDA
pack kernels and the NCCL engine.
"""

from typing import Optional

import torch

from . import env
from .extensions import kernel_input_problem, triton_kernels
from .reference.exchange import (
    HeadsToSeq,
    SeqToHeads,
    all_to_all,
    exchange_seq_to_heads,
    pack_for_heads,
    placements_for,
    unpack_from_heads,
)
from .reference.ring import ring_attention


def problem(device: torch.device, tensors) -> Optional[str]:
    """Why this path cannot run q/k/v `tensors` on `device` (None when it can), phrased to
    follow "backend='triton' " (dispatch's errors)."""
    # Check before importing: kernels imported without the interpreter cannot run on CPU.
    if device.type != "cuda" and not env.interpreting():
        return ("on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 before "
                "importing ulysses_kernels")
    module, reason = triton_kernels()
    if module is None:
        return f"needs the Triton kernels, which cannot be used: {reason}"
    why = kernel_input_problem("triton", tensors)
    return f"cannot run these inputs: {why}" if why else None


def _kernels():
    module, reason = triton_kernels()
    if module is None:
        raise RuntimeError(f"Triton kernels unavailable: {reason}")
    return module


def _reverse_exchange(rows: torch.Tensor, batch: int, seq_lens, rank: int, group):
    """Send block-ordered rows `[B*S, Hc, D]` back to the ranks owning each sequence slice.

    Returns `[P, B, S_r, Hc, D]` (slot i = source rank i's heads)."""
    P = len(seq_lens)
    _, Hc, D = rows.shape
    per_token = batch * Hc * D
    recv = all_to_all(rows, [n * per_token for n in seq_lens], [seq_lens[rank] * per_token] * P, group)
    return recv.view(P, batch, seq_lens[rank], Hc, D)


class TritonUlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, rank, seq_lens, causal, softmax_scale, cu_seqlens):
        kernels = _kernels()
        world = len(seq_lens)
        B, _, Hq, D = q.shape
        placements = placements_for([Hq, k.shape[2], v.shape[2]], world)
        hl_q, hl_kv = placements[0].local, placements[1].local
        send = pack_for_heads([q, k, v], placements, world)
        recv = exchange_seq_to_heads(send, seq_lens, rank, group)
        channels = hl_q + 2 * hl_kv
        rows = recv.view(B * sum(seq_lens), channels, D)  # block-ordered rows, zero copy
        q_rows, k_rows, v_rows = rows[:, :hl_q], rows[:, hl_q:hl_q + hl_kv], rows[:, hl_q + hl_kv:]
        out_rows = torch.empty(rows.shape[0], hl_q, D, dtype=q.dtype, device=q.device)
        _, lse = kernels.flash_attention_forward(q_rows, k_rows, v_rows, causal=causal,
                                                 softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
                                                 out=out_rows, seq_splits=world, batch=B)
        back = _reverse_exchange(out_rows, B, seq_lens, rank, group)  # [P, B, S_r, hl_q, D]
        ctx.save_for_backward(rows, out_rows, lse, cu_seqlens if cu_seqlens is not None else torch.empty(0))
        ctx.has_cu = cu_seqlens is not None
        ctx.meta = (group, rank, seq_lens, causal, softmax_scale, placements, B)
        return back.permute(1, 2, 0, 3, 4).reshape(B, seq_lens[rank], Hq, D)

    @staticmethod
    def backward(ctx, grad_out):
        kernels = _kernels()
        rows, out_rows, lse, cu = ctx.saved_tensors
        group, rank, seq_lens, causal, softmax_scale, placements, B = ctx.meta
        world = len(seq_lens)
        hl_q, hl_kv = placements[0].local, placements[1].local
        D = rows.shape[-1]
        send = pack_for_heads([grad_out.to(out_rows.dtype)], placements[:1], world)
        do_rows = exchange_seq_to_heads(send, seq_lens, rank, group).view(rows.shape[0], hl_q, D)
        grad_rows = torch.empty_like(rows)  # dq|dk|dv, block-ordered: the reverse send buffer
        kernels.flash_attention_backward(
            do_rows, rows[:, :hl_q], rows[:, hl_q:hl_q + hl_kv], rows[:, hl_q + hl_kv:], out_rows, lse,
            causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu if ctx.has_cu else None,
            dq=grad_rows[:, :hl_q], dk=grad_rows[:, hl_q:hl_q + hl_kv], dv=grad_rows[:, hl_q + hl_kv:],
            seq_splits=world, batch=B)
        back = _reverse_exchange(grad_rows, B, seq_lens, rank, group)
        dq, dk, dv = unpack_from_heads(back, placements)
        return dq, dk, dv, None, None, None, None, None, None


class TritonBlockOps:
    """The ring's block computations (reference/ring.py) on the Triton kernels: flash
    forward/backward of one block (diagonal blocks causal and/or with their documents),
    and the fp32 merge kernel."""

    _documents = {}  # (local boundaries, device) -> int32 tensor: one host->device copy per block shape

    @staticmethod
    def _options(block, device):
        docs = None
        if block.documents is not None:
            key = (block.documents, str(device))
            docs = TritonBlockOps._documents.get(key)
            if docs is None:
                if len(TritonBlockOps._documents) > 1024:
                    TritonBlockOps._documents.clear()
                docs = torch.tensor(block.documents, dtype=torch.int32, device=device)
                TritonBlockOps._documents[key] = docs
        return dict(causal=block.diagonal and block.causal, cu_seqlens=docs)

    @staticmethod
    def forward(q, k, v, block, scale):
        return _kernels().flash_attention_forward(q, k, v, softmax_scale=scale, **TritonBlockOps._options(block, q.device))

    @staticmethod
    def backward(do, q, k, v, out, lse, block, scale):
        return _kernels().flash_attention_backward(do, q, k, v, out, lse, softmax_scale=scale,
                                                   **TritonBlockOps._options(block, q.device))

    @staticmethod
    def merge(acc, acc_lse, out, lse):
        _kernels().merge_attention(acc, acc_lse, out, lse)


def ulysses_attention(q, k, v, *, group, rank, seq_lens, causal, softmax_scale, cu_seqlens, ring=None):
    if ring is not None:
        # Ulysses x Ring: the exchange to head shards, then ring attention over the ring
        # group with the Triton block kernels (docs/architecture.md, "Ulysses x Ring").
        qh, kh, vh = SeqToHeads.apply(group, rank, list(seq_lens), q, k, v)
        out = ring_attention(qh, kh, vh, ring)  # api set ring.block_ops = TritonBlockOps
        return HeadsToSeq.apply(group, rank, list(seq_lens), out)
    return TritonUlyssesAttention.apply(q, k, v, group, rank, list(seq_lens), causal, softmax_scale, cu_seqlens)
