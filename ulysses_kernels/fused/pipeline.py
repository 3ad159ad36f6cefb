"""The fused path's pipelines (docs/architecture.md, "Fused path").

Data flow of one call, per chunk c of every destination's heads (chunks: plan.py):

  comm stream:    pack q,k,v -> send_c ; all-to-all send_c -> recv_c ; (event ready_c)
  compute stream: wait ready_c ; Triton attention reads q/k/v straight from recv_c and
                  writes its output straight into osend_c ; (event done_c)
  comm stream:    wait done_c ; all-to-all osend_c -> orecv_c ; unpack into out

so chunk c+1's pack and exchange run while chunk c's attention runs, and chunk c's
reverse exchange runs while chunk c+1's attention runs. The backward mirrors it (dO is
packed and exchanged per chunk, the attention backward writes dq/dk/dv into the reverse
send buffer, unpack sums the gradients of replicated KV heads).

Buffers. The transient send/receive regions are the engine's grow-only buffers. The two
buffers the backward needs (the q/k/v receive buffer and the attention output) are
per-call tensors when a gradient is required (they are saved activations), engine
buffers otherwise.

Streams. Every call starts with the comm stream waiting on the compute (current) stream
and ends with the compute stream waiting on the comm stream, so the caller sees ordinary
stream semantics. With `seq_lens` given there is no host synchronisation, so the call can
be captured in a CUDA graph (create the engine with one eager call first).

The two pipelines below move chunks through pack -> exchange -> attention -> reverse
exchange -> unpack. Where a chunk's inputs come from and where its results go is the
business of an `io` object, so that the attention op (q/k/v in, `out` back) and the
self-attention layer (layer.py: per-chunk projection GEMMs in and out) share them:
  io.inputs(i, c)        -> (tensors, head offsets, head counts) to pack for chunk i; may
                            enqueue work on the compute stream (then io.computes_inputs)
  io.after_inputs()      compute-stream work that needs no exchange (issued after every
                         chunk's inputs, before the first attention)
  io.outputs(i, c)       -> (tensors, head offsets, head counts) to unpack chunk i into
  io.consume(i, c, ev)   compute-stream work on chunk i's unpacked result, once event ev
                         (recorded on the comm stream after the unpack) has fired.
consume(i) is issued after chunk i+1's attention, so that attention is not queued behind
chunk i's reverse exchange on the compute stream.
"""

from typing import Dict, List, Sequence, Tuple

import torch

from . import ops
from .engine import Engine
from .streams import current_stream, event, on, wait

_ALIGN_BYTES = 256


# ------------------------------------------------------------------------ buffer views

def regions(sizes: Sequence[int], dtype: torch.dtype) -> Tuple[List[int], int]:
    """Element offsets of consecutive regions, each aligned to 256 bytes, and the total."""
    align = _ALIGN_BYTES // torch.empty((), dtype=dtype).element_size()
    offsets, acc = [], 0
    for n in sizes:
        offsets.append(acc)
        acc += (int(n) + align - 1) // align * align
    return offsets, acc


def attn_view(region: torch.Tensor, rows: int, channels: int, lo: int, n: int, geo) -> torch.Tensor:
    """Heads [lo, lo+n) of a `[rows, channels, D]` block buffer, in the attention layout."""
    B, S, D, P = geo
    x = region[:rows * channels * D].view(rows, channels, D)[:, lo:lo + n]
    if P == 1 or B == 1:  # blocks concatenated are plain [B, S] order
        return x.view(B, S, n, D)
    return x


def chunk_views(plan, i, recv, recv_off, osend, osend_off, rows, geo):
    """q, k, v of chunk i in the receive buffer (its KV heads may live in an earlier
    chunk's region, see Chunk.kv_src) and its output region in the reverse send buffer."""
    c, src = plan[i], plan[plan[i].kv_src]
    r_kv = recv[recv_off[c.kv_src]:]
    kv_base = src.q_cnt + c.kv_lo
    return (attn_view(recv[recv_off[i]:], rows, c.channels, 0, c.q_cnt, geo),
            attn_view(r_kv, rows, src.channels, kv_base, c.kv_use, geo),
            attn_view(r_kv, rows, src.channels, kv_base + src.kv_cnt, c.kv_use, geo),
            attn_view(osend[osend_off[i]:], rows, c.q_cnt, 0, c.q_cnt, geo))


def attn_kwargs(geo):
    B, S, D, P = geo
    if P == 1 or B == 1:
        return dict(seq_splits=1, batch=None)
    return dict(seq_splits=P, batch=B)


