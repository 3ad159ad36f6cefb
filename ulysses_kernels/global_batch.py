"""Balanced global batches (docs/global_batch.md): where each document of a global batch
goes across the DP x SP world, and with which SP size, so that every rank's cost is about
the same.

A step is a sequence of micro-batches; in each, every rank of the world works with one SP
size `s` (the world splits into `world / s` SP groups of consecutive ranks), and each group
packs a few whole documents along its sequence (at most `s * token_budget` tokens:
`token_budget` per rank) or has none. A document longer than one rank's budget needs an SP
size of at least `ceil(length / token_budget)`; short documents need none, and pay an
exchange only if put in a larger group. The cost of a group is its ranks' cost: the
documents' attention (the causal square) and linear work divided by `s`, plus the exchange
when `s > 1` (`CostModel`). The ranks run the micro-batches in order, skipping those where
their group has nothing; the ranks of a group start it together, and groups never wait for
each other (only the gradients' reduction after the step joins every rank), so the step
lasts until its last rank is done (`GlobalBatchPlan.makespan`).

`plan_global_batch` gives each document the smallest SP size that fits it and keeps its cost
on one rank within a share of the step's ideal (`balanced_sp`), then places the documents
costliest first, each on the group of its size whose busiest rank is least busy (list
scheduling over the ranks' costs so far). Each group's documents are packed into rows (first
fit, longest first), and the micro-batches run the largest SP size first: with SP sizes that
divide one another, the ranks of a group then have done the same work before it, so no rank
waits and the step lasts as long as its busiest rank's cost. `naive_plan` is what a fixed
layout does: one SP size that fits the longest document, the documents dealt to the DP
groups in order and packed there. Both are rules on lengths alone: no torch, no process
group.
"""

import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class CostModel:
    """The cost of a document of `length` tokens on one rank of an SP group of `sp` ranks,
    in FLOP-equivalents: attention `attention_per_pair` per causal (query, key) pair,
    linear `linear_per_token` per token, both divided over the group; the exchange
    `exchange_per_token` per token a rank sends to the others (`length / sp * (sp - 1) / sp`),
    none at `sp = 1`. A group larger than a `node`: with `kv_per_token` (the keys and values
    a rank passes on a ring per token of its shard, forward and backward), Ulysses inside
    each node and a ring across the nodes (`init_sequence_parallel(ring_size="auto")` with
    the node's ranks), whose transfers cost `across_nodes` times more a byte and hide behind
    the block attention (only what exceeds it counts); without it, Ulysses across the nodes,
    its whole exchange at `across_nodes` times the cost. Replace it with any callable
    `(length, sp) -> cost`."""

    attention_per_pair: float
    linear_per_token: float
    exchange_per_token: float
    node: int = 8                  # ranks that share a node's all-to-all bandwidth
    across_nodes: float = 8.0      # an exchange across nodes costs this much more a byte (NVLink / network)
    kv_per_token: Optional[float] = None

    @classmethod
    def for_model(cls, *, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                  flops_per_byte: float = 2500.0, dtype_bytes: int = 2, node: int = 8) -> "CostModel":
        """Forward + backward of a dense decoder: attention 3.5x its forward's 4 * heads *
        head_dim FLOPs per pair, linear 6 FLOPs per parameter per token (q, k, v, o and a
        gated MLP), the exchange of q, k, v and the output forward and their gradients
        backward, the ring's keys and values forward and keys, values and their gradients
        backward, each byte weighted by `flops_per_byte` (an H100's dense bf16 FLOP/s over
        its NVLink all-to-all bytes/s, about 2500)."""
        attention = 3.5 * 4 * heads * head_dim * layers
        params = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * intermediate
        linear = 6 * params * layers
        exchanged = 2 * (heads + 2 * kv_heads + heads) * head_dim * dtype_bytes * layers   # fwd + bwd
        ring = 3 * 2 * kv_heads * head_dim * dtype_bytes * layers                          # K, V; then K, V, dK, dV
        return cls(attention_per_pair=attention, linear_per_token=linear, exchange_per_token=exchanged * flops_per_byte,
                   node=node, kv_per_token=ring * flops_per_byte)

    def __call__(self, length: int, sp: int) -> float:
        pairs = length * (length + 1) / 2
        attention = self.attention_per_pair * pairs / sp
        work = attention + self.linear_per_token * length / sp
        if sp <= self.node:
            return work + self.exchange_per_token * length / sp * (sp - 1) / sp
        if self.kv_per_token is None:
            return work + self.exchange_per_token * length / sp * (sp - 1) / sp * self.across_nodes
        ulysses = math.gcd(sp, self.node)
        ring = sp // ulysses
        inside = self.exchange_per_token * length / sp * (ulysses - 1) / ulysses
        passed = self.kv_per_token * self.across_nodes * (ring - 1) * length / sp
        return work + inside + max(0.0, passed - attention)


