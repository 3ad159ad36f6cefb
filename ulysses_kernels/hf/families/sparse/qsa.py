"""Qwen4-Exp's query-selected attention (QSA, `qwen4_exp_text`) under sequence parallelism,
in training and generation: the queries stay on their sequence shard, the keys, values and
the indexer's raw keys are gathered (docs/hf_families.md, "Sparse attention: Qwen4-Exp"; the selection rule:
selection.py).

One `indexed_attention` layer, as transformers 5.25 computes it (`Qwen4ExpTextAttention` with
its `Qwen4ExpTextQSAIndexer`): gated GQA (a sigmoid gate from the query projection on the
output), q and k RMS-normed per head, rope. The indexer cuts the keys a query sees into blocks
of `indexer_compress_ratio` tokens from the first one it sees (its document's first token);
a complete block's key is the RMS-normed mean of its tokens' raw index keys, turned by the
rope of the block's first token; the query scores it `sum_h relu(q_h . k_block) / sqrt(d)`
(float32) and keeps the `indexer_budget / indexer_compress_ratio` best complete blocks, and
always the incomplete tail of the blocks up to itself. The attention runs over the kept tokens.

Sequence-parallel: every rank gathers the keys and values of every KV head (differentiable:
the backward sums each token's gradient on its owner), the raw index keys and the rope of
every token (no gradient: the selection is a mask); the blocks' keys are computed from the
gathered raw keys, the same on every rank; each rank selects for its own queries (selection.py's
rule over the blocks, `KEY_TILE` blocks at a time) and attends over the kept tokens, gathered
per query (`QUERY_TILE` queries at a time, recomputed in the backward): no head exchange.
Not on a ring (refused on every rank).

Generation (`ulysses_kernels.hf.generate` / `prefill`): every rank keeps every token's keys,
values, raw index keys and rope (`generation_forward`); a chunk's queries select and attend
over them as in training.
"""

import math
import sys

import torch
from torch.utils.checkpoint import checkpoint

from ....api import gather_sequence
from ....exchange.sequence import all_gather_sequence
from ..family import SPARSE_ATTENTION, Adapter, Family
from ..mixers import document_starts
from .selection import EMPTY, tiled_select

QSA_CLASSES = ("Qwen4ExpTextAttention",)
KEY_TILE = 4096     # blocks the indexer scores at once: `[B, QUERY_TILE, KEY_TILE, index heads]` float32
QUERY_TILE = 256    # queries selecting, then attending over their kept tokens (recomputed in the backward), at once


def _rope(module):
    return sys.modules[type(module).__module__].apply_rotary_pos_emb


def _projections(module, hidden_states, position_embeddings):
    """The queries `[B, H, S, D]`, keys and values `[B, S, Hkv, D]`, the output gate `[B, S, H
    x D]`, the index queries `[B, S, index heads, d]` (float32) and raw keys `[B, S, d]`, as
    transformers computes them."""
    B, S, _ = hidden_states.shape
    D, rope, indexer = module.head_dim, _rope(module), module.indexer
    queries, gate = torch.chunk(module.q_proj(hidden_states).view(B, S, -1, 2 * D), 2, dim=-1)
    q = module.q_norm(queries.reshape(B, S, -1, D)).transpose(1, 2)
    k = module.k_norm(module.k_proj(hidden_states).view(B, S, -1, D)).transpose(1, 2)
    v = module.v_proj(hidden_states).view(B, S, -1, D)
    cos, sin = position_embeddings
    q, k = rope(q, k, cos, sin)
    index_q, raw_keys = torch.split(indexer.index_qk_proj(hidden_states),
                                    [indexer.index_n_heads * indexer.index_head_dim, indexer.index_head_dim], dim=-1)
    index_q = rope(indexer.q_layernorm(index_q.reshape(B, S, -1, indexer.index_head_dim)), cos=cos, sin=sin,
                   unsqueeze_dim=2)
    return q, k.transpose(1, 2), v, gate.reshape(B, S, -1), index_q.float(), raw_keys


