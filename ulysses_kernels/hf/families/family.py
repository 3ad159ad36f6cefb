"""A token-mixer family as one declaration, and the one protocol its adapters run
(docs/hf_hybrids.md, "Hybrid models").

The declaration: the transformers classes a family adapts, the sequence-parallel forward
each gets, by which mechanism, where its heads can be placed, whether it runs on a ring,
the cache its model insists on and what a new decoding cache needs from it. Every family
module ends with one `FAMILY`; adapters.py derives the registry (`ADAPTERS`, the guard's
kinds, the caches) from them, so no fact about a family is written twice or hung on a
function as an attribute.

The protocol: every adapter gets, as its class's forward, `protocol_forward`, which in
this order:

1. runs transformers' own forward, and nothing else, for a layer its adapter leaves as written
   (`runs_as_written`: a sparse model's dense layer, which calls the attention function, the
   package's, which counts the call);
2. for a sparse attention (`SPARSE_ATTENTION`), whose cache is an attention's, refuses on
   every rank, whatever the size and before anything is counted, attention dropout in
   training and any cache but the decoding cache (`mixers.sparse_attention_cache`); for any
   adapter, likewise first, what it declares in `refuse_first` (Inkling's and Qwen4-Exp's
   convolutions: a padding mask; Inkling's attentions: that, then attention dropout in training);
3. inside `generate` / `prefill` (the package's head-sharded `DecodingCache`, or the
   `LayerSlot` of it a model hands each layer): counts the call, refuses a head placement
   the cache's Ulysses size does not allow, and runs the adapter's `generation(module,
   hidden_states, cache (the slot as given), **the layer's other arguments)`; with
   `decoding_from_context`, the context's decoding cache (`inference_cache`), whatever the
   layer is given, its own cache argument (its model's states) staying among the others;
4. otherwise takes the call's lengths and documents from the context, counting it
   (`context.token_mixer_call`: the guard's call check; a sparse attention's from the position
   ids its forward names too, as the attention function reads the ones it is given);
5. given any other cache (transformers makes one unless `use_cache=False`): lets
   transformers' own forward fill it where nothing is sharded (one rank, one document per
   row; the cache under the name that forward takes), else refuses on every rank
   (`mixers.check_cache_outside_generation`, with the adapter's `cache_kept`); refuses it
   whatever the size where the adapter declares `cache_refused`; where it declares
   `cache_rule`, applies that instead (with or without a cache), then goes on;
6. refuses a head placement the Ulysses size does not allow (`problem`, advising the
   adapter's `placement_advice`);
7. applies the padding mask the way the layer's modeling module does (`pads`);
8. under a ring, cuts this rank's portion (`mixer_ring.ring_portion`) for a mixer by heads;
9. runs the adapter's `forward(module, call, hidden_states, **the layer's other arguments)`
   with the `MixerCall`.

A mixer over depth (`DEPTH`: each token's own states across the layers, no other token's)
takes none of these steps, which are a sequence's: it runs `generation(module, *the layer's
arguments)` inside `generate` / `prefill` (the context's decoding cache set), else
`forward(module, *the layer's arguments)`, uncounted (it is no call of the attention).

A family writes only what is its own: the sequence forward and the generation forward.

A users' declaration (`adapters.declare_family`; by_heads/declared.py, halo/declared.py) is
an `Adapter` too: its forward is the layer's own (`mixers.declared_forward`), during which
the method it names runs by heads or with the halo, and its generation a refusal."""

import inspect
import sys
from dataclasses import dataclass
from typing import Any, Callable, List, NamedTuple, Optional, Tuple, Union

from ..context import DecodingCache, context_of, require_default_context, token_mixer_call
from ..model import refusal
from .mixer_ring import ring_portion
from .mixers import check_cache_outside_generation, original_forward, sparse_attention_cache

# How a layer that is not attention is made exact under sequence parallelism
BY_HEADS = "by heads"                  # an exchange to the head layout, the whole sequence per head
HALO = "halo"                          # each rank reads the last tokens of the rank before it
STATE_PASSING = "halo + state passing"  # the halo, then a recurrent state passed along the ranks
SPARSE_ATTENTION = "sparse attention"  # a key selection computed over the whole sequence
DEPTH = "over depth"                   # mixes a token's own states across layers: per token, as it is
MECHANISMS = (BY_HEADS, HALO, STATE_PASSING, SPARSE_ATTENTION, DEPTH)


