"""A users' declaration of a layer that mixes tokens within each head (docs/hf_custom.md): the
head exchange of the package's own mixers by heads (Gated DeltaNet, Mamba2, lightning), for a
layer the package does not know.

The layer's forward calls a method of its own, named by the declaration, with its per-head
tensors `[B, S, H, D]` (dim 1 the sequence, dim 2 the heads); the method mixes tokens within
each head and returns one tensor `[B, S, H_out, D_out]`. Under sequence parallelism, while the
layer's forward runs (family.py's protocol, then `mixers.declared_forward`), that method goes through
`ulysses_head_parallel`: the tensors to the head layout in one exchange, the method over the
whole sequence of this rank's heads, the output back. Packed documents run one by one, as the
package's attention and mixers run them.

A method with parameters per head (a decay, a gate bias) takes a `heads` argument: the range
of global heads it holds (of its first tensor), `range(H)` where the layer calls it itself.
That the method mixes within heads and reads `heads` is checked, not trusted: before a layer's
method runs on `P` ranks, and again whenever its parameters' values changed since (`mixers.probe_key`:
one host read per layer and forward), the method runs on a small fixed probe over all heads and
over each rank's heads alone, in eval mode from a fixed random state; a difference in the
outputs, or in its parameters' gradients (where gradients are on), refuses the model on every
rank (the probe is the same everywhere, and so is the answer)."""

import inspect
import weakref
from typing import Callable, Dict

import torch

from ....api import ulysses_head_parallel
from ....layout import LocalHeads, place_heads
from ...model import refusal
from ..family import BY_HEADS, Adapter, class_names
from ..mixers import (
    declared_forward,
    declared_method,
    over_documents,
    probe_key,
    probe_tolerance,
    probing,
    refuse_declared_generation,
)

PROBE_TOKENS = 6
# a method that mixes within heads gives its heads' outputs alone up to rounding; one that
# mixes heads, or ignores `heads`, is off by order one


def by_heads(classes, method: str) -> Adapter:
    """The declaration of layers (`classes`, types or names) whose `method` mixes tokens within
    each head (the module doc), for `declare_family`."""
    names = class_names(classes)
    return Adapter(names, "declared by heads", declared_forward(method), BY_HEADS,
                   generation=refuse_declared_generation, generates=False,
                   members=lambda base: {method: head_parallel_method(base, method)},
                   cache_kept="a declaration says nothing of the layer's cache")


def _parameters(base: type, method: str):
    own = getattr(base, method, None)
    if not callable(own):
        raise ValueError(f"ulysses_kernels.hf: {base.__name__} has no method {method!r} to run by heads")
    signature = inspect.signature(own)
    if any(p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY) for p in signature.parameters.values()):
        raise ValueError(f"ulysses_kernels.hf: {base.__name__}.{method} takes *args or positional-only "
                         "parameters; the declaration passes its tensors by name")
    return own, signature


def head_parallel_method(base: type, method: str) -> Callable:
    """`base.method`, run over the whole sequence of this rank's heads while a declared layer's
    forward runs (as written elsewhere)."""
    own, signature = _parameters(base, method)
    takes_heads = "heads" in signature.parameters
    probed = weakref.WeakKeyDictionary()      # module -> what its last probe passed on (probe_key, gradients)
    exchanged = weakref.WeakSet()               # modules whose first exchange checked what the ranks pass

    def run(self, *args, **kwargs):
        with declared_method(self) as call:
            if call is None:
                return own(self, *args, **kwargs)
            tensors, others = _split_arguments(signature, self, args, kwargs)
            first = next(iter(tensors), None)
            placements = _placements(base, method, tensors, call.world)
            shapes = (call.world, tuple((n, tuple(t.shape[2:]), t.dtype) for n, t in tensors.items()))
            key, grads = probe_key(self, shapes, others), torch.is_grad_enabled()
            last = probed.get(self)   # (key, whether that probe compared gradients)
            if last is None or last[0] != key or (grads and not last[1]):
                _probe(self, own, f"{base.__name__}.{method}", tensors, others, placements, call.world, takes_heads)
                probed[self] = (key, grads or (last is not None and last[0] == key and last[1]))

            def mixer(local, heads: LocalHeads):
                extra = {"heads": heads.heads(first)} if takes_heads else {}
                return over_documents(lambda *pieces: own(self, **dict(zip(tensors, pieces)), **others, **extra),
                                      [local[name] for name in tensors], call.cu_seqlens)

            # a layer's first exchange checks what the ranks pass (names, heads, lengths); then trusted
            out = ulysses_head_parallel(mixer, tensors, call.group,
                                        seq_lens=call.ulysses_lens if self in exchanged else None)
            exchanged.add(self)
            return out

    run.__name__, run.__doc__ = own.__name__, own.__doc__
    return run


def _split_arguments(signature, module, args, kwargs):
    """({name: tensor} of the call, {name: anything else}); `heads` is the exchange's to give."""
    arguments = dict(signature.bind(module, *args, **kwargs).arguments)
    arguments.pop(next(iter(signature.parameters)))   # the module
    for name, p in signature.parameters.items():
        if p.kind is p.VAR_KEYWORD:
            arguments.update(arguments.pop(name, {}))
    arguments.pop("heads", None)
    tensors = {name: value for name, value in arguments.items() if isinstance(value, torch.Tensor)}
    return tensors, {name: value for name, value in arguments.items() if name not in tensors}


