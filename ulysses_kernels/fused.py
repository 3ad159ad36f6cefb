"""Fused Ulysses attention: CUDA pack/unpack kernels + NCCL engine + Triton attention.

Data flow of one call (DESIGN.md, "Data flow"), per chunk c of every destination's heads:

  comm stream:    pack q,k,v -> send_c ; all-to-all send_c -> recv_c ; (event ready_c)
  compute stream: wait ready_c ; Triton attention reads q/k/v straight from recv_c and
                  writes its output straight into osend_c ; (event done_c)
  comm stream:    wait done_c ; all-to-all osend_c -> orecv_c ; unpack into out

so chunk c+1's pack and exchange run while chunk c's attention runs, and chunk c's
reverse exchange runs while chunk c+1's attention runs. The backward mirrors it (dO is
packed and exchanged per chunk, the attention backward writes dq/dk/dv into the reverse
send buffer, unpack sums the gradients of replicated KV heads).

Chunks. Chunk c owns local query heads `[c*Hqc, (c+1)*Hqc)` of every destination
(`Hqc = Hl_q / C`); a KV head travels with the first chunk whose query heads use it and
its gradient with the last. C must divide Hl_q and either Hqc is a multiple of the local
GQA group g = Hl_q / Hl_kv (each chunk has its own KV heads) or g a multiple of Hqc
(several chunks share one KV head; its dK/dV are accumulated in fp32 across them). The
count is automatic (by bytes moved per rank) or set by `num_chunks=` /
`ULYSSES_KERNELS_NUM_CHUNKS`; an invalid request is lowered to the largest valid count.

Buffers. Each engine (one per (group, device)) keeps grow-only buffers for the transient
send/receive regions, so steady-state calls allocate nothing but their results. The two
buffers the backward needs (the q/k/v receive buffer and the attention output) are per-call
tensors when a gradient is required (they are saved activations), engine buffers otherwise.

Streams. Every call starts with the comm stream waiting on the compute (current) stream
and ends with the compute stream waiting on the comm stream, so the caller sees ordinary
stream semantics. With `seq_lens` given there is no host synchronisation, so the call can
be captured in a CUDA graph (create the engine with one eager call first).

Errors. The NCCL communicator is non-blocking; init and enqueue are polled with a timeout
(`ULYSSES_KERNELS_NCCL_TIMEOUT`, seconds, default 600) and raise instead of hanging. With
`ULYSSES_KERNELS_NCCL_CHECK=1` every call also waits (host side, with the same timeout)
for its exchanges to finish, turning a hang inside NCCL into an exception.
`ULYSSES_KERNELS_NCCL_BLOCKING=1` (read when a communicator is created) selects NCCL's
blocking mode instead: launches stay in the calling thread (NCCL >= 2.19 launches every
non-blocking group from a helper thread), but init can then hang instead of timing out.
"""

import atexit
import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _backend
from ._layout import split_lengths

ENV_CHUNKS = "ULYSSES_KERNELS_NUM_CHUNKS"
ENV_TIMEOUT = "ULYSSES_KERNELS_NCCL_TIMEOUT"
ENV_CHECK = "ULYSSES_KERNELS_NCCL_CHECK"
ENV_TRANSPORT = "ULYSSES_KERNELS_FUSED_TRANSPORT"

FUSED_OPS = ("pack", "pack_into", "unpack", "unpack_into", "nccl_unique_id", "nccl_comm_create",
             "nccl_comm_destroy", "nccl_all_to_all", "nccl_comm_wait")
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ALIGN_BYTES = 256


def is_supported() -> bool:
    """True when the CUDA extension is loaded and has every op of the fused path."""
    module, _ = _backend.load_extension()
    if module is None:
        return False
    try:
        from . import _ops
        _ops.register_fakes()
    except Exception:  # noqa: BLE001 - a broken build must read as "not supported"
        return False
    return all(hasattr(torch.ops.ulysses_kernels, name) for name in FUSED_OPS)


# Tests swap in ReferenceOps to run the whole pipeline on CPU (see ReferenceOps).
_ops_override = None


def _ops():
    return _ops_override if _ops_override is not None else torch.ops.ulysses_kernels


# ------------------------------------------------------------------------ chunk plan

@dataclass(frozen=True)
class Chunk:
    q_off: int      # first local query head of this chunk
    q_cnt: int
    kv_off: int     # KV heads sent with this chunk (forward): [kv_off, kv_off + kv_cnt)
    kv_cnt: int
    kv_src: int     # chunk whose receive buffer holds the KV heads this chunk's attention uses
    kv_lo: int      # ... at this index among that chunk's KV heads
    kv_use: int     # number of KV heads this chunk's attention uses
    g_off: int      # KV heads whose gradients are complete after this chunk (backward)
    g_cnt: int
    shared: bool    # this chunk's KV head is shared with other chunks (accumulate dK/dV)

    @property
    def channels(self) -> int:
        return self.q_cnt + 2 * self.kv_cnt

    @property
    def grad_channels(self) -> int:
        return self.q_cnt + 2 * self.g_cnt


