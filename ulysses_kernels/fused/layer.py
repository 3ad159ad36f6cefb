"""Fused Ulysses self-attention layer: QKV projection, attention and output projection in
one pipeline, so the projection GEMMs overlap the exchanges (docs/architecture.md,
"Fused path").

It reuses the chunk plan (plan.py) and the pipelines (pipeline.py) (chunk c owns local query heads
`[c*Hqc, (c+1)*Hqc)` of every destination). Per chunk c, forward:

  compute: qkv_c = x @ W_c^T (+ b_c)      W_c: the rows of W_qkv of chunk c's query heads
                                           for every destination and of the KV heads it sends
  comm:    pack qkv_c, exchange           (runs while the GEMM of chunk c+1 runs)
  compute: attention of chunk c
  comm:    reverse exchange, unpack o_c   (runs while the attention of chunk c+1 runs)
  compute: y += o_c @ Wo_c^T               Wo_c: the columns of W_o of chunk c's heads

The backward mirrors it: dO_c = dy @ Wo_c per chunk feeds chunk c's exchange while the
next GEMM runs, and chunk c's unpacked dq/dk/dv give dx += dqkv_c @ W'_c and chunk c's
rows of dW_qkv while later chunks are still in flight. W_qkv rows and W_o columns are
gathered into chunk order once per call (one copy of the weights).

Precision: with C chunks, y and dx are accumulated over the chunks in the activation
dtype (C - 1 more roundings than one GEMM, as in a row-parallel linear layer); with
one chunk the results match `Linear -> ulysses_attention -> Linear` up to GEMM
blocking.
"""

import threading
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from ..layout import place_heads
from ..rotary import apply_rotary_adjoint
from ..streams import current_stream, device_ctx, wait
from ..variants import PLAIN, Variant
from . import pipeline
from .attention import Setup, prepare
from .pipeline import Saved

# ----------------------------------------------------------------------- head orders

@dataclass(frozen=True)
class HeadOrder:
    """Where chunk c's rows of W_qkv (viewed `[Hq + 2*Hkv, D, hidden]`) and columns of W_o
    (viewed `[hidden, Hq, D]`) are, in the layouts the pack and unpack kernels expect:
    per chunk `[q heads of every destination | its KV heads (k) | the same (v)]`."""
    fwd: Tuple[int, ...]            # W_qkv heads in forward chunk order (the KV heads each chunk sends)
    grad: Tuple[int, ...]           # W_qkv heads in backward chunk order (the KV heads each chunk returns)
    q: Tuple[int, ...]              # query heads in chunk order (W_o's heads)
    fwd_counts: Tuple[Tuple[int, int], ...]   # per chunk: (query heads, KV heads) in `fwd`
    grad_counts: Tuple[Tuple[int, int], ...]  # per chunk: (query heads, KV heads) in `grad`


def head_order(plan, world: int, hq: int, hkv: int) -> HeadOrder:
    q_place, kv_place = place_heads(hq, world), place_heads(hkv, world)
    fwd, grad, q_all, fwd_counts, grad_counts = [], [], [], [], []
    for c in plan:
        # The heads of the whole tensor that chunk c's slice of every destination covers
        # (each once: a replicated KV head is computed once and packed for every replica).
        q = q_place.sent_heads(c.q_off, c.q_cnt)
        sent, returned = kv_place.sent_heads(c.kv_off, c.kv_cnt), kv_place.sent_heads(c.g_off, c.g_cnt)
        fwd += q + [hq + h for h in sent] + [hq + hkv + h for h in sent]
        grad += q + [hq + h for h in returned] + [hq + hkv + h for h in returned]
        q_all += q
        fwd_counts.append((len(q), len(sent)))
        grad_counts.append((len(q), len(returned)))
    return HeadOrder(tuple(fwd), tuple(grad), tuple(q_all), tuple(fwd_counts), tuple(grad_counts))


