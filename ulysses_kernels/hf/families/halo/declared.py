"""A users' declaration of a layer whose token mixing reads a fixed number of earlier tokens
(docs/hf_custom.md): the sequence halo of the package's own short convolutions (halo.py), for a
layer the package does not know.

The layer's forward calls a method of its own, named by the declaration, on inputs `[B, S, C]`
(dim 1 the sequence); the method is causal and reads at most `width` earlier inputs (a causal
convolution of kernel `width + 1`, a token shift of `width`, a stack of them), from zeros before
the first token, and returns `[B, S, C']`. Under sequence parallelism, while the layer's forward
runs (family.py's protocol, then `mixers.declared_forward`), that method runs on each of this rank's
ranges with the `width` inputs before it prepended (`halo_map`: one all-gather of every rank's
last `width` inputs), and the prepended outputs are dropped. Packed documents run one by one
(zeros before each document's start), as the package's attention and mixers run them.

That the method is what `halo_map` needs is checked, not trusted: before a layer's method
first runs sequence-parallel, and again whenever its parameters' values changed since, the
method runs on a small fixed probe (`_probe`, in eval mode from a fixed random state): it must be causal, read no more than `width` earlier
inputs, read zeros before the first token as its history, and depend on nothing but its
inputs (no absolute position). Anything else refuses the model on every rank (the probe is
the same everywhere, and so is the answer).
"""

import inspect
import weakref
from typing import Callable, Union

import torch

from ...model import refusal
from ..family import HALO, Adapter, class_names
from ..mixers import (
    declared_forward,
    declared_method,
    probe_key,
    probe_tolerance,
    probing,
    refuse_declared_generation,
)
from .halo import halo_map, training_layout


def halo(classes, method: str, *, width: Union[int, Callable]) -> Adapter:
    """The declaration of layers (`classes`, types or names) whose `method` reads at most
    `width` earlier inputs (an int, or a function of the module: `lambda m: m.conv.kernel_size[0] - 1`),
    for `declare_family` (the module doc)."""
    names = class_names(classes)
    return Adapter(names, "declared halo", declared_forward(method), HALO,
                   generation=refuse_declared_generation, generates=False,
                   members=lambda base: {method: halo_method(base, method, width)},
                   cache_kept="a declaration says nothing of the layer's cache")


def halo_method(base: type, method: str, width: Union[int, Callable]) -> Callable:
    """`base.method`, run over the global sequence while a declared layer's forward runs (as
    written elsewhere)."""
    own = getattr(base, method, None)
    if not callable(own):
        raise ValueError(f"ulysses_kernels.hf: {base.__name__} has no method {method!r} to run with the halo")
    where = f"{base.__name__}.{method}"
    probed = weakref.WeakKeyDictionary()   # module -> what its last probe passed on

    def run(self, x, *args, **kwargs):
        with declared_method(self) as call:
            if call is None:
                return own(self, x, *args, **kwargs)
            reach = int(width(self) if callable(width) else width)
            _check_arguments(where, x, args, kwargs)
            key = probe_key(self, (reach, x.shape[2], x.dtype), {**{str(i): a for i, a in enumerate(args)}, **kwargs})
            if probed.get(self) != key:
                with probing(self):
                    _probe(where, lambda inputs: own(self, inputs, *args, **kwargs), x, reach)
                probed[self] = key
            out, _ = halo_map(x, lambda extended: own(self, extended, *args, **kwargs)[:, reach:], reach,
                              training_layout(call.context, call.lens), cu_seqlens=call.cu_seqlens)
            return out

    run.__name__, run.__doc__, run.__signature__ = own.__name__, own.__doc__, inspect.signature(own)
    return run


def _check_arguments(where: str, x, args, kwargs) -> None:
    """The inputs `[B, S, C]` and nothing else along the sequence (shapes but the sequence's
    are the same on every rank, so is the refusal)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise refusal(None, f"{where} got {shape}: a method declared with the halo takes inputs "
                            "[batch, sequence, channels]")
    if any(isinstance(v, torch.Tensor) and v.dim() >= 2 for v in (*args, *kwargs.values())):
        raise refusal(None, f"{where} got a tensor beside its inputs: a method declared with the halo reads its "
                            "inputs only (pass parameters through the module)")


def _probe(where: str, method: Callable, x: torch.Tensor, reach: int) -> None:
    """The module doc's checks, on `8 x reach + 16` random tokens: one changed in the middle
    (no output before it changes: causal; none more than `reach` after it: the reach), zeros
    prepended (the outputs stay: zeros are its history before the first token, as `halo_map`
    gives it), and more tokens prepended before the `reach` it reads (the outputs stay: no
    absolute position)."""
    tokens = 8 * reach + 16
    changed = tokens // 2
    generator = torch.Generator().manual_seed(0)
    probe, before = (torch.randn((1, n, x.shape[2]), generator=generator, dtype=torch.float64)
                     for n in (tokens, reach + 5))
    moved = probe.clone()
    moved[:, changed] += 1.0
    zeros = probe[:, :reach] * 0

    def run(*pieces):   # the outputs for the probe's tokens, after what comes before them
        inputs = torch.cat(pieces, dim=1)
        with torch.no_grad():
            out = method(inputs.to(device=x.device, dtype=x.dtype)).double()
        if out.dim() != 3 or out.shape[1] != inputs.shape[1]:
            raise refusal(None, f"{where} returned {tuple(out.shape)} for inputs of {inputs.shape[1]} tokens: a "
                                "method declared with the halo returns one output per token [batch, sequence, channels]")
        return out[:, inputs.shape[1] - tokens:]

    plain = run(probe)
    scale = float(plain.norm().clamp(min=1e-30)) * probe_tolerance(x.dtype)
    differs = lambda a, b: float((a - b).norm()) > scale   # noqa: E731
    after = run(moved)
    if differs(after[:, :changed], plain[:, :changed]):
        raise refusal(None, f"{where} is not causal: changing the input at position {changed} changed an earlier "
                            "output (on a probe)")
    if differs(after[:, changed + reach + 1:], plain[:, changed + reach + 1:]):
        raise refusal(None, f"{where} reads more than its declared width of {reach} earlier inputs: changing the "
                            f"input at position {changed} changed an output {reach + 1} or more positions after it (on a "
                            "probe); declare the width it reads")
    if differs(run(zeros, probe), plain):
        raise refusal(None, f"{where} does not read zeros as its history before the first token (a learned or "
                            "special start): its outputs change when zeros are prepended (on a probe)")
    if differs(run(before, probe), run(before[:, before.shape[1] - reach:], probe)):
        raise refusal(None, f"{where} depends on more than its inputs (a token's absolute position): its outputs "
                            f"change with the tokens before the {reach} it reads (on a probe)")
