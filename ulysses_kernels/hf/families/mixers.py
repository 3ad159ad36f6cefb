"""What the token mixers that are not attention share (docs/hf_hybrids.md, "Hybrid models"),
above all the side of the head exchange of those made sequence-parallel by heads.

The rule is attention's (`ulysses_kernels.ulysses_head_parallel`): each of these layers
mixes tokens within a head only (a gated delta rule or a selective scan per head, a
depthwise convolution per channel), so the per-head inputs go from the sequence layout to
the head layout in one exchange, the layer runs over the whole sequence of this rank's
heads, and the output comes back. What mixes heads but not tokens (the projections, a
gated RMSNorm over a token's heads) stays on the local shard.

Packed documents: the convolution and the recurrence restart at every document boundary
of the global sequence (`document_starts`, `causal_conv1d`, `over_documents`), so a packed
row equals its documents run one by one, on one rank as on many. Under Ulysses x Ring the
state and the convolution's inputs pass from chunk to chunk of the ring (mixer_ring.py);
in generation each rank keeps its heads' states on the head-sharded cache
(`chunk_head_parallel`, hf/inference/cache.py).

An adapter gives one module instance the sequence-parallel forward (`install_adapters`,
called when the package meets a model: `attach_context`) by moving it to a subclass of its
own class (same name and module) whose forward is the adapter: an instance attribute would
not survive what transformers does to a model afterwards (since 5.25 every `train()` /
`eval()` re-runs the hub-kernel setup, which deletes a module's own `forward`), a class
does, and the subclass refuses hub kernels (`kernel_condition`), which would run the
one-device layer on the local shard. The module's kind is its subclass's (`adapted_kind`) and the guard
lets it (and its layer kind) through; every outermost forward checks that no adapted
module's forward was replaced since (`replaced_adapter_problem`). The installing is
adapters.py's; the protocol around each adapted forward (`context.token_mixer_call`, which
counts it as a call of the package's token mixers and gives it the forward's lengths and
documents, then the cache, placement, padding and ring rules) is family.py's
`protocol_forward`, for the families that declare their generation forward.
"""

import contextlib
import contextvars
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...api import ulysses_head_parallel
from ...distributed.collectives import all_gather_tensor
from ...layout import LocalHeads, place_heads
from ..context import DecodingCache, context_of
from ..model import record_of, refusal, torch_sequence_mixer


def original_forward(module: nn.Module):
    """The forward an adapted module ran before its adaptation (its own, or its class's):
    what the adapter runs where it has nothing to change (one rank, a refused call)."""
    own = record_of(module).marked(module, "own_forward")
    return own if own is not None else types.MethodType(type(module).__bases__[0].forward, module)   # the adapted class's base


GENERATION_ADVICE = ("Train and evaluate with use_cache=False (shard_batch's model_inputs() passes it); generate "
                     "with ulysses_kernels.hf.generate (or prefill and decoding).")


def check_cache_outside_generation(module: nn.Module, context, cu_seqlens, length: int, kept: str) -> None:
    """A cache given to an adapted mixer outside `generate` / `prefill` (transformers' models
    make one unless called with use_cache=False): returns where transformers' own forward
    may fill it (one rank, one document per row: nothing is sharded); else raises, the same
    on every rank: `NotSequenceParallelError` on several ranks (`kept`: where the layer's
    states live instead), ValueError for packed documents on one (the cache holds one state
    per row, not per document)."""
    name = type(module).__name__
    if context.sp_size > 1:
        raise refusal(None, f"{name} got a cache outside ulysses_kernels.hf.generate / prefill: {kept}",
                      GENERATION_ADVICE)
    if document_bounds(cu_seqlens, length) is not None:
        raise ValueError(f"ulysses_kernels.hf: {name} got a cache and packed documents: its cache holds one state "
                         "per row, not per document; call the model with use_cache=False")


def refuse_attention_dropout(module: nn.Module) -> None:
    """Attention dropout in training, refused with a ValueError on every rank, as the package's
    attention function refuses it: an adapted attention that computes its own softmax (the
    sparse attentions, the Inklings') has none."""
    dropout = getattr(module, "attention_dropout", 0.0)
    if module.training and dropout and dropout > 0.0:
        raise ValueError(f"ulysses_kernels.hf: {type(module).__name__}: attention dropout {dropout} is not supported "
                         "(set config.attention_dropout = 0.0)")


