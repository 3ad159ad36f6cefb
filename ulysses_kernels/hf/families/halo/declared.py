"""A users' declaration of a layer whose token mixing reads a fixed number of earlier tokens
(docs/hf_custom.md): the sequence halo of the package's own short convolutions (halo.py), for a
layer the package does not know.

The layer's forward calls a method of its own, named by the declaration, on inputs `[B, S, C]`
(dim 1 the sequence); the method is causal and reads at most `width` earlier inputs (a causal
convolution of kernel `width + 1`, a token shift of `width`, a stack of them), from zeros before
the first token, and returns `[B, S, C']`. Under sequence parallelism, while the layer's forward
runs (family.py's protocol, then `declared_forward`), that method runs on each of this rank's
ranges with the `width` inputs before it prepended (`halo_map`: one all-gather of every rank's
last `width` inputs), and the prepended outputs are dropped. Packed documents run one by one
(zeros before each document's start), as the package's attention and mixers run them.

That the method is causal and reads no more than `width` earlier inputs is checked, not
trusted: the first time a layer runs, the method runs on a small fixed probe and on the probe
with one token changed; an output before that token, or more than `width` after it, that
changes refuses the model on every rank (the probe is the same everywhere, and so is the answer).
"""

import inspect
import weakref
from functools import partial
from typing import Callable, Union

import torch

from ...model import refusal
from ..family import HALO, Adapter, class_names, declared_call, declared_forward, refuse_declared_generation
from .halo import halo_map, training_layout

PROBE_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
PROBE_TOLERANCE_LOW = 2e-2   # bfloat16, float16


def halo(classes, method: str, *, width: Union[int, Callable]) -> Adapter:
    """The declaration of layers (`classes`, types or names) whose `method` reads at most
    `width` earlier inputs (an int, or a function of the module: `lambda m: m.conv.kernel_size[0] - 1`),
    for `declare_family` (the module doc)."""
    names = class_names(classes)
    return Adapter(names, "declared halo", partial(declared_forward, method=method), HALO,
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
    checked = weakref.WeakKeyDictionary()   # module -> the widths its probe passed

    def run(self, x, *args, **kwargs):
        call = declared_call(self)
        if call is None:
            return own(self, x, *args, **kwargs)
        reach = int(width(self) if callable(width) else width)
        _check_arguments(where, x, args, kwargs)
        if reach not in checked.setdefault(self, set()):
            _probe(where, lambda inputs: own(self, inputs, *args, **kwargs), x, reach)
            checked[self].add(reach)
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
    """The module doc's check, on `2 x reach + 3` tokens with the middle one changed."""
    tokens, changed = 2 * reach + 3, reach + 1
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn((1, tokens, x.shape[2]), generator=generator, dtype=torch.float64)
    moved = probe.clone()
    moved[:, changed] += 1.0
    tolerance = PROBE_TOLERANCE.get(x.dtype, PROBE_TOLERANCE_LOW)
    with torch.no_grad():
        before, after = (method(p.to(device=x.device, dtype=x.dtype)).double() for p in (probe, moved))
    if before.dim() != 3 or before.shape[1] != tokens:
        raise refusal(None, f"{where} returned {tuple(before.shape)} for inputs of {tokens} tokens: a method "
                            "declared with the halo returns one output per token [batch, sequence, channels]")
    scale = float(before.norm().clamp(min=1e-30))
    if float((after[:, :changed] - before[:, :changed]).norm()) > tolerance * scale:
        raise refusal(None, f"{where} is not causal: changing the input at position {changed} changed an earlier "
                            "output (on a probe)")
    if float((after[:, changed + reach + 1:] - before[:, changed + reach + 1:]).norm()) > tolerance * scale:
        raise refusal(None, f"{where} reads more than its declared width of {reach} earlier inputs: changing the "
                            f"input at position {changed} changed the output at position {changed + reach + 1} or "
                            "later (on a probe); declare the width it reads")
