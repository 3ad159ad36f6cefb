"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) under sequence parallelism, training: the queries
stay on their sequence shard, what every head shares is gathered (docs/hf_families.md,
"Sparse attention: DeepSeek-V3.2 (training)"; the selection rule: selection.py).

One layer, as transformers 5.24 and 5.25 compute it (`DeepseekV32Attention`): MLA (queries
through a low-rank `q_resid`; keys and values expanded from one latent `c` of `kv_lora_rank`
per token plus a shared rotary key), and an indexer (without gradients) that scores every
visible key for each query, `sum_h w_h relu(q_h . k)` in float32, and keeps the `index_topk`
best; the attention runs over those only. GLM-5 (`GlmMoeDsaAttention`): the indexer's rope on
interleaved pairs, and its "shared" layers reuse the previous full layer's selection (passed
from layer to layer as `prev_topk_indices`; here, the selection mask).

Sequence-parallel: every rank gathers the latent and the rotary key (`kv_lora_rank +
qk_rope_head_dim` values a token, differentiable: the backward sums each token's gradient on
its owner) and the indexer key (`index_head_dim` a token, no gradient) of the whole sequence;
each rank scores its own queries over every key of their document up to them, selects its
top k by one rule (selection.py: the k largest, ties to the smaller global key index) and
attends over the selected keys in MLA's absorbed form (the queries into the latent space by
`kv_b_proj`'s key half, the output out of it by its value half): no head exchange, and no
rank expands the whole sequence's keys. Positions are global (each token's in its document).

Memory per rank: the gathered latent and indexer keys of the whole sequence (704 values a
token), the queries in the latent space (`[B, heads, S_local, kv_lora_rank]`), and one tile at
a time of the indexer's scores (`[B, QUERY_TILE, index heads, KEY_TILE]`, float32, a running
top k across the key tiles) and of the attention (each tile's chosen rows and scores,
recomputed in the backward), never `[S, heads, T]`. Not in generation, not on a ring
(refused on every rank).
"""

import sys

import torch
from torch.utils.checkpoint import checkpoint

from ...api import gather_sequence
from ...exchange.sequence import all_gather_sequence
from ..context import DecodingCache, token_mixer_call
from ..model import refusal
from .mixers import check_cache_outside_generation, document_starts, original_forward
from .selection import tiled_select

DSA_CLASSES = ("DeepseekV32Attention",)
GLM_CLASSES = ("GlmMoeDsaAttention",)   # GLM-5: some layers reuse the previous full layer's selection
_INTERLEAVED_INDEXERS = ("GlmMoeDsaIndexer",)   # the indexer's rope on interleaved pairs, not halves


def _refuse_generation(module):
    raise refusal(None, f"{type(module).__name__} does not generate sequence-parallel yet: its latent and indexer-key "
                        "cache are not kept sharded",
                  "Generate without sequence parallelism (sp_size=1); training runs sequence-parallel.")


def _visible(lens, rank, cu_seqlens, device):
    """`[S_local, T]`: which keys each of this rank's queries sees (its document's, up to
    itself), and the queries' global positions."""
    total = sum(lens)
    start = sum(lens[:rank])
    queries = torch.arange(start, start + lens[rank], device=device)
    keys = torch.arange(total, device=device)
    visible = keys[None, :] <= queries[:, None]
    starts = document_starts(cu_seqlens, total, device)
    if starts is not None:
        visible = visible & (keys[None, :] >= starts[queries][:, None])
    return visible


def _rotated(indexer, x, position_embeddings):
    """The indexer's rope (on its first `qk_rope_head_dim` channels: half-split, or interleaved
    pairs for GLM-5) of `x` `[B, S, heads, D]`, as transformers applies it."""
    family = sys.modules[type(indexer).__module__]
    interleaved = type(indexer).__name__ in _INTERLEAVED_INDEXERS
    rope = family.apply_rotary_pos_emb_interleave if interleaved else family.apply_rotary_pos_emb
    x_rot, x_pass = torch.split(x, [indexer.qk_rope_head_dim, indexer.head_dim - indexer.qk_rope_head_dim], dim=-1)
    cos, sin = position_embeddings
    return torch.cat([rope(x_rot, x_rot, cos, sin, unsqueeze_dim=2)[0], x_pass], dim=-1)


def _indexer_keys(indexer, hidden_states, position_embeddings):
    """The indexer's key of each local token `[B, S, D]`."""
    return _rotated(indexer, indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2), position_embeddings).squeeze(2)


