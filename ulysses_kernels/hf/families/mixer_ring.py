"""The adapted token mixers under Ulysses x Ring (docs/hf_hybrids.md, "Hybrid models"): the
recurrence and the convolution passed from chunk to chunk of the ring's zigzag layout.

Under a ring, the Ulysses exchange gives each rank its heads over its ring rank's
*portion*: chunk i and chunk 2R-1-i of the 2R chunks of the global sequence
(ring/layout.py). A recurrence needs every earlier chunk, so:

* **Convolution.** Each chunk needs the `kernel - 1` inputs before it. Every ring rank
  shares the last `kernel - 1` inputs of its two chunks (one all-gather over the ring);
  a chunk reads those of the chunks before it (`ring_conv`), several of them when the
  chunks are shorter than the window.
* **Recurrence.** Every token mixer adapted here is linear in its state: over one chunk,
  the state leaving it is `M S + F` (S the state entering, F the state leaving from zero,
  M the chunk's transition: a `[Dk, Dk]` matrix per head for the gated delta rule, a
  decay per head for Mamba2). Each rank computes M and F of its two chunks, one
  all-gather over the ring shares them, every rank composes the states entering all 2R
  chunks in order (the LASP-2 scheme), and each chunk runs again from its entering state
  (`ring_recurrence`). The all-gathers are differentiable (their backward sums each
  chunk's gradient over the ring), so gradients reach every chunk that fed a state.
* **Documents.** A chunk holding a document start passes no state through it (M = 0);
  its first segment starts from the entering state unless a document starts with the
  chunk; the rest start from zero.

The per-model parts (run a segment from a state, a chunk's transition, the identity and
the zero state) come with an object of the `ChunkRecurrence` shape from each adapter.
"""

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ...exchange.sequence import GatherSequence
from ...layout import split_lengths
from ...ring.layout import lengths_error as zigzag_lengths_error
from ...ring.layout import zigzag_segments
from .mixers import causal_conv1d, conv_history, document_bounds, document_starts


