"""The fused path's pipelines (docs/architecture.md, "Fused path").

Data flow of one call, per chunk c of every destination's heads (chunks: plan.py):

  comm stream:    pack q,k,v -> send_c ; all-to-all send_c -> recv_c ; (event ready_c)
  compute stream: wait ready_c ; the chosen kernel reads q/k/v straight from recv_c and
                  writes its output into osend_c ; (event done_c)
  comm stream:    wait done_c ; all-to-all osend_c -> orecv_c ; unpack into out

so chunk c+1's pack and exchange run while chunk c's attention runs, and chunk c's
reverse exchange runs while chunk c+1's attention runs. The backward mirrors it (dO is
packed and exchanged per chunk, the attention backward writes dq/dk/dv into the reverse
send buffer, unpack sums the gradients of replicated KV heads). The exchanges themselves
are exchange.py's.

Buffers. The transient send/receive regions are the engine's grow-only buffers. The two
buffers the backward needs (the q/k/v receive buffer and the attention output) are
per-call tensors when a gradient is required (they are saved activations, `Saved`),
engine buffers otherwise.

Streams. Every call starts with the comm stream waiting on the compute (current) stream
and ends with the compute stream waiting on the comm stream, so the caller sees ordinary
stream semantics. With `seq_lens` given there is no host synchronisation, so the call can
be captured in a CUDA graph (create the engine with one eager call first).

The kernel is the one the kernel choice made for the call (`AttentionOptions.kernel`,
docs/architecture.md, "The kernel choice"). Ours writes into osend_c and returns the LSE
the backward reads. Another one (cuDNN, FlashAttention, ...) reads the same receive-buffer
views (`[B, S, h, D]` strided: the choice offers it only where the buffer is one) under
autograd: its graph, recorded per chunk, is replayed in the backward, and its output is
copied into osend_c (one copy of the output, not of q/k/v).

Where a chunk's inputs come from and where its results go is the business of a
`ChunkIo`, so that the attention op (q/k/v in, `out` back; attention.py) and the
self-attention layer (per-chunk projection GEMMs in and out; layer.py) share the
pipelines.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from .. import kernel_choice
from ..extensions import require_triton_kernels
from ..streams import current_stream, event, on, wait
from ..variants import PLAIN, Variant
from .engine import Engine
from .exchange import return_to_seq, send_to_heads
from .plan import Chunk

_ALIGN_BYTES = 256

# (tensors, head offsets, head counts): what a chunk packs or unpacks, per tensor.
ChunkTensors = Tuple[Sequence[torch.Tensor], Sequence[int], Sequence[int]]


class ChunkIo(Protocol):
    """Where the pipelines' chunks come from and go to (see the module doc)."""

    computes_inputs: bool  # inputs() enqueues compute-stream work the pack must wait for

    def inputs(self, i: int, chunk: Chunk) -> ChunkTensors:
        """What to pack for chunk i (forward: q, k, v heads; backward: dO heads)."""

    def pack_rotary(self, i: int) -> Optional[tuple]:
        """(cos, sin, flags) for a pack that applies the rotary embedding (ops.pack_into), or None."""

    def after_inputs(self) -> None:
        """Compute-stream work that needs no exchange, issued after every chunk's inputs and
        before the first attention."""

    def outputs(self, i: int, chunk: Chunk) -> ChunkTensors:
        """Where to unpack chunk i's result (forward: out heads; backward: dq, dk, dv heads)."""

    def consume(self, i: int, chunk: Chunk, ready) -> None:
        """Compute-stream work on chunk i's unpacked result once event `ready` (recorded on
        the comm stream after the unpack) has fired; issued after chunk i+1's attention,
        so that attention is not queued behind chunk i's reverse exchange."""