def _placements(base, method, tensors: Dict[str, torch.Tensor], world: int):
    """Each tensor's head placement over `world` ranks; the same refusal on every rank (shapes
    but the sequence's are the same everywhere) when one is not [B, S, H, D] or has none."""
    where = f"{base.__name__}.{method}"
    if not tensors:
        raise refusal(None, f"{where} got no tensor to exchange by heads")
    for name, t in tensors.items():
        if t.dim() != 4:
            raise refusal(None, f"{where} got {name} of shape {tuple(t.shape)}: a method declared by heads takes "
                                "tensors [batch, sequence, heads, head_dim] only (pass per-head parameters through "
                                "the module and take `heads`)")
    try:
        return {name: place_heads(t.shape[2], world) for name, t in tensors.items()}
    except ValueError as error:
        raise refusal(None, f"{where}: {error}", "Use a sequence-parallel size that divides the heads (or that "
                                                 "they divide).") from None


def _probe(module, own, where: str, tensors, others, placements, world: int, takes_heads: bool) -> None:
    """The module doc's check: the method on a fixed probe, over all heads and over each rank's
    heads alone, must agree, and so must the gradients of its parameters (where gradients are
    on: per-head parameters equal in value still send a method that ignores `heads` the wrong
    heads' gradients)."""
    generator = torch.Generator().manual_seed(0)
    probe = {name: torch.randn((1, PROBE_TOKENS) + tuple(t.shape[2:]), generator=generator,
                               dtype=torch.float64).to(device=t.device, dtype=t.dtype) for name, t in tensors.items()}
    first = next(iter(tensors))
    tolerance = probe_tolerance(probe[first].dtype)
    hint = "" if takes_heads else "; a method with parameters per head takes a `heads` argument"
    params = [p for p in module.parameters() if p.requires_grad] if torch.is_grad_enabled() else []
    with probing(module), torch.enable_grad() if params else torch.no_grad():
        whole = own(module, **probe, **others)
        if not isinstance(whole, torch.Tensor) or whole.dim() != 4 or whole.shape[2] % world:
            shape = tuple(whole.shape) if isinstance(whole, torch.Tensor) else type(whole).__name__
            raise refusal(None, f"{where} returned {shape}: a method declared by heads returns one tensor "
                                f"[batch, sequence, heads, head_dim] whose heads split over {world} ranks")
        cotangent = torch.randn(whole.shape, generator=generator, dtype=torch.float64).to(whole)
        want_grads = _grads(whole, cotangent, params)
        got_grads = [torch.zeros_like(g) for g in want_grads]
        for rank in range(world):
            heads = LocalHeads(rank, world, (PROBE_TOKENS,), placements)
            local = {name: _heads_of(p, heads.heads(name)) for name, p in probe.items()}
            try:
                part = own(module, **local, **others, **({"heads": heads.heads(first)} if takes_heads else {}))
            except (RuntimeError, IndexError, ValueError) as error:   # a shape that does not fit its parameters
                raise refusal(None, f"{where} failed on heads {_span(heads.heads(first))} alone ({error}){hint}") \
                    from None
            output_heads = heads.output_heads(whole.shape[2])
            error = _relative_error([part], [_heads_of(whole, output_heads)])
            if error > tolerance:
                raise refusal(None, f"{where} on heads {_span(heads.heads(first))} alone gives another result than "
                                    f"over all heads (relative error {error:.1e} on a probe): it mixes across heads, "
                                    f"or reads the parameters of other heads{hint}")
            got_grads = [a + b for a, b in zip(got_grads, _grads(part, _heads_of(cotangent, output_heads), params))]
    error = _relative_error(got_grads, want_grads)
    if error > tolerance:
        raise refusal(None, f"{where} on each rank's heads alone gives its parameters other gradients than over all "
                            f"heads (relative error {error:.1e} on a probe): it reads the parameters of other "
                            f"heads{hint}")


def _grads(out: torch.Tensor, cotangent: torch.Tensor, params) -> list:
    """The gradients of `(out * cotangent).sum()` for `params` (zeros for those it does not read)."""
    if not params:
        return []
    if not out.requires_grad:   # it reads none of them (frozen, or parameters of the layer's other parts)
        return [torch.zeros_like(p) for p in params]
    grads = torch.autograd.grad((out * cotangent).sum(), params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g.detach() for g, p in zip(grads, params)]


def _relative_error(got, want) -> float:
    if not want:
        return 0.0
    diff = sum(float((g.detach().double() - w.detach().double()).norm()) ** 2 for g, w in zip(got, want)) ** 0.5
    scale = sum(float(w.detach().double().norm()) ** 2 for w in want) ** 0.5
    return diff / max(scale, 1e-30)


def _heads_of(x: torch.Tensor, heads: range) -> torch.Tensor:
    return x.index_select(2, torch.tensor(list(heads), device=x.device, dtype=torch.long))


def _span(heads: range) -> str:
    return f"{heads.start}..{heads.stop - 1}"
