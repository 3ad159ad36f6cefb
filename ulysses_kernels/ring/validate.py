"""The checked metadata exchange of the Ulysses x Ring hybrid: the same errors on every
rank of the whole SP grid, no hang (docs/architecture.md, "Ulysses x Ring").

Two small all-gathers. First each Ulysses group runs the usual exchange (distributed/validate.py)
without raising. Then each ring group all-gathers one descriptor per ring rank: the
inputs with the sequence length replaced by the ring rank's portion, the Ulysses degree
and rank, and whether the first step failed. A ring group holds one rank of every
Ulysses group, so after the second step every rank knows every problem and all of them
raise, or none. The portions must be the zigzag layout (`layout.py`) of their sum, the
global length, which `cu_seqlens` must end at.
"""

from typing import List, Sequence

import torch.distributed as dist

from ..distributed.collectives import first_message, gather_ints
from ..distributed.validate import (
    DESCRIPTOR_LEN,
    ERROR_FIELD,
    SEQ_FIELD,
    build_descriptor,
    check_table,
    error_row,
    gather_and_check,
    shape_error,
    with_sequence_length,
)
from ..layout import head_plan_error
from .layout import lengths_error as zigzag_lengths_error
from .layout import portion_lengths, sp_lengths


def _portions_error(portions: List[int]) -> str:
    expected = portion_lengths(sum(portions), len(portions))
    if list(portions) != expected:
        return (f"ring ranks hold {list(portions)} tokens but the Ulysses x Ring (zigzag) layout of the global "
                f"length {sum(portions)} over {len(portions)} ring ranks is {expected} (shard with "
                "ulysses_kernels.shard_sequence(..., ring_group=...))")
    return None


def exchange_and_check_ring(kind: str, group, ring_group, names: Sequence[str], tensors: Sequence, *,
                            local_errors: Sequence[str] = (), **options) -> List[int]:
    """Validate a hybrid call on every rank; return every SP rank's local length (ring
    rank major). `group` is this rank's Ulysses group (a process group, size 1 allowed)."""
    ulysses, ulysses_rank = dist.get_world_size(group), dist.get_rank(group)
    lens, err = gather_and_check(kind, group, names, tensors, local_errors=local_errors, documents=False, **options)
    ring = dist.get_world_size(ring_group)
    try:
        row = with_sequence_length(build_descriptor(kind, tensors, local_error=err is not None, **options),
                                   sum(lens))
    except Exception:  # noqa: BLE001
        row = error_row(kind, len(tensors))
        err = err or "could not describe the inputs"
    table = gather_ints(row + [ulysses, ulysses_rank], ring_group)
    if any(r[ERROR_FIELD] for r in table):
        first, message = first_message(err, ring_group)
        raise ValueError(f"{kind}: in the Ulysses group of ring rank {first}: {message}")
    grid = {(r[DESCRIPTOR_LEN], r[DESCRIPTOR_LEN + 1]) for r in table}
    if len(grid) > 1:
        raise ValueError(f"{kind}: the ring group is not orthogonal to the Ulysses groups (the members of a "
                         "ring group must share their Ulysses degree and Ulysses rank); use the groups of "
                         "ulysses_kernels.init_sequence_parallel(sp_size, ring_size=...)")
    err = check_table(kind, [r[:DESCRIPTOR_LEN] for r in table], names, head_world=ulysses,
                      lengths_check=_portions_error)
    if err:
        raise ValueError(f"{kind}: {err}")
    return sp_lengths(sum(r[SEQ_FIELD] for r in table), ring, ulysses)


def trusted_ring_lengths(seq_lens, ulysses: int, ring: int, sp_rank: int, q, k, v) -> List[int]:
    """The hybrid's fast path: `seq_lens` are every SP rank's local lengths (ring rank
    major); only the checks that need no peer run."""
    lens = [int(n) for n in seq_lens]
    err = None
    if len(lens) != ulysses * ring:
        err = (f"with a ring group, seq_lens must hold every SP rank's length ({ring} ring x {ulysses} "
               f"Ulysses = {ulysses * ring} entries), got {len(lens)}")
    else:
        err = shape_error(q, k, v)
        if not err and not (q.shape[1] == k.shape[1] == lens[sp_rank]):
            err = (f"seq_lens[{sp_rank}] = {lens[sp_rank]} but this rank's q/k local lengths are "
                   f"{q.shape[1]}/{k.shape[1]}")
        err = err or zigzag_lengths_error(lens, ulysses) or head_plan_error(ulysses, q.shape[2], k.shape[2])
    if err:
        raise ValueError(f"ulysses_attention: {err}")
    return lens
