"""The fused path's ring transfers (docs/architecture.md, "Ulysses x Ring").

The ring schedule itself is the shared one (`ring/schedule.py`), run with the Triton
block ops and this path's exchange (exchange.py, unchunked: ring attention needs every
head of the portion before its first block). Its transfers run on the ring group's
engine (one per (ring group, device)), on that engine's comm stream: a shift to the next
ring rank is an all-to-all whose only non-zero counts are the next rank (send) and the
previous one (receive); the engine skips empty peers, so that is one grouped
ncclSend/ncclRecv pair. The compute stream waits for a transfer only when the ring
schedule needs its data, so the transfer of block i+1 runs while block i is computed.
"""

import torch

from ..streams import current_stream, wait
from .engine import Engine, get_engine
from .exchange import keep_for_comm, on_comm


class EngineShift:
    """One ring transfer on the ring engine: `send` to the next ring rank, `recv` from the
    previous one; `wait()` makes the compute stream wait for it."""

    def __init__(self, engine: Engine, send: torch.Tensor, recv: torch.Tensor):
        R, r = engine.world, engine.rank
        send_counts, recv_counts = [0] * R, [0] * R
        send_counts[(r + 1) % R] = send.numel()
        recv_counts[(r - 1) % R] = recv.numel()
        self.device = send.device
        keep_for_comm(engine, send, recv)
        self.done = on_comm(engine, send.device,
                            lambda: engine.transport.all_to_all(send, recv, send_counts, recv_counts))

    def wait(self):
        wait(current_stream(self.device), self.done)


def ring_shift(group, world: int, rank: int, device: torch.device):
    """The ring's transfers on the ring group's engine (ring/schedule.py, `Shift`)."""
    engine = get_engine(group, world, rank, device)
    return lambda send, recv, tag: EngineShift(engine, send, recv)
