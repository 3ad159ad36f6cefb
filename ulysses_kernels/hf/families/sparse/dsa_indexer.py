"""DeepSeek Sparse Attention's indexer under sequence parallelism (dsa.py has the layer): its
keys, its scores of a rank's queries over the gathered keys in float32 as transformers computes
them, and its selection by selection.py's rule, `QUERY_TILE` queries and `KEY_TILE` keys at a
time with a running top k (docs/hf_families.md, "Sparse attention: DeepSeek Sparse Attention").

What differs between the families' indexers: the rope (`rope_of`: on halves or interleaved
pairs, read from the forward; on the first or the last channels, `_ROPE_LAST`) and where the
`softmax_scale` goes (`_SCALE_IN_WEIGHTS`).
"""

import inspect
import sys
from typing import Callable, NamedTuple, Optional

import torch

from ..mixers import document_starts
from .selection import tiled_select

# indexers whose rotary channels are the last `qk_rope_head_dim`, not the first (HY-V4)
_ROPE_LAST = ("HYV4Indexer",)


def rope_of(cls: type) -> Callable:
    """The rope `cls`'s forward applies, as transformers' module of `cls` defines it: on
    interleaved pairs (`apply_rotary_pos_emb_interleave`) or on halves. Read from the forward
    itself: it changes between releases (HY-V4's indexer and attention: halves in 5.24,
    interleaved pairs in 5.25)."""
    rope = _ROPES.get(cls)
    if rope is None:
        family = sys.modules[cls.__module__]
        interleaved = "apply_rotary_pos_emb_interleave(" in inspect.getsource(cls.forward)
        rope = _ROPES[cls] = family.apply_rotary_pos_emb_interleave if interleaved else family.apply_rotary_pos_emb
    return rope


_ROPES: dict = {}


# indexers that scale the head weights by `softmax_scale` instead of each head's scores (HY-V4)
_SCALE_IN_WEIGHTS = ("HYV4Indexer",)


class Visibility(NamedTuple):
    """Which keys this rank's queries see: the keys of their document (`starts`: each token's
    document start `[T]`, None: one document a row) up to themselves (`queries`: their global
    indices `[S_local]`). Asked one tile at a time: never `[S_local, T]` at once."""
    queries: torch.Tensor
    starts: Optional[torch.Tensor]

    def tile(self, part: slice, first: int, stop: int) -> torch.Tensor:
        """`[q, stop - first]`: the queries `part` over keys `first..stop-1`."""
        queries = self.queries[part]
        keys = torch.arange(first, stop, device=queries.device)
        visible = keys[None, :] <= queries[:, None]
        if self.starts is not None:
            visible = visible & (keys[None, :] >= self.starts[queries][:, None])
        return visible


def visibility(lens, rank, cu_seqlens, device) -> Visibility:
    """This rank's queries' `Visibility` over the whole sequence of a training forward."""
    start = sum(lens[:rank])
    return Visibility(torch.arange(start, start + lens[rank], device=device),
                      document_starts(cu_seqlens, sum(lens), device))


def _rotated(indexer, x, position_embeddings):
    """The indexer's rope (`_rope`, on its first or `_ROPE_LAST` channels) of `x` `[B, S,
    heads, D]`, as transformers applies it."""
    rope = rope_of(type(indexer))
    rotary, plain = indexer.qk_rope_head_dim, indexer.head_dim - indexer.qk_rope_head_dim
    cos, sin = position_embeddings
    if type(indexer).__name__ not in _ROPE_LAST:
        x_rot, x_pass = torch.split(x, [rotary, plain], dim=-1)
        return torch.cat([rope(x_rot, x_rot, cos, sin, unsqueeze_dim=2)[0], x_pass], dim=-1)
    x_pass, x_rot = torch.split(x, [plain, rotary], dim=-1)
    return torch.cat([x_pass, rope(x_rot, x_rot, cos, sin, unsqueeze_dim=2)[0]], dim=-1)


def indexer_keys(indexer, hidden_states, position_embeddings):
    """The indexer's key of each local token `[B, S, D]` (its norm in the norm's dtype: HY-V4's
    is float32)."""
    keys = indexer.k_norm(indexer.wk(hidden_states).to(indexer.k_norm.weight.dtype)).to(hidden_states.dtype)
    return _rotated(indexer, keys.unsqueeze(2), position_embeddings).squeeze(2)


KEY_TILE = 4096     # keys the indexer scores at once: `[B, QUERY_TILE, index heads, KEY_TILE]` float32
QUERY_TILE = 256    # queries the indexer scores at once


def _query_side(indexer, hidden_states, q_resid, position_embeddings):
    """The indexer's queries `[B, S, heads, D]` and their weights `[B, S, heads]`, float32."""
    B, S, _ = q_resid.shape
    q = _rotated(indexer, indexer.wq_b(q_resid).view(B, S, indexer.n_heads, indexer.head_dim), position_embeddings)
    weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float() \
        * (indexer.n_heads ** -0.5)
    if type(indexer).__name__ in _SCALE_IN_WEIGHTS:
        weights = weights * indexer.softmax_scale
    return q.float(), weights


def _scores(indexer, q, weights, keys):
    """`[B, S, T]`: `sum_h w_h relu(q_h . k)` of the queries over `keys` `[B, T, D]`, in
    transformers' order of operations (float32)."""
    scores = torch.matmul(q, keys.transpose(-1, -2).float().unsqueeze(1))
    if type(indexer).__name__ not in _SCALE_IN_WEIGHTS:
        scores = scores * indexer.softmax_scale
    return torch.matmul(weights.unsqueeze(-2), torch.relu(scores)).squeeze(-2)


@torch.no_grad()
def index_scores(indexer, hidden_states, q_resid, position_embeddings, keys):
    """`[B, S_local, T]` float32 scores of this rank's queries over the keys `keys` `[B, T, D]`,
    as transformers' indexer computes them."""
    return _scores(indexer, *_query_side(indexer, hidden_states, q_resid, position_embeddings), keys)


@torch.no_grad()
def select(indexer, hidden_states, q_resid, position_embeddings, keys, visible):
    """`[B, S_local, k]` long: the keys of `keys` `[B, T, D]` each query keeps (the rule of
    selection.py among the keys `visible`, a `Visibility`, lets it see; ascending,
    EMPTY-padded), `QUERY_TILE` queries and `KEY_TILE` keys at a time with a running top k:
    at most `[B, QUERY_TILE, index heads, KEY_TILE]` scores at once."""
    k = min(indexer.index_topk, keys.shape[1])
    q, weights = _query_side(indexer, hidden_states, q_resid, position_embeddings)
    chosen = []
    for start in range(0, q.shape[1], QUERY_TILE):
        part = slice(start, start + QUERY_TILE)

        def tile(first, stop, part=part):
            scores = _scores(indexer, q[:, part], weights[:, part], keys[:, first:stop])
            return scores.masked_fill(~visible.tile(part, first, stop), float("-inf"))
        chosen.append(tiled_select(tile, keys.shape[1], k, KEY_TILE)[1].long())
    return torch.cat(chosen, dim=1)