def _blocks(indexer, raw_keys, cos, sin, starts):
    """The complete blocks of every document of the sequence: (their first tokens `[NB]`, global
    indices, and their keys `[B, NB, d]`: the RMS-normed float32 mean of their raw keys `[B, T,
    d]`, turned by the rope `cos` / `sin` `[B, T, r]` of their first token). `starts`: each
    token's document start `[T]`."""
    r, T = indexer.compress_ratio, raw_keys.shape[1]
    tokens = torch.arange(T, device=raw_keys.device)
    bounds = torch.unique(starts)                                     # the documents' first tokens, ascending
    doc_end = torch.cat([bounds[1:], bounds.new_tensor([T])])[torch.searchsorted(bounds, starts)]
    offset = tokens - starts
    first = tokens[(offset % r == 0) & (tokens + r <= doc_end)]
    rows = first[:, None] + torch.arange(r, device=raw_keys.device)
    pooled = raw_keys[:, rows].float().mean(dim=2).to(raw_keys.dtype)
    keys = _rope(indexer)(indexer.k_layernorm(pooled).unsqueeze(2), cos=cos[:, first], sin=sin[:, first],
                         unsqueeze_dim=2).squeeze(2)
    return first, keys


def _chosen_blocks(indexer, index_q, block_first, block_keys, queries, query_starts):
    """`[B, n, block_topk]`: the complete blocks the queries keep (selection.py's rule over
    `KEY_TILE` blocks at a time), EMPTY-padded; all EMPTY without a complete block."""
    r = indexer.compress_ratio
    if block_first.numel() == 0:
        return queries.new_full((index_q.shape[0], queries.shape[0], indexer.block_topk), EMPTY)

    def tile(first, stop):
        keys = block_keys[:, first:stop].float()
        scores = torch.relu(torch.einsum("bqhd,bkd->bqkh", index_q, keys)).sum(-1) / math.sqrt(indexer.index_head_dim)
        own = block_first[first:stop]
        visible = (own[None, :] >= query_starts[:, None]) & (own[None, :] + r - 1 <= queries[:, None])
        return scores.masked_fill(~visible, float("-inf"))
    return tiled_select(tile, block_first.shape[0], indexer.block_topk, KEY_TILE)[1]


@torch.no_grad()
def select_tokens(indexer, index_q, block_first, block_keys, queries, starts):
    """`[B, n, budget + r - 1]` long: the tokens the queries at global indices `queries` `[n]`
    (index queries `[B, n, heads, d]`) keep, EMPTY-padded: the kept complete blocks and the tail
    up to the query; `QUERY_TILE` queries at a time (`[B, QUERY_TILE, KEY_TILE, heads]` scores)."""
    r = indexer.compress_ratio
    query_starts = starts[queries]
    chosen = torch.cat([_chosen_blocks(indexer, index_q[:, part], block_first, block_keys, queries[part],
                                       query_starts[part])
                        for part in (slice(i, i + QUERY_TILE) for i in range(0, queries.shape[0], QUERY_TILE))], dim=1)
    # a chosen block's first token (EMPTY through a last slot of the lookup)
    first = torch.cat([block_first, block_first.new_tensor([EMPTY])])[torch.where(chosen >= 0, chosen, -1)]
    picked = (first[..., None] + torch.arange(r, device=first.device)).masked_fill(first[..., None] < 0, EMPTY)
    tail = query_starts + (queries - query_starts + 1) // r * r   # the first token after its complete blocks
    tail = tail[:, None] + torch.arange(r - 1, device=first.device)
    tail = tail.masked_fill(tail > queries[:, None], EMPTY).expand(chosen.shape[0], -1, -1)
    return torch.cat([picked.flatten(2), tail], dim=-1)