# ------------------------------------------------------------------------- pipelines

def pack_and_send(engine, io, plan, buf_name, send_sizes, recv, recv_off, lens, B, Sp, D, dtype, channels):
    """Comm stream, per chunk: pack its inputs, exchange them (seq -> heads). Returns one
    'ready' event per chunk (None on CPU)."""
    P = engine.world
    compute, comm = current_stream(recv.device), engine.stream
    send_off, send_total = regions(send_sizes, dtype)
    send = engine.buffer(buf_name, send_total, dtype)
    ready = []
    for i, c in enumerate(plan):
        srcs, offsets, counts = io.inputs(i, c)
        produced = event(compute) if io.computes_inputs else None
        ch = channels(c)
        with on(comm):
            wait(comm, produced)
            s_c = send[send_off[i]:send_off[i] + P * B * Sp * ch * D].view(P, B, Sp, ch, D)
            r_c = recv[recv_off[i]:recv_off[i] + B * sum(lens) * ch * D]
            ops.pack_into(srcs, s_c, offsets, counts, rotary=io.pack_rotary(i) if hasattr(io, "pack_rotary") else None)
            engine.transport.all_to_all(s_c, r_c, [B * Sp * ch * D] * P, [B * n * ch * D for n in lens])
            ready.append(event(comm))
    return ready


def chunk_done(engine, io, plan, i, send, recv, lens, B, Sp, D, ch, unpacked):
    """Chunk i's attention is queued on the compute stream: the comm stream waits for it,
    exchanges the result back (heads -> seq) and unpacks it; then the previous chunk's
    result is handed to io.consume (one chunk late, see the module doc)."""
    P, comm = engine.world, engine.stream
    done = event(current_stream(send.device))
    with on(comm):
        wait(comm, done)
        engine.transport.all_to_all(send, recv, [B * m * ch * D for m in lens], [B * Sp * ch * D] * P)
        outs, offsets, counts = io.outputs(i, plan[i])
        ops.unpack_into(recv.view(P, B, Sp, ch, D), outs, offsets, counts)
        unpacked.append(event(comm))
    if i:
        io.consume(i - 1, plan[i - 1], unpacked[i - 1])


def pipeline_done(engine, io, plan, unpacked, compute):
    """Consume the last chunk, run the transport's optional check, and make the caller's
    stream wait for everything the comm stream did."""
    io.consume(len(plan) - 1, plan[-1], unpacked[-1])
    with on(engine.stream):
        engine.transport.check()
    wait(compute, event(engine.stream))


def forward(engine: Engine, io, x_shape, lens, causal, scale, cu_seqlens, plan, save, device, dtype):
    """Forward pipeline for inputs of shape x_shape = (B, S_p, ., D). Returns the saved
    state for the backward (None unless save)."""
    from ..triton import flash_attention_forward  # lazy: importing the fused path must not need Triton

    P = engine.world
    B, Sp, _, D = x_shape
    S = sum(lens)
    rows = B * S
    geo = (B, S, D, P)

    recv_off, recv_total = regions([rows * c.channels * D for c in plan], dtype)
    osend_off, osend_total = regions([rows * c.q_cnt * D for c in plan], dtype)
    orecv_off, orecv_total = regions([P * B * Sp * c.q_cnt * D for c in plan], dtype)
    if save:
        recv = torch.empty(recv_total, dtype=dtype, device=device)
        osend = torch.empty(osend_total, dtype=dtype, device=device)
    else:
        recv = engine.buffer("fwd_recv", recv_total, dtype)
        osend = engine.buffer("fwd_osend", osend_total, dtype)
    orecv = engine.buffer("fwd_orecv", orecv_total, dtype)

    compute, comm = current_stream(device), engine.stream
    wait(comm, event(compute))
    ready = pack_and_send(engine, io, plan, "fwd_send", [P * B * Sp * c.channels * D for c in plan], recv,
                           recv_off, lens, B, Sp, D, dtype, lambda c: c.channels)
    io.after_inputs()
    lses, unpacked = [], []
    kw = attn_kwargs(geo)
    for i, c in enumerate(plan):
        wait(compute, ready[i])
        qv, kview, vview, o_c = chunk_views(plan, i, recv, recv_off, osend, osend_off, rows, geo)
        _, lse = flash_attention_forward(qv, kview, vview, causal=causal, softmax_scale=scale,
                                         cu_seqlens=cu_seqlens, out=o_c, **kw)
        lses.append(lse)
        n = c.q_cnt
        chunk_done(engine, io, plan, i, osend[osend_off[i]:osend_off[i] + rows * n * D],
                    orecv[orecv_off[i]:orecv_off[i] + P * B * Sp * n * D], lens, B, Sp, D, n, unpacked)
    pipeline_done(engine, io, plan, unpacked, compute)
    if not save:
        return None
    return dict(recv=recv, recv_off=recv_off, osend=osend, osend_off=osend_off, lses=lses)


