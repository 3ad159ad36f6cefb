"""The stream-order checker: simulated CUDA streams on CPU that fail on a missing wait
(docs/architecture.md, "Streams and the stream-order checker").

On CPU every stream is None and every wait a no-op, so no CPU test can see a missing
stream dependency, and on one GPU the tests' host transport synchronizes through the host,
which hides most of them there too. This module replaces the package's stream layer
(`ulysses_kernels/streams.py`, `use_layer`) with simulated streams for CPU devices and
records, through a `TorchDispatchMode`, what every operation reads and writes, on which
stream. Work still runs at once, in program order (results are unchanged); what is checked
is whether the order the code *asked for* would hold on a GPU:

- happens-before: each stream carries a vector clock. An operation ticks its stream's
  clock; an event copies its stream's clock; a wait joins it into the waiting stream; a
  stream wait joins the other stream's clock. The host joins a stream's clock when it
  synchronizes or observes an event (`query` answers True: on a GPU it may answer False,
  and the package then allocates instead of reusing), and work issued afterwards to any
  stream starts after what the host has seen.
- a read or write of memory that overlaps an earlier write on another stream (or a write
  that overlaps an earlier read) must be ordered after it, byte ranges of strided views
  computed exactly; a new tensor counts as written on the stream it is allocated on (its
  memory may still be in use by work queued there before it was freed, and that stream is
  the only one the caching allocator orders it after).
- when a tensor's memory is freed, every use of it on a stream other than its home stream
  must be ordered before the home stream's work (or `record_stream`-ed on that stream):
  the caching allocator hands freed memory out again on the home stream at once.

Mutations: `drop` names waits (and `record_stream` calls) to leave out, by the file, the
function and a piece of the source line that issues them, so a test shows that removing
one is caught.

Transports: `StreamOrderedTransport` models the NCCL transport (one operation on the
current stream reading the send counts and writing the receive counts); the host transport
and the symmetric-memory transport run their own code (the latter on `FakeSymmetricMemory`,
windows in host memory, every peer's window copied at the "ready" barrier).
"""

import contextlib
import linecache
import os
import sys
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .. import streams

HOST = 0
_HERE = os.path.abspath(__file__)
_STREAMS = os.path.abspath(streams.__file__)
_PACKAGE = os.path.dirname(os.path.dirname(_HERE))


class StreamOrderError(AssertionError):
    """The checker cannot run this (a CUDA tensor: it simulates streams for CPU tensors only)."""


def _join(into: Dict[int, int], other: Dict[int, int]) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


class SimStream:
    """A simulated stream: a name, an id and a vector clock (stream id -> tick)."""

    def __init__(self, name: str, stream_id: int):
        self.name, self.stream_id, self.device_index = name, stream_id, 0
        self.clock: Dict[int, int] = {stream_id: 0}

    def __repr__(self):
        return f"<stream {self.name}>"


@dataclass
class SimEvent:
    stream: SimStream
    clock: Dict[int, int]


@dataclass
class Mutation:
    """Leave out the waits / record_streams issued from `function` in `file` (a basename) on
    a line containing `line` (a piece of its source)."""

    file: str
    function: str
    line: str
    dropped: int = 0

    def matches(self, frame) -> bool:
        code = frame.f_code
        if os.path.basename(code.co_filename) != self.file or code.co_name != self.function:
            return False
        return self.line in linecache.getline(code.co_filename, frame.f_lineno)

    def __str__(self):
        return f"{self.file}:{self.function}: `{self.line}`"


@dataclass
class _Access:
    stream: int
    tick: int
    write: bool
    spans: np.ndarray  # [n, 2] sorted, disjoint byte ranges [start, end)
    what: str


@dataclass
class _Storage:
    home: int
    label: str
    accesses: List[_Access] = field(default_factory=list)
    recorded: Set[int] = field(default_factory=set)  # streams record_stream named


def _caller_frame(skip_files: Sequence[str]):
    frame = sys._getframe(2)
    while frame is not None and os.path.abspath(frame.f_code.co_filename) in skip_files:
        frame = frame.f_back
    return frame


_NOT_CALLERS = (os.path.dirname(torch.__file__), os.path.dirname(os.__file__))


def _site(frame) -> str:
    """The nearest caller that is neither torch, the standard library, this module nor the
    stream layer (the package's code, or a test's): file:function:line."""
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if name not in (_HERE, _STREAMS) and not name.startswith(_NOT_CALLERS):
            rel = os.path.relpath(name, os.path.dirname(_PACKAGE)) if name.startswith(_PACKAGE) else \
                os.path.basename(name)
            return f"{rel}:{frame.f_code.co_name}:{frame.f_lineno}"
        frame = frame.f_back
    return "unknown"