# Llama-3-8B (hidden 4096, 32 layers, 32 / 8 heads of 128, MLP 14336): the default costs.
LLAMA3_8B = CostModel.for_model(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336)

Cost = Callable[[int, int], float]


@dataclass
class MicroBatch:
    """One micro-batch: every rank at SP size `sp`; `groups[g]` the documents (indices into
    the global batch) SP group `g` packs, `tokens[g]` and `costs[g]` their totals."""

    sp: int
    groups: List[List[int]]
    tokens: List[int]
    costs: List[float]

    @property
    def makespan(self) -> float:
        return max(self.costs)


@dataclass
class GlobalBatchPlan:
    world: int
    token_budget: int
    micro_batches: List[MicroBatch] = field(default_factory=list)
    ideal: float = 0.0   # every document's rank-work at its smallest SP size, over the ranks

    @property
    def makespan(self) -> float:
        """When the step's last rank finishes: the ranks run the micro-batches in order,
        skipping those where their group has no document, and the ranks of a group start it
        together (their exchange), when the last of them is ready; groups never wait for
        each other (only the gradients' reduction after the step joins them)."""
        ready = [0.0] * self.world
        for mb in self.micro_batches:
            for g, (docs, cost) in enumerate(zip(mb.groups, mb.costs)):
                if docs:
                    ranks = range(g * mb.sp, (g + 1) * mb.sp)
                    end = max(ready[r] for r in ranks) + cost
                    for r in ranks:
                        ready[r] = end
        return max(ready, default=0.0)

    def rank_costs(self) -> List[float]:
        """Each rank's cost over the step (its groups' documents), in rank order."""
        costs = [0.0] * self.world
        for mb in self.micro_batches:
            for g, cost in enumerate(mb.costs):
                for r in range(g * mb.sp, (g + 1) * mb.sp):
                    costs[r] += cost
        return costs

    @property
    def imbalance(self) -> float:
        """The makespan over the ideal (1.0: every rank busy for the whole step)."""
        return self.makespan / self.ideal if self.ideal else 1.0

    def sp_sizes(self) -> List[int]:
        """The SP sizes its micro-batches use."""
        return sorted({mb.sp for mb in self.micro_batches})

    def documents(self) -> List[int]:
        return sorted(d for mb in self.micro_batches for g in mb.groups for d in g)


def sp_sizes_for(world: int) -> Tuple[int, ...]:
    """The SP sizes a world of `world` ranks can switch between: its divisors."""
    return tuple(s for s in range(1, world + 1) if world % s == 0)


def smallest_sp(length: int, token_budget: int, sizes: Sequence[int]) -> int:
    """The smallest SP size whose ranks each hold at most `token_budget` of the document."""
    for s in sorted(sizes):
        if math.ceil(length / s) <= token_budget:
            return s
    raise ValueError(f"a document of {length} tokens does not fit: {max(sizes)} ranks of {token_budget} tokens "
                     f"hold {max(sizes) * token_budget}")


def balanced_sp(length: int, token_budget: int, sizes: Sequence[int], cost: Cost, ideal: float) -> int:
    """The SP size a document gets: the smallest that fits it (`smallest_sp`) and keeps its
    cost on one rank within the step's ideal (a document that alone costs a rank more than
    every rank's share of the step makes that rank the slowest, whatever else is placed);
    the largest size when none does."""
    fits = [s for s in sorted(sizes) if s >= smallest_sp(length, token_budget, sizes)]
    return next((s for s in fits if cost(length, s) <= ideal), fits[-1])


def _ideal(lengths, token_budget, sizes, cost, world) -> float:
    work = 0.0
    for length in lengths:
        s = smallest_sp(length, token_budget, sizes)
        work += cost(length, s) * s
    return work / world


# How much of the step's ideal one document may cost a rank before it gets a larger SP size
# (`balanced_sp`): the planner tries each and keeps the plan with the smallest makespan.
SHARES = (0.125, 0.25, 0.5, 1.0)


