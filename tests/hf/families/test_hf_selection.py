"""The key selection rule of sparse attention (ulysses_kernels/hf/families/sparse/selection.py)
against a brute force in Python: the k largest scores, ties to the smaller key index, a set
in ascending key order, empty slots -1 last; the same set from the whole row, from any
tiling of its keys, and from candidates merged over any split of the keys (what each rank
of a sequence-parallel group selects from its own keys, gathered); without ties, the set
torch.topk selects."""

import pytest
import torch

from ulysses_kernels.hf.families.sparse.selection import EMPTY, merge_candidates, select_keys, tiled_select


def brute_force(scores: torch.Tensor, k: int) -> torch.Tensor:
    rows = scores.reshape(-1, scores.shape[-1]).tolist()
    out = []
    for row in rows:
        visible = [i for i, s in enumerate(row) if s != float("-inf")]
        chosen = sorted(sorted(visible, key=lambda i: (-row[i], i))[:k])
        out.append(chosen + [EMPTY] * (k - len(chosen)))
    return torch.tensor(out).reshape(*scores.shape[:-1], k)


def tied_scores(seed: int, S: int = 11, T: int = 37, levels: int = 3) -> torch.Tensor:
    """`[2, 3, S, T]` scores of a few distinct values (many ties), causal over the last S
    keys: query q sees keys 0 .. T - S + q."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, levels, (2, 3, S, T), generator=g).float()
    visible = torch.arange(T)[None, :] <= torch.arange(T - S, T)[:, None]
    return scores.masked_fill(~visible, float("-inf"))


@pytest.mark.parametrize("k", [1, 5, 30, 40])   # 40: more slots than most queries see keys
def test_the_rule_with_ties_and_fewer_keys_than_slots(k):
    scores = tied_scores(seed=k)
    assert torch.equal(select_keys(scores, k), brute_force(scores, k))


@pytest.mark.parametrize("tile", [1, 4, 7, 37, 64])
def test_tiles_select_the_same_set(tile):
    scores = tied_scores(seed=tile)
    got_values, got_keys = tiled_select(lambda a, b: scores[..., a:b], scores.shape[-1], 5, tile)
    assert torch.equal(got_keys, brute_force(scores, 5))
    want = scores.gather(-1, got_keys.clamp(min=0)).masked_fill(got_keys < 0, float("-inf"))
    assert torch.equal(got_values, want)


@pytest.mark.parametrize("parts", [[37], [19, 18], [13, 12, 12], [10, 10, 10, 7], [3, 0, 30, 4]])
def test_candidates_merged_over_a_split_of_the_keys(parts):
    """Each part's keys (a rank's shard: global offsets, one part empty) select their own k
    candidates, tiled; all candidates merged give the whole row's set."""
    scores, k = tied_scores(seed=len(parts)), 6
    values, keys, start = [], [], 0
    for n in parts:
        if n:
            v, i = tiled_select(lambda a, b, s=start: scores[..., s + a:s + b], n, k, tile=4, offset=start)
            values.append(v)
            keys.append(i)
        start += n
    merged = merge_candidates(torch.cat(values, dim=-1), torch.cat(keys, dim=-1), k)[1]
    assert torch.equal(merged, brute_force(scores, k))


def test_without_ties_it_is_the_set_topk_selects():
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(4, 50, generator=g)
    chosen = select_keys(scores, 8)
    assert torch.equal(chosen, torch.topk(scores, 8, dim=-1).indices.sort(dim=-1).values)
    assert bool((chosen[:, 1:] > chosen[:, :-1]).all())   # ascending key order
