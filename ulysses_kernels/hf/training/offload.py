"""Checkpoint offload: the inputs a checkpointed block saves for its backward wait in host
memory instead of GPU memory (ALST's activation checkpoint offload).

With activation checkpointing, each decoder layer keeps only its inputs (the hidden states
entering it, `[B, S_local, hidden]`) until the backward recomputes it; at a million tokens
those inputs of all layers are most of what stays on the GPU. `CheckpointOffload` is a pair
of `torch.autograd.graph.saved_tensors_hooks` that is active around each block's call:

- pack (forward): a device tensor saved by the block goes to a host buffer from a reusable
  pool (pinned on CUDA), copied on a side stream after the compute stream has produced it;
  the device memory returns to the allocator once the copy is done (`record_stream`).
- unpack (backward): the tensor comes back to the device, into memory allocated on the
  side stream that copies it; the host buffer returns to the pool when that copy has
  finished. Blocks are unpacked in reverse order, and each unpack
  starts the copy of the previous block's inputs on the side stream, so it is on the GPU
  when the backward reaches it.

The hooks wrap the block's module call from the outside (a forward pre-hook enters them,
a forward hook leaves them), so with checkpointing they see only what the checkpoint saves:
the block's inputs (the recomputation's own saved tensors are the checkpoint's business).
Non-contiguous saved tensors come back contiguous (same values). A saved input can be read
once: `retain_graph=True` / double backward raise a clear error.
Without checkpointing they would offload everything the block saves; that is correct but
slow, so `offload_checkpoints` asks for checkpointing. The last block is left alone (its
backward comes first). Tensors on other devices pass through unchanged: on CPU the offload
is a no-op. Tests give `device_type="cpu"` to exercise the pool and the hooks on CPU.
"""

from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ... import streams


class HostBufferPool:
    """Grow-only pool of flat host byte buffers, reused by size: after the first step the
    same buffers serve every step (no allocation in steady state). A returned buffer is
    reused only once its pending copy (an event, or None) has completed."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._free: Dict[int, List[Tuple[torch.Tensor, object]]] = defaultdict(list)
        self._pointers = set()  # every buffer ever handed out
        self.allocations = 0
        self.allocated_bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        free = self._free[nbytes]
        for i, (buf, ready) in enumerate(free):
            if streams.query(ready):
                return free.pop(i)[0]
        self.allocations += 1
        self.allocated_bytes += nbytes
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        self._pointers.add(buf.untyped_storage().data_ptr())
        return buf

    def give(self, buf: torch.Tensor, ready=None) -> None:
        self._free[buf.numel()].append((buf, ready))

    def owns(self, t: torch.Tensor) -> bool:
        """True when `t` views one of the pool's buffers (tests, monitoring)."""
        return t.untyped_storage().data_ptr() in self._pointers


class _Offloaded:
    """A saved tensor that waits in host memory."""

    __slots__ = ("host", "dtype", "shape", "device", "copied", "prefetched", "previous")
    # host: the pool buffer (None once read back); copied: event of the device->host copy;
    # prefetched: (device tensor, event) started early; previous: the handle packed before

    def __init__(self, host, dtype, shape, device, copied, previous):
        self.host, self.dtype, self.shape, self.device = host, dtype, shape, device
        self.copied, self.prefetched, self.previous = copied, None, previous


