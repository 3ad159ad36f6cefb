"""The engine of the fused path: one per (SP group, device), holding what every call of
that group reuses, the way DeepEP's Buffer does (docs/architecture.md, "Fused path"):
the transport (its own NCCL communicator), the high-priority comm stream, and grow-only
buffers for the transient send/receive regions, so steady-state calls allocate nothing
but their results. `get_engine` caches engines; `close` frees them (also at exit).

Which transport: the one `use_transport` set for the group, else `choose_transport`,
from `ULYSSES_KERNELS_TRANSPORT` (auto|symm|nccl): auto means NCCL for now (auto will
choose symmetric memory inside a node once its GPU tests have passed), symm selects
`SymmTransport` (fused/symm_transport.py) for every engine and fails at engine creation
where it cannot run.
"""

import atexit
import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import env, streams
from . import symm_transport
from .symm_transport import SymmTransport
from .transport import NcclTransport


def choose_transport(device: torch.device) -> Tuple[Optional[Callable], str]:
    """The default transport factory of an engine on `device` and why (None and the reason
    when the requested one cannot run there). Raises ValueError for a bad
    ULYSSES_KERNELS_TRANSPORT."""
    requested = env.choice(env.TRANSPORT, env.TRANSPORT.choices, "auto")
    if requested == "nccl":
        return NcclTransport, f"{env.TRANSPORT.name}=nccl"
    if requested == "auto":
        # Never run on a GPU yet: auto stays on NCCL until the symm GPU tests have passed.
        return NcclTransport, ("auto, which means NCCL for now; auto will choose symmetric memory inside a node "
                               "once its GPU tests have passed")
    why = symm_transport.problem(device)
    if why is not None:
        return None, f"{env.TRANSPORT.name}=symm, but the symmetric-memory transport {why}"
    bound = "barriers bounded" if symm_transport.barrier_is_bounded() else "barriers UNBOUNDED (no timeout_ms)"
    return SymmTransport, f"{env.TRANSPORT.name}=symm (its fused attention not yet run on a GPU; {bound})"


def _transport_of(group, device: torch.device) -> Callable:
    """The transport factory of a new engine of `group` on `device`: the one `use_transport`
    set for the group (it wins over ULYSSES_KERNELS_TRANSPORT), else `choose_transport`'s."""
    factory = _transport_for.get(_group_key(group))
    if factory is not None:
        return factory
    factory, why = choose_transport(device)
    if factory is None:
        raise RuntimeError(f"ulysses_kernels: {why}; unset it or use {env.TRANSPORT.name}=nccl")
    return factory


class Engine:
    """Per (group, device): transport, comm stream, reusable buffers.

    Held by the caller, in the manner of DeepEP's ``Buffer``: ``Engine.create(group)`` makes
    one and ``engine=`` passes it to ``ulysses_attention``, ``UlyssesAttention``,
    ``UlyssesSelfAttention`` or a model's ``SequenceParallelContext``; its lifetime is then
    the caller's (``close()``). Without ``engine=`` the fused path takes the default engine
    of the call's group (``get_engine``, cached per group and device)."""

    @classmethod
    def create(cls, group=None, *, device: Optional[torch.device] = None, transport: Optional[Callable] = None
               ) -> "Engine":
        """An engine of `group` (None: the default group, or a single process) on `device`
        (default: the current CUDA device), with `transport(group, world, rank, device)`
        (default: the group's `use_transport` choice, else `choose_transport`'s)."""
        from ..distributed.groups import resolve_group

        group, world, rank = resolve_group(group)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else torch.device("cpu")
        device = torch.device(device)
        return cls(group, world, rank, device, transport if transport is not None else _transport_of(group, device))

    def problem(self, group, world: int, rank: int, device: torch.device) -> Optional[str]:
        """Why this engine cannot serve a call of (group, world, rank) on `device` (None when
        it can)."""
        if _group_key(group) != _group_key(self.group):
            return "engine= was made for another process group than the call's"
        if (world, rank) != (self.world, self.rank):
            return f"engine= was made for rank {self.rank} of {self.world}, the call runs on rank {rank} of {world}"
        if torch.device(device) != self.device and not (self.device.index is None and
                                                        torch.device(device).type == self.device.type):
            return f"engine= is on {self.device}, the call's tensors on {device}"
        return None

    def __init__(self, group, world: int, rank: int, device: torch.device, transport=NcclTransport):
        self.group, self.world, self.rank, self.device = group, world, rank, device
        self.transport = transport(group, world, rank, device)
        # CPU engines (the pipeline on the torch stand-ins of ulysses_kernels.testing) have no streams,
        # unless the stream-order checker simulates them (ulysses_kernels/streams.py).
        # High priority so NCCL's kernels get SMs while attention kernels fill the GPU.
        self.stream = streams.new_stream(device, priority=-1)
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
            streams.record_stream(buf, self.stream)
        if self.stream is not None and not streams.is_capturing():
            cur = streams.current_stream(self.device)
            seen = self._buffer_streams.setdefault(name, set())
            key = (cur.stream_id, cur.device_index)
            if key not in seen:
                streams.record_stream(buf, cur)
                seen.add(key)
        return buf[:int(numel) * esize].view(dtype)

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
            transport = _transport_of(group, device)
            if engine is not None:
                stale.append(engine)
            for k in [k for k, e in _engines.items() if k != key and _group_destroyed(e.group)]:
                stale.append(_engines.pop(k))
            engine = Engine(group, world, rank, device, transport)
            _engines[key] = engine
    _close_all(stale)
    return engine


def _close_all(engines: Sequence[Engine]) -> None:
    for engine in engines:
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - best effort: a stale communicator may already be broken
            pass


_transport_for: Dict[int, Callable] = {}


def use_transport(group, factory=None):
    """Build the engines of `group` (None = default group / single process) with
    `factory(group, world, rank, device)` instead of the default (`choose_transport`:
    ULYSSES_KERNELS_TRANSPORT; None restores it). Drops a cached engine of that group so
    the next call uses the new transport. Returns the factory that was selected before
    (None: the default). An explicit NcclTransport is kept, so it wins over
    ULYSSES_KERNELS_TRANSPORT=symm too."""
    key = _group_key(group)
    previous = _transport_for.get(key)
    if factory is None:
        _transport_for.pop(key, None)
    else:
        _transport_for[key] = factory
    with _engines_lock:
        stale = [_engines.pop(k) for k in [k for k in _engines if k[0] == key]]
    _close_all(stale)
    return previous


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