@dataclass(frozen=True)
class Adapter:
    """The sequence-parallel forward of some transformers classes (by name).

    kind: the layer kind the guard lets through; forward(module, ...): replaces the class's
    forward; problem(module, world): why its heads have no placement over `world` Ulysses
    ranks (None: they have; no function: any world); runs_on_a_ring: its forward takes a
    ring's chunks (mixer_ring.py / halo.py); own_cache: the cache class its model's forward
    insists on (a class name in the model's module, or a class of the package's whose fields
    it reads), which the decoding cache derives from; prepare_cache(module, cache): what a new
    decoding cache needs before the layer first runs.

    Every layer follows the one protocol (the module doc): `forward(module, call,
    hidden_states, **its other arguments)` is only the layer's own sequence forward (`call`:
    MixerCall), `generation(module, hidden_states, cache, **its other arguments)` (required)
    its forward inside `generate` / `prefill`, `cache_kept` says where its states live
    instead of a cache given outside generation, and `pads` applies the padding mask as the
    layer's modeling module does. cache_refused: (why, what to do)
    where a cache outside generation is refused on any number of ranks instead (its model's
    own use of it cannot run: xLSTM's chunked inference); placement_advice: what a refusal by
    `problem` in a forward advises (empty: the package's default advice).

    Where the layer's model keeps the layer's states itself (on the module, in a list of its
    own: RecurrentGemma, RWKV): `decoding_from_context` takes the decoding cache from the
    context (`inference_cache`, as the attention function does), not from the layer's
    arguments, and leaves its cache argument (its model's states) among the arguments its
    `generation` gets; `cache_rule(module, context, cache, **its other arguments)` is its own
    rule outside generation instead of step 5's: it raises where refused, else the package's
    forward runs (transformers' own would keep the states per rank).

    A sparse attention (mechanism SPARSE_ATTENTION) is an attention layer, and its cache an
    attention's: the decoding cache inside `generate` / `prefill`, none outside (transformers'
    KV cache refused whatever the size, as is attention dropout in training, before anything is
    counted: `mixers.sparse_attention_cache`); its lengths read the position ids its forward
    names. runs_as_written(module): True where the layer runs transformers' own forward,
    untouched (MiniMax-M3's dense layers, dots3's sliding-window ones: they call the attention
    function, the package's, which counts them).

    refuse_first(module, **the layer's arguments but its hidden states): refusals before
    anything else (step 2), in generation or not, whatever the cache: it raises where refused
    (a padding mask given to a convolution, attention dropout). A mixer over depth (mechanism
    DEPTH) takes none of the steps: its `generation` and `forward` both take the layer's own
    arguments, `(module, *args, **kwargs)`, the former inside `generate` / `prefill`.

    members(base): more members of the adapted class (a users' declaration wraps the method
    it names: by_heads/declared.py, halo/declared.py); generates: False where `make_cache`
    must refuse (a users' declaration says nothing of the layer's decoding state)."""
    classes: Tuple[str, ...]
    kind: str
    forward: Callable
    mechanism: str
    problem: Optional[Callable] = None
    runs_on_a_ring: bool = False
    own_cache: Union[str, type, None] = None
    prepare_cache: Optional[Callable] = None
    generation: Optional[Callable] = None
    cache_kept: str = ""
    pads: bool = False
    cache_refused: Tuple[str, ...] = ()
    placement_advice: str = ""
    decoding_from_context: bool = False
    cache_rule: Optional[Callable] = None
    runs_as_written: Optional[Callable] = None
    refuse_first: Optional[Callable] = None
    members: Optional[Callable] = None
    generates: bool = True

    def __post_init__(self):
        if self.mechanism not in MECHANISMS:
            raise ValueError(f"Adapter {self.classes}: mechanism {self.mechanism!r} is none of {MECHANISMS}")
        if self.generation is None:   # the protocol dispatches to it (a refusal is a generation forward too)
            raise ValueError(f"Adapter {self.classes}: no generation forward declared")


