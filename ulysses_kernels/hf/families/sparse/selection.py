"""The key selection of sparse attention (DeepSeek Sparse Attention's indexer and its kin:
MiniMax-M3's blocks, Qwen4-Exp's blocks), one rule on one device and on P ranks
(docs/hf_families.md, "Sparse attention: DeepSeek Sparse Attention").

For each query, the k keys with the largest index scores, ties broken by the smaller global
key index; the result is a set, emitted in ascending key order, its empty slots (fewer than k
visible keys) -1 at the end. Scores are whatever the model computes (transformers: float32);
a key the query may not see scores -inf and is never selected.

`torch.topk` alone is not this rule: which of several equal scores it keeps depends on the
tensor's shape, so a packed row and its documents alone, or a whole row and its tiles, could
select different keys. Here every selection is a stable sort of (score descending) over
candidates ordered by key index, so the same candidates give the same set however they were
tiled or split over ranks:

* `select_keys(scores, k)`: the rule over `[..., T]` scores (key i = position i);
* `merge_candidates(values, keys, k)`: the rule over candidates `(score, global key)` from
  anywhere (a running top-k over key tiles, every rank's candidates after an all-gather),
  -1 keys being empty;
* `tiled_select(score_tile, T, k, tile)`: the running top-k over key tiles of `tile` keys,
  never `[..., T]` scores at once (`score_tile(start, stop)` gives a tile's).
"""

from typing import Callable, Tuple

import torch

EMPTY = -1


def merge_candidates(values: torch.Tensor, keys: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The k best of candidates `values` / `keys` `[..., C]` (global key indices, EMPTY for
    none): (their scores, their keys) `[..., k]` in ascending key order, empty slots last
    (score -inf, key EMPTY). Scores at -inf are empty whatever their key."""
    values = values.masked_fill(keys < 0, float("-inf"))
    if values.shape[-1] < k:   # fewer candidates than slots: pad with empty ones
        pad = k - values.shape[-1]
        values = torch.cat([values, values.new_full((*values.shape[:-1], pad), float("-inf"))], dim=-1)
        keys = torch.cat([keys, keys.new_full((*keys.shape[:-1], pad), EMPTY)], dim=-1)
    empty = torch.isneginf(values)
    # key order first (empty candidates last), then a stable sort by score: ties keep key order
    by_key = torch.argsort(keys.masked_fill(empty, torch.iinfo(keys.dtype).max), dim=-1, stable=True)
    values, keys = values.gather(-1, by_key), keys.gather(-1, by_key)
    best = torch.argsort(values, dim=-1, descending=True, stable=True)[..., :k]
    values, keys = values.gather(-1, best), keys.gather(-1, best)
    keys = keys.masked_fill(torch.isneginf(values), EMPTY)
    order = torch.argsort(keys.masked_fill(keys < 0, torch.iinfo(keys.dtype).max), dim=-1, stable=True)
    return values.gather(-1, order), keys.gather(-1, order)


def select_keys(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The rule over `scores` `[..., T]` (key i at position i; -inf: not visible): the
    selected keys `[..., k]`, ascending, EMPTY-padded."""
    keys = torch.arange(scores.shape[-1], device=scores.device).expand(scores.shape)
    return merge_candidates(scores, keys, k)[1]


def tiled_select(score_tile: Callable[[int, int], torch.Tensor], total: int, k: int, tile: int,
                 offset: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """The rule over `total` keys, `tile` keys at a time: `score_tile(start, stop)` returns
    the scores `[..., stop - start]` of keys `start..stop-1`; a running (scores, keys) of k
    candidates is merged with each tile's. `offset`: the global index of key 0 (a rank's
    keys). Returns (scores, keys) `[..., k]` as `merge_candidates`."""
    best = None
    for start in range(0, total, tile):
        stop = min(total, start + tile)
        values = score_tile(start, stop)
        keys = torch.arange(offset + start, offset + stop, device=values.device).expand(values.shape)
        if best is not None:
            values, keys = torch.cat([best[0], values], dim=-1), torch.cat([best[1], keys], dim=-1)
        best = merge_candidates(values, keys, k)
    if best is None:
        raise ValueError("tiled_select: no keys (total must be >= 1)")
    return best
