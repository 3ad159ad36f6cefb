"""`SymmTransport`: the fused path's exchanges through torch's symmetric memory inside one
node, by copy-engine reads of the peers' windows (docs/architecture.md, "Fused path").

On a GPU so far: its all-to-all matched gloo at P = 2 and 4 processes on one H200 (torch
2.11, 2026-12-04); its fused attention has not passed there yet. Written against the
symmetric-memory API that torch 2.11 and 2.14 share (`torch.distributed._symmetric_memory.empty` / `rendezvous(tensor, group)`, the
handle's `get_buffer(rank, sizes, dtype, storage_offset)` and `barrier(channel,
timeout_ms)`); `ULYSSES_KERNELS_TRANSPORT=symm` selects it, `auto` still means NCCL
until its GPU tests (tests/fused/test_symm_transport.py, `bench/gpu_check.sh` step
`symm_tests`) have passed.

The window. Each transport owns one symmetric-memory window (every rank of the group
maps every other rank's window). It is cut into `world` slots of M elements: slot j of
rank i's window holds what rank i sends to rank j, at element offset j * M in the
exchange's dtype.

The size rule (no collective). Every rank must decide the same window size at the same
call, or the rendezvous that follows a growth would pair different allocations. M is the
largest count any rank sends to any rank. A rank sees only its row of the count matrix
(`send_counts`) and its column (`recv_counts`), so the rule is
    M = max(max(send_counts), max(recv_counts)),   window = M * world elements,
which is the same on every rank for the two shapes a Ulysses exchange has:
  - sender-uniform (seq -> heads): a rank sends the same count to every destination, so
    `recv_counts[i]` is rank i's count to every rank and the column holds every row:
    M = max(recv_counts), window = max(recv_counts) * world;
  - receiver-uniform (heads -> seq, the reverse): a rank receives the same count from
    every source, so the row holds every column: M = max(send_counts).
Counts of neither shape (this rank's `send_counts` and `recv_counts` both non-uniform,
e.g. a ring exchange) raise a ValueError before anything is enqueued. What one rank cannot
check alone is that every rank sees the same shape; the fused path's callers guarantee it.

Growth. The window is grow-only: when an exchange needs more bytes than it has, the new
size is max(needed, 2 * current) (geometric, so a growing workload re-rendezvouses
O(log size) times), and every rank grows at the same call because the decision above is
identical. `rendezvous` is a host-blocking collective over the group, so growth is
refused during CUDA graph capture (RuntimeError: run one eager call of the largest shape
before capturing). A replaced window is kept, not freed, until `close()`: queued work on
this device, or a peer's copy engine, may still read it.

One exchange, all on the current stream (the engine's comm stream):
  1. copy this rank's send buffer into its window's slots (one strided D2D copy when the
     send counts are uniform, one per destination otherwise);
  2. barrier on channel 0 ("ready"): every rank's window now holds this call's data;
  3. for each rank j, starting at this rank + 1 (so the ranks do not all read rank 0
     first), copy slot `rank` of j's window into `recv` (tensor `.copy_` of a
     `get_buffer` view: the copy engine reading the peer's memory over NVLink);
  4. barrier on channel 1 ("done reading"): no rank still reads this rank's window, so
     the next call may overwrite it.
The barriers are torch's device-side ones (a kernel that signals every peer's signal pad
and spins on its own), so nothing waits on the host.

What is bounded. Each barrier waits at most `ULYSSES_KERNELS_NCCL_TIMEOUT` seconds (the
fused path's one exchange timeout) when torch's `barrier` takes `timeout_ms` (2.11 and
2.14 both do); on expiry torch's kernel reports the hang and traps, which poisons the
CUDA context: the process must exit (the fused tests run each rank in its own process).
Were `timeout_ms` missing, the barrier would be unbounded; `barrier_is_bounded` says
which, and doctor shows it. The rendezvous is bounded by the group's own timeout.

A world of one has no peers: the exchange is one local copy, with no window.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import streams
from .transport import timeout as exchange_timeout

READY_CHANNEL = 0         # barrier: every window holds this call's data
DONE_READING_CHANNEL = 1  # barrier: every peer finished reading this call's data
MIN_WINDOW_BYTES = 1 << 20  # a first window of at least 1 MiB: small exchanges never grow


# ------------------------------------------------------------------ pure rules (CPU-tested)

def slot_elements(send_counts: Sequence[int], recv_counts: Sequence[int], world: int) -> int:
    """M, the elements of one slot: the largest count any rank sends to any rank, decided
    identically on every rank without a collective (module docstring, "The size rule").
    Raises ValueError for counts of the wrong length, negative, or of neither shape."""
    send, recv = [int(n) for n in send_counts], [int(n) for n in recv_counts]
    if len(send) != world or len(recv) != world:
        raise ValueError(f"ulysses_kernels: SymmTransport needs one send and one receive count per rank "
                         f"(world {world}), got {len(send)} and {len(recv)}")
    if min(send + recv) < 0:
        raise ValueError(f"ulysses_kernels: SymmTransport got negative counts: send {send}, recv {recv}")
    if len(set(send)) > 1 and len(set(recv)) > 1:
        raise ValueError(
            "ulysses_kernels: SymmTransport sizes its window without a collective, which needs a Ulysses-shaped "
            "exchange: this rank sends the same count to every rank (seq -> heads) or receives the same count "
            f"from every rank (heads -> seq); got send counts {send} and receive counts {recv}, neither uniform. "
            "Use ULYSSES_KERNELS_TRANSPORT=nccl for this exchange")
    return max(send + recv)


def window_bytes_needed(send_counts: Sequence[int], recv_counts: Sequence[int], world: int,
                        element_size: int) -> int:
    """Bytes of a window with `world` slots of `slot_elements` elements."""
    return slot_elements(send_counts, recv_counts, world) * world * int(element_size)


def grown_window_bytes(current: int, needed: int) -> int:
    """The window's size after an exchange needing `needed` bytes: unchanged when it fits,
    else max(needed, 2 * current, MIN_WINDOW_BYTES) (geometric growth, identical on every
    rank since both arguments are)."""
    if needed <= current:
        return current
    return max(needed, 2 * current, MIN_WINDOW_BYTES)


def read_order(rank: int, world: int) -> List[int]:
    """The ranks whose windows this rank reads, starting at rank + 1 and ending with its
    own: at each step every rank reads a different peer, spreading the load."""
    return [(rank + step) % world for step in range(1, world + 1)]


def offsets(counts: Sequence[int]) -> List[int]:
    """Start of each rank's part in a buffer packed in rank order."""
    out, total = [], 0
    for n in counts:
        out.append(total)
        total += int(n)
    return out