@dataclass(frozen=True)
class Family:
    """One family module's adapters, under the family's name, and the model types it serves."""
    name: str
    adapters: Tuple[Adapter, ...]
    attention: Tuple[str, ...] = ()   # a users' declaration: its attention classes (InterfaceAttention)
    # the transformers model types whose decoder layers hold its classes (the tests' tiny models
    # are keyed by them; the planner's MIXER_MODEL_TYPES is held to them)
    model_types: Tuple[str, ...] = ()
    # its layers' shape in the planner's memory model (planner.MIXER_SHAPES, keyed by it; None:
    # planned as the attention it is, a sparse attention, or not planned, said at its declaration)
    planner_shape: Optional[str] = None

    @property
    def classes(self) -> Tuple[str, ...]:
        return tuple(name for adapter in self.adapters for name in adapter.classes)


# where transformers' layers take their cache (5.25: `cache`; 5.24: `cache_params`; MiniMax: `past_key_values`;
# xLSTM and RWKV: `state`, their model's recurrent states)
CACHE_NAMES = ("cache", "cache_params", "past_key_values", "state")


class LayerSlot:
    """Layer `layer`'s entry of the decoding cache `cache`, for a model that hands each layer
    its own entry of its cache rather than the cache (xLSTM's `rnn_state[layer]`:
    by_heads/xlstm.py): the protocol dispatches it as the decoding cache."""

    def __init__(self, cache: DecodingCache, layer: int):
        self.cache, self.layer = cache, layer


class MixerCall(NamedTuple):
    """One forward of an adapted token mixer over the sequence (not in generation)."""
    context: Any              # the model's SequenceParallelContext
    lens: List[int]           # every SP rank's length (ring rank major)
    cu_seqlens: Any           # the global document boundaries (None: one document per row)
    group: Any                # the Ulysses group
    world: int                # its size
    portion: Optional[Any]    # this rank's RingPortion under a ring (a mixer by heads; else None)
    ulysses_lens: List[int]   # a mixer by heads: its Ulysses group's lengths (`lens` without a ring; others: `lens`)


def protocol_forward(adapter: Adapter, base: type):
    """The forward of `base`'s adapted class (adapters.adapted_class): the module doc's
    protocol around `adapter.forward` and `adapter.generation`, bound by `base.forward`'s
    own signature (so positional and keyword calls, and either cache name, reach it)."""
    if adapter.mechanism == DEPTH:   # each token's own states: none of a sequence's steps
        return _over_depth(adapter)
    signature = inspect.signature(base.forward)
    params = signature.parameters
    hidden_name = list(params)[1]
    own_cache_name = next((name for name in CACHE_NAMES if name in params), None)
    var_keyword = next((name for name, p in params.items() if p.kind is p.VAR_KEYWORD), None)
    attention = adapter.mechanism == SPARSE_ATTENTION   # an attention's cache and lengths (steps 2 and 4)

    def forward(self, *args, **kwargs):
        if adapter.runs_as_written is not None and adapter.runs_as_written(self):
            return original_forward(self)(*args, **kwargs)
        arguments = dict(signature.bind(self, *args, **kwargs).arguments)
        extra = dict(arguments.pop(var_keyword, None) or {}) if var_keyword else {}
        arguments.pop("self")
        hidden_states = arguments.pop(hidden_name)
        if adapter.refuse_first is not None:   # step 2: before the cache or the context decides anything
            adapter.refuse_first(self, **arguments, **extra)
        if adapter.decoding_from_context:   # before the cache is taken out: it holds the model's states
            decoding = (context_of(self) or require_default_context()).inference_cache
            if decoding is not None:
                return _generation(self, adapter, hidden_states, decoding, decoding, arguments, extra)
        caches = [value for name in CACHE_NAMES for value in (arguments.pop(name, None), extra.pop(name, None))
                  if value is not None]
        cache = caches[0] if caches else None
        if attention:
            sparse_attention_cache(self, cache)
        decoding = cache.cache if isinstance(cache, LayerSlot) else cache
        if isinstance(decoding, DecodingCache) and not adapter.decoding_from_context:
            return _generation(self, adapter, hidden_states, cache, decoding, arguments, extra)
        lengths_from = dict(arguments, **extra) if attention else extra
        context, lens, cu_seqlens = token_mixer_call(self, hidden_states.shape[1], lengths_from)
        group, world, _ = context.ulysses()
        if adapter.cache_rule is not None:   # its model keeps the layer's states itself: its own rule
            adapter.cache_rule(self, context, cache, **arguments, **extra)
        elif cache is not None:
            _refuse_cache_outside_generation(self, adapter, context, cu_seqlens, sum(lens))
            return original_forward(self)(*args, **_cache_under_its_name(kwargs, own_cache_name))
        _refuse_placement(self, adapter, world)
        if adapter.pads:
            hidden_states = sys.modules[base.__module__].apply_mask_to_padding_states(
                hidden_states, arguments.get("attention_mask"))
        portion, ulysses_lens = (ring_portion(context, lens) if adapter.mechanism == BY_HEADS and adapter.runs_on_a_ring
                                 else (None, lens))
        call = MixerCall(context, lens, cu_seqlens, group, world, portion, ulysses_lens)
        return adapter.forward(self, call, hidden_states, **arguments, **extra)

    return forward


