"""Entry points that the benchmarks (bench/) time, built on the fused path's modules
(its engine, op wrappers and stream helpers)."""

from typing import Sequence

import torch

from .. import fused
from ..fused.exchange import send_to_heads
from ..layout import HeadPlan
from ..streams import current_stream, event, on, wait


def qkv_exchange(q, k, v, engine: fused.Engine, lens: Sequence[int]) -> torch.Tensor:
    """One fused seq->heads exchange of q, k, v (no chunks, no autograd): the pack kernel
    and one transport all-to-all on the engine's comm stream. Returns the flat receive
    buffer (source-major `[B, S_i, Hl_q + 2*Hl_kv, D]` blocks)."""
    P = engine.world
    B, Sp, Hq, D = q.shape
    heads = HeadPlan(P, Hq, k.shape[2])
    ch = heads.channels
    send = engine.buffer("x_send", P * B * Sp * ch * D, q.dtype).view(P, B, Sp, ch, D)
    recv = torch.empty(B * sum(lens) * ch * D, dtype=q.dtype, device=q.device)
    compute, comm = current_stream(q.device), engine.stream
    wait(comm, event(compute))
    with on(comm):
        send_to_heads(engine, [q, k, v], send, recv, lens, offsets=[0, 0, 0],
                      counts=[heads.local_q_heads, heads.local_kv_heads, heads.local_kv_heads])
    wait(compute, event(comm))
    return recv


_reference_event = None


def cuda_event_clock() -> float:
    """Seconds on the GPU's timeline, read through CUDA events: records an event on the
    current stream, waits for it and returns its time since a reference event. The
    difference of two readings is the GPU time of the work queued between them. Used as
    pytest-benchmark's timer by bench/bench_kernels.py (bench/pytest.ini); without CUDA it
    is `time.perf_counter`."""
    global _reference_event
    if not torch.cuda.is_available():
        import time
        return time.perf_counter()
    if _reference_event is None:
        _reference_event = torch.cuda.Event(enable_timing=True)
        _reference_event.record()
    now = torch.cuda.Event(enable_timing=True)
    now.record()
    now.synchronize()
    return _reference_event.elapsed_time(now) / 1e3