def _valid_chunks(hl_q: int, hl_kv: int, c: int) -> bool:
    if c < 1 or hl_q % c:
        return False
    hqc, g = hl_q // c, hl_q // hl_kv
    return hqc % g == 0 or g % hqc == 0


def valid_num_chunks(hl_q: int, hl_kv: int, requested: int) -> int:
    """Largest valid chunk count <= requested (1 is always valid)."""
    for c in range(min(max(1, int(requested)), hl_q), 0, -1):
        if _valid_chunks(hl_q, hl_kv, c):
            return c
    return 1


def plan_chunks(hl_q: int, hl_kv: int, num_chunks: int) -> List[Chunk]:
    """Chunk plan for Hl_q local query heads and Hl_kv local KV heads (see module doc)."""
    if hl_q % hl_kv:
        raise ValueError(f"local query heads {hl_q} not a multiple of local KV heads {hl_kv}")
    c_total = valid_num_chunks(hl_q, hl_kv, num_chunks)
    hqc, g = hl_q // c_total, hl_q // hl_kv
    first = [(k * g) // hqc for k in range(hl_kv)]            # chunk that sends KV head k
    last = [((k + 1) * g - 1) // hqc for k in range(hl_kv)]   # chunk after which dK/dV are done
    sent_lo: Dict[int, int] = {}
    for k in range(hl_kv):
        sent_lo.setdefault(first[k], k)
    plan = []
    for c in range(c_total):
        qs, qe = c * hqc, (c + 1) * hqc
        need_lo, need_hi = qs // g, (qe - 1) // g + 1
        sent = [k for k in range(hl_kv) if first[k] == c]
        done = [k for k in range(hl_kv) if last[k] == c]
        src = first[need_lo]
        assert all(first[k] == src for k in range(need_lo, need_hi)), "chunk plan: KV heads span chunks"
        plan.append(Chunk(q_off=qs, q_cnt=hqc,
                          kv_off=sent[0] if sent else 0, kv_cnt=len(sent),
                          kv_src=src, kv_lo=need_lo - sent_lo[src], kv_use=need_hi - need_lo,
                          g_off=done[0] if done else 0, g_cnt=len(done),
                          shared=hqc < g))
    return plan


def auto_num_chunks(world: int, hl_q: int, hl_kv: int, recv_bytes: int) -> int:
    """Chunks for overlap: none at P == 1 (nothing to hide) or for small exchanges."""
    if world == 1 or recv_bytes < (8 << 20):
        return 1
    want = 2 if recv_bytes < (64 << 20) else 4
    return valid_num_chunks(hl_q, hl_kv, want)


def resolve_num_chunks(num_chunks: Optional[int], world: int, hl_q: int, hl_kv: int, recv_bytes: int) -> int:
    if num_chunks is None:
        env = os.environ.get(ENV_CHUNKS, "").strip()
        if env:
            try:
                num_chunks = int(env)
            except ValueError:
                raise ValueError(f"{ENV_CHUNKS}={env!r} is not an integer") from None
    if num_chunks is None or num_chunks <= 0:
        return auto_num_chunks(world, hl_q, hl_kv, recv_bytes)
    return valid_num_chunks(hl_q, hl_kv, num_chunks)


# --------------------------------------------------------------------------- transports

def _timeout() -> float:
    return float(os.environ.get(ENV_TIMEOUT, "600"))


class NcclTransport:
    """Own NCCL communicator for one SP group, bootstrapped through that group."""

    name = "nccl"

    def __init__(self, group, world: int, rank: int, device: torch.device):
        self.world, self.rank, self.device = world, rank, device
        uid = _ops().nccl_unique_id() if rank == 0 else None
        if world > 1:
            obj = [bytes(uid.numpy().tobytes()) if rank == 0 else None]
            src = dist.get_global_rank(group if group is not None else dist.group.WORLD, 0)
            bcast_device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
            dist.broadcast_object_list(obj, src=src, group=group, device=bcast_device)
            uid = torch.frombuffer(bytearray(obj[0]), dtype=torch.uint8).clone()
        self.handle = _ops().nccl_comm_create(uid, world, rank, device.index, _timeout())

    def all_to_all(self, send, recv, send_counts, recv_counts):
        _ops().nccl_all_to_all(self.handle, send, recv, send_counts, recv_counts)

    def check(self):
        if os.environ.get(ENV_CHECK, "0") not in ("", "0") and not torch.cuda.is_current_stream_capturing():
            _ops().nccl_comm_wait(self.handle, _timeout())

    def close(self):
        if self.handle is not None:
            _ops().nccl_comm_destroy(self.handle)
            self.handle = None


class HostTransport:
    """Test-only transport: the exchange goes through host memory over a gloo group.

    NCCL refuses two ranks on one GPU, so multi-rank tests on a single GPU run every
    CUDA part of the fused path (pack/unpack kernels, chunking, streams, the attention
    reading the receive buffers in place) and replace only the NCCL call by a gloo
    `all_to_all_single` of the same bytes. It synchronises the comm stream; it is for
    correctness tests, never for speed.
    """

    name = "host"

    def __init__(self, group, world: int, rank: int, device: torch.device):
        self.group, self.world, self.rank, self.device = group, world, rank, device

    def all_to_all(self, send, recv, send_counts, recv_counts):
        esize = send.element_size()
        s = send.reshape(-1)[:sum(send_counts)].view(torch.uint8).cpu()
        r = torch.empty(sum(recv_counts) * esize, dtype=torch.uint8)
        if self.group is None and not dist.is_initialized():
            r.copy_(s)
        else:
            dist.all_to_all_single(r, s, [n * esize for n in recv_counts], [n * esize for n in send_counts],
                                   group=self.group)
        recv.reshape(-1)[:sum(recv_counts)].view(torch.uint8).copy_(r)

    def check(self):
        pass

    def close(self):
        pass


_TRANSPORTS = {"nccl": NcclTransport, "host": HostTransport}
_transport_override: Dict[int, str] = {}


def use_transport(group, name: str) -> None:
    """Select the transport for `group` (None = default / single process): "nccl" (the
    engine's own communicator, the default) or "host" (test-only, see HostTransport).
    Drops a cached engine of that group so the next call uses the new transport."""
    if name not in _TRANSPORTS:
        raise ValueError(f"transport {name!r} is not one of {sorted(_TRANSPORTS)}")
    _transport_override[_group_key(group)] = name
    with _engines_lock:
        for key in [k for k in _engines if k[0] == _group_key(group)]:
            _engines.pop(key).close()


# ------------------------------------------------------------------------------ engine

class Engine:
    """Per (group, device): transport, comm stream, reusable buffers."""

    def __init__(self, group, world: int, rank: int, device: torch.device, transport: str):
        self.group, self.world, self.rank, self.device = group, world, rank, device
        self.transport = _TRANSPORTS[transport](group, world, rank, device)
        # CPU engines (tests of the orchestration with reference ops) have no streams.
        # High priority so NCCL's kernels get SMs while attention kernels fill the GPU.
        self.stream = torch.cuda.Stream(device=device, priority=-1) if device.type == "cuda" else None
        self._buffers: Dict[str, torch.Tensor] = {}
        self._buffer_streams: Dict[str, set] = {}  # streams each buffer was recorded on

    def buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Flat `numel`-element view of a grow-only byte buffer (allocated on the current stream).

        Caching-allocator safety: a buffer is used on the comm stream and on the compute
        stream of every call, which need not be the stream it was allocated on. Both are
        recorded (record_stream), so when the buffer is replaced by a larger one, or the
        engine is closed, its memory is not handed out again while queued work of either
        stream may still read or write it."""
        esize = torch.empty((), dtype=dtype).element_size()
        nbytes = max(int(numel) * esize, 1)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._buffers[name] = buf
            self._buffer_streams[name] = set()
            if self.stream is not None:
                buf.record_stream(self.stream)
        if self.stream is not None and not torch.cuda.is_current_stream_capturing():
            cur = torch.cuda.current_stream(self.device)
            seen = self._buffer_streams.setdefault(name, set())
            key = (cur.stream_id, cur.device_index)
            if key not in seen:
                buf.record_stream(cur)
                seen.add(key)
        return buf[:int(numel) * esize].view(dtype)

    def buffer_bytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())

    def close(self):
        # Every buffer was recorded on the comm and compute streams (see buffer()), so
        # dropping them cannot recycle memory under in-flight kernels or NCCL work.
        self._buffers.clear()
        self._buffer_streams.clear()
        self.transport.close()


_engines: Dict[Tuple[int, int], Engine] = {}
_engines_lock = threading.Lock()


def _group_key(group) -> int:
    """0 for the default group, whether passed as None or as the WORLD group object
    (`ulysses_attention` resolves None to `dist.group.WORLD` when torch.distributed is
    initialised, while `use_transport(None, ...)` and tests name it None)."""
    if group is None:
        return 0
    if dist.is_available() and dist.is_initialized() and group is dist.group.WORLD:
        return 0
    return id(group)


def _group_destroyed(group) -> bool:
    """True once `dist.destroy_process_group(group)` has run (torch forgets its ranks)."""
    if group is None or _group_key(group) == 0:
        return False
    try:
        dist.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001 - torch raises KeyError/ValueError/RuntimeError by version
        return True
    return False


def get_engine(group, world: int, rank: int, device: torch.device) -> Engine:
    """The engine of (group, device), created on first use. On a miss, engines of groups
    destroyed since are closed too: each holds a communicator and grow-only buffers, which
    would otherwise leak (an engine keeps its group alive, so `id(group)` is not reused
    while it is cached)."""
    key = (_group_key(group), device.index)
    stale: List[Engine] = []
    with _engines_lock:
        engine = _engines.get(key)
        if engine is None or engine.world != world or engine.rank != rank:
            name = _transport_override.get(key[0]) or os.environ.get(ENV_TRANSPORT, "").strip() or "nccl"
            if name not in _TRANSPORTS:
                raise ValueError(f"{ENV_TRANSPORT}={name!r} is not one of {sorted(_TRANSPORTS)}")
            if engine is not None:
                stale.append(engine)
            for k in [k for k, e in _engines.items() if k != key and _group_destroyed(e.group)]:
                stale.append(_engines.pop(k))
            engine = Engine(group, world, rank, device, name)
            _engines[key] = engine
    _close_all(stale)
    return engine


def _close_all(engines: Sequence[Engine]) -> None:
    for engine in engines:
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - best effort: a stale communicator may already be broken
            pass


_ALL = object()


def close(group=_ALL) -> None:
    """Destroy the engines (communicators and buffers) of `group` (None = the default
    group), or of every group when called without an argument. Call it before
    `dist.destroy_process_group` to free them at once; it also runs at interpreter exit."""
    with _engines_lock:
        if group is _ALL:
            keys = list(_engines)
        else:
            keys = [k for k in _engines if k[0] == _group_key(group)]
        engines = [_engines.pop(k) for k in keys]
    _close_all(engines)


atexit.register(close)


# ------------------------------------------------------------------------ buffer layout

def _regions(sizes: Sequence[int], dtype: torch.dtype) -> Tuple[List[int], int]:
    """Element offsets of consecutive regions, each aligned to 256 bytes, and the total."""
    align = _ALIGN_BYTES // torch.empty((), dtype=dtype).element_size()
    offsets, acc = [], 0
    for n in sizes:
        offsets.append(acc)
        acc += (int(n) + align - 1) // align * align
    return offsets, acc


def _attn_view(region: torch.Tensor, rows: int, channels: int, lo: int, n: int, geo) -> torch.Tensor:
    """Heads [lo, lo+n) of a `[rows, channels, D]` block buffer, in the attention layout."""
    B, S, D, P = geo
    x = region[:rows * channels * D].view(rows, channels, D)[:, lo:lo + n]
    if P == 1 or B == 1:  # blocks concatenated are plain [B, S] order
        return x.view(B, S, n, D)
    return x


def _chunk_views(plan, i, recv, recv_off, osend, osend_off, rows, geo):
    """q, k, v of chunk i in the receive buffer (its KV heads may live in an earlier
    chunk's region, see Chunk.kv_src) and its output region in the reverse send buffer."""
    c, src = plan[i], plan[plan[i].kv_src]
    r_kv = recv[recv_off[c.kv_src]:]
    kv_base = src.q_cnt + c.kv_lo
    return (_attn_view(recv[recv_off[i]:], rows, c.channels, 0, c.q_cnt, geo),
            _attn_view(r_kv, rows, src.channels, kv_base, c.kv_use, geo),
            _attn_view(r_kv, rows, src.channels, kv_base + src.kv_cnt, c.kv_use, geo),
            _attn_view(osend[osend_off[i]:], rows, c.q_cnt, 0, c.q_cnt, geo))


def _attn_kwargs(geo):
    B, S, D, P = geo
    if P == 1 or B == 1:
        return dict(seq_splits=1, batch=None)
    return dict(seq_splits=P, batch=B)


def _event(stream):
    """Event recorded on `stream` (None on CPU, where everything runs in program order)."""
    if stream is None:
        return None
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def _wait(stream, event) -> None:
    if stream is not None and event is not None:
        stream.wait_event(event)


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _current_stream(device: torch.device):
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def _device_ctx(device: torch.device):
    """Make `device` current: Triton launches on the current device's current stream,
    whatever device its tensors are on."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


# ------------------------------------------------------------------------- pipelines
#
# The two pipelines below move chunks through pack -> exchange -> attention -> reverse
# exchange -> unpack. Where a chunk's inputs come from and where its results go is the
# business of an `io` object, so that the attention op (q/k/v in, `out` back) and the
# self-attention layer (fused_layer.py: per-chunk projection GEMMs in and out) share them:
#   io.inputs(i, c)        -> (tensors, head offsets, head counts) to pack for chunk i; may
#                             enqueue work on the compute stream (then io.computes_inputs)
#   io.after_inputs()      compute-stream work that needs no exchange (issued after every
#                          chunk's inputs, before the first attention)
#   io.outputs(i, c)       -> (tensors, head offsets, head counts) to unpack chunk i into
#   io.consume(i, c, ev)   compute-stream work on chunk i's unpacked result, once event ev
#                          (recorded on the comm stream after the unpack) has fired.
# consume(i) is issued after chunk i+1's attention, so that attention is not queued behind
# chunk i's reverse exchange on the compute stream.


class _AttentionIo:
    """io of the attention op: chunk i packs its heads of q/k/v (forward) or dO (backward)
    and unpacks into the op's results."""

    computes_inputs = False

    def __init__(self, sources, results, backward: bool):
        self.sources, self.results, self.backward = sources, results, backward

    def inputs(self, i, c):
        if self.backward:
            return self.sources, [c.q_off], [c.q_cnt]
        return self.sources, [c.q_off, c.kv_off, c.kv_off], [c.q_cnt, c.kv_cnt, c.kv_cnt]

    def after_inputs(self):
        pass

    def outputs(self, i, c):
        if self.backward:
            return self.results, [c.q_off, c.g_off, c.g_off], [c.q_cnt, c.g_cnt, c.g_cnt]
        return self.results, [c.q_off], [c.q_cnt]

    def consume(self, i, c, event):
        pass


def _pack_and_send(engine, io, plan, buf_name, send_sizes, recv, recv_off, lens, B, Sp, D, dtype, channels):
    """Comm stream, per chunk: pack its inputs, exchange them (seq -> heads). Returns one
    'ready' event per chunk (None on CPU)."""
    P, ops = engine.world, _ops()
    compute, comm = _current_stream(recv.device), engine.stream
    send_off, send_total = _regions(send_sizes, dtype)
    send = engine.buffer(buf_name, send_total, dtype)
    ready = []
    for i, c in enumerate(plan):
        srcs, offsets, counts = io.inputs(i, c)
        produced = _event(compute) if io.computes_inputs else None
        ch = channels(c)
        with _on(comm):
            _wait(comm, produced)
            s_c = send[send_off[i]:send_off[i] + P * B * Sp * ch * D].view(P, B, Sp, ch, D)
            r_c = recv[recv_off[i]:recv_off[i] + B * sum(lens) * ch * D]
            ops.pack_into(srcs, s_c, offsets, counts)
            engine.transport.all_to_all(s_c, r_c, [B * Sp * ch * D] * P, [B * n * ch * D for n in lens])
            ready.append(_event(comm))
    return ready


def _chunk_done(engine, io, plan, i, send, recv, lens, B, Sp, D, ch, unpacked):
    """Chunk i's attention is queued on the compute stream: the comm stream waits for it,
    exchanges the result back (heads -> seq) and unpacks it; then the previous chunk's
    result is handed to io.consume (one chunk late, see the note above _AttentionIo)."""
    P, comm = engine.world, engine.stream
    done = _event(_current_stream(send.device))
    with _on(comm):
        _wait(comm, done)
        engine.transport.all_to_all(send, recv, [B * m * ch * D for m in lens], [B * Sp * ch * D] * P)
        outs, offsets, counts = io.outputs(i, plan[i])
        _ops().unpack_into(recv.view(P, B, Sp, ch, D), outs, offsets, counts)
        unpacked.append(_event(comm))
    if i:
        io.consume(i - 1, plan[i - 1], unpacked[i - 1])


def _pipeline_done(engine, io, plan, unpacked, compute):
    """Consume the last chunk, run the transport's optional check, and make the caller's
    stream wait for everything the comm stream did."""
    io.consume(len(plan) - 1, plan[-1], unpacked[-1])
    with _on(engine.stream):
        engine.transport.check()
    _wait(compute, _event(engine.stream))


def _forward(engine: Engine, io, x_shape, lens, causal, scale, cu_seqlens, plan, save, device, dtype):
    """Forward pipeline for inputs of shape x_shape = (B, S_p, ., D). Returns the saved
    state for the backward (None unless save)."""
    from .triton import flash_attention_forward  # lazy: CPU-only import must not need it

    P = engine.world
    B, Sp, _, D = x_shape
    S = sum(lens)
    rows = B * S
    geo = (B, S, D, P)

    recv_off, recv_total = _regions([rows * c.channels * D for c in plan], dtype)
    osend_off, osend_total = _regions([rows * c.q_cnt * D for c in plan], dtype)
    orecv_off, orecv_total = _regions([P * B * Sp * c.q_cnt * D for c in plan], dtype)
    if save:
        recv = torch.empty(recv_total, dtype=dtype, device=device)
        osend = torch.empty(osend_total, dtype=dtype, device=device)
    else:
        recv = engine.buffer("fwd_recv", recv_total, dtype)
        osend = engine.buffer("fwd_osend", osend_total, dtype)
    orecv = engine.buffer("fwd_orecv", orecv_total, dtype)

    compute, comm = _current_stream(device), engine.stream
    _wait(comm, _event(compute))
    ready = _pack_and_send(engine, io, plan, "fwd_send", [P * B * Sp * c.channels * D for c in plan], recv,
                           recv_off, lens, B, Sp, D, dtype, lambda c: c.channels)
    io.after_inputs()
    lses, unpacked = [], []
    kw = _attn_kwargs(geo)
    for i, c in enumerate(plan):
        _wait(compute, ready[i])
        qv, kview, vview, o_c = _chunk_views(plan, i, recv, recv_off, osend, osend_off, rows, geo)
        _, lse = flash_attention_forward(qv, kview, vview, causal=causal, softmax_scale=scale,
                                         cu_seqlens=cu_seqlens, out=o_c, **kw)
        lses.append(lse)
        n = c.q_cnt
        _chunk_done(engine, io, plan, i, osend[osend_off[i]:osend_off[i] + rows * n * D],
                    orecv[orecv_off[i]:orecv_off[i] + P * B * Sp * n * D], lens, B, Sp, D, n, unpacked)
    _pipeline_done(engine, io, plan, unpacked, compute)
    if not save:
        return None
    return dict(recv=recv, recv_off=recv_off, osend=osend, osend_off=osend_off, lses=lses)


def _backward(engine: Engine, io, x_shape, lens, causal, scale, cu_seqlens, plan, state, device, dtype):
    """Backward pipeline: io.inputs gives dO per chunk, io.outputs takes dq/dk/dv."""
    from .triton import flash_attention_backward

    P = engine.world
    B, Sp, _, D = x_shape
    S = sum(lens)
    rows = B * S
    geo = (B, S, D, P)
    recv, recv_off, osend, osend_off, lses = (state[k] for k in ("recv", "recv_off", "osend", "osend_off", "lses"))

    drecv_off, drecv_total = _regions([rows * c.q_cnt * D for c in plan], dtype)
    gsend_off, gsend_total = _regions([rows * c.grad_channels * D for c in plan], dtype)
    grecv_off, grecv_total = _regions([P * B * Sp * c.grad_channels * D for c in plan], dtype)
    drecv = engine.buffer("bwd_drecv", drecv_total, dtype)
    gsend = engine.buffer("bwd_gsend", gsend_total, dtype)
    grecv = engine.buffer("bwd_grecv", grecv_total, dtype)
    acc: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    compute, comm = _current_stream(device), engine.stream
    _wait(comm, _event(compute))
    ready = _pack_and_send(engine, io, plan, "bwd_dsend", [P * B * Sp * c.q_cnt * D for c in plan], drecv,
                           drecv_off, lens, B, Sp, D, dtype, lambda c: c.q_cnt)
    io.after_inputs()
    unpacked = []
    kw = _attn_kwargs(geo)
    for i, c in enumerate(plan):
        _wait(compute, ready[i])
        qv, kview, vview, o_c = _chunk_views(plan, i, recv, recv_off, osend, osend_off, rows, geo)
        do_c = _attn_view(drecv[drecv_off[i]:], rows, c.q_cnt, 0, c.q_cnt, geo)
        gc = c.grad_channels
        g_base = gsend[gsend_off[i]:]
        dq_c = _attn_view(g_base, rows, gc, 0, c.q_cnt, geo)
        if not c.shared:
            # This chunk alone uses its KV heads: dK/dV go straight into the send buffer.
            assert c.g_cnt == c.kv_use
            dk_c = _attn_view(g_base, rows, gc, c.q_cnt, c.g_cnt, geo)
            dv_c = _attn_view(g_base, rows, gc, c.q_cnt + c.g_cnt, c.g_cnt, geo)
            flash_attention_backward(do_c, qv, kview, vview, o_c, lses[i], causal=causal, softmax_scale=scale,
                                     cu_seqlens=cu_seqlens, dq=dq_c, dk=dk_c, dv=dv_c, **kw)
        else:
            # One KV head shared by several chunks: accumulate its dK/dV in fp32 and write
            # them into the send buffer of the last chunk that uses it.
            _, dk_t, dv_t = flash_attention_backward(do_c, qv, kview, vview, o_c, lses[i], causal=causal,
                                                  softmax_scale=scale, cu_seqlens=cu_seqlens, dq=dq_c, **kw)
            key = c.kv_src * 1_000_000 + c.kv_lo
            if key in acc:
                acc[key][0].add_(dk_t)
                acc[key][1].add_(dv_t)
            else:
                acc[key] = (dk_t.float(), dv_t.float())
            if c.g_cnt:
                a_k, a_v = acc.pop(key)
                _attn_view(g_base, rows, gc, c.q_cnt, 1, geo).copy_(a_k)
                _attn_view(g_base, rows, gc, c.q_cnt + 1, 1, geo).copy_(a_v)
        _chunk_done(engine, io, plan, i, gsend[gsend_off[i]:gsend_off[i] + rows * gc * D],
                    grecv[grecv_off[i]:grecv_off[i] + P * B * Sp * gc * D], lens, B, Sp, D, gc, unpacked)
    _pipeline_done(engine, io, plan, unpacked, compute)


# ------------------------------------------------------------------ autograd + entry

class _FusedUlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, engine, lens, rank, causal, scale, cu_seqlens, plan, grad_enabled=True):
        # needs_input_grad does not see torch.no_grad(): the caller passes the grad mode.
        save = grad_enabled and any(ctx.needs_input_grad[:3])
        out = q.new_empty(q.shape)
        with _device_ctx(q.device):
            state = _forward(engine, _AttentionIo([q, k, v], [out], backward=False), q.shape, lens, causal, scale,
                             cu_seqlens, plan, save, q.device, q.dtype)
        if save:
            ctx.engine, ctx.lens, ctx.rank, ctx.causal, ctx.scale = engine, lens, rank, causal, scale
            ctx.cu_seqlens, ctx.plan = cu_seqlens, plan
            ctx.q_shape, ctx.kv_heads = tuple(q.shape), k.shape[2]
            # Saved through autograd (not as ctx attributes) so that backward frees them
            # unless retain_graph=True, and a second backward without it raises torch's
            # usual error instead of reading freed state.
            ctx.recv_off, ctx.osend_off = state["recv_off"], state["osend_off"]
            ctx.save_for_backward(state["recv"], state["osend"], *state["lses"])
        return out

    @staticmethod
    def backward(ctx, dout):
        recv, osend, *lses = ctx.saved_tensors
        state = dict(recv=recv, recv_off=ctx.recv_off, osend=osend, osend_off=ctx.osend_off, lses=lses)
        B, Sp, Hq, D = ctx.q_shape
        dq = dout.new_empty(B, Sp, Hq, D)
        dk, dv = (dout.new_empty(B, Sp, ctx.kv_heads, D) for _ in range(2))
        with _device_ctx(dout.device):
            _backward(ctx.engine, _AttentionIo([dout], [dq, dk, dv], backward=True), ctx.q_shape, ctx.lens,
                      ctx.causal, ctx.scale, ctx.cu_seqlens, ctx.plan, state, dout.device, dout.dtype)
        return dq, dk, dv, None, None, None, None, None, None, None, None


_supported_seen = False


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    """Why the fused path cannot take these inputs (None when it can). Lets automatic
    dispatch fall back instead of raising: CUDA tensors, one dtype among bf16/fp16/fp32,
    head dim a multiple of 16 up to 256 (the Triton attention's limits)."""
    if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in (q, k, v)):
        return "the fused path needs CUDA tensors"
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"the fused path supports bfloat16/float16/float32 inputs of one dtype, got {q.dtype}/{k.dtype}/{v.dtype}"
    d = q.shape[-1]
    if d % 16 or d > 256:
        return f"the fused path needs a head dim that is a multiple of 16 up to 256, got {d}"
    return None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, rank: int,
                      seq_lens: Sequence[int], causal: bool, softmax_scale: float, cu_seqlens=None,
                      num_chunks: Optional[int] = None) -> torch.Tensor:
    """Fused Ulysses attention (differentiable). Called by `ulysses_kernels.ulysses_attention`
    after it validated the inputs: `seq_lens` is every rank's local length, `group` None
    means the default group (or a single process when torch.distributed is not initialised).
    """
    _require_extension()
    why = unsupported_reason(q, k, v)
    if why:
        raise RuntimeError(f"{why}; use backend='triton' or 'reference'")
    setup = prepare(q.shape, k.shape[2], q.dtype, q.device, group=group, rank=rank, seq_lens=seq_lens,
                    cu_seqlens=cu_seqlens, num_chunks=num_chunks)
    return _FusedUlyssesAttention.apply(q, k, v, setup.engine, setup.lens, rank, bool(causal), float(softmax_scale),
                                        setup.cu_seqlens, setup.plan, torch.is_grad_enabled())