def byte_spans(t: torch.Tensor) -> np.ndarray:
    """The byte ranges of `t`'s storage its elements occupy, sorted and merged: [n, 2]."""
    es = t.element_size()
    if t.numel() == 0:
        return np.zeros((0, 2), dtype=np.int64)
    start = t.storage_offset() * es
    if t.is_contiguous():
        return np.array([[start, start + t.numel() * es]], dtype=np.int64)
    sizes, strides = list(t.shape), list(t.stride())
    # Innermost dimension of stride 1 gives runs; the others give the run starts.
    if sizes and strides[-1] == 1:
        run, sizes, strides = sizes[-1], sizes[:-1], strides[:-1]
    else:
        run = 1
    starts = np.zeros(1, dtype=np.int64)
    for n, s in zip(sizes, strides):
        starts = (starts[:, None] + np.arange(n, dtype=np.int64)[None, :] * s).reshape(-1)
    starts = np.unique(starts) * es + start
    ends = starts + run * es
    # merge touching or overlapping runs
    keep = np.ones(len(starts), dtype=bool)
    keep[1:] = starts[1:] > np.maximum.accumulate(ends)[:-1]
    group = np.cumsum(keep) - 1
    merged_end = np.zeros(int(group[-1]) + 1, dtype=np.int64)
    np.maximum.at(merged_end, group, ends)
    return np.stack([starts[keep], merged_end], axis=1)


def covers(outer: np.ndarray, inner: np.ndarray) -> bool:
    """True when every byte range of `inner` lies inside one of `outer`'s."""
    if len(inner) == 0:
        return True
    if len(outer) == 0:
        return False
    idx = np.searchsorted(outer[:, 0], inner[:, 0], side="right") - 1
    return bool(np.all((idx >= 0) & (outer[np.maximum(idx, 0), 1] >= inner[:, 1])))


def _prune(rec: "_Storage", stream: int, write: bool, spans: np.ndarray) -> None:
    """Drop the earlier accesses on `stream` that a new one covering them dominates: whatever
    is ordered after the new one is ordered after them (program order), and whatever conflicts
    with them conflicts with it (a write covers reads and writes, a read covers reads)."""
    rec.accesses = [a for a in rec.accesses
                    if not (a.stream == stream and (write or not a.write) and covers(spans, a.spans))]


def _overlap(a: np.ndarray, b: np.ndarray) -> bool:
    if len(a) == 0 or len(b) == 0:
        return False
    idx = np.searchsorted(a[:, 1], b[:, 0], side="right")  # first a ending after each b start
    ok = idx < len(a)
    return bool(np.any(a[idx[ok], 0] < b[ok, 1]))


