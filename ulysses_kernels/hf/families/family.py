"""A token-mixer family as one declaration, and the one protocol its adapters run
(docs/hf_hybrids.md, "Hybrid models").

The declaration: the transformers classes a family adapts, the sequence-parallel forward
each gets, by which mechanism, where its heads can be placed, whether it runs on a ring,
the cache its model insists on and what a new decoding cache needs from it. Every family
module ends with one `FAMILY`; adapters.py derives the registry (`ADAPTERS`, the guard's
kinds, the caches) from them, so no fact about a family is written twice or hung on a
function as an attribute.

The protocol: an adapter that declares its `generation` forward gets, as its class's
forward, `protocol_forward`, which in this order:

1. inside `generate` / `prefill` (the package's head-sharded `DecodingCache`): counts the
   call, refuses a head placement the cache's Ulysses size does not allow, and runs the
   adapter's `generation(module, hidden_states, cache, **the layer's other arguments)`;
2. otherwise takes the call's lengths and documents from the context, counting it
   (`context.token_mixer_call`: the guard's call check);
3. given any other cache (transformers makes one unless `use_cache=False`): lets
   transformers' own forward fill it where nothing is sharded (one rank, one document per
   row), else refuses on every rank (`mixers.check_cache_outside_generation`, with the
   adapter's `cache_kept`);
4. refuses a head placement the Ulysses size does not allow (`problem`);
5. applies the padding mask the way the layer's modeling module does (`pads`);
6. under a ring, cuts this rank's portion (`mixer_ring.ring_portion`) for a mixer by heads;
7. runs the adapter's `forward(module, call, hidden_states, **the layer's other arguments)`
   with the `MixerCall`.

A family writes only what is its own: the sequence forward and the generation forward."""

import inspect
import sys
from dataclasses import dataclass
from typing import Any, Callable, List, NamedTuple, Optional, Tuple, Union

from ..context import DecodingCache, token_mixer_call
from ..model import refusal
from .mixer_ring import ring_portion
from .mixers import check_cache_outside_generation, original_forward

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

    With `generation(module, hidden_states, cache, **its other arguments)` declared, the layer follows the one
    protocol (below): `forward(module, call, hidden_states, **its other arguments)` is
    then only the layer's own sequence forward (`call`: MixerCall), `cache_kept` says
    where its states live instead of a cache given outside generation, and `pads` applies
    the padding mask as the layer's modeling module does. Without it, `forward` is the whole
    forward (the adapters not moved onto the protocol yet)."""
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

    def __post_init__(self):
        if self.mechanism not in MECHANISMS:
            raise ValueError(f"Adapter {self.classes}: mechanism {self.mechanism!r} is none of {MECHANISMS}")


@dataclass(frozen=True)
class Family:
    """One family module's adapters, under the family's name."""
    name: str
    adapters: Tuple[Adapter, ...]

    @property
    def classes(self) -> Tuple[str, ...]:
        return tuple(name for adapter in self.adapters for name in adapter.classes)


# where transformers' layers take their cache (5.25: `cache`; 5.24: `cache_params`; MiniMax: `past_key_values`)
CACHE_NAMES = ("cache", "cache_params", "past_key_values")


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
    signature = inspect.signature(base.forward)
    params = signature.parameters
    hidden_name = list(params)[1]
    var_keyword = next((name for name, p in params.items() if p.kind is p.VAR_KEYWORD), None)

    def forward(self, *args, **kwargs):
        arguments = dict(signature.bind(self, *args, **kwargs).arguments)
        extra = dict(arguments.pop(var_keyword, None) or {}) if var_keyword else {}
        arguments.pop("self")
        hidden_states = arguments.pop(hidden_name)
        caches = [value for name in CACHE_NAMES for value in (arguments.pop(name, None), extra.pop(name, None))
                  if value is not None]
        cache = caches[0] if caches else None
        if isinstance(cache, DecodingCache):   # ulysses_kernels.hf.generate / prefill: the head-sharded cache
            cache.context.attention_calls += 1
            _refuse_placement(self, adapter, cache.ulysses[1])
            return adapter.generation(self, hidden_states, cache, **arguments, **extra)
        context, lens, cu_seqlens = token_mixer_call(self, hidden_states.shape[1], extra)
        group, world, _ = context.ulysses()
        if cache is not None:
            check_cache_outside_generation(self, context, cu_seqlens, sum(lens), adapter.cache_kept)
            return original_forward(self)(*args, **kwargs)
        _refuse_placement(self, adapter, world)
        if adapter.pads:
            hidden_states = sys.modules[base.__module__].apply_mask_to_padding_states(
                hidden_states, arguments.get("attention_mask"))
        portion, ulysses_lens = (ring_portion(context, lens) if adapter.mechanism == BY_HEADS and adapter.runs_on_a_ring
                                 else (None, lens))
        call = MixerCall(context, lens, cu_seqlens, group, world, portion, ulysses_lens)
        return adapter.forward(self, call, hidden_states, **arguments, **extra)

    return forward


def _refuse_placement(module, adapter: Adapter, world: int) -> None:
    problem = adapter.problem(module, world) if adapter.problem is not None else None
    if problem:
        raise refusal(None, f"{type(module).__name__}: {problem}")
