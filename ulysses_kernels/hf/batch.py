"""Sharding a full batch along the sequence for one rank of the SP group: labels shifted
before sharding, packed documents turned into global `cu_seqlens` once."""

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from ..distributed.groups import ParallelGroups, resolve_group
from ..ring.layout import local_ranges, sp_lengths

IGNORE_INDEX = -100


def split_groups(group, ring_group=None):
    """(Ulysses group, ring group) from a process group (+ ring group), or from the
    `ParallelGroups` of `init_sequence_parallel` (its Ulysses and ring groups)."""
    if isinstance(group, ParallelGroups):
        if ring_group is not None:
            raise ValueError("pass either init_sequence_parallel's groups or a ring_group, not both")
        return group.ulysses_group, group.ring_group
    return group, ring_group


def sp_group_of(group):
    """The whole SP group (for the loss and gradient sums) from a group or `ParallelGroups`."""
    return group.sp_group if isinstance(group, ParallelGroups) else group


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """Global document boundaries (int32 `cu_seqlens`) from global position ids.

    A document starts wherever `p[t] != p[t-1] + 1` (transformers' own rule). Returns None
    when every row is one contiguous run (no packing). Packed rows need batch size 1.
    """
    pos = position_ids
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    if pos.dim() != 2:
        raise ValueError(f"position_ids must be [batch, seq], got {tuple(position_ids.shape)}")
    S = pos.shape[1]
    if S <= 1:
        return None
    starts = (pos[:, 1:] - pos[:, :-1]) != 1
    if not bool(starts.any()):
        return None
    if pos.shape[0] != 1:
        if bool((pos == pos[:1]).all()):
            pos, starts = pos[:1], starts[:1]
        else:
            raise ValueError("ulysses attention: packed documents (position_ids restarting) need batch size 1; "
                             f"got position_ids of shape {tuple(position_ids.shape)}. Concatenate the batch "
                             "into one row instead.")
    idx = torch.nonzero(starts[0]).flatten() + 1
    bounds = torch.cat([idx.new_zeros(1), idx, idx.new_full((1,), S)])
    return bounds.to(dtype=torch.int32, device=position_ids.device)


@dataclass
class SequenceParallelBatch:
    """This rank's slice of a batch (see `shard_batch`).

    input_ids / position_ids / labels: `[B, S_local]` shards; labels are already shifted
    (labels[t] is the target of token t). cu_seqlens: global int32 document boundaries or
    None. seq_lens: every rank's local length.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: Optional[torch.Tensor]
    seq_lens: List[int]   # every SP rank's local length (ring rank major with a ring)
    rank: int             # this rank's SP rank (ring rank * Ulysses degree + Ulysses rank)
    world: int            # SP size (Ulysses degree x ring degree)

    def model_inputs(self) -> Dict[str, object]:
        """Keyword arguments for `model(**batch.model_inputs())` (no labels: see shard_batch)."""
        return dict(input_ids=self.input_ids, position_ids=self.position_ids, use_cache=False,
                    ulysses_cu_seqlens=self.cu_seqlens, ulysses_seq_lens=list(self.seq_lens))

    @property
    def num_valid_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


def shard_batch(input_ids: torch.Tensor, group=None, *, ring_group=None,
                position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                ignore_index: int = IGNORE_INDEX, labels_shifted: bool = False,
                mask_document_ends: bool = False) -> SequenceParallelBatch:
    """Shard a full batch `[B, S]` along the sequence for this rank of the SP group.

    Every rank of the group passes the same full batch. Labels (default: `input_ids`) are
    shifted *before* sharding: ``labels[t] = labels_in[t + 1]`` and the last is
    `ignore_index`, so the target of the last token of each shard (the first token of the
    next shard) is kept. Then call the model with ``labels=None``
    (``model(**batch.model_inputs())``) and compute the loss with `sequence_parallel_loss`
    or `causal_lm_loss`: HF's own loss shifts the labels again *locally*, which would
    drop one target at every shard boundary and misalign the rest, and averages over the
    local tokens only instead of the global count.

    position_ids: global positions (default `arange(S)` per row); restarting positions mark
    packed documents (B must then be 1), turned once into global `cu_seqlens` here.
    `mask_document_ends=True` sets the target of each document's last token to
    `ignore_index` (so no token learns to predict the next document). `labels_shifted=True`
    takes labels as already aligned (labels[t] = target of token t). An `attention_mask`
    may be passed only if it is all ones (padding is not supported; pack instead).
    S need not be divisible by the group size (shards follow `torch.tensor_split`).

    Ulysses x Ring: pass `init_sequence_parallel`'s groups as `group` (or the Ulysses
    group and `ring_group`): the shards then follow the zigzag layout of
    `ulysses_kernels.shard_sequence(..., ring_group=...)`.
    """
    group, ring_group = split_groups(group, ring_group)
    group, world, rank = resolve_group(group)
    ring_group, ring_world, ring_rank = resolve_group(ring_group) if ring_group is not None else (None, 1, 0)
    if input_ids.dim() != 2:
        raise ValueError(f"shard_batch: input_ids must be [batch, seq], got {tuple(input_ids.shape)}")
    B, S = input_ids.shape
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("shard_batch: padding (attention_mask with zeros) is not supported with sequence "
                         "parallelism; pack documents and mark them with position_ids instead")
    if position_ids is None:
        position_ids = torch.arange(S, device=input_ids.device).unsqueeze(0).expand(B, S)
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    if position_ids.shape[-1] != S:
        raise ValueError(f"shard_batch: position_ids {tuple(position_ids.shape)} do not match input_ids {(B, S)}")
    position_ids = position_ids.expand(B, S)
    cu_seqlens = cu_seqlens_from_position_ids(position_ids)
    labels = input_ids if labels is None else labels
    if labels.shape != (B, S):
        raise ValueError(f"shard_batch: labels {tuple(labels.shape)} do not match input_ids {(B, S)}")
    if labels_shifted:
        shifted = labels.clone()
    else:
        shifted = torch.full_like(labels, ignore_index)
        shifted[:, :-1] = labels[:, 1:]
    if mask_document_ends and cu_seqlens is not None:
        ends = cu_seqlens[1:].long() - 1
        ends = ends[ends >= 0]
        shifted[:, ends] = ignore_index
    lens = sp_lengths(S, ring_world, world)
    ranges = local_ranges(S, ring_world, world, ring_rank, rank)

    def cut(t):
        return torch.cat([t[:, start:start + n] for start, n in ranges], dim=1) if ranges else t[:, :0].clone()

    return SequenceParallelBatch(input_ids=cut(input_ids), position_ids=cut(position_ids),
                                 labels=cut(shifted), cu_seqlens=cu_seqlens, seq_lens=lens,
                                 rank=ring_rank * world + rank, world=world * ring_world)