@dataclass(frozen=True)
class Geometry:
    """The shapes of one call: batch, every rank's local length, head dim; this rank is
    `rank`. The receive buffers hold `rows = batch * total` token rows."""

    batch: int
    lens: Tuple[int, ...]
    rank: int
    head_dim: int

    @property
    def world(self) -> int:
        return len(self.lens)

    @property
    def local_len(self) -> int:
        return self.lens[self.rank]

    @property
    def total(self) -> int:
        return sum(self.lens)

    @property
    def rows(self) -> int:
        return self.batch * self.total

    def send_numel(self, channels: int) -> int:
        """Elements of a seq -> heads send buffer `[P, B, S_local, channels, D]`."""
        return self.world * self.batch * self.local_len * channels * self.head_dim

    def recv_numel(self, channels: int) -> int:
        """Elements of a receive buffer of `rows` token rows of `channels` heads."""
        return self.rows * channels * self.head_dim

    def send_view(self, flat: torch.Tensor, channels: int) -> torch.Tensor:
        return flat[:self.send_numel(channels)].view(self.world, self.batch, self.local_len, channels, self.head_dim)

    def attn_view(self, region: torch.Tensor, channels: int, lo: int, n: int) -> torch.Tensor:
        """Heads [lo, lo+n) of a `[rows, channels, D]` block buffer, in the attention layout:
        `[B, S, n, D]` when the blocks concatenated are plain `[B, S]` order (one rank or
        batch 1), else the 3-D rows the kernels address with two-level indexing."""
        x = region[:self.recv_numel(channels)].view(self.rows, channels, self.head_dim)[:, lo:lo + n]
        if self.world == 1 or self.batch == 1:
            return x.view(self.batch, self.total, n, self.head_dim)
        return x

    def attn_kwargs(self) -> Dict[str, Optional[int]]:
        """The kernels' layout arguments for `attn_view` tensors."""
        if self.world == 1 or self.batch == 1:
            return dict(seq_splits=1, batch=None)
        return dict(seq_splits=self.world, batch=self.batch)


@dataclass(frozen=True)
class AttentionOptions:
    causal: bool
    softmax_scale: float
    cu_seqlens: Optional[torch.Tensor]  # int32 on the device, or None
    variant: Variant = PLAIN            # the window band and the softcap (variants.py)
    sinks: Optional[torch.Tensor] = None  # this rank's local query heads' sink logits, or None
    kernel: str = "triton"              # the kernel choice's candidate for this call

    def kernel_kwargs(self, chunk: Chunk) -> Dict:
        """The kernels' attention arguments for `chunk` (its query heads' sinks)."""
        sinks = self.sinks[chunk.q_off:chunk.q_off + chunk.q_cnt] if self.sinks is not None else None
        return dict(causal=self.causal, softmax_scale=self.softmax_scale, cu_seqlens=self.cu_seqlens,
                    _band=self.variant.window, softcap=self.variant.softcap, sinks=sinks)


@dataclass
class Saved:
    """What the forward leaves for the backward: the q/k/v receive buffer, the attention
    output (the reverse send buffer), their chunk regions, and each chunk's LSE (our
    kernel) or recorded autograd graph (another kernel: its detached q/k/v views and output)."""

    recv: torch.Tensor
    recv_off: List[int]
    osend: torch.Tensor
    osend_off: List[int]
    lses: List[torch.Tensor]
    graphs: List[Optional[tuple]] = field(default_factory=list)


def regions(sizes: Sequence[int], dtype: torch.dtype) -> Tuple[List[int], int]:
    """Element offsets of consecutive regions, each aligned to 256 bytes, and the total."""
    align = _ALIGN_BYTES // torch.empty((), dtype=dtype).element_size()
    offsets, acc = [], 0
    for n in sizes:
        offsets.append(acc)
        acc += (int(n) + align - 1) // align * align
    return offsets, acc


