"""Stream and event helpers of the fused path. On CPU (the pipeline run with the torch
stand-ins of `ulysses_kernels.testing`) every stream is None and everything runs in
program order, so the same pipeline code serves both."""

import contextlib

import torch


def event(stream):
    """Event recorded on `stream` (None on CPU)."""
    if stream is None:
        return None
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def wait(stream, ev) -> None:
    """`stream` waits for `ev` (nothing on CPU)."""
    if stream is not None and ev is not None:
        stream.wait_event(ev)


def on(stream):
    """Context that issues work on `stream`."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def current_stream(device: torch.device):
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def device_ctx(device: torch.device):
    """Make `device` current: Triton launches on the current device's current stream,
    whatever device its tensors are on."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