def backward(engine: Engine, io, x_shape, lens, causal, scale, cu_seqlens, plan, state, device, dtype):
    """Backward pipeline: io.inputs gives dO per chunk, io.outputs takes dq/dk/dv."""
    from ..triton import flash_attention_backward

    P = engine.world
    B, Sp, _, D = x_shape
    S = sum(lens)
    rows = B * S
    geo = (B, S, D, P)
    recv, recv_off, osend, osend_off, lses = (state[k] for k in ("recv", "recv_off", "osend", "osend_off", "lses"))

    drecv_off, drecv_total = regions([rows * c.q_cnt * D for c in plan], dtype)
    gsend_off, gsend_total = regions([rows * c.grad_channels * D for c in plan], dtype)
    grecv_off, grecv_total = regions([P * B * Sp * c.grad_channels * D for c in plan], dtype)
    drecv = engine.buffer("bwd_drecv", drecv_total, dtype)
    gsend = engine.buffer("bwd_gsend", gsend_total, dtype)
    grecv = engine.buffer("bwd_grecv", grecv_total, dtype)
    acc: Dict[Tuple[int, int], Tuple[torch.Tensor, torch.Tensor]] = {}

    compute, comm = current_stream(device), engine.stream
    wait(comm, event(compute))
    ready = pack_and_send(engine, io, plan, "bwd_dsend", [P * B * Sp * c.q_cnt * D for c in plan], drecv,
                           drecv_off, lens, B, Sp, D, dtype, lambda c: c.q_cnt)
    io.after_inputs()
    unpacked = []
    kw = attn_kwargs(geo)
    for i, c in enumerate(plan):
        wait(compute, ready[i])
        qv, kview, vview, o_c = chunk_views(plan, i, recv, recv_off, osend, osend_off, rows, geo)
        do_c = attn_view(drecv[drecv_off[i]:], rows, c.q_cnt, 0, c.q_cnt, geo)
        gc = c.grad_channels
        g_base = gsend[gsend_off[i]:]
        dq_c = attn_view(g_base, rows, gc, 0, c.q_cnt, geo)
        if not c.shared:
            # This chunk alone uses its KV heads: dK/dV go straight into the send buffer.
            assert c.g_cnt == c.kv_use
            dk_c = attn_view(g_base, rows, gc, c.q_cnt, c.g_cnt, geo)
            dv_c = attn_view(g_base, rows, gc, c.q_cnt + c.g_cnt, c.g_cnt, geo)
            flash_attention_backward(do_c, qv, kview, vview, o_c, lses[i], causal=causal, softmax_scale=scale,
                                     cu_seqlens=cu_seqlens, dq=dq_c, dk=dk_c, dv=dv_c, **kw)
        else:
            # One KV head shared by several chunks: accumulate its dK/dV in fp32 and write
            # them into the send buffer of the last chunk that uses it.
            _, dk_t, dv_t = flash_attention_backward(do_c, qv, kview, vview, o_c, lses[i], causal=causal,
                                                  softmax_scale=scale, cu_seqlens=cu_seqlens, dq=dq_c, **kw)
            key = (c.kv_src, c.kv_lo)  # the shared KV head: its chunk and index there
            if key in acc:
                acc[key][0].add_(dk_t)
                acc[key][1].add_(dv_t)
            else:
                acc[key] = (dk_t.float(), dv_t.float())
            if c.g_cnt:
                a_k, a_v = acc.pop(key)
                attn_view(g_base, rows, gc, c.q_cnt, 1, geo).copy_(a_k)
                attn_view(g_base, rows, gc, c.q_cnt + 1, 1, geo).copy_(a_v)
        chunk_done(engine, io, plan, i, gsend[gsend_off[i]:gsend_off[i] + rows * gc * D],
                    grecv[grecv_off[i]:grecv_off[i] + P * B * Sp * gc * D], lens, B, Sp, D, gc, unpacked)
    pipeline_done(engine, io, plan, unpacked, compute)