def sparse_attention_cache(module: nn.Module, cache) -> Optional[DecodingCache]:
    """What the protocol asks first of every adapted sparse attention (family.py, step 2; dsa.py,
    qsa.py, compressed.py, block_sparse.py): the decoding cache inside `generate` / `prefill`
    (None: training). Refused on every
    rank, whatever the size: attention dropout in training (`refuse_attention_dropout`), and a
    cache outside `generate` / `prefill` (transformers' models make one unless called with
    use_cache=False; transformers' own forward of these layers needs eager attention's masks and
    folds its selection into them, which the package's attention function does not take)."""
    refuse_attention_dropout(module)
    if cache is None or isinstance(cache, DecodingCache):
        return cache
    raise refusal(None, f"{type(module).__name__} got a cache outside ulysses_kernels.hf.generate / prefill: its "
                        "sparse attention runs the package's own forward only", GENERATION_ADVICE)


def refuse_conv_padding(module: nn.Module, conv_mask) -> None:
    """A padding mask given to a convolution along the sequence (the per-token mask
    transformers derives from a padded batch) is refused, the same on every rank: a padded
    row's mask is not this rank's slice."""
    if conv_mask is not None:
        raise refusal(None, f"{type(module).__name__} got a padding mask for its convolution: under sequence "
                            "parallelism a padded row's mask is not this rank's slice",
                      "Pack documents without padding (ulysses_kernels.hf.shard_batch) instead.")


# ------------------------------------------------------------------ the forward's documents

