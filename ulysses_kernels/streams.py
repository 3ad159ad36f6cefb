"""The one stream and event layer of the package (docs/architecture.md, "Streams and the
stream-order checker"): the fused path's comm and compute streams, the ring's transfers on
the engine, checkpoint offload's side stream.

Every stream, event, wait and `record_stream` of the package goes through the functions
here, never through `torch.cuda` directly, for one reason: a test can replace the layer.
On a CUDA device they are CUDA's; on any other device there are no streams (None), work
runs in program order, and the same code serves the CPU tests. The tests' stream-order
checker (`ulysses_kernels.testing.stream_order`) installs simulated streams on CPU with
`use_layer`, records what every operation reads and writes, and fails on a read that is not
ordered after its write or on memory freed while another stream may still use it: the
faults that no CPU run can otherwise see and that a GPU shows only as a wrong number now
and then.

The rules the package keeps (what the checker enforces):
- a stream reads a buffer only after an event or stream wait orders it behind the write
  (same stream: program order);
- a buffer is written only after every earlier read and write of it on other streams is
  ordered before the write (grow-only buffers reused across calls and chunks);
- a tensor used on a stream other than the one it was allocated on is `record_stream`-ed
  there, or that stream's use is waited for on its home stream before the tensor dies
  (the caching allocator hands freed memory out again on the home stream at once).
"""

import contextlib

import torch


class CudaStreams:
    """The real layer: CUDA streams and events on CUDA devices, none elsewhere."""

    def current_stream(self, device: torch.device):
        return torch.cuda.current_stream(device) if device.type == "cuda" else None

    def new_stream(self, device: torch.device, priority: int = 0):
        return torch.cuda.Stream(device=device, priority=priority) if device.type == "cuda" else None

    def event(self, stream):
        if stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def wait(self, stream, ev) -> None:
        if stream is not None and ev is not None:
            stream.wait_event(ev)

    def wait_stream(self, stream, other) -> None:
        if stream is not None and other is not None:
            stream.wait_stream(other)

    def on(self, stream):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        if stream is not None:
            tensor.record_stream(stream)

    def query(self, ev) -> bool:
        return ev is None or ev.query()

    def is_capturing(self) -> bool:
        # torch 2.11 raises from the query on a machine without a usable driver
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

    def synchronize(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def pin_host_memory(self, device: torch.device) -> bool:
        """Host buffers that copies to and from `device` run asynchronously with (pinned)."""
        return device.type == "cuda" and torch.cuda.is_available()


_layer = CudaStreams()


def layer():
    """The stream layer in use (the tests' checker, or CUDA's)."""
    return _layer


def use_layer(new_layer):
    """Replace the stream layer (tests: the stream-order checker); returns the previous one."""
    global _layer
    previous, _layer = _layer, new_layer
    return previous


def current_stream(device: torch.device):
    """The stream work on `device` is issued to now (None without streams)."""
    return _layer.current_stream(device)


def new_stream(device: torch.device, *, priority: int = 0):
    """A new stream on `device` (None without streams); priority -1 is CUDA's high priority."""
    return _layer.new_stream(device, priority)


def event(stream):
    """An event recorded on `stream` now (None without streams)."""
    return _layer.event(stream)


def wait(stream, ev) -> None:
    """Work issued to `stream` from now on runs after `ev`'s."""
    _layer.wait(stream, ev)


def wait_stream(stream, other) -> None:
    """Work issued to `stream` from now on runs after everything issued to `other` so far."""
    _layer.wait_stream(stream, other)


def on(stream):
    """Context in which work is issued to `stream`."""
    return _layer.on(stream)


def record_stream(tensor: torch.Tensor, stream) -> None:
    """`tensor`'s memory is not handed out again before `stream`'s work issued so far is done."""
    _layer.record_stream(tensor, stream)


def query(ev) -> bool:
    """True when `ev` has completed (None: nothing to wait for)."""
    return _layer.query(ev)


def is_capturing() -> bool:
    """True inside a CUDA graph capture (no host waits, no new events to poll)."""
    return _layer.is_capturing()


def synchronize(device: torch.device) -> None:
    """The host waits for every stream of `device`."""
    _layer.synchronize(device)


def pin_host_memory(device: torch.device) -> bool:
    return _layer.pin_host_memory(device)


def device_ctx(device: torch.device):
    """Make `device` current: Triton launches on the current device's current stream,
    whatever device its tensors are on."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
