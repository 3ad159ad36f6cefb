"""THE layout rules shared by every execution path: how a sequence is cut over P ranks,
and where each head goes in the sequence -> heads all-to-all (docs/architecture.md,
"Layout rules").

Everything here is pure arithmetic. The reference exchange, the Triton path, the fused
path (which hands the numbers to the CUDA pack/unpack kernels as arguments), the fused
layer's weight orders, the validation, the CLI and the benchmarks all ask this module;
none of them decides a placement on its own.

Head placement of one tensor with H heads over P ranks (`place_heads`):
- split (`H % P == 0`): rank j receives the `H / P` heads `[j * H/P, (j+1) * H/P)`;
- replicated (`P % H == 0`, fewer heads than ranks, GQA/MQA key/value heads): rank j
  receives head `j // (P / H)`, so each head goes to the `P / H` consecutive ranks whose
  query heads use it; their gradients are summed on the way back.
Both are one formula: rank j's l-th local head is source head `(j // replicas) * local + l`
with `local` heads per rank and `replicas` ranks per head.

`choose_ring_size` is the head rule of the Ulysses x Ring hybrid: the smallest ring that
leaves a Ulysses degree these head counts fit and, given the GPUs of a node, whose Ulysses
groups stay inside a node (its sequence layout is ring/layout.py).
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple


def split_lengths(total: int, parts: int) -> List[int]:
    """Lengths of `torch.tensor_split(x, parts)` along a dim of size `total`.

    The first `total % parts` chunks are one longer than the rest.
    """
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@dataclass(frozen=True)
class HeadPlacement:
    """Where the heads of one tensor go over `world` ranks (see the module doc)."""

    heads: int
    world: int
    local: int      # heads each rank receives
    replicas: int   # ranks that receive each head (1: split)

    @property
    def split(self) -> bool:
        return self.replicas == 1

    def source_head(self, rank: int, local_index: int = 0) -> int:
        """The head of the full tensor that `rank` holds at local index `local_index`."""
        return (rank // self.replicas) * self.local + local_index

    def sent_heads(self, offset: int, count: int) -> List[int]:
        """The distinct source heads that local heads `[offset, offset + count)` of every
        rank cover, in rank order (what a projection must compute for that slice)."""
        heads: List[int] = []
        for rank in range(0, self.world, self.replicas):
            heads += [self.source_head(rank, offset + i) for i in range(count)]
        return heads


def place_heads(heads: int, world: int) -> HeadPlacement:
    """The placement of `heads` heads over `world` ranks; ValueError if there is none."""
    if heads <= 0 or world <= 0:
        raise ValueError(f"cannot place {heads} heads over {world} ranks")
    if heads % world == 0:
        return HeadPlacement(heads, world, heads // world, 1)
    if world % heads == 0:
        return HeadPlacement(heads, world, 1, world // heads)
    raise ValueError(f"{heads} heads can be neither split over nor replicated to {world} ranks "
                     f"(need heads % P == 0 or P % heads == 0)")


@dataclass(frozen=True)
class LocalHeads:
    """What one rank holds inside a head-parallel call (`ulysses_head_parallel`): the whole
    sequence (every rank's length in `seq_lens`) of some heads of each named tensor, by the
    placement rule above (split, or replicated when a tensor has fewer heads than ranks)."""

    rank: int
    world: int
    seq_lens: Tuple[int, ...]
    placements: Dict[str, HeadPlacement]

    def heads(self, name: str) -> range:
        """The global heads of tensor `name` this rank holds, in local order."""
        placement = self.placements[name]
        start = placement.source_head(self.rank)
        return range(start, start + placement.local)

    def output_heads(self, total: int) -> range:
        """The global heads of an output with `total` heads this rank computes: outputs are
        split (`total % world == 0`), rank r holding `[r * total/P, (r+1) * total/P)`."""
        err = split_heads_error(total, self.world)
        if err:
            raise ValueError(f"ulysses_head_parallel: output {err}")
        local = total // self.world
        return range(self.rank * local, (self.rank + 1) * local)


def split_heads_error(heads: int, world: int) -> Optional[str]:
    """Why `heads` heads of one tensor cannot be split evenly over `world` ranks (None: they
    can); the exchange of a single tensor (`seq_to_heads`) splits, it never replicates."""
    if heads % world != 0:
        return f"heads ({heads}) must be divisible by the sequence-parallel size ({world})"
    return None


def head_plan_error(world: int, num_q_heads: int, num_kv_heads: int) -> Optional[str]:
    """Why q/k/v with these head counts cannot be exchanged over `world` ranks (None: they can)."""
    if num_q_heads % num_kv_heads != 0:
        return (f"query heads ({num_q_heads}) must be a multiple of key/value heads "
                f"({num_kv_heads}) for grouped-query attention")
    if num_q_heads % world != 0:
        return (f"query heads ({num_q_heads}) must be divisible by the sequence-parallel "
                f"size ({world})")
    if num_kv_heads % world != 0 and world % num_kv_heads != 0:
        return (f"key/value heads ({num_kv_heads}) must either be divisible by the "
                f"sequence-parallel size ({world}) or divide it (GQA replication)")
    return None


@dataclass(frozen=True)
class HeadPlan:
    """The placement of q and k/v heads for one attention call over `world` ranks.

    Query heads are always split; KV heads are split when `Hkv % P == 0`, else replicated
    (`P % Hkv == 0`). Rank r's query heads `[r * Hq/P, (r+1) * Hq/P)` then read KV heads
    that rank r holds: `q_head // (Hq/Hkv)` of the full tensor.
    """

    world: int
    num_q_heads: int
    num_kv_heads: int

    def __post_init__(self):
        err = head_plan_error(self.world, self.num_q_heads, self.num_kv_heads)
        if err:
            raise ValueError(err)

    @property
    def q(self) -> HeadPlacement:
        return place_heads(self.num_q_heads, self.world)

    @property
    def kv(self) -> HeadPlacement:
        return place_heads(self.num_kv_heads, self.world)

    @property
    def kv_split(self) -> bool:
        return self.kv.split

    @property
    def local_q_heads(self) -> int:
        return self.q.local

    @property
    def local_kv_heads(self) -> int:
        return self.kv.local

    @property
    def kv_replicas(self) -> int:
        """How many ranks receive each KV head (1 when KV heads are split)."""
        return self.kv.replicas

    @property
    def channels(self) -> int:
        """Heads one rank receives for q, k and v together: `Hl_q + 2 * Hl_kv`."""
        return self.local_q_heads + 2 * self.local_kv_heads

    def q_head_start(self, rank: int) -> int:
        return self.q.source_head(rank)

    def kv_head_start(self, rank: int) -> int:
        return self.kv.source_head(rank)

    def placements(self) -> Tuple[HeadPlacement, HeadPlacement, HeadPlacement]:
        """(q, k, v) placements, in the order the exchanges pack them."""
        return self.q, self.kv, self.kv


def choose_ring_size(sp_size: int, num_heads: int, num_kv_heads: Optional[int] = None, *,
                     gpus_per_node: Optional[int] = None) -> int:
    """The smallest ring size that makes the Ulysses degree `sp_size / ring` valid for
    these head counts (query heads split, KV heads split or replicated) and, given
    `gpus_per_node`, keeps each Ulysses group inside a node: the degree divides the GPUs of
    a node, so the all-to-all stays on the node's links and only the ring's point-to-point
    steps cross nodes (docs/ring.md, "Which layout", models the two against each other). Ranks
    are numbered node by node, an SP group's Ulysses groups are runs of
    consecutive ranks. A ring of `sp_size` (Ulysses degree 1) always works, so every SP
    size fits every model."""
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if sp_size < 1 or num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"choose_ring_size: need sp_size >= 1 and query heads ({num_heads}) a multiple of "
                         f"key/value heads ({num_kv_heads})")
    if gpus_per_node is not None and gpus_per_node < 1:
        raise ValueError(f"choose_ring_size: gpus_per_node must be >= 1, got {gpus_per_node}")
    for ring in range(1, sp_size + 1):
        if sp_size % ring or head_plan_error(sp_size // ring, num_heads, num_kv_heads) is not None:
            continue
        if gpus_per_node is None or gpus_per_node % (sp_size // ring) == 0:
            return ring
    return sp_size  # unreachable: ring == sp_size gives Ulysses degree 1