def chunk_views(plan: Sequence[Chunk], i: int, saved: Saved, geo: Geometry):
    """q, k, v of chunk i in the receive buffer (its KV heads may live in an earlier
    chunk's region, see Chunk.kv_src) and its output region in the reverse send buffer."""
    c, src = plan[i], plan[plan[i].kv_src]
    r_kv = saved.recv[saved.recv_off[c.kv_src]:]
    kv_base = src.q_cnt + c.kv_lo
    return (geo.attn_view(saved.recv[saved.recv_off[i]:], c.channels, 0, c.q_cnt),
            geo.attn_view(r_kv, src.channels, kv_base, c.kv_use),
            geo.attn_view(r_kv, src.channels, kv_base + src.kv_cnt, c.kv_use),
            geo.attn_view(saved.osend[saved.osend_off[i]:], c.q_cnt, 0, c.q_cnt))


# ------------------------------------------------------------------------- pipelines

def _send_buffer(engine: Engine, plan, geo: Geometry, *, buffer: str, channels, dtype):
    """The seq -> heads send buffer of every chunk and each chunk's offset in it."""
    send_off, send_total = regions([geo.send_numel(channels(c)) for c in plan], dtype)
    return engine.buffer(buffer, send_total, dtype), send_off


def _pack_and_send(engine: Engine, io: ChunkIo, plan, geo: Geometry, *, send, send_off, recv, recv_off,
                   channels) -> list:
    """Comm stream, per chunk: pack its inputs, exchange them (seq -> heads). Returns one
    'ready' event per chunk (None on CPU). `send` was allocated before the comm stream's
    wait on the compute stream (see forward)."""
    compute, comm = current_stream(recv.device), engine.stream
    ready = []
    for i, c in enumerate(plan):
        srcs, offsets, counts = io.inputs(i, c)
        produced = event(compute) if io.computes_inputs else None
        ch = channels(c)
        with on(comm):
            wait(comm, produced)
            send_to_heads(engine, srcs, geo.send_view(send[send_off[i]:], ch),
                          recv[recv_off[i]:recv_off[i] + geo.recv_numel(ch)], geo.lens,
                          offsets=offsets, counts=counts, rotary=io.pack_rotary(i))
            ready.append(event(comm))
    return ready


def _chunk_done(engine: Engine, io: ChunkIo, plan, i: int, geo: Geometry, *, send, recv, channels: int,
                unpacked: list) -> None:
    """Chunk i's attention is queued on the compute stream: the comm stream waits for it,
    exchanges the result back (heads -> seq) and unpacks it; then the previous chunk's
    result is handed to io.consume (one chunk late, see ChunkIo.consume)."""
    comm = engine.stream
    done = event(current_stream(send.device))
    with on(comm):
        wait(comm, done)
        outs, offsets, counts = io.outputs(i, plan[i])
        return_to_seq(engine, send[:geo.recv_numel(channels)], geo.send_view(recv, channels), outs, geo.lens,
                      offsets=offsets, counts=counts)
        unpacked.append(event(comm))
    if i:
        io.consume(i - 1, plan[i - 1], unpacked[i - 1])


def _pipeline_done(engine: Engine, io: ChunkIo, plan, unpacked, compute) -> None:
    """Consume the last chunk, run the transport's optional check, and make the caller's
    stream wait for everything the comm stream did."""
    io.consume(len(plan) - 1, plan[-1], unpacked[-1])
    with on(engine.stream):
        engine.transport.check()
    wait(compute, event(engine.stream))