def _require_extension() -> None:
    global _supported_seen
    if not _supported_seen:
        if not is_supported():
            _, reason = _backend.load_extension()
            raise RuntimeError(f"the fused path is unavailable: {reason or 'the extension lacks the fused ops'}")
        _supported_seen = True


@dataclass(frozen=True)
class Setup:
    engine: Engine
    lens: List[int]
    plan: Tuple[Chunk, ...]
    cu_seqlens: Optional[torch.Tensor]


def prepare(q_shape, kv_heads: int, dtype: torch.dtype, device: torch.device, *, group, rank: int,
            seq_lens: Sequence[int], cu_seqlens=None, num_chunks: Optional[int] = None) -> Setup:
    """Engine, lengths, chunk plan and device cu_seqlens for a validated call whose q is
    `q_shape = [B, S_p, Hq, D]` (shared by the attention op and fused_layer.py)."""
    _require_extension()
    lens = [int(n) for n in seq_lens]
    world = len(lens)
    B, Sp, Hq, D = q_shape
    if B > 1 and world > 1 and lens != split_lengths(sum(lens), world):
        raise ValueError(f"fused ulysses_attention: local lengths {lens} are not the torch.tensor_split "
                         f"of {sum(lens)} over {world} ranks")
    hl_q = Hq // world
    hl_kv = kv_heads // world if kv_heads % world == 0 else 1
    recv_bytes = B * sum(lens) * (hl_q + 2 * hl_kv) * D * torch.empty((), dtype=dtype).element_size()
    chunks = resolve_num_chunks(num_chunks, world, hl_q, hl_kv, recv_bytes)
    plan = tuple(plan_chunks(hl_q, hl_kv, chunks))
    engine = get_engine(group, world, rank, device)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int32)
    return Setup(engine, lens, plan, cu_seqlens)


