"""A token-mixer family as one declaration (docs/hf_hybrids.md, "Hybrid models"): the
transformers classes it adapts, the sequence-parallel forward each gets, by which mechanism,
where its heads can be placed, whether it runs on a ring, the cache its model insists on
and what a new decoding cache needs from it. Every family module ends with one `FAMILY`;
adapters.py derives the registry (`ADAPTERS`, the guard's kinds, the caches) from them, so
no fact about a family is written twice or hung on a function as an attribute."""

from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

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
    decoding cache needs before the layer first runs."""
    classes: Tuple[str, ...]
    kind: str
    forward: Callable
    mechanism: str
    problem: Optional[Callable] = None
    runs_on_a_ring: bool = False
    own_cache: Union[str, type, None] = None
    prepare_cache: Optional[Callable] = None

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
