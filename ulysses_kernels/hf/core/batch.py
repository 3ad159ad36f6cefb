"""Sharding a full batch along the sequence for one rank of the SP group: labels shifted
before sharding, packed documents turned into global `cu_seqlens` once, padded rows
unpadded into one packed row (and per-token values put back into the padded layout)."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from ...api import gather_sequence
from ...distributed.groups import resolve_group
from ...ring.layout import local_ranges, sp_lengths
from ...ring.shard import cut_ranges
from ..context import cu_seqlens_from_position_ids
from ..families.attention.gemma3 import image_blocks
from ..families.vision.vision_shard import SHARD_KEY, TokenShard, check_vision_mode, has_images, vision_inputs
from ..groups import sp_group_of, split_groups

IGNORE_INDEX = -100


# ------------------------------------------------------------------ padded batches

@dataclass(frozen=True)
class PaddingInfo:
    """Where the tokens of a padded batch went when `shard_batch` unpadded it.

    The packed row holds the valid tokens (attention_mask 1) of row 0, then those of row
    1, and so on: packed token i is column ``indices[i] % S`` of row ``indices[i] // S`` of
    the `[B, S]` batch. shape: (B, S); row_lengths: every row's valid tokens (0 for a row
    that is all padding).
    """

    shape: Tuple[int, int]
    indices: torch.Tensor        # [T] int64, increasing: flat positions row * S + column
    row_lengths: Tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        """T, the length of the packed row."""
        return int(self.indices.numel())

    def valid_mask(self) -> torch.Tensor:
        """The `[B, S]` boolean mask of the valid tokens."""
        B, S = self.shape
        flat = torch.zeros(B * S, dtype=torch.bool, device=self.indices.device)
        return flat.index_fill_(0, self.indices, True).view(B, S)

    def row_starts(self) -> List[int]:
        """Where each row that has tokens starts in the packed row."""
        starts, offset = [], 0
        for n in self.row_lengths:
            if n:
                starts.append(offset)
            offset += n
        return starts

    def pack(self, values: torch.Tensor) -> torch.Tensor:
        """Per-token values of the padded batch `[B, S, ...]` -> `[1, T, ...]`, the valid
        tokens in packed order."""
        if tuple(values.shape[:2]) != self.shape:
            raise ValueError(f"pack: values of shape {tuple(values.shape)} do not start with the padded batch's "
                             f"shape {self.shape}")
        flat = values.reshape(-1, *values.shape[2:])
        return flat.index_select(0, self.indices.to(values.device)).unsqueeze(0)


def padding_from_mask(attention_mask: Optional[torch.Tensor], shape) -> Optional[PaddingInfo]:
    """The `PaddingInfo` of a 2-D padding mask (1: a token, 0: padding), or None when there
    is nothing to unpad (no mask, or all ones). ValueError for a mask of another shape, with
    values other than 0 and 1, with padding between a row's tokens, or with no token."""
    if attention_mask is None:
        return None
    shape = tuple(shape)
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != shape:
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"shard_batch: attention_mask must be a [batch, seq] padding mask of input_ids' shape "
                         f"{shape}, got {got} (custom 4-D masks are not supported)")
    if attention_mask.dtype != torch.bool and not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        values = attention_mask.unique()[:8].tolist()
        raise ValueError(f"shard_batch: attention_mask must hold only 1 (a token) and 0 (padding), got values "
                         f"{values}")
    valid = attention_mask.bool()
    if bool(valid.all()):
        return None
    refuse_holes(valid)
    lengths = valid.sum(dim=1)
    if int(lengths.sum()) == 0:
        raise ValueError("shard_batch: every row of attention_mask is padding; the batch has no token")
    return PaddingInfo(shape=shape, indices=torch.nonzero(valid.reshape(-1)).flatten(),
                       row_lengths=tuple(int(n) for n in lengths.tolist()))