def document_bounds(cu_seqlens, length: int) -> Optional[List[int]]:
    """The global document boundaries `[0, ..., length]` of a packed row (None: one
    document per row); ValueError when they do not cover the sequence."""
    if cu_seqlens is None:
        return None
    bounds = [int(b) for b in torch.as_tensor(cu_seqlens).reshape(-1).tolist()]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != length or any(b > c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(f"ulysses_kernels.hf: document boundaries {bounds} must rise from 0 to the sequence length "
                         f"{length}")
    return bounds if len(bounds) > 2 else None


def document_starts(cu_seqlens, length: int, device) -> Optional[torch.Tensor]:
    """`[S]`: the global index where each position's document starts (None: one document)."""
    if cu_seqlens is None:
        return None
    bounds = torch.as_tensor(cu_seqlens, device=device).reshape(-1).to(torch.int64)
    if bounds.numel() <= 2:
        return None
    positions = torch.arange(length, device=device)
    return bounds[torch.searchsorted(bounds, positions, right=True) - 1]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  starts: Optional[torch.Tensor], activation: Optional[str],
                  history: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Depthwise causal convolution of `x` `[B, S, C]` with `weight` `[C, K]`, zero history
    before each document (`starts` from `document_starts`; None: one document per row), or
    the inputs `history` `[B, K - 1, C]` before the row (generation's conv state, one
    document per row), then the activation ("silu" or None)."""
    B, S, C = x.shape
    K = weight.shape[-1]
    if history is not None:
        return causal_conv1d(torch.cat([history.to(x.dtype), x], dim=1), weight, bias, None, activation)[:, -S:]
    if starts is None:
        out = F.conv1d(x.transpose(1, 2).to(weight.dtype), weight.unsqueeze(1), bias, padding=K - 1,
                       groups=C)[:, :, :S].transpose(1, 2)
    else:
        # window tap i of position t reads position t - K + 1 + i: only inside t's document
        windows = F.pad(x.to(weight.dtype), (0, 0, K - 1, 0)).unfold(1, K, 1)           # [B, S, C, K]
        taps = torch.arange(S, device=x.device)[:, None] - (K - 1) + torch.arange(K, device=x.device)
        inside = (taps >= starts[:, None]).to(weight.dtype)                               # [S, K]
        out = (windows * (weight[None] * inside[:, None, :])).sum(-1)
        if bias is not None:
            out = out + bias
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"ulysses_kernels.hf: convolution activation {activation!r} is not supported")
    return out.to(x.dtype)


def conv_history(previous: Optional[torch.Tensor], x: torch.Tensor, kernel: int) -> torch.Tensor:
    """The last `kernel - 1` inputs `[B, K - 1, C]` of the convolution after `x` `[B, S, C]`
    (zeros before the first token): what the next chunk's convolution reads first."""
    B, _, C = x.shape
    if previous is None:
        previous = x.new_zeros(B, kernel - 1, C)
    return torch.cat([previous.to(x.dtype), x], dim=1)[:, -(kernel - 1):].detach().clone()


def chunk_head_parallel(fn: Callable, tensors: Dict[str, torch.Tensor], cache) -> torch.Tensor:
    """The head-parallel call of a token mixer inside a generation forward (hf/inference/cache.py's
    chunks): a sharded chunk (the prefill: sequence shards of the chunk) goes through
    `ulysses_head_parallel` with the chunk's lengths; a replicated chunk (decode: every rank
    holds the same tokens) takes this rank's heads of each tensor, runs `fn` on them and
    all-gathers the output heads, so every rank continues with the same hidden state."""
    group, world, rank = cache.ulysses
    if cache.chunk_lens is not None:
        return ulysses_head_parallel(fn, tensors, group, seq_lens=cache.chunk_lens)
    length = next(iter(tensors.values())).shape[1]
    heads = LocalHeads(rank, world, (length,), {name: place_heads(t.shape[2], world) for name, t in tensors.items()})
    local = {name: t[:, :, heads.heads(name).start:heads.heads(name).stop] for name, t in tensors.items()}
    return torch.cat(all_gather_tensor(fn(local, heads).contiguous(), group), dim=2)


def over_documents(fn: Callable, tensors: List[torch.Tensor], cu_seqlens) -> torch.Tensor:
    """`fn(*tensors)` on each document of a packed row (B == 1, dim 1 the sequence), the
    outputs concatenated along the sequence; on the whole row without documents."""
    bounds = document_bounds(cu_seqlens, tensors[0].shape[1])
    if bounds is None:
        return fn(*tensors)
    parts = [fn(*(t[:, start:stop] for t in tensors)) for start, stop in zip(bounds[:-1], bounds[1:]) if stop > start]
    return torch.cat(parts, dim=1)


# ---------------------------------------- users' declarations (by_heads/declared.py, halo/declared.py)

@dataclass
class _DeclaredForward:
    """A declared layer's sequence forward in progress."""
    module: nn.Module
    call: Any             # family.MixerCall
    method: str           # the name of the method its declaration names
    calls: int = 0        # of that method so far
    inside: int = 0       # > 0 while that method runs


_DECLARED_FORWARDS = contextvars.ContextVar("ulysses_declared_forwards", default=())
# every adapted class (adapters.adapted_class adds it): its own adapter answers for what is inside it
ADAPTED_CLASSES = weakref.WeakSet()


def _watched(module: nn.Module) -> List[tuple]:
    """(name, submodule, what) of `module`'s torch modules that mix tokens along the sequence
    (`torch_sequence_mixer`), but those inside another adapted module."""
    found = []

    def walk(parent, prefix):
        for name, child in parent.named_children():
            if type(child) in ADAPTED_CLASSES:
                continue
            what = torch_sequence_mixer(child)
            if what:
                found.append((prefix + name, child, what))
            walk(child, prefix + name + ".")
    walk(module, "")
    return found


# a declared method that keeps to its declaration gives the probe's answers up to rounding; one
# that does not is off by order one
_PROBE_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}


def probe_tolerance(dtype) -> float:
    return _PROBE_TOLERANCE.get(dtype, 2e-2)   # bfloat16, float16


def probe_key(module: nn.Module, shapes: tuple, arguments: dict) -> tuple:
    """What a probe's verdict on `module`'s declared method holds for: the call's shapes (but the
    sequence's), its other arguments (`arguments_key`) and the module's parameters' values
    (`parameters_fingerprint`: a method that ignores `heads` gives the right output while
    per-head parameters are equal, and the wrong one once any update makes them differ)."""
    return shapes, arguments_key(arguments), parameters_fingerprint(module)


def parameters_fingerprint(module: nn.Module) -> tuple:
    """The values of `module`'s parameters, summed with weights by position (one host read):
    any update (an optimizer's, FSDP's, through `.data`) changes it, a permutation too."""
    sums = [(p.detach().double().flatten() * torch.linspace(1, 2, p.numel(), device=p.device,
                                                             dtype=torch.float64)).sum()
            for p in module.parameters() if p.numel()]
    return tuple(torch.stack(sums).tolist()) if sums else ()