# ---------------------------------------------------------------- what torch must provide

def _symmetric_memory():
    """torch's symmetric-memory module, or None when this torch has none."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
        from torch._C._distributed_c10d import _SymmetricMemory  # noqa: F401 - the C++ backend must exist
    except Exception:  # noqa: BLE001 - an import error of any kind means: not available
        return None
    return symm_mem


def problem(device: torch.device) -> Optional[str]:
    """Why SymmTransport cannot run on `device` (None when it can)."""
    if device.type != "cuda":
        return f"needs a CUDA device, got {device.type}"
    if not torch.version.cuda:
        return "needs a CUDA build of torch (this one is CPU-only)"
    if _symmetric_memory() is None:
        return "needs torch.distributed._symmetric_memory, which this torch lacks"
    if not torch.cuda.is_available():
        return "needs a visible CUDA device (torch.cuda.is_available() is False)"
    from torch._C._distributed_c10d import _SymmetricMemory
    backend = _SymmetricMemory.get_backend(torch.device("cuda", device.index or 0))
    if backend not in (None, "CUDA"):
        return f"needs torch's CUDA symmetric-memory backend, but {backend} is selected"
    return None


def barrier_is_bounded() -> bool:
    """True when torch's barrier takes `timeout_ms` (its pybind signature names it)."""
    if _symmetric_memory() is None:
        return False
    from torch._C._distributed_c10d import _SymmetricMemory
    return "timeout_ms" in (_SymmetricMemory.barrier.__doc__ or "")


# ---------------------------------------------------------------------------- the transport