def forward(engine: Engine, io: ChunkIo, geo: Geometry, attn: AttentionOptions, plan: Sequence[Chunk], *,
            save: bool, dtype: torch.dtype, device: torch.device) -> Optional[Saved]:
    """Forward pipeline; returns what the backward needs (None unless `save`)."""
    flash_attention_forward = require_triton_kernels().flash_attention_forward  # importing needs no Triton

    recv_off, recv_total = regions([geo.recv_numel(c.channels) for c in plan], dtype)
    osend_off, osend_total = regions([geo.recv_numel(c.q_cnt) for c in plan], dtype)
    orecv_off, orecv_total = regions([geo.send_numel(c.q_cnt) for c in plan], dtype)
    if save:
        recv = torch.empty(recv_total, dtype=dtype, device=device)
        osend = torch.empty(osend_total, dtype=dtype, device=device)
    else:
        recv = engine.buffer("fwd_recv", recv_total, dtype)
        osend = engine.buffer("fwd_osend", osend_total, dtype)
    orecv = engine.buffer("fwd_orecv", orecv_total, dtype)
    send, send_off = _send_buffer(engine, plan, geo, buffer="fwd_send", channels=lambda c: c.channels, dtype=dtype)
    saved = Saved(recv, recv_off, osend, osend_off, [])

    # Every buffer is allocated (on the compute stream) before the comm stream waits for it:
    # memory the caching allocator hands out may still be in use by compute work queued before
    # its last free, and the comm stream is ordered after that work only by this wait.
    compute, comm = current_stream(device), engine.stream
    wait(comm, event(compute))
    ready = _pack_and_send(engine, io, plan, geo, send=send, send_off=send_off, recv=recv, recv_off=recv_off,
                           channels=lambda c: c.channels)
    io.after_inputs()
    unpacked: list = []
    for i, c in enumerate(plan):
        wait(compute, ready[i])
        q, k, v, out = chunk_views(plan, i, saved, geo)
        if attn.kernel == "triton":
            _, lse = flash_attention_forward(q, k, v, out=out, **attn.kernel_kwargs(c), **geo.attn_kwargs())
            saved.lses.append(lse)
            saved.graphs.append(None)
        else:
            saved.lses.append(out.new_empty(0))
            saved.graphs.append(_external_forward(attn, q, k, v, out, record=save))
        _chunk_done(engine, io, plan, i, geo, send=osend[osend_off[i]:], recv=orecv[orecv_off[i]:],
                    channels=c.q_cnt, unpacked=unpacked)
    _pipeline_done(engine, io, plan, unpacked, compute)
    return saved if save else None


def _external_forward(attn: AttentionOptions, q, k, v, out, *, record: bool) -> Optional[tuple]:
    """A chunk on a kernel other than ours: its output copied into `out`; with `record`, its
    autograd graph over detached views of the receive buffer (no copies), for `_external_backward`."""
    views = [t.detach().requires_grad_(record) for t in (q, k, v)]
    with torch.enable_grad() if record else torch.no_grad():
        result = kernel_choice.run(attn.kernel, *views, causal=attn.causal, softmax_scale=attn.softmax_scale,
                                   cu_seqlens=attn.cu_seqlens, variant=attn.variant)
    out.copy_(result)
    return (views, result) if record else None


def _external_backward(graph: Optional[tuple], do) -> Tuple[torch.Tensor, ...]:
    """dq, dk, dv of a chunk recorded by `_external_forward`. The recorded graph is kept
    (`retain_graph`): it lives as long as the call's autograd node, so a backward with
    retain_graph=True can run again, and torch frees both after the last one."""
    if graph is None:
        raise RuntimeError("the attention graph of this chunk was not recorded (the forward ran without grad)")
    views, result = graph
    return torch.autograd.grad(result, views, do, retain_graph=True)