def _attend_tile(q, k, v, kept, scaling, groups: int):
    """Queries `[B, H, n, D]` over their kept tokens `[B, n, K]` (EMPTY: none) of the keys and
    values `[B, T, Hkv, D]`, each query head over its KV head's (`groups` query heads a KV
    head): `[B, H, n, D]`, the softmax in float32 or wider."""
    B, H, n, D = q.shape
    index = kept.clamp(min=0)

    def picked(x):   # [B, T, Hkv, D] -> each query's kept rows [B, n, K, Hkv, D]; the backward scatters into [B, T, ...]
        K, width = index.shape[-1], x.shape[2] * x.shape[3]
        rows = x.reshape(B, x.shape[1], width).gather(1, index.reshape(B, n * K, 1).expand(B, n * K, width))
        return rows.view(B, n, K, *x.shape[2:])
    keys, values = picked(k), picked(v)
    grouped = q.view(B, H // groups, groups, n, D)
    scores = torch.einsum("bkgqd,bqjkd->bkgqj", grouped, keys) * scaling
    scores = scores.masked_fill((kept < 0)[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype)
    return torch.einsum("bkgqj,bqjkd->bkgqd", probs, values).reshape(B, H, n, D)


def _attention(module, q, k, v, kept):
    tiles = []
    for start in range(0, kept.shape[1], QUERY_TILE):
        part = slice(start, start + QUERY_TILE)
        tiles.append(checkpoint(_attend_tile, q[:, :, part], k, v, kept[:, part], module.scaling,
                                module.num_key_value_groups, use_reentrant=False))
    return torch.cat(tiles, dim=2)


def generation_forward(module, hidden_states: torch.Tensor, cache, position_embeddings, **_):
    """The attention inside `generate` / `prefill` (the protocol around it: family.py): every
    rank keeps every token's keys, values, raw index keys and rope (the layer's decoding state;
    a sharded chunk's gathered from its shards), and the chunk's queries select and attend over
    them as in training (one document a row: generation refuses padding). Returns (output,
    None)."""
    group, _, rank = cache.ulysses
    lens = cache.chunk_lens
    B, n, _ = hidden_states.shape
    # the model passes the rope of every token its indexer positions hold (on this rank): the chunk's are the last
    current = tuple(x[:, -n:] for x in position_embeddings)
    q, k, v, gate, index_q, raw_keys = _projections(module, hidden_states, current)
    state = cache.mixer_state(module.layer_idx, n)
    first = cache.forward_start

    def grown(name, x):   # the chunk's tokens on every rank, after the ones the state holds
        x = x if lens is None else all_gather_sequence(x, lens, 1, group)
        state[name] = x if name not in state else torch.cat([state[name], x], dim=1)
        return state[name]
    k, v, raw_keys = grown("keys", k), grown("values", v), grown("index keys", raw_keys)
    cos, sin = (grown(name, x.expand(B, -1, -1)) for name, x in zip(("cos", "sin"), current))
    starts = torch.zeros(k.shape[1], dtype=torch.long, device=k.device)
    block_first, block_keys = _blocks(module.indexer, raw_keys, cos, sin, starts)
    offset = first + (sum(lens[:rank]) if lens is not None else 0)
    queries = torch.arange(offset, offset + n, device=k.device)
    kept = select_tokens(module.indexer, index_q, block_first, block_keys, queries, starts)
    out = _attention(module, q, k, v, kept).transpose(1, 2).reshape(B, n, -1)
    return module.o_proj(out * torch.sigmoid(gate)), None


def _prepare_cache(module, cache) -> None:
    """The model's forward appends its indexer positions to its first QSA layer's cache layer
    before the layers run: that layer must exist, with none yet."""
    index = module.config.layer_types.index("indexed_attention")
    while len(cache.layers) <= index:
        cache.layers.append(cache.layer_class_to_replicate())
    cache.layers[index].indexer_position_ids = None


def qsa_forward(self, call, hidden_states: torch.Tensor, position_embeddings, **_):
    """Qwen4ExpTextAttention's forward over the sequence (the module doc; the protocol around
    it: family.py); returns (output, None)."""
    lens, cu_seqlens, group, rank = call.lens, call.cu_seqlens, call.group, call.context.ulysses()[2]
    B, S, _ = hidden_states.shape
    q, k, v, gate, index_q, raw_keys = _projections(self, hidden_states, position_embeddings)
    k, v = (gather_sequence(x, group, dim=1, seq_lens=lens) for x in (k, v))
    with torch.no_grad():
        cos, sin = (all_gather_sequence(x.expand(B, -1, -1), lens, 1, group) for x in position_embeddings)
        raw_keys = all_gather_sequence(raw_keys, lens, 1, group)
        total = sum(lens)
        starts = document_starts(cu_seqlens, total, hidden_states.device)
        if starts is None:
            starts = torch.zeros(total, dtype=torch.long, device=hidden_states.device)
        block_first, block_keys = _blocks(self.indexer, raw_keys, cos, sin, starts)
        queries = torch.arange(sum(lens[:rank]), sum(lens[:rank + 1]), device=hidden_states.device)
        kept = select_tokens(self.indexer, index_q, block_first, block_keys, queries, starts)
    out = _attention(self, q, k, v, kept).transpose(1, 2).reshape(B, S, -1)
    return self.o_proj(out * torch.sigmoid(gate)), None


# a new decoding cache gets the indexer's positions first (_prepare_cache)
FAMILY = Family("qsa", (Adapter(QSA_CLASSES, "sparse_attention", qsa_forward, SPARSE_ATTENTION,
                                prepare_cache=_prepare_cache, generation=generation_forward),),
                model_types=("qwen4_exp_text", "qwen4_exp"))