class SymmTransport:
    """The exchange through a grow-only symmetric-memory window per transport (module
    docstring: the slots, the size rule, the two barriers, what is bounded)."""

    name = "symm"

    def __init__(self, group, world: int, rank: int, device: torch.device):
        why = problem(device)
        if why is not None:
            raise RuntimeError(f"ulysses_kernels: the symmetric-memory transport (ULYSSES_KERNELS_TRANSPORT=symm) "
                               f"{why}; use ULYSSES_KERNELS_TRANSPORT=nccl")
        self.group = group if group is not None or world == 1 else dist.group.WORLD
        self.world, self.rank, self.device = world, rank, device
        self.timeout_ms = int(exchange_timeout() * 1000)
        self.bounded = barrier_is_bounded()
        self.window: Optional[torch.Tensor] = None  # uint8, on every rank the same size
        self.handle = None                          # torch's _SymmetricMemory of the window
        self.retired: List[torch.Tensor] = []       # replaced windows, kept until close()
        self._views: Dict[Tuple[int, torch.dtype, int], torch.Tensor] = {}
        self.closed = False

    # -- one exchange

    def all_to_all(self, send, recv, send_counts, recv_counts):
        self._open()
        if self.world == 1:  # no peers: one local copy, no window
            n = int(recv_counts[0])
            recv.reshape(-1)[:n].copy_(send.reshape(-1)[:n])
            return
        m = slot_elements(send_counts, recv_counts, self.world)
        if recv.dtype != send.dtype:
            raise ValueError(f"ulysses_kernels: SymmTransport exchanges one dtype, got send {send.dtype} and "
                             f"recv {recv.dtype}")
        self._ensure_window(m * self.world * send.element_size())
        self._write_own_window(send.reshape(-1), send_counts, m)
        self._barrier(READY_CHANNEL)
        self._read_peer_slots(recv.reshape(-1), recv_counts, m, send.dtype)
        self._barrier(DONE_READING_CHANNEL)

    def _write_own_window(self, send: torch.Tensor, send_counts: Sequence[int], m: int) -> None:
        """Slot j of this rank's window <- what this rank sends to rank j."""
        slots = self._slots(self.rank, send.dtype, m)
        counts = [int(n) for n in send_counts]
        if len(set(counts)) == 1:  # uniform: the send buffer is `world` rows of one width
            c = counts[0]
            if c:
                slots[:, :c].copy_(send[:c * self.world].view(self.world, c))
            return
        for j, (start, c) in enumerate(zip(offsets(counts), counts)):
            if c:
                slots[j, :c].copy_(send[start:start + c])

    def _read_peer_slots(self, recv: torch.Tensor, recv_counts: Sequence[int], m: int, dtype) -> None:
        """recv's part from rank j <- slot `rank` of j's window, j from rank + 1 on."""
        starts = offsets(recv_counts)
        for j in read_order(self.rank, self.world):
            c = int(recv_counts[j])
            if c:
                recv[starts[j]:starts[j] + c].copy_(self._slots(j, dtype, m)[self.rank, :c])

    def _barrier(self, channel: int) -> None:
        if self.bounded:
            self.handle.barrier(channel=channel, timeout_ms=self.timeout_ms)
        else:  # a torch without timeout_ms: unbounded (barrier_is_bounded() says so)
            self.handle.barrier(channel=channel)

    # -- the window

    def _slots(self, rank: int, dtype: torch.dtype, m: int) -> torch.Tensor:
        """Rank `rank`'s window as [world, m] elements of `dtype` (views cached until the
        window grows)."""
        key = (rank, dtype, m)
        view = self._views.get(key)
        if view is None:
            view = self.handle.get_buffer(rank, (self.world, m), dtype, 0)
            self._views[key] = view
        return view

    def window_bytes(self) -> int:
        return 0 if self.window is None else self.window.numel()

    def _ensure_window(self, needed: int) -> None:
        """Grow the window to hold `needed` bytes (same decision, same call, every rank)."""
        size = grown_window_bytes(self.window_bytes(), needed)
        if size == self.window_bytes():
            return
        if streams.is_capturing():
            raise RuntimeError(
                f"ulysses_kernels: SymmTransport needs a larger window ({needed} bytes, it has "
                f"{self.window_bytes()}) during CUDA graph capture, where its rendezvous (a host-blocking "
                "collective) cannot run; run one eager call of the largest shape before capturing")
        symm_mem = _symmetric_memory()
        window = symm_mem.empty(size, dtype=torch.uint8, device=self.device)
        handle = symm_mem.rendezvous(window, self.group)
        if self.window is not None:
            self.retired.append(self.window)
        self.window, self.handle = window, handle
        self._views.clear()

    # -- the transport interface

    def check(self):
        """No host-side wait: the barriers bound every wait on the device."""

    def _open(self):
        if self.closed:
            raise RuntimeError("ulysses_kernels: this symmetric-memory transport is closed (fused.close() or an "
                               "engine rebuilt for a new group); its engine must not be used any more")

    def close(self):
        """Free the windows. This device's queue ends with the last "done reading"
        barrier, so once it drains no peer still reads them."""
        if self.closed:
            return
        self.closed = True
        if self.window is not None and not streams.is_capturing():
            streams.synchronize(self.device)
        self._views.clear()
        self.window, self.handle, self.retired = None, None, []