class ReferenceOps:
    """Pure-torch implementations of the pack/unpack op semantics (the kernels must match
    them bitwise; replicated heads are summed in fp32 in replica order, like the kernel).
    Also lets tests run the fused pipeline on CPU: `fused._ops_override = ReferenceOps`."""

    @staticmethod
    def pack_into(srcs, send, offsets, counts):
        P = send.shape[0]
        ch = 0
        for x, off, cnt in zip(srcs, offsets, counts):
            if cnt == 0:
                continue
            H = x.shape[2]
            for j in range(P):
                start = j * (H // P) + off if H % P == 0 else j // (P // H)
                send[j, :, :, ch:ch + cnt] = x[:, :, start:start + cnt]
            ch += cnt

    @staticmethod
    def unpack_into(recv, outs, offsets, counts):
        P, B, S, _, D = recv.shape
        ch = 0
        for x, off, cnt in zip(outs, offsets, counts):
            if cnt == 0:
                continue
            H = x.shape[2]
            if H % P == 0:
                local = H // P
                for j in range(P):
                    x[:, :, j * local + off:j * local + off + cnt] = recv[j, :, :, ch:ch + cnt]
            else:
                rep = P // H
                for h in range(H):
                    acc = recv[h * rep, :, :, ch].float()
                    for r in range(1, rep):
                        acc = acc + recv[h * rep + r, :, :, ch].float()
                    x[:, :, h] = acc.to(x.dtype)
            ch += cnt

    @classmethod
    def pack(cls, srcs, world):
        x0 = srcs[0]
        counts = [h // world if h % world == 0 else 1 for h in (x.shape[2] for x in srcs)]
        send = x0.new_empty(world, x0.shape[0], x0.shape[1], sum(counts), x0.shape[3])
        cls.pack_into(srcs, send, [0] * len(srcs), counts)
        return send

    @classmethod
    def unpack(cls, recv, num_heads):
        P, B, S, _, D = recv.shape
        outs = [recv.new_empty(B, S, h, D) for h in num_heads]
        cls.unpack_into(recv, outs, [0] * len(outs), [h // P if h % P == 0 else 1 for h in num_heads])
        return outs


def split_packed_qkv(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int):
    """Views q, k, v of a packed projection output `[B, S, (Hq + 2*Hkv) * D]` (no copy);
    the pack kernel reads them through their strides."""
    B, S, width = qkv.shape
    heads = num_q_heads + 2 * num_kv_heads
    if width % heads:
        raise ValueError(f"packed qkv width {width} is not a multiple of {heads} heads")
    x = qkv.view(B, S, heads, width // heads)
    return (x[:, :, :num_q_heads], x[:, :, num_q_heads:num_q_heads + num_kv_heads],
            x[:, :, num_q_heads + num_kv_heads:])


def qkv_exchange(q, k, v, engine: Engine, lens: Sequence[int]) -> torch.Tensor:
    """One fused seq->heads exchange of q, k, v (no chunks, no autograd): returns the flat
    receive buffer (source-major `[B, S_i, Hl_q + 2*Hl_kv, D]` blocks). Used by benchmarks."""
    P = engine.world
    B, Sp, Hq, D = q.shape
    plan = plan_chunks(Hq // P, k.shape[2] // P if k.shape[2] % P == 0 else 1, 1)
    ch = plan[0].channels
    send = engine.buffer("x_send", P * B * Sp * ch * D, q.dtype).view(P, B, Sp, ch, D)
    recv = torch.empty(B * sum(lens) * ch * D, dtype=q.dtype, device=q.device)
    compute, comm = _current_stream(q.device), engine.stream
    _wait(comm, _event(compute))
    with _on(comm):
        _ops().pack_into([q, k, v], send, [0, 0, 0], [plan[0].q_cnt, plan[0].kv_cnt, plan[0].kv_cnt])
        engine.transport.all_to_all(send, recv, [B * Sp * ch * D] * P, [B * n * ch * D for n in lens])
    _wait(compute, _event(comm))
    return recv