class StreamOrderChecker:
    """The simulated stream layer and the recorder (module docstring). Use as a context
    manager; `violations` lists what it found (a freed tensor's, when the free comes after
    the block: collect garbage before reading it)."""

    def __init__(self, drop: Sequence[Mutation] = ()):
        self.drop = list(drop)
        self.host = SimStream("host", HOST)
        self._streams: List[SimStream] = [self.host]
        self.default = self._new("compute (default)")
        self._stack: List[SimStream] = []
        self._storages: Dict[int, _Storage] = {}
        self.violations: List[str] = []
        self.operations = 0
        self.waits = 0
        self._paused = 0

    # ------------------------------------------------------------ the stream layer API

    def _new(self, name: str) -> SimStream:
        s = SimStream(name, len(self._streams))
        self._streams.append(s)
        return s

    def current_stream(self, device: torch.device):
        if device.type == "cuda":
            raise StreamOrderError("the stream-order checker runs CPU tensors only")
        return self._stack[-1] if self._stack else self.default

    def new_stream(self, device: torch.device, priority: int = 0):
        self.current_stream(device)
        made = _site(sys._getframe(1)).rsplit(":", 1)[0].replace("ulysses_kernels/", "")
        return self._new(f"stream {len(self._streams)} ({made}, priority {priority})")

    def _dropped(self) -> bool:
        frame = _caller_frame((_HERE, _STREAMS))
        for m in self.drop:
            if m.matches(frame):
                m.dropped += 1
                return True
        return False

    def event(self, stream):
        if stream is None:
            return None
        return SimEvent(stream, dict(stream.clock))

    def wait(self, stream, ev) -> None:
        if stream is None or ev is None or self._dropped():
            return
        self.waits += 1
        _join(stream.clock, ev.clock)

    def wait_stream(self, stream, other) -> None:
        if stream is None or other is None or self._dropped():
            return
        self.waits += 1
        _join(stream.clock, other.clock)

    @contextlib.contextmanager
    def on(self, stream):
        if stream is None:
            yield
            return
        self._stack.append(stream)
        try:
            yield
        finally:
            self._stack.pop()

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        if stream is None or self._dropped():
            return
        self._storage(tensor).recorded.add(stream.stream_id)

    def query(self, ev) -> bool:
        if ev is not None:
            _join(self.host.clock, ev.clock)
        return True

    def is_capturing(self) -> bool:
        return False

    def synchronize(self, device: torch.device) -> None:
        for s in self._streams:
            _join(self.host.clock, s.clock)

    def pin_host_memory(self, device: torch.device) -> bool:
        return False

    # ------------------------------------------------------------------- recording

    @contextlib.contextmanager
    def paused(self):
        """Operations inside are not recorded (a transport's own data movement)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _storage(self, t: torch.Tensor, *, home: Optional[int] = None) -> _Storage:
        st = t.untyped_storage()
        key = st._cdata
        rec = self._storages.get(key)
        if rec is None:
            rec = _Storage(home=home if home is not None else self.default.stream_id,
                           label=f"{tuple(t.shape)} {t.dtype}")
            self._storages[key] = rec
            weakref.finalize(st, self._freed, key).atexit = False
        return rec

    def record(self, what: str, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor],
               fresh: Sequence[torch.Tensor] = (), *, allocation: bool = False) -> None:
        """One operation on the current stream: it reads `reads`, writes `writes`, and
        allocates `fresh` (written, home here). An `allocation` (torch.empty and its kin)
        runs no kernel: its memory's earlier users are the work issued to the stream so far,
        so it takes the stream's current tick instead of a new one."""
        if self._paused:
            return
        stream = self._stack[-1] if self._stack else self.default
        _join(stream.clock, self.host.clock)  # work issued after what the host has seen
        if not allocation:
            stream.clock[stream.stream_id] += 1
        tick = stream.clock[stream.stream_id]
        self.operations += 1
        site = None
        for t in fresh:
            self._storage(t, home=stream.stream_id)
        for t, write in [(t, False) for t in reads] + [(t, True) for t in list(writes) + list(fresh)]:
            if t.device.type == "meta":
                continue
            rec = self._storage(t)
            spans = byte_spans(t)
            if site is None:
                site = f"{what} at {_site(sys._getframe(1))} on {stream.name}"
            for a in rec.accesses:
                if a.stream == stream.stream_id or not (write or a.write):
                    continue
                if stream.clock.get(a.stream, 0) >= a.tick:
                    continue
                if _overlap(a.spans, spans):
                    self._violation(f"{site} {'writes' if write else 'reads'} memory that {a.what} "
                                    f"{'wrote' if a.write else 'read'} (tensor {rec.label}), with no wait "
                                    "ordering it after that")
            _prune(rec, stream.stream_id, write, spans)
            rec.accesses.append(_Access(stream.stream_id, tick, write, spans, site or what))

    def _freed(self, key: int) -> None:
        rec = self._storages.pop(key, None)
        if rec is None:
            return
        home = self._streams[rec.home]
        seen = dict(home.clock)
        _join(seen, self.host.clock)
        for a in rec.accesses:
            if a.stream == rec.home or a.stream in rec.recorded or seen.get(a.stream, 0) >= a.tick:
                continue
            self._violation(f"tensor {rec.label} allocated on {home.name} was freed while {a.what} may still "
                            f"use it: neither record_stream({self._streams[a.stream].name}) nor a wait on "
                            f"{home.name} orders that use before its memory is handed out again")
            return

    def _violation(self, message: str) -> None:
        if message not in self.violations:
            self.violations.append(message)

    # ------------------------------------------------------------ installation

    def __enter__(self):
        self._previous = streams.use_layer(self)
        self._mode = _RecordingMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        streams.use_layer(self._previous)
        return False


def _tensors(values) -> List[torch.Tensor]:
    flat, _ = tree_flatten(values)
    return [t for t in flat if isinstance(t, torch.Tensor)]


_ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default,
                torch.ops.aten.empty_like.default}


class _RecordingMode(TorchDispatchMode):
    """Every aten / custom op: its tensor arguments read (written where the schema says
    so), its new outputs allocated, on the checker's current stream. View ops touch no
    memory; c10d's all-to-all writes its first argument."""

    def __init__(self, checker: StreamOrderChecker):
        super().__init__()
        self.checker = checker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            return out  # a view: no memory touched
        namespace = schema.name.split("::")[0]
        reads: List[torch.Tensor] = []
        writes: List[torch.Tensor] = []
        if namespace == "c10d":
            tensors = _tensors(list(args) + list(kwargs.values()))
            if schema.name.startswith("c10d::alltoall_base_"):
                writes, reads = tensors[:1], tensors[1:2]
            else:
                writes = tensors
        else:
            for i, arg in enumerate(schema.arguments):
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                found = _tensors(value)
                if arg.alias_info is not None and arg.alias_info.is_write:
                    writes += found
                else:
                    reads += found
        inputs = {t.untyped_storage()._cdata for t in reads + writes}
        fresh = [t for t in _tensors(out) if t.untyped_storage()._cdata not in inputs]
        self.checker.record(str(func), reads, writes, fresh, allocation=func in _ALLOCATIONS)
        if func is torch.ops.aten._local_scalar_dense.default:  # .item(): the host waits for the stream
            _join(self.checker.host.clock, self.checker.current_stream(torch.device("cpu")).clock)
        return out