def backward(engine: Engine, io: ChunkIo, geo: Geometry, attn: AttentionOptions, plan: Sequence[Chunk],
             saved: Saved, *, dtype: torch.dtype, device: torch.device,
             dsinks: Optional[torch.Tensor] = None) -> None:
    """Backward pipeline: io.inputs gives dO per chunk, io.outputs takes dq/dk/dv;
    `dsinks` (fp32, one per local query head; with sinks) receives the sinks' gradient."""
    flash_attention_backward = require_triton_kernels().flash_attention_backward

    drecv_off, drecv_total = regions([geo.recv_numel(c.q_cnt) for c in plan], dtype)
    gsend_off, gsend_total = regions([geo.recv_numel(c.grad_channels) for c in plan], dtype)
    grecv_off, grecv_total = regions([geo.send_numel(c.grad_channels) for c in plan], dtype)
    drecv = engine.buffer("bwd_drecv", drecv_total, dtype)
    gsend = engine.buffer("bwd_gsend", gsend_total, dtype)
    grecv = engine.buffer("bwd_grecv", grecv_total, dtype)
    send, send_off = _send_buffer(engine, plan, geo, buffer="bwd_dsend", channels=lambda c: c.q_cnt, dtype=dtype)
    # A KV head shared by several chunks: its dK/dV accumulated in fp32 over them.
    shared: Dict[Tuple[int, int], Tuple[torch.Tensor, torch.Tensor]] = {}

    compute, comm = current_stream(device), engine.stream
    wait(comm, event(compute))  # after every allocation (see forward)
    ready = _pack_and_send(engine, io, plan, geo, send=send, send_off=send_off, recv=drecv, recv_off=drecv_off,
                           channels=lambda c: c.q_cnt)
    io.after_inputs()
    unpacked: list = []
    for i, c in enumerate(plan):
        options = dict(attn.kernel_kwargs(c), **geo.attn_kwargs())
        if dsinks is not None:
            options["dsinks"] = dsinks[c.q_off:c.q_off + c.q_cnt]
        wait(compute, ready[i])
        q, k, v, out = chunk_views(plan, i, saved, geo)
        do = geo.attn_view(drecv[drecv_off[i]:], c.q_cnt, 0, c.q_cnt)
        gc, grads = c.grad_channels, gsend[gsend_off[i]:]
        dq = geo.attn_view(grads, gc, 0, c.q_cnt)
        if attn.kernel != "triton":
            ext_dq, dk, dv = _external_backward(saved.graphs[i], do)
            dq.copy_(ext_dq)
            if not c.shared:
                geo.attn_view(grads, gc, c.q_cnt, c.g_cnt).copy_(dk)
                geo.attn_view(grads, gc, c.q_cnt + c.g_cnt, c.g_cnt).copy_(dv)
            else:
                _accumulate_shared(shared, c, dk, dv, geo, grads, gc)
        elif not c.shared:
            # This chunk alone uses its KV heads: dK/dV go straight into the send buffer.
            assert c.g_cnt == c.kv_use
            flash_attention_backward(do, q, k, v, out, saved.lses[i], dq=dq,
                                     dk=geo.attn_view(grads, gc, c.q_cnt, c.g_cnt),
                                     dv=geo.attn_view(grads, gc, c.q_cnt + c.g_cnt, c.g_cnt), **options)
        else:
            # One KV head shared by several chunks: accumulate its dK/dV in fp32 and write
            # them into the send buffer of the last chunk that uses it.
            _, dk, dv = flash_attention_backward(do, q, k, v, out, saved.lses[i], dq=dq, **options)
            _accumulate_shared(shared, c, dk, dv, geo, grads, gc)
        _chunk_done(engine, io, plan, i, geo, send=grads, recv=grecv[grecv_off[i]:], channels=gc,
                    unpacked=unpacked)
    _pipeline_done(engine, io, plan, unpacked, compute)


def _accumulate_shared(shared: dict, c: Chunk, dk, dv, geo: Geometry, grads, gc: int) -> None:
    """dK/dV of a KV head shared by several chunks: accumulated in fp32 over them and written
    into the send buffer of the last chunk that uses it (the one with `g_cnt`)."""
    key = (c.kv_src, c.kv_lo)  # the shared KV head: its chunk and index there
    if key in shared:
        shared[key][0].add_(dk)
        shared[key][1].add_(dv)
    else:
        shared[key] = (dk.float(), dv.float())
    if c.g_cnt:
        acc_k, acc_v = shared.pop(key)
        geo.attn_view(grads, gc, c.q_cnt, 1).copy_(acc_k)
        geo.attn_view(grads, gc, c.q_cnt + 1, 1).copy_(acc_v)