KEY_TILE = 4096     # keys the indexer scores at once: `[B, S_local, index heads, KEY_TILE]` float32
QUERY_TILE = 256    # queries attending at once over their selection (recomputed in the backward)


def _query_side(indexer, hidden_states, q_resid, position_embeddings):
    """The indexer's queries `[B, S, heads, D]` and their weights `[B, S, heads]`, float32."""
    B, S, _ = q_resid.shape
    q = _rotated(indexer, indexer.wq_b(q_resid).view(B, S, indexer.n_heads, indexer.head_dim), position_embeddings)
    weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float() \
        * (indexer.n_heads ** -0.5)
    return q.float(), weights


def _scores(indexer, q, weights, keys):
    """`[B, S, T]`: `sum_h w_h relu(q_h . k)` of the queries over `keys` `[B, T, D]`, in
    transformers' order of operations (float32)."""
    scores = torch.relu(torch.matmul(q, keys.transpose(-1, -2).float().unsqueeze(1)) * indexer.softmax_scale)
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)


@torch.no_grad()
def index_scores(indexer, hidden_states, q_resid, position_embeddings, keys):
    """`[B, S_local, T]` float32 scores of this rank's queries over the keys `keys` `[B, T, D]`,
    as transformers' indexer computes them."""
    return _scores(indexer, *_query_side(indexer, hidden_states, q_resid, position_embeddings), keys)


@torch.no_grad()
def select(indexer, hidden_states, q_resid, position_embeddings, keys, visible):
    """`[B, S_local, k]` long: the keys of `keys` `[B, T, D]` each query keeps (the rule of
    selection.py among the `visible` `[S_local, T]`, ascending, EMPTY-padded), `QUERY_TILE`
    queries and `KEY_TILE` keys at a time with a running top k: at most `[B, QUERY_TILE,
    index heads, KEY_TILE]` scores at once."""
    k = min(indexer.index_topk, keys.shape[1])
    q, weights = _query_side(indexer, hidden_states, q_resid, position_embeddings)
    chosen = []
    for start in range(0, q.shape[1], QUERY_TILE):
        part = slice(start, start + QUERY_TILE)

        def tile(first, stop, part=part):
            scores = _scores(indexer, q[:, part], weights[:, part], keys[:, first:stop])
            return scores.masked_fill(~visible[part, first:stop], float("-inf"))
        chosen.append(tiled_select(tile, keys.shape[1], k, KEY_TILE)[1].long())
    return torch.cat(chosen, dim=1)