def arguments_key(values: dict) -> tuple:
    """What of a call's other arguments a probe's verdict holds for: tensors by shape and dtype,
    plain values by value, anything else by type (never a repr that reads a device or an address)."""
    def key(value):
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), value.dtype)
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, (tuple, list)):
            return tuple(key(v) for v in value)
        return type(value).__name__
    return tuple(sorted((name, key(value)) for name, value in values.items()))


def _kept(tensor):
    return tensor


@contextlib.contextmanager
def probing(module: nn.Module):
    """How a declared method runs on its probe, the same on every rank: in eval mode (no dropout)
    and from a fixed random state (the caller's restored after); what its gradients save kept
    as it is, outside an activation checkpoint's count (which a recomputed forward, probed no
    more, must match)."""
    modes = [(m, m.training) for m in module.modules()]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), torch.autograd.graph.saved_tensors_hooks(_kept, _kept):
        torch.manual_seed(0)
        module.train(False)
        try:
            yield
        finally:
            for m, training in modes:
                m.training = training


def declared_forward(method: str) -> Callable:
    """The sequence forward of a layer of a users' declaration naming `method`: the layer's own
    forward, during which `method` runs sequence-parallel (`declared_method`). Refused, the same
    on every rank (whose layers run the same code): a forward that never called `method`, and
    a convolution, token shift or recurrent module of the layer run outside `method` (both
    would mix tokens on this rank's slice only; a functional call, `F.conv1d` or `cumsum`, is
    not seen: docs/hf_custom.md)."""
    def forward(module, call, hidden_states, /, **others):
        running = _DeclaredForward(module, call, method)
        token = _DECLARED_FORWARDS.set(_DECLARED_FORWARDS.get() + (running,))
        hooks = [sub.register_forward_pre_hook(_mixing_outside(running, name, what))
                 for name, sub, what in _watched(module)]
        try:
            out = original_forward(module)(hidden_states, **others)
        finally:
            for hook in hooks:
                hook.remove()
            _DECLARED_FORWARDS.reset(token)
        if running.calls == 0:
            raise refusal(None, f"{type(module).__name__}'s forward did not call {method}, the method its "
                                "declaration names, so it mixed its tokens another way, on this rank's slice only",
                          "Declare the method the layer's forward calls to mix tokens.")
        return out
    return forward


def _mixing_outside(running: _DeclaredForward, name: str, what: str) -> Callable:
    def hook(sub, args):
        if running.inside == 0:
            raise refusal(None, f"{type(running.module).__name__}.{name} is {what}, run outside {running.method} "
                                "(the method the declaration names): it would mix this rank's slice only",
                          "Mix tokens inside the declared method only.")
    return hook


@contextlib.contextmanager
def declared_method(module: nn.Module):
    """The MixerCall (counted) while `module`'s declared method runs inside its layer's
    sequence forward; None on one device (no context, or one rank), where the method runs as
    written. Called outside the layer's forward on several ranks (the method checkpointed by
    itself, so recomputed in the backward; a call from another module): refused, the same on
    every rank, since it would mix this rank's slice only."""
    running = next((r for r in reversed(_DECLARED_FORWARDS.get()) if r.module is module), None)
    if running is None:
        context = context_of(module)
        if context is not None and context.sp_size > 1:
            raise refusal(None, f"a declared method of {type(module).__name__} was called outside the layer's "
                                "forward (checkpointed by itself and recomputed in the backward, or called by "
                                "another module): it would mix this rank's slice only",
                          "Call it from the layer's forward; checkpoint the whole layer or decoder layer.")
        yield None
        return
    running.calls += 1
    running.inside += 1
    try:
        yield running.call
    finally:
        running.inside -= 1


def refuse_declared_generation(module, hidden_states, cache, **_):
    """Generation of a layer of a users' declaration: refused on every rank (make_cache
    refuses first; this is the layer that got a decoding cache anyway)."""
    raise refusal(None, f"{type(module).__name__} is a layer of a users' declaration: a declaration says how the "
                        "layer mixes a whole sequence, not what it keeps between decoding steps",
                  "Generate on one device, or with the package's own families.")