def _over_depth(adapter: Adapter):
    """The forward of a mixer over depth (the module doc, after the steps): nothing counted, no
    lengths, no cache; `generation` inside `generate` / `prefill` (the context's decoding
    cache), else `forward`, on the layer's own arguments."""
    def forward(self, *args, **kwargs):
        decoding = (context_of(self) or require_default_context()).inference_cache
        run = adapter.forward if decoding is None else adapter.generation
        return run(self, *args, **kwargs)
    return forward


def _generation(module, adapter: Adapter, hidden_states, cache, decoding: DecodingCache, arguments: dict,
                extra: dict):
    """Step 3 (`generate` / `prefill`): counted, its placement checked against the cache's
    Ulysses size, then the adapter's generation forward (`cache` as the layer got it)."""
    decoding.context.attention_calls += 1
    _refuse_placement(module, adapter, decoding.ulysses[1])
    return adapter.generation(module, hidden_states, cache, **arguments, **extra)


def _refuse_cache_outside_generation(module, adapter: Adapter, context, cu_seqlens, length: int) -> None:
    """Step 5's refusals: the adapter's `cache_refused` whatever the size, else the rule of
    `mixers.check_cache_outside_generation` (the same on every rank either way)."""
    if adapter.cache_refused:
        why, what_to_do = adapter.cache_refused
        raise refusal(None, f"{type(module).__name__} got {why}", what_to_do)
    check_cache_outside_generation(module, context, cu_seqlens, length, adapter.cache_kept)


def _cache_under_its_name(kwargs: dict, own_name: Optional[str]) -> dict:
    """The call's keyword arguments for transformers' own forward, a cache given under another
    of CACHE_NAMES (5.24's `cache_params`) moved to the name that forward takes, as its
    deprecated-keyword wrapper would."""
    other = next((name for name in CACHE_NAMES if name != own_name and kwargs.get(name) is not None), None)
    if own_name is None or other is None or kwargs.get(own_name) is not None:
        return kwargs
    renamed = {name: value for name, value in kwargs.items() if name != other}
    renamed[own_name] = kwargs[other]
    return renamed


def _refuse_placement(module, adapter: Adapter, world: int) -> None:
    problem = adapter.problem(module, world) if adapter.problem is not None else None
    if problem:
        advice = (adapter.placement_advice,) if adapter.placement_advice else ()
        raise refusal(None, f"{type(module).__name__}: {problem}", *advice)


# ------------------------------------ users' declarations (by_heads/declared.py, halo/declared.py)

def class_names(classes) -> Tuple[str, ...]:
    """Class names from a class, a name or a sequence of them (the registry is keyed by name)."""
    items = (classes,) if isinstance(classes, (str, type)) else tuple(classes)
    return tuple(c if isinstance(c, str) else c.__name__ for c in items)


@dataclass(frozen=True)
class InterfaceAttention:
    """A users' declaration of attention layers (`classes`, by name) that call transformers'
    attention interface: the guard lets their names through (the call check still confirms,
    at the model's first forward, that every such decoder layer calls the attention)."""
    classes: Tuple[str, ...]


def interface_attention(classes) -> InterfaceAttention:
    """The declaration of attention layers of a users' model (`classes`, types or names) that
    look their attention up in transformers' `ALL_ATTENTION_FUNCTIONS`, for `declare_family`."""
    return InterfaceAttention(class_names(classes))