class CheckpointOffload:
    """saved_tensors_hooks that keep checkpointed blocks' saved inputs in host memory.

    device_type: the tensors to offload ("cuda"; tests use "cpu"). min_bytes: smaller
    tensors stay (e.g. rotary tables would cost more in copies than they save).
    """

    def __init__(self, device_type: str = "cuda", min_bytes: int = 1 << 16, pool: Optional[HostBufferPool] = None):
        self.device_type, self.min_bytes = device_type, min_bytes
        self.pool = pool or HostBufferPool(pin=streams.pin_host_memory(torch.device(device_type)))
        self.stream = None
        self._last: Optional[_Offloaded] = None  # the most recent pack: the next unpack's predecessor
        self.packed = 0                          # tensors offloaded (tests, monitoring)

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _side_stream(self, device):
        """The side stream of the copies (None without streams: CPU, where copies are in order)."""
        if self.stream is None:
            self.stream = streams.new_stream(device)
        return self.stream

    def _pack(self, t: torch.Tensor):
        # Empty tensors stay: nothing to move (torch 2.11's checkpoint saves an empty placeholder
        # beside the inputs, later releases do not).
        if t.device.type != self.device_type or isinstance(t, nn.Parameter) or t.numel() == 0 or \
                t.numel() * t.element_size() < self.min_bytes:
            return t
        src = t if t.is_contiguous() else t.contiguous()
        nbytes = src.numel() * src.element_size()
        host = self.pool.take(nbytes)
        side = self._side_stream(t.device)
        copied = None
        if side is None:
            host.copy_(src.reshape(-1).view(torch.uint8))
        else:
            streams.wait_stream(side, streams.current_stream(t.device))
            with streams.on(side):
                host.copy_(src.reshape(-1).view(torch.uint8), non_blocking=True)
                copied = streams.event(side)
            streams.record_stream(src, side)  # its memory is not reused before the copy is done
        self.packed += 1
        handle = _Offloaded(host, src.dtype, tuple(src.shape), t.device, copied, self._last)
        self._last = handle
        return handle

    def _to_device(self, h: _Offloaded, stream) -> Tuple[torch.Tensor, object]:
        if stream is None:
            flat = torch.empty(h.host.numel(), dtype=torch.uint8, device=h.device)
            flat.copy_(h.host)
            return flat.view(h.dtype).view(h.shape), None
        with streams.on(stream):
            # Allocated on the side stream that writes it: memory from the compute stream's
            # pool can still be in use by compute kernels queued before its free, and a side
            # stream write into it would race them. The compute stream's use is recorded in
            # _unpack (record_stream), so the block is not reused before that use is done.
            flat = torch.empty(h.host.numel(), dtype=torch.uint8, device=h.device)
            streams.wait(stream, h.copied)
            flat.copy_(h.host, non_blocking=True)
            done = streams.event(stream)
        return flat.view(h.dtype).view(h.shape), done

    def _unpack(self, h):
        if not isinstance(h, _Offloaded):
            return h
        if h.host is None:
            raise RuntimeError("checkpoint offload: a saved input was read twice (retain_graph=True or a double "
                               "backward); its host buffer went back to the pool. Disable offload_checkpoints.")
        side = self._side_stream(h.device)
        if h.prefetched is not None:
            t, done = h.prefetched
        else:
            t, done = self._to_device(h, side)
        if side is not None:
            compute = streams.current_stream(h.device)
            streams.wait(compute, done)
            streams.record_stream(t, compute)
        prev = h.previous  # the block before is needed next (backward runs in reverse)
        if prev is not None and prev.prefetched is None and side is not None:
            prev.prefetched = self._to_device(prev, side)
        self.pool.give(h.host, done)
        h.host, h.previous = None, None
        if self._last is h:
            self._last = None
        return t


def enable_checkpoint_offload(blocks, offload: CheckpointOffload) -> List[object]:
    """Activate `offload`'s hooks around the calls of every block but the last; returns
    the hook handles (removing them disables it)."""
    handles = []
    for block in list(blocks)[:-1]:
        state = {}

        def enter(module, args, state=state):
            if torch.is_grad_enabled():
                state.setdefault("ctx", []).append(offload.hooks())
                state["ctx"][-1].__enter__()

        def leave(module, args, output, state=state):
            if state.get("ctx"):
                state["ctx"].pop().__exit__(None, None, None)

        handles.append(block.register_forward_pre_hook(enter))
        handles.append(block.register_forward_hook(leave, always_call=True))
    return handles