class HeadIndices(NamedTuple):
    """A HeadOrder's gathers as index tensors on one device; None is the identity order
    (P == 1, one chunk), which needs no gather."""

    fwd: Optional[torch.Tensor]       # W_qkv's head rows in the forward's send order
    grad: Optional[torch.Tensor]      # W_qkv's head rows in the backward's send order
    grad_inv: Optional[torch.Tensor]  # the inverse of grad: dW_qkv back to the model's order
    q: Optional[torch.Tensor]         # W_o's query heads in the attention output's order
    q_inv: Optional[torch.Tensor]     # the inverse of q: dW_o back to the model's order


_index_cache: Dict[tuple, Tuple[HeadOrder, HeadIndices]] = {}
_index_lock = threading.Lock()


def _index_tensor(heads, device) -> Optional[torch.Tensor]:
    identity = list(heads) == list(range(len(heads)))
    return None if identity else torch.tensor(heads, dtype=torch.long, device=device)


def _inverse(index: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if index is None else torch.argsort(index)


def _indices(plan, world, hq, hkv, device) -> Tuple[HeadOrder, HeadIndices]:
    """HeadOrder plus its index tensors on `device`, cached so that steady-state calls make
    no host-to-device copies (and can be captured in a graph)."""
    key = (plan, world, hq, hkv, str(device))
    with _index_lock:
        hit = _index_cache.get(key)
        if hit is None:
            order = head_order(plan, world, hq, hkv)
            grad, q = _index_tensor(order.grad, device), _index_tensor(order.q, device)
            indices = HeadIndices(fwd=_index_tensor(order.fwd, device), grad=grad, grad_inv=_inverse(grad), q=q,
                                  q_inv=_inverse(q))
            hit = _index_cache[key] = (order, indices)
    return hit


def _gather(x, dim: int, index):
    """x.index_select(dim, index), or x itself for the identity order (index None)."""
    return x if index is None else x.index_select(dim, index)


def _chunk_block(flat, i, starts, heads, B, Sp, D):
    """Chunk i's `[B, S_p, heads[i], D]` block of a buffer holding the chunks one after another."""
    lo = B * Sp * starts[i] * D
    return flat[lo:lo + B * Sp * heads[i] * D].view(B, Sp, heads[i], D)


def _prefix(counts) -> List[int]:
    """Head offset of each chunk's block (q + 2 * kv heads) in a chunk-ordered layout."""
    out, acc = [], 0
    for nq, nkv in counts:
        out.append(acc)
        acc += nq + 2 * nkv
    return out


# ------------------------------------------------------------------------- pipeline io

class _LayerForwardIo:
    """`pipeline.ChunkIo` of the forward: chunk inputs are projection GEMMs, chunk outputs feed the output
    projection. Every tensor the comm stream touches is kept until the call ends (the
    caller's stream waits for the comm stream then), so the caching allocator cannot hand
    its memory to later work while an exchange still reads or writes it."""

    computes_inputs = True

    def __init__(self, x2d, w_fwd, b_fwd, w_o_perm, b_o, rotary, order: HeadOrder, shape, device):
        self.x2d, self.w_fwd, self.b_fwd, self.w_o_perm, self.b_o = x2d, w_fwd, b_fwd, w_o_perm, b_o
        self.rotary = rotary  # (cos, sin) of this rank's tokens, or None
        self.order, (self.B, self.Sp, self.D) = order, shape
        self.rows = _prefix(order.fwd_counts)
        self.q_cols = _prefix((nq, 0) for nq, _ in order.fwd_counts)
        self.compute = current_stream(device)
        n_tokens = self.B * self.Sp
        # The unpacked attention output, chunk after chunk ([B, S_p, P*q_cnt, D] each):
        # the output projection reads it, the backward needs it for dW_o.
        self.o_chunks = x2d.new_empty(n_tokens * len(order.q) * self.D)
        self.keep: List[torch.Tensor] = []
        self.y = None

    def o_chunk(self, i):
        return _chunk_block(self.o_chunks, i, self.q_cols, [nq for nq, _ in self.order.fwd_counts],
                            self.B, self.Sp, self.D)

    def inputs(self, i, c):
        nq, nkv = self.order.fwd_counts[i]
        D, lo, n = self.D, self.rows[i], nq + 2 * nkv
        bias = self.b_fwd[lo * D:(lo + n) * D] if self.b_fwd is not None else None
        qkv = F.linear(self.x2d, self.w_fwd[lo * D:(lo + n) * D], bias).view(self.B, self.Sp, n, D)
        self.keep.append(qkv)  # the rotary embedding of q and k is applied by the pack (pack_rotary)
        if nkv == 0:
            return [qkv], [0], [c.q_cnt]
        parts = [qkv[:, :, :nq], qkv[:, :, nq:nq + nkv], qkv[:, :, nq + nkv:]]
        return parts, [0, 0, 0], [c.q_cnt, c.kv_cnt, c.kv_cnt]

    def pack_rotary(self, i):
        """The pack kernel applies the rotary embedding to chunk i's q and k (its inputs'
        first parts) while packing: no separate pass over them. Positions are this rank's
        tokens, so any subset of heads works."""
        if self.rotary is None:
            return None
        flags = [1] if self.order.fwd_counts[i][1] == 0 else [1, 1, 0]
        return (*self.rotary, flags)

    def after_inputs(self):
        pass

    def outputs(self, i, c):
        return [self.o_chunk(i)], [0], [c.q_cnt]

    def consume(self, i, c, event):
        wait(self.compute, event)
        o2d = self.o_chunk(i).view(self.B * self.Sp, -1)
        lo, hi = self.q_cols[i] * self.D, (self.q_cols[i] + self.order.fwd_counts[i][0]) * self.D
        w = self.w_o_perm[:, lo:hi]
        if self.y is None:
            self.y = F.linear(o2d, w, self.b_o)
        else:
            self.y.addmm_(o2d, w.t())


class _LayerBackwardIo:
    """`pipeline.ChunkIo` of the backward: dO per chunk from dy @ Wo_c, chunk results give dx and dW_qkv."""

    computes_inputs = True

    def __init__(self, dy2d, x2d, w_grad, w_o_perm, o_chunks, rotary, order: HeadOrder, shape, device, need):
        self.dy2d, self.x2d, self.w_grad, self.w_o_perm, self.o_chunks = dy2d, x2d, w_grad, w_o_perm, o_chunks
        self.rotary = rotary
        self.order, (self.B, self.Sp, self.D) = order, shape
        # which of x, W_qkv, b_qkv, W_o, b_o need a gradient (frozen weights cost nothing)
        self.need_dx, self.need_dw, self.need_db, self.need_dwo = need[0], need[1], need[2], need[3]
        self.rows = _prefix(order.grad_counts)
        self.q_cols = _prefix((nq, 0) for nq, _ in order.grad_counts)
        self.compute = current_stream(device)
        self.g_chunks = dy2d.new_empty(self.B * self.Sp * len(order.grad) * self.D)
        self.keep: List[torch.Tensor] = []
        self.dx = None
        self.dw_rows: List[torch.Tensor] = []
        self.db_rows: List[torch.Tensor] = []
        self.dwo_cols: List[torch.Tensor] = []

    def _q_cols(self, i):
        return self.q_cols[i] * self.D, (self.q_cols[i] + self.order.grad_counts[i][0]) * self.D

    def g_chunk(self, i):
        return _chunk_block(self.g_chunks, i, self.rows, [nq + 2 * nkv for nq, nkv in self.order.grad_counts],
                            self.B, self.Sp, self.D)

    def o_chunk(self, i):
        # The forward's chunk order: the same query heads per chunk as the backward's.
        return _chunk_block(self.o_chunks, i, self.q_cols, [nq for nq, _ in self.order.grad_counts],
                            self.B, self.Sp, self.D)

    def inputs(self, i, c):
        lo, hi = self._q_cols(i)
        do = torch.mm(self.dy2d, self.w_o_perm[:, lo:hi]).view(self.B, self.Sp, -1, self.D)
        self.keep.append(do)
        return [do], [0], [c.q_cnt]

    def pack_rotary(self, i):
        return None  # dO carries no rotary embedding (its adjoint is applied in consume)

    def after_inputs(self):
        # dW_o needs no exchange: issued behind the dO GEMMs, ahead of the attention.
        if not self.need_dwo:
            return
        for i in range(len(self.order.grad_counts)):
            self.dwo_cols.append(torch.mm(self.dy2d.t(), self.o_chunk(i).view(self.B * self.Sp, -1)))

    def outputs(self, i, c):
        nq, nkv = self.order.grad_counts[i]
        g = self.g_chunk(i)
        if nkv == 0:
            return [g], [0], [c.q_cnt]
        return [g[:, :, :nq], g[:, :, nq:nq + nkv], g[:, :, nq + nkv:]], [0, 0, 0], [c.q_cnt, c.g_cnt, c.g_cnt]

    def consume(self, i, c, event):
        wait(self.compute, event)
        g = self.g_chunk(i)
        if self.rotary is not None:  # gradients of the rotated q/k -> of the projections
            nqk = sum(self.order.grad_counts[i])
            g[:, :, :nqk] = apply_rotary_adjoint(g[:, :, :nqk], *self.rotary)
        g2d = g.view(self.B * self.Sp, -1)
        D, lo = self.D, self.rows[i]
        if self.need_dx:
            w = self.w_grad[lo * D:lo * D + g2d.shape[1]]
            if self.dx is None:
                self.dx = torch.mm(g2d, w)
            else:
                self.dx.addmm_(g2d, w)
        if self.need_dw:
            self.dw_rows.append(torch.mm(g2d.t(), self.x2d))
        if self.need_db:
            self.db_rows.append(g2d.sum(0))


# ------------------------------------------------------------------------ autograd

@dataclass(frozen=True)
class LayerHeads:
    """The layer's head counts and head dim."""
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


class _FusedSelfAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_qkv, b_qkv, w_o, b_o, cos, sin, setup: Setup, heads: LayerHeads, grad_enabled: bool):
        hq, hkv, D = heads.num_q_heads, heads.num_kv_heads, heads.head_dim
        B, Sp, hidden = x.shape
        order, idx = _indices(setup.plan, setup.geometry.world, hq, hkv, x.device)
        x2d = x.reshape(B * Sp, hidden)
        w_fwd = _gather(w_qkv.reshape(hq + 2 * hkv, D, hidden), 0, idx.fwd).reshape(-1, hidden)
        b_fwd = _gather(b_qkv.reshape(-1, D), 0, idx.fwd).reshape(-1) if b_qkv is not None else None
        w_o_perm = _gather(w_o.reshape(hidden, hq, D), 1, idx.q).reshape(hidden, hq * D)
        # needs_input_grad does not see torch.no_grad(): the caller passes the grad mode.
        save = grad_enabled and any(ctx.needs_input_grad[:5])
        rotary = (cos, sin) if cos is not None else None
        io = _LayerForwardIo(x2d, w_fwd, b_fwd, w_o_perm, b_o, rotary, order, (B, Sp, D), x.device)
        with device_ctx(x.device):
            saved = pipeline.forward(setup.engine, io, setup.geometry, setup.attention, setup.plan, save=save,
                                     dtype=x.dtype, device=x.device)
        if save:
            ctx.setup, ctx.heads, ctx.has_rotary = setup, heads, rotary is not None
            ctx.recv_off, ctx.osend_off, ctx.graphs = saved.recv_off, saved.osend_off, saved.graphs
            rot = [cos, sin] if rotary is not None else []
            ctx.save_for_backward(x, w_qkv, w_o, io.o_chunks, saved.recv, saved.osend, *rot, *saved.lses)
        return io.y.view(B, Sp, hidden)

    @staticmethod
    def backward(ctx, dy):
        x, w_qkv, w_o, o_chunks, recv, osend, *rest = ctx.saved_tensors
        rotary, lses = (tuple(rest[:2]), rest[2:]) if ctx.has_rotary else (None, rest)
        setup, heads = ctx.setup, ctx.heads
        hq, hkv, D = heads.num_q_heads, heads.num_kv_heads, heads.head_dim
        B, Sp, hidden = x.shape
        order, idx = _indices(setup.plan, setup.geometry.world, hq, hkv, x.device)
        x2d, dy2d = x.reshape(B * Sp, hidden), dy.reshape(B * Sp, hidden).contiguous()
        need = ctx.needs_input_grad
        w_grad = _gather(w_qkv.reshape(hq + 2 * hkv, D, hidden), 0, idx.grad).reshape(-1, hidden)
        w_o_perm = _gather(w_o.reshape(hidden, hq, D), 1, idx.q).reshape(hidden, hq * D)
        io = _LayerBackwardIo(dy2d, x2d, w_grad, w_o_perm, o_chunks, rotary, order, (B, Sp, D), x.device,
                              need=need[:5])
        with device_ctx(x.device):
            if any(need[:3]):  # x, W_qkv or b_qkv: the gradients travel back through the exchanges
                saved = Saved(recv, ctx.recv_off, osend, ctx.osend_off, lses, ctx.graphs)
                pipeline.backward(setup.engine, io, setup.geometry, setup.attention, setup.plan, saved,
                                  dtype=x.dtype, device=x.device)
            else:  # only the output projection trains: no exchange needed
                io.after_inputs()
        d_wqkv = d_bqkv = d_wo = d_bo = None
        if need[1]:
            d_wqkv = _gather(torch.cat(io.dw_rows).view(-1, D, hidden), 0, idx.grad_inv).reshape(-1, hidden)
        if need[2]:
            d_bqkv = _gather(torch.cat(io.db_rows).view(-1, D), 0, idx.grad_inv).reshape(-1)
        if need[3]:
            d_wo = _gather(torch.cat(io.dwo_cols, dim=1).view(hidden, hq, D), 1, idx.q_inv).reshape(hidden, -1)
        if need[4]:
            d_bo = dy2d.sum(0)
        dx = io.dx.view(B, Sp, hidden) if io.dx is not None else None
        return dx, d_wqkv, d_bqkv, d_wo, d_bo, None, None, None, None, None  # cos, sin, setup, heads, grad_enabled