def _attend_tile(q_latent, q_rot, latent, rot_keys, chosen, scaling):
    """Queries `[B, H, q, R]` (in the latent) / `[B, H, q, r]` over their chosen keys `[B, q,
    k]` (EMPTY: none) of the latent `[B, T, R]` and rotary keys `[B, T, r]`: `[B, H, q, R]`."""
    B, q, k = chosen.shape
    index = chosen.clamp(min=0)

    def picked(x):   # [B, T, C] -> each query's chosen rows [B, q, k, C]
        return x.unsqueeze(1).expand(B, q, *x.shape[1:]).gather(2, index[..., None].expand(B, q, k, x.shape[-1]))
    c, r = picked(latent), picked(rot_keys)
    scores = (torch.einsum("bhqr,bqkr->bhqk", q_latent, c) + torch.einsum("bhqd,bqkd->bhqk", q_rot, r)) * scaling
    scores = scores.masked_fill((chosen < 0)[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(c.dtype)
    return torch.einsum("bhqk,bqkr->bhqr", probs, c)


def _absorbed_attention(module, q_pass, q_rot, latent, rot_keys, chosen):
    """MLA over the gathered latent `[B, T, R]` and rotary keys `[B, T, r]`, queries `[B, H,
    S, dn]` / `[B, H, S, r]`, each over its chosen keys `[B, S, k]`: `[B, H, S, dv]`. In MLA's
    absorbed form (the queries into the latent by `kv_b_proj`'s key half, the output out of it
    by its value half), `QUERY_TILE` queries at a time, each tile recomputed in the backward:
    the scores and the chosen rows of one tile at a time."""
    H, dn = module.num_heads, module.qk_nope_head_dim
    weight = module.kv_b_proj.weight.view(H, dn + module.v_head_dim, -1)
    q_latent = torch.einsum("bhsd,hdr->bhsr", q_pass, weight[:, :dn])
    tiles = []
    for start in range(0, chosen.shape[1], QUERY_TILE):
        part = slice(start, start + QUERY_TILE)
        tiles.append(checkpoint(_attend_tile, q_latent[:, :, part], q_rot[:, :, part], latent, rot_keys,
                                chosen[:, part], module.scaling, use_reentrant=False))
    return torch.einsum("bhsr,hvr->bhsv", torch.cat(tiles, dim=2), weight[:, dn:])


def _sparse_attention(module, hidden_states, position_embeddings, position_ids, kwargs, shared_chosen=None):
    """(output, the chosen keys `[B, S_local, k]`) of a DSA layer (the module doc); a layer
    without an indexer of its own reuses `shared_chosen`, the previous full layer's."""
    context, lens, cu_seqlens = token_mixer_call(module, hidden_states.shape[1],
                                                 dict(kwargs, position_ids=position_ids))
    group, _, rank = context.ulysses()
    B, S, _ = hidden_states.shape
    rope = sys.modules[type(module).__module__].apply_rotary_pos_emb_interleave
    q_resid = module.q_a_layernorm(module.q_a_proj(hidden_states))
    q = module.q_b_proj(q_resid).view(B, S, -1, module.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)
    kv_pass, k_rot = torch.split(module.kv_a_proj_with_mqa(hidden_states),
                                 [module.kv_lora_rank, module.qk_rope_head_dim], dim=-1)
    cos, sin = position_embeddings
    q_rot, k_rot = rope(q_rot, k_rot.view(B, 1, S, module.qk_rope_head_dim), cos, sin)
    shared = torch.cat([module.kv_a_layernorm(kv_pass), k_rot[:, 0]], dim=-1)   # what every head reads of a token
    shared = gather_sequence(shared, group, dim=1, seq_lens=lens)
    latent, rot_keys = torch.split(shared, [module.kv_lora_rank, module.qk_rope_head_dim], dim=-1)
    chosen = shared_chosen
    if module.indexer is not None:
        with torch.no_grad():
            keys = all_gather_sequence(_indexer_keys(module.indexer, hidden_states, position_embeddings), lens, 1,
                                       group)
            chosen = select(module.indexer, hidden_states, q_resid, position_embeddings, keys,
                            _visible(lens, rank, cu_seqlens, hidden_states.device))
    elif chosen is None:
        raise ValueError(f"ulysses_kernels.hf: {type(module).__name__} shares the selection of a previous layer, "
                         "which gave none")
    out = _absorbed_attention(module, q_pass, q_rot, latent, rot_keys, chosen)
    return module.o_proj(out.transpose(1, 2).reshape(B, S, -1)), chosen


def _call_outside_training(module, hidden_states, cache, kwargs):
    """None to go on; refuses generation, and gives a cache outside it to transformers' own
    forward where `check_cache_outside_generation` lets it (True)."""
    if isinstance(cache, DecodingCache):
        _refuse_generation(module)
    if cache is None:
        return None
    context, lens, cu_seqlens = token_mixer_call(module, hidden_states.shape[1], kwargs)
    check_cache_outside_generation(module, context, cu_seqlens, sum(lens), "its latent is gathered there only")
    return True


def dsa_forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask=None, cache=None,
                position_ids=None, **kwargs):
    """DeepseekV32Attention's forward, sequence-parallel (the module doc); returns (output, None)."""
    if _call_outside_training(self, hidden_states, cache, dict(kwargs, position_ids=position_ids)):
        return original_forward(self)(hidden_states, position_embeddings, attention_mask, cache=cache,
                                      position_ids=position_ids, **kwargs)
    return _sparse_attention(self, hidden_states, position_embeddings, position_ids, kwargs)[0], None


def glm_forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask=None, cache=None,
                position_ids=None, prev_topk_indices=None, **kwargs):
    """GlmMoeDsaAttention's forward, sequence-parallel; returns (output, None, the chosen keys
    `[B, S_local, k]`, global indices), which the model hands to the next layer as
    `prev_topk_indices` (a "shared" layer's)."""
    if _call_outside_training(self, hidden_states, cache, dict(kwargs, position_ids=position_ids)):
        return original_forward(self)(hidden_states, position_embeddings, attention_mask, cache=cache,
                                      position_ids=position_ids, prev_topk_indices=prev_topk_indices, **kwargs)
    out, chosen = _sparse_attention(self, hidden_states, position_embeddings, position_ids, kwargs,
                                    shared_chosen=prev_topk_indices)
    return out, None, chosen