# -------------------------------------------------------------------- the transports' models

class StreamOrderedTransport:
    """The NCCL transport's stream contract without NCCL: one exchange is one operation on
    the current stream that reads `send`'s counts and writes `recv`'s (its data moved by a
    gloo all-to-all, or a local copy for one rank, outside the record)."""

    name = "nccl (simulated)"

    def __init__(self, group, world: int, rank: int, device: torch.device):
        self.group, self.world, self.rank = group, world, rank
        self.checker: Optional[StreamOrderChecker] = None

    def all_to_all(self, send, recv, send_counts, recv_counts):
        flat_send, flat_recv = send.reshape(-1)[:sum(send_counts)], recv.reshape(-1)[:sum(recv_counts)]
        checker = streams.layer()
        if isinstance(checker, StreamOrderChecker):
            checker.record("nccl all_to_all", [flat_send], [flat_recv])
            with checker.paused(), _no_dispatch():
                self._move(flat_send, flat_recv, send_counts, recv_counts)
        else:
            self._move(flat_send, flat_recv, send_counts, recv_counts)

    def _move(self, send, recv, send_counts, recv_counts):
        if self.world == 1:
            recv.copy_(send)
            return
        dist.all_to_all_single(recv, send, list(recv_counts), list(send_counts), group=self.group)

    def check(self):
        pass

    def close(self):
        pass


@contextlib.contextmanager
def _no_dispatch():
    from torch.utils._mode_utils import no_dispatch

    with no_dispatch():
        yield


class FakeSymmetricMemory:
    """`torch.distributed._symmetric_memory` for `SymmTransport` on CPU: `empty` gives a host
    tensor, `rendezvous` a handle whose `get_buffer(rank, ...)` views this rank's window or
    a host copy of a peer's, refreshed at the "ready" barrier (a gloo all-gather, outside
    the record). What the transport enqueues on its stream (the copies into its window and
    out of the peers') is recorded as on a GPU."""

    def empty(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device="cpu")

    def rendezvous(self, window, group):
        return _FakeHandle(window, group)


class _FakeHandle:
    def __init__(self, window: torch.Tensor, group):
        self.window, self.group = window, group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.peers = [window if r == self.rank else torch.empty_like(window) for r in range(self.world)]

    def get_buffer(self, rank, sizes, dtype, storage_offset):
        n = int(np.prod(sizes))
        base = self.peers[rank].view(dtype)
        return base[storage_offset:storage_offset + n].view(*sizes)

    def barrier(self, channel: int, timeout_ms: Optional[int] = None):
        from ..fused.symm_transport import READY_CHANNEL

        checker = streams.layer()
        pause = checker.paused() if isinstance(checker, StreamOrderChecker) else contextlib.nullcontext()
        if channel == READY_CHANNEL:
            with pause, _no_dispatch():
                gathered = [torch.empty_like(self.window) for _ in range(self.world)]
                dist.all_gather(gathered, self.window, group=self.group)
                for r in range(self.world):
                    if r != self.rank:
                        self.peers[r].copy_(gathered[r])
        else:
            with pause, _no_dispatch():
                dist.barrier(group=self.group)


@contextlib.contextmanager
def fake_symmetric_memory():
    """Let `SymmTransport` run on CPU over `FakeSymmetricMemory` (its device checks pass)."""
    from ..fused import symm_transport

    saved = (symm_transport.problem, symm_transport._symmetric_memory, symm_transport.barrier_is_bounded)
    fake = FakeSymmetricMemory()
    symm_transport.problem = lambda device: None
    symm_transport._symmetric_memory = lambda: fake
    symm_transport.barrier_is_bounded = lambda: True
    try:
        yield
    finally:
        symm_transport.problem, symm_transport._symmetric_memory, symm_transport.barrier_is_bounded = saved


def transports() -> Dict[str, object]:
    """Every transport the fused path has, as the checker runs them on CPU."""
    from ..fused.symm_transport import SymmTransport
    from .host_transport import HostTransport

    return {"nccl": StreamOrderedTransport, "host": HostTransport, "symm": SymmTransport}