def self_attention(x, w_qkv, b_qkv, w_o, b_o, *, num_heads: int, num_kv_heads: int, head_dim: int, group,
                   rank: int, seq_lens, causal: bool, softmax_scale: float, cu_seqlens=None,
                   position_embeddings=None, num_chunks=None, variant: Variant = PLAIN, engine=None):
    """`o_proj(ulysses_attention(split(qkv_proj(x))))` on the fused path with the projections
    overlapped (differentiable in x and every weight). Called by UlyssesSelfAttention
    after `ulysses_attention`'s validation; x `[B, S_local, hidden]`, w_qkv
    `[(Hq + 2*Hkv) * D, hidden]` (rows: q heads, then k heads, then v heads), w_o `[hidden, Hq * D]`,
    position_embeddings an optional rotary (cos, sin) pair of this rank's tokens (rotary.py;
    not differentiated); `variant` a window and softcap (variants.py; sinks, which are
    parameters with a gradient, take the unfused composition: UlyssesSelfAttention); `engine`:
    the caller's (fused.Engine.create), else the group's default one."""
    B, Sp, _ = x.shape
    setup = prepare((B, Sp, num_heads, head_dim), num_kv_heads, x.dtype, x.device, group=group, rank=rank,
                    seq_lens=seq_lens, causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
                    num_chunks=num_chunks, variant=variant, engine=engine,
                    grad=torch.is_grad_enabled() and any(t.requires_grad for t in (x, w_qkv, b_qkv, w_o, b_o)
                                                         if t is not None))
    cos, sin = position_embeddings if position_embeddings is not None else (None, None)
    if cos is not None:
        # [B, S_p, D] views with a contiguous last dim, as the rotary pack reads them.
        cos, sin = (t.detach().to(x.dtype).contiguous().expand(B, Sp, head_dim) for t in (cos, sin))
    return _FusedSelfAttention.apply(x, w_qkv, b_qkv, w_o, b_o, cos, sin, setup,
                                     LayerHeads(num_heads, num_kv_heads, head_dim), torch.is_grad_enabled())