class RingPortion:
    """This rank's two chunks of the zigzag layout over `world` ring ranks, and the
    differentiable all-gather over the ring that puts every rank's pair in chunk order."""

    def __init__(self, group, world: int, rank: int, total: int):
        self.group, self.world, self.rank, self.total = group, world, rank, total
        self.segments = zigzag_segments(total, world, rank)    # ((global start, length), ...)
        self.chunks = (rank, 2 * world - 1 - rank)
        self.chunk_lengths = split_lengths(total, 2 * world)   # every chunk's, in global order

    def split(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """`[B, portion, ...]` -> this rank's two chunks."""
        return torch.split(x, [n for _, n in self.segments], dim=1)

    def gather(self, pair: Sequence[torch.Tensor], anchor: torch.Tensor) -> List[torch.Tensor]:
        """Every ring rank's two tensors (same shapes everywhere) in global chunk order.

        The backward of the all-gather is a collective too, so every rank must run it: a
        pair that needs no gradient on this rank (zero transitions of chunks that hold a
        document start, the states of empty chunks) is tied to `anchor` (this rank's
        inputs, adding zero), or this rank would skip the collective its peers wait in.
        The output side likewise: see `tie_to`."""
        stacked = torch.stack(list(pair))
        if torch.is_grad_enabled() and anchor.requires_grad and not stacked.requires_grad:
            stacked = stacked + (0 * anchor).sum()
        every = GatherSequence.apply(self.group, self.world, self.rank, 0, [2] * self.world, stacked)
        order = []
        for chunk in range(2 * self.world):
            holder = min(chunk, 2 * self.world - 1 - chunk)
            order.append(every[2 * holder + (0 if chunk == holder else 1)])
        return order


def tie_to(out: torch.Tensor, gathered: Sequence[torch.Tensor]) -> torch.Tensor:
    """`out` plus zero times the gathered values: every rank's output then depends on every
    all-gather, so every rank runs its backward collective, also a rank that reads none
    of the gathered values (one whose chunks both start a document, or are empty)."""
    return out + sum((0 * g).sum() for g in gathered)   # zero first: a sum of large states could overflow


def ring_portion(context, lens: Sequence[int]):
    """(the RingPortion of this rank, its Ulysses group's lengths) under a ring; (None,
    `lens`) without one. `lens`: every SP rank's length, ring rank major."""
    ring_group, ring_world, ring_rank = context.ring()
    if ring_world == 1:
        return None, lens
    ulysses = context.ulysses()[1]
    err = zigzag_lengths_error(lens, ulysses) if len(lens) == ring_world * ulysses else \
        f"{len(lens)} lengths for {ring_world} ring x {ulysses} Ulysses ranks (every SP rank's, in the zigzag layout)"
    if err:   # the lengths are every rank's (shard_batch's, or gathered): the same error everywhere
        raise ValueError(f"ulysses_kernels.hf: a token mixer on a ring got the sequence lengths {list(lens)}: {err}")
    mine = list(lens[ring_rank * ulysses:(ring_rank + 1) * ulysses])
    return RingPortion(ring_group, ring_world, ring_rank, sum(lens)), mine


def _starts_at(bounds, positions: torch.Tensor) -> torch.Tensor:
    """The global start of the document each global position is in (positions < 0: 0)."""
    edges = torch.tensor(bounds, device=positions.device)
    return edges[torch.searchsorted(edges, positions.clamp(min=0), right=True) - 1]


def _front(x: torch.Tensor, width: int) -> torch.Tensor:
    """The last `width` positions of `x` `[B, n, C]`, zero-padded in front."""
    tail = x[:, max(0, x.shape[1] - width):]
    return F.pad(tail, (0, 0, width - tail.shape[1], 0))


def ring_conv(x: torch.Tensor, weight: torch.Tensor, bias, activation, portion: RingPortion,
              cu_seqlens) -> torch.Tensor:
    """The depthwise causal convolution (mixers.causal_conv1d) of a portion `[B, P, C]`, each
    chunk after the inputs of the chunks before it, zero history before each document."""
    K = weight.shape[-1]
    chunks = portion.split(x)
    tails = portion.gather([_front(c, K - 1) for c in chunks], anchor=x)
    # a chunk shorter than the window: only its last min(n, K - 1) entries are inputs
    real = [tail[:, K - 1 - min(n, K - 1):] for tail, n in zip(tails, portion.chunk_lengths)]
    bounds = document_bounds(cu_seqlens, portion.total)
    out = []
    for chunk, index, (start, n) in zip(chunks, portion.chunks, portion.segments):
        history = _front(torch.cat(real[:index], dim=1), K - 1) if index else torch.zeros_like(tails[0])
        extended = torch.cat([history, chunk], dim=1)
        starts = None
        if bounds is not None:
            positions = torch.arange(start - (K - 1), start + n, device=x.device)
            starts = _starts_at(bounds, positions) - (start - (K - 1))
        out.append(causal_conv1d(extended, weight, bias, starts, activation)[:, K - 1:])
    return tie_to(torch.cat(out, dim=1), tails)


def mixer_conv(mixed: torch.Tensor, weight: torch.Tensor, bias, activation, *, cu_seqlens,
               state: Optional[dict] = None, portion: Optional[RingPortion] = None) -> torch.Tensor:
    """The depthwise causal convolution of an adapted mixer's local channels `[B, S, C]` in
    each of its settings: generation (after the conv history in `state`, which is then
    replaced), a ring `portion` (`ring_conv`), or the whole sequence with documents."""
    if state is not None:
        history = state.get("conv")
        state["conv"] = conv_history(history, mixed, weight.shape[-1])
        return causal_conv1d(mixed, weight, bias, None, activation, history=history)
    if portion is not None:
        return ring_conv(mixed, weight, bias, activation, portion, cu_seqlens)
    return causal_conv1d(mixed, weight, bias, document_starts(cu_seqlens, mixed.shape[1], mixed.device), activation)


def _segment_edges(bounds, start: int, n: int) -> Tuple[List[int], bool]:
    """(local edges [0, ..., n] of the documents inside a chunk at global `start`, whether a
    document starts with the chunk)."""
    if bounds is None:
        return [0, n], start == 0
    inside = sorted({b - start for b in bounds if start < b < start + n})
    return [0] + inside + [n], start == 0 or start in bounds


def ring_recurrence(ops, pieces: Sequence[Sequence[torch.Tensor]], portion, cu_seqlens, *,
                    initial: Optional[torch.Tensor] = None, with_final: bool = False):
    """The recurrence over the whole sequence (the module doc): `pieces` holds, for each of
    this rank's chunks (`portion.segments`: a ring's two, or the ranges of the sequence
    layout, state_passing.py), the tensors `ops.run` takes (`[B, n, ...]`); returns the
    outputs of the portion `[B, P, ...]`. `initial`: the state entering the sequence
    (generation's, one document; None: zero); `with_final`: also the state leaving it, the
    same on every rank."""
    bounds = document_bounds(cu_seqlens, portion.total)
    finals, transitions, plans = [], [], []
    if initial is not None and bounds is not None:
        raise ValueError("ulysses_kernels.hf: a recurrence continuing from a state runs one document")
    for inputs, (start, n) in zip(pieces, portion.segments):
        edges, fresh = _segment_edges(bounds, start, n)
        fresh = fresh and initial is None   # continuing from `initial`: position 0 starts no document
        plans.append((edges, fresh))
        if n == 0:   # an empty chunk passes the state through
            finals.append(ops.zero_state(inputs))
            transitions.append(ops.identity(inputs))
            continue
        last = [t[:, edges[-2]:edges[-1]] for t in inputs]
        finals.append(ops.run(last, None)[1])
        carries = len(edges) == 2 and not fresh
        transitions.append(ops.transition(inputs) if carries else _no_carry(ops, inputs))
    anchor = pieces[0][0]
    every_final, every_transition = portion.gather(finals, anchor), portion.gather(transitions, anchor)
    state = torch.zeros_like(every_final[0]) if initial is None else initial.to(every_final[0].dtype)
    entering = []
    for transition, final in zip(every_transition, every_final):
        entering.append(state)
        state = _compose(ops, transition, state, final)
    out = []
    for inputs, chunk, (edges, fresh), (_, n) in zip(pieces, portion.chunks, plans, portion.segments):
        for a, b in zip(edges[:-1], edges[1:]):
            if b > a:
                start = entering[chunk] if (a == 0 and not fresh) else None
                out.append(ops.run([t[:, a:b] for t in inputs], start)[0])
    empty = [t[:, :0] for t in pieces[0]]
    result = torch.cat(out, dim=1) if out else ops.run(empty, None)[0]
    result = tie_to(result, every_final + every_transition)
    return (result, state) if with_final else result


def _no_carry(ops, inputs) -> torch.Tensor:
    """The transition of a chunk that passes no state (a document starts in it): zero, or
    what the ops say (RWKV's log-space decays: -inf)."""
    return ops.no_carry(inputs) if hasattr(ops, "no_carry") else torch.zeros_like(ops.identity(inputs))


def _compose(ops, transition, state, final) -> torch.Tensor:
    """The state leaving a chunk: `M S + F`, or the ops' own rule for a state kept in log
    space with a running maximum (RWKV's)."""
    return ops.compose(transition, state, final) if hasattr(ops, "compose") else ops.carry(transition, state) + final


def portion_pieces(portion, tensors: Sequence[torch.Tensor]) -> List[List[torch.Tensor]]:
    """The tensors of a portion `[B, P, ...]` cut into this rank's chunks."""
    split = [portion.split(t) for t in tensors]
    return [[s[i] for s in split] for i in range(len(portion.segments))]