def plan_global_batch(lengths: Sequence[int], *, world: int, token_budget: int,
                      sp_sizes: Optional[Sequence[int]] = None, cost: Cost = LLAMA3_8B) -> GlobalBatchPlan:
    """The balanced placement of the documents of `lengths` (module doc). `sp_sizes`: the SP
    sizes allowed (default: every divisor of `world`); one size means a fixed SP layout,
    balanced."""
    sizes = tuple(sorted(sp_sizes or sp_sizes_for(world)))
    if any(world % s for s in sizes):
        raise ValueError(f"every SP size must divide the world of {world}, got {sizes}")
    ideal = _ideal(lengths, token_budget, sizes, cost, world)
    plans = [_placed(lengths, world, token_budget, sizes, cost, ideal, share) for share in SHARES]
    return min(plans, key=lambda p: (p.makespan, len(p.micro_batches)))


def _placed(lengths, world, token_budget, sizes, cost, ideal, share) -> GlobalBatchPlan:
    """The greedy placement (module doc) with SP sizes from `balanced_sp` at `share` of the ideal."""
    need = [balanced_sp(n, token_budget, sizes, cost, share * ideal) for n in lengths]
    order = sorted(range(len(lengths)), key=lambda d: (-cost(lengths[d], need[d]) * need[d], d))
    busy = [0.0] * world                       # each rank's cost so far
    blocks: dict = {}                          # (sp, group) -> its documents
    for d in order:
        s, c = need[d], cost(lengths[d], need[d])
        g = min(range(world // s), key=lambda g: (max(busy[g * s:(g + 1) * s]), g))
        for r in range(g * s, (g + 1) * s):
            busy[r] += c
        blocks.setdefault((s, g), []).append(d)
    plan = GlobalBatchPlan(world, token_budget, ideal=ideal)
    for s in sorted({s for s, _ in blocks}, reverse=True):   # the largest SP size first (module doc)
        rows = {g: _rows(docs, lengths, s * token_budget) for (size, g), docs in blocks.items() if size == s}
        for k in range(max(len(r) for r in rows.values())):
            groups = [rows[g][k] if g in rows and k < len(rows[g]) else [] for g in range(world // s)]
            plan.micro_batches.append(MicroBatch(s, groups, [sum(lengths[d] for d in g) for g in groups],
                                                 [sum(cost(lengths[d], s) for d in g) for g in groups]))
    return plan


def _rows(docs, lengths, capacity) -> List[List[int]]:
    """The documents of one SP group packed into rows of at most `capacity` tokens: first
    fit, longest first."""
    rows: List[List[int]] = []
    room: List[int] = []
    for d in sorted(docs, key=lambda d: (-lengths[d], d)):
        i = next((i for i, left in enumerate(room) if left >= lengths[d]), None)
        if i is None:
            rows.append([])
            room.append(capacity)
            i = len(rows) - 1
        rows[i].append(d)
        room[i] -= lengths[d]
    return rows


def naive_plan(lengths: Sequence[int], *, world: int, token_budget: int, cost: Cost = LLAMA3_8B,
               sp: Optional[int] = None) -> GlobalBatchPlan:
    """A fixed layout: SP size `sp` (default: the size the longest document needs), the
    documents dealt to the DP groups in order (a distributed sampler), each group packing them
    into micro-batches as they come; micro-batch k of the step is every group's k-th (a group
    without one waits). Its ideal is the planner's (every divisor of the world allowed)."""
    sizes = sp_sizes_for(world)
    needed = max(smallest_sp(n, token_budget, sizes) for n in lengths)
    sp = needed if sp is None else int(sp)
    if world % sp or sp < needed:
        raise ValueError(f"naive_plan: SP size {sp} must divide the world of {world} and hold the longest "
                         f"document (at least {needed})")
    groups = world // sp
    packed: List[List[List[int]]] = [[] for _ in range(groups)]
    for i, d in enumerate(range(len(lengths))):
        mine = packed[i % groups]
        if not mine or sum(lengths[x] for x in mine[-1]) + lengths[d] > sp * token_budget:
            mine.append([])
        mine[-1].append(d)
    plan = GlobalBatchPlan(world, token_budget, ideal=_ideal(lengths, token_budget, sizes, cost, world))
    for k in range(max(len(p) for p in packed)):
        docs = [p[k] if k < len(p) else [] for p in packed]
        plan.micro_batches.append(MicroBatch(sp, docs, [sum(lengths[d] for d in g) for g in docs],
                                             [sum(cost(lengths[d], sp) for d in g) for g in docs]))
    return plan