def refuse_holes(valid: torch.Tensor) -> None:
    """Each row's tokens must be one run (left and/or right padding). Padding between
    tokens is refused rather than guessed at: the pieces on either side could be one
    sequence (positions running on, or jumping the gap?) or two documents."""
    runs = valid[:, 0].long() + (valid[:, 1:] & ~valid[:, :-1]).sum(dim=1)
    bad = torch.nonzero(runs > 1).flatten()
    if bad.numel():
        row = int(bad[0])
        cols = torch.nonzero(valid[row]).flatten()
        gap = int(cols[0]) + int(torch.nonzero(~valid[row, int(cols[0]):]).flatten()[0])
        raise ValueError(f"shard_batch: attention_mask row {row} has padding between its tokens (column {gap}); "
                         "only left and/or right padding is supported. Remove the gap from the row, or put "
                         "the pieces in rows of their own (or pack them and mark documents with position_ids)")


def shift_targets(labels: torch.Tensor, *, labels_shifted: bool = False, ignore_index: int = IGNORE_INDEX,
                  valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`[B, S]` labels -> `[B, S]` targets (targets[t]: what token t must predict).

    Unshifted labels: ``targets[t] = labels[t + 1]``, the last column `ignore_index`. With
    `valid` (the padding mask as booleans), a target also needs token t and token t + 1 to
    be valid: no target at padding, nor at a row's last token, whose next column is padding
    (after unpadding it would predict the next row's first token). Pre-shifted labels
    follow the same rule: labels[t] is still the target of token t, i.e. token t + 1.
    """
    if labels_shifted:
        targets = labels.clone()
    else:
        targets = torch.full_like(labels, ignore_index)
        targets[:, :-1] = labels[:, 1:]
    if valid is not None:
        next_valid = torch.zeros_like(valid)
        next_valid[:, :-1] = valid[:, 1:]
        targets = targets.masked_fill(~(valid & next_valid), ignore_index)
    return targets


def count_targets(labels: torch.Tensor, *, attention_mask: Optional[torch.Tensor] = None,
                  labels_shifted: bool = False, ignore_index: int = IGNORE_INDEX) -> int:
    """The number of targets `shard_batch` keeps for these arguments, summed over every
    rank of the SP group: what the global mean loss divides by (count a gradient
    accumulation window's micro-batches with it)."""
    padding = padding_from_mask(attention_mask, labels.shape)
    valid = padding.valid_mask().to(labels.device) if padding is not None else None
    return int((shift_targets(labels, labels_shifted=labels_shifted, ignore_index=ignore_index, valid=valid)
                != ignore_index).sum())


def packed_cu_seqlens(positions: torch.Tensor, padding: PaddingInfo) -> Optional[torch.Tensor]:
    """Document boundaries (int32 `cu_seqlens`) of the packed row, from its positions `[T]`:
    every row starts a document whatever its positions say (rows never see each other),
    and inside a row a document starts wherever ``p[t] != p[t-1] + 1`` (rows of packed
    documents). None when the packed row is one document."""
    T = positions.numel()
    starts = torch.zeros(T, dtype=torch.bool, device=positions.device)
    starts[1:] = positions[1:] != positions[:-1] + 1
    starts[padding.row_starts()] = True
    bounds = torch.cat([torch.nonzero(starts).flatten(), torch.tensor([T], device=positions.device)])
    return None if bounds.numel() == 2 else bounds.to(torch.int32)


def repad(values: torch.Tensor, padding, *, fill=0) -> torch.Tensor:
    """Put per-token values of the whole packed row back into the padded batch's layout.

    values: `[1, T, ...]`, every packed token's value (this rank's `[1, T_local, ...]`
    gathered with `gather_sequence`, or `gather_tokens` which does both). padding: a
    `SequenceParallelBatch` or its `.padding`. Returns `[B, S, ...]` with `fill` at the
    padded positions; differentiable in `values`. A batch that was not unpadded
    (`padding` None) is already in its layout: `values` comes back as it is.
    """
    info = padding.padding if isinstance(padding, SequenceParallelBatch) else padding
    if info is None:
        return values
    T = info.num_tokens
    if values.dim() < 2 or tuple(values.shape[:2]) != (1, T):
        raise ValueError(f"repad: values must be [1, {T}, ...] (the packed row of {T} tokens), got "
                         f"{tuple(values.shape)}")
    B, S = info.shape
    flat = values[0]
    out = flat.new_full((B * S, *flat.shape[1:]), fill)
    return out.index_copy(0, info.indices.to(flat.device), flat).view(B, S, *flat.shape[1:])


def gather_tokens(values: torch.Tensor, batch: "SequenceParallelBatch", group=None, *, ring_group=None,
                  fill=0) -> torch.Tensor:
    """Every token's value of the whole batch, in the layout `shard_batch` was given
    (`[B, S, ...]`, `fill` at padding), from this rank's per-token values laid out like
    `batch.input_ids` (say log-probs computed on its shard). Every rank of the SP group
    calls it; `group` as for shard_batch (`init_sequence_parallel`'s groups with a ring).

    Its backward sums the gradients every rank sends to each shard (`gather_sequence`): for
    a loss, bring per-token inputs to the shards with `batch.shard_tokens` instead of
    computing the same loss from the gathered values on every rank.
    """
    group, ring_group = split_groups(group, ring_group)
    full = gather_sequence(values, group, dim=1, seq_lens=batch.seq_lens, ring_group=ring_group)
    return repad(full, batch, fill=fill)


# ------------------------------------------------------------------ the batch

@dataclass(frozen=True)
class BatchRows:
    """The row of the batch given to `shard_batch` that each of this rank's tokens came
    from (`rows`, int64, laid out like `input_ids`) and how many rows it had (`count`,
    padded rows included): what a head that pools per row needs (hf/core/heads.py). It reaches
    the model as `ulysses_rows=` (`SequenceParallelBatch.model_inputs`)."""

    rows: torch.Tensor
    count: int


@dataclass
class SequenceParallelBatch:
    """This rank's slice of a batch (see `shard_batch`).

    input_ids / position_ids / labels: `[B, S_local]` shards (`[1, S_local]` of the packed
    row when a padded batch was unpadded); labels are already shifted (labels[t] is the
    target of token t). cu_seqlens: global int32 document boundaries or None. seq_lens:
    every rank's local length. padding: how a padded batch was unpadded (None: its rows
    were kept). token_ranges: the global (start, length) ranges of the (packed) sequence
    this rank holds, in local order.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: Optional[torch.Tensor]
    seq_lens: List[int]   # every SP rank's local length (ring rank major with a ring)
    rank: int             # this rank's SP rank (ring rank * Ulysses degree + Ulysses rank)
    world: int            # SP size (Ulysses degree x ring degree)
    padding: Optional[PaddingInfo] = None
    token_ranges: List[Tuple[int, int]] = field(default_factory=list)
    multimodal: Optional[Dict[str, object]] = None   # a VLM batch: the whole batch's inputs (vision.py)

    def model_inputs(self) -> Dict[str, object]:
        """Keyword arguments for `model(**batch.model_inputs())` (no labels: see shard_batch;
        no attention_mask: padding is gone, documents come from cu_seqlens). A VLM batch
        hands the model the whole batch and its images, and the shard its language model
        cuts after the merge (vision.py)."""
        lengths = dict(ulysses_cu_seqlens=self.cu_seqlens, ulysses_seq_lens=list(self.seq_lens))
        if self.multimodal is not None:
            return dict(self.multimodal, use_cache=False, **lengths)
        return dict(input_ids=self.input_ids, position_ids=self.position_ids, use_cache=False,
                    ulysses_rows=self.rows(), **lengths)

    def rows(self) -> BatchRows:
        """Which row of the batch given to `shard_batch` each of this rank's tokens came from."""
        count = self.padding.shape[0] if self.padding is not None else self.input_ids.shape[0]
        width = self.padding.shape[1] if self.padding is not None else sum(self.seq_lens)
        rows = torch.arange(count, device=self.input_ids.device).unsqueeze(1).expand(count, width)
        return BatchRows(self.shard_tokens(rows), count)

    @property
    def num_valid_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def shard_tokens(self, values: torch.Tensor) -> torch.Tensor:
        """This rank's part of per-token values of the full batch (`[B, S, ...]`, the layout
        given to shard_batch: advantages, reference log-probs, loss weights), laid out like
        `input_ids` (unpadded and packed like it)."""
        if self.padding is not None:
            values = self.padding.pack(values)
        elif values.dim() < 2 or values.shape[0] != self.input_ids.shape[0] or values.shape[1] != sum(self.seq_lens):
            raise ValueError(f"shard_tokens: values of shape {tuple(values.shape)} are not per-token values of a "
                             f"batch of {self.input_ids.shape[0]} rows of {sum(self.seq_lens)} tokens")
        return cut_ranges(values, self.token_ranges)


def shard_batch(input_ids: torch.Tensor, group=None, *, ring_group=None,
                position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                ignore_index: int = IGNORE_INDEX, labels_shifted: bool = False,
                mask_document_ends: bool = False, pixel_values: Optional[torch.Tensor] = None,
                image_grid_thw: Optional[torch.Tensor] = None, pixel_values_videos: Optional[torch.Tensor] = None,
                video_grid_thw: Optional[torch.Tensor] = None, second_per_grid_ts: Optional[torch.Tensor] = None,
                mm_token_type_ids: Optional[torch.Tensor] = None, token_type_ids: Optional[torch.Tensor] = None,
                vision: str = "replicate") -> SequenceParallelBatch:
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
    packed documents (B must then be 1), turned once into global `cu_seqlens` here: from
    the host array when they are a CPU tensor (a collator's; no device read), else read once.
    `mask_document_ends=True` sets the target of each document's last token to
    `ignore_index` (so no token learns to predict the next document). `labels_shifted=True`
    takes labels as already aligned (labels[t] = target of token t).
    S need not be divisible by the group size (shards follow `torch.tensor_split`).

    Padded batches: an `attention_mask` `[B, S]` of 1 (token) and 0 (padding) with any
    zero unpads the batch into ONE packed row (batch 1): the valid tokens of row 0, then of
    row 1, ... Each row is a document of its own (`cu_seqlens`), its positions restart at
    0 at its first valid token (given `position_ids` are taken at the valid tokens instead,
    so documents packed inside a row stay documents), and a row's last valid token has no
    target (nor has padding, which is gone). Any mix of left and right padding per row and
    rows that are all padding are fine; padding *between* a row's tokens, masks of another
    shape, values other than 0/1 and a batch without any token raise `ValueError`. The
    global mean loss is then the mean over the valid targets of all rows (each row on its
    own). `batch.padding` records the layout: `repad` / `gather_tokens` put per-token
    results back to `[B, S]`, `batch.shard_tokens` brings `[B, S]` per-token inputs to
    this rank's shard. An all-ones mask changes nothing (the rows are kept).

    Ulysses x Ring: pass `init_sequence_parallel`'s groups as `group` (or the Ulysses
    group and `ring_group`): the shards then follow the zigzag layout of
    `ulysses_kernels.shard_sequence(..., ring_group=...)`.

    Vision-language models: pass the processor's multimodal outputs as they are
    (`pixel_values`, `image_grid_thw`, `mm_token_type_ids`; videos: `pixel_values_videos`,
    `video_grid_thw`, `second_per_grid_ts`; Gemma 3: `token_type_ids`). The model then gets
    the whole batch, merges the image features into it on every rank and its language model
    takes this rank's tokens (vision.py); documents are the rows. `vision="replicate"`:
    every rank encodes every image; `"split"`: each encodes a block of them and the
    features are gathered (the same result, the tower's work divided by the SP size). Text
    positions for the documents come from the rows: `position_ids` with images raise.
    """
    multimodal = vision_inputs(dict(pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                                    pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw,
                                    second_per_grid_ts=second_per_grid_ts, mm_token_type_ids=mm_token_type_ids,
                                    token_type_ids=token_type_ids))
    check_vision_mode(vision)
    batch = _shard_text(input_ids, group, ring_group=ring_group, position_ids=position_ids, labels=labels,
                        attention_mask=attention_mask, ignore_index=ignore_index, labels_shifted=labels_shifted,
                        mask_document_ends=mask_document_ends)
    if has_images(multimodal):
        if position_ids is not None:
            raise ValueError("shard_batch: position_ids with images: a vision-language model numbers its tokens "
                             "itself over each row; put one sample per row (padded rows are unpadded and packed) "
                             "and leave position_ids out")
        shard = TokenShard(shape=tuple(input_ids.shape), ranges=batch.token_ranges, positions=batch.position_ids,
                           padding=batch.padding, vision=vision, group=sp_group_of(group),
                           blocks=image_blocks(token_type_ids) if token_type_ids is not None else None)
        batch.multimodal = dict(input_ids=input_ids, attention_mask=attention_mask if batch.padding else None,
                                **multimodal, **{SHARD_KEY: shard})
    return batch


def _shard_text(input_ids, group, *, ring_group, position_ids, labels, attention_mask, ignore_index,
                labels_shifted, mask_document_ends) -> SequenceParallelBatch:
    """`shard_batch` of the tokens (see there)."""
    group, ring_group = split_groups(group, ring_group)
    group, world, rank = resolve_group(group)
    ring_group, ring_world, ring_rank = resolve_group(ring_group) if ring_group is not None else (None, 1, 0)
    if input_ids.dim() != 2:
        raise ValueError(f"shard_batch: input_ids must be [batch, seq], got {tuple(input_ids.shape)}")
    B, S = input_ids.shape
    position_ids = given_positions(position_ids, B, S)
    labels = input_ids if labels is None else labels
    if labels.shape != (B, S):
        raise ValueError(f"shard_batch: labels {tuple(labels.shape)} do not match input_ids {(B, S)}")
    mask = attention_mask.to(input_ids.device) if isinstance(attention_mask, torch.Tensor) else attention_mask
    padding = padding_from_mask(mask, (B, S))
    if padding is None:
        ids, positions, targets, cu_seqlens = kept_rows(input_ids, position_ids, labels, labels_shifted, ignore_index)
    else:
        ids, positions, targets, cu_seqlens = packed_row(input_ids, position_ids, labels, padding, labels_shifted,
                                                         ignore_index)
    positions = positions.to(ids.device)   # position ids may come on the host (cu_seqlens_from_position_ids)
    cu_seqlens = cu_seqlens.to(ids.device) if cu_seqlens is not None else None
    if mask_document_ends and cu_seqlens is not None:   # boundaries rise from 0: every end is a token
        targets[:, cu_seqlens[1:].long() - 1] = ignore_index
    total = ids.shape[1]
    ranges = local_ranges(total, ring_world, world, ring_rank, rank)
    return SequenceParallelBatch(input_ids=cut_ranges(ids, ranges), position_ids=cut_ranges(positions, ranges),
                                 labels=cut_ranges(targets, ranges), cu_seqlens=cu_seqlens,
                                 seq_lens=sp_lengths(total, ring_world, world), rank=ring_rank * world + rank,
                                 world=world * ring_world, padding=padding, token_ranges=ranges)


def given_positions(position_ids: Optional[torch.Tensor], B: int, S: int) -> Optional[torch.Tensor]:
    """The caller's position ids as `[B, S]` (a `[S]` or `[1, S]` one serves every row)."""
    if position_ids is None:
        return None
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    if position_ids.dim() != 2 or position_ids.shape[1] != S or position_ids.shape[0] not in (1, B):
        raise ValueError(f"shard_batch: position_ids {tuple(position_ids.shape)} do not match input_ids {(B, S)}")
    return position_ids.expand(B, S)


def kept_rows(input_ids, position_ids, labels, labels_shifted, ignore_index):
    """An unpadded batch: its rows as they are (ids, positions, targets, cu_seqlens). No
    position ids: one document per row, nothing to read; host ones: see cu_seqlens_from_position_ids."""
    B, S = input_ids.shape
    targets = shift_targets(labels, labels_shifted=labels_shifted, ignore_index=ignore_index)
    if position_ids is None:
        return input_ids, torch.arange(S, device=input_ids.device).unsqueeze(0).expand(B, S), targets, None
    return input_ids, position_ids, targets, cu_seqlens_from_position_ids(position_ids, input_ids.device)


def packed_row(input_ids, position_ids, labels, padding: PaddingInfo, labels_shifted, ignore_index):
    """A padded batch unpadded into one packed row (ids, positions, targets, cu_seqlens),
    each `[1, T]`; see shard_batch."""
    valid = padding.valid_mask()
    if position_ids is None:   # every row's positions restart at 0 at its first valid token
        position_ids = valid.long().cumsum(dim=1) - 1
    targets = shift_targets(labels, labels_shifted=labels_shifted, ignore_index=ignore_index, valid=valid)
    positions = padding.pack(position_ids)
    return padding.pack(input_ids), positions, padding.pack(targets), packed_cu_seqlens(positions[0], padding)
