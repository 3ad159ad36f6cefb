"""MiniMax-M3's block-sparse attention (`minimax_m3_vl_text`) under sequence parallelism, in
training and generation: by the head exchange, each index head selecting for its own KV group
(docs/hf_families.md, "Sparse attention: MiniMax-M3"; the selection rule: selection.py).

One sparse layer, as transformers 5.25 computes it (`MiniMaxM3VLAttention` with its
`MiniMaxM3VLIndexer`): GQA with q and k RMS-normed per head and partial rope; an indexer of
`index_n_heads` heads (one per KV group) scores each query against every earlier key
(`q_g . k` in float32, one shared index key a token), max-pools the scores over blocks of
`index_block_size` keys, forces the query's own block and the `index_local_blocks - 1` before
it, and keeps the `index_topk_blocks` best blocks; each query head attends to the keys of its
group's blocks, causally. transformers anchors the blocks at the row's first slot, so a
packed row's documents would share blocks (its own TODO says so); here blocks start at each
document's first token, as when each document runs alone.

Sequence-parallel: q, k, v, the index queries and the index key go to the head layout in one
exchange (an index head is split like its KV head; the one index key is replicated, like a
one-head KV); each rank selects blocks for its groups over the whole sequence and attends its
query heads over them, `QUERY_TILE` queries at a time (their scores over the document's keys,
recomputed in the backward), then the output comes back. The dense layers of the model run
through the attention function. Not on a ring (refused on every rank).

Generation (`ulysses_kernels.hf.generate` / `prefill`): the cache holds this rank's KV heads
(`update_own_heads`) and every token's index key (the layer's decoding state); a chunk's
query heads select and attend over them at the tokens' global positions.
"""

import sys
from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from ....api import ulysses_head_parallel
from ....exchange.sequence import all_gather_sequence
from ....layout import head_plan_error
from ..family import SPARSE_ATTENTION, Adapter, Family
from ..mixers import chunk_head_parallel, over_documents
from .selection import EMPTY, select_keys

M3_CLASSES = ("MiniMaxM3VLAttention",)
QUERY_TILE = 256   # queries selecting and attending at once: `[B, heads, QUERY_TILE, keys]` scores


def placement_problem(module, world: int) -> Optional[str]:
    """Why this layer's heads have no placement over `world` ranks (None: they have). A sparse
    layer's index heads must be its KV heads: each selects for one KV group."""
    config = module.config
    problem = head_plan_error(world, config.num_attention_heads, config.num_key_value_heads)
    if problem is None and module.indexer is not None and module.indexer.num_heads != config.num_key_value_heads:
        problem = (f"its indexer's heads ({module.indexer.num_heads}) are not its key/value heads "
                   f"({config.num_key_value_heads}): each index head selects for one KV group")
    if problem is None and module.indexer is not None and module.indexer.local_blocks > module.indexer.topk_blocks:
        problem = (f"its indexer forces {module.indexer.local_blocks} local blocks into {module.indexer.topk_blocks} "
                   "slots: which of the forced blocks transformers keeps is torch.topk's order of equal scores")
    return problem


def _projections(module, hidden_states, position_embeddings):
    """q, k, v `[B, S, heads, head_dim]`, the index queries `[B, S, index heads, index_head_dim]`
    and the index key `[B, S, 1, index_head_dim]`, as transformers computes them."""
    rope = sys.modules[type(module).__module__].apply_rotary_pos_emb
    indexer = module.indexer
    B, S, _ = hidden_states.shape
    q = module.q_norm(module.q_proj(hidden_states).view(B, S, -1, module.head_dim)).transpose(1, 2)
    k = module.k_norm(module.k_proj(hidden_states).view(B, S, -1, module.head_dim)).transpose(1, 2)
    v = module.v_proj(hidden_states).view(B, S, -1, module.head_dim)
    cos, sin = position_embeddings
    q, k = rope(q, k, cos, sin)
    index_q = indexer.q_norm(indexer.q_proj(hidden_states).view(B, S, -1, indexer.head_dim)).transpose(1, 2)
    index_k = indexer.k_norm(indexer.k_proj(hidden_states).view(B, S, 1, indexer.head_dim)).transpose(1, 2)
    index_q, index_k = rope(index_q, index_k, cos[..., :indexer.head_dim], sin[..., :indexer.head_dim])
    return {"q": q.transpose(1, 2), "k": k.transpose(1, 2), "v": v, "iq": index_q.transpose(1, 2),
            "ik": index_k.transpose(1, 2)}


@torch.no_grad()
def select_blocks(indexer, index_q, index_k, positions, key_positions):
    """`[B, Hi, n, blocks]` bool: the key blocks each query keeps, per index head, for index
    queries `[B, Hi, n, D]` at `positions` `[n]` over index keys `[B, 1, m, D]` at
    `key_positions` `[m]` (from their document's first token: blocks start there), by
    selection.py's rule over the blocks' max-pooled float32 scores, the query's own block and
    the `local_blocks - 1` before it forced."""
    B, heads, n, _ = index_q.shape
    m, size = index_k.shape[2], indexer.block_size
    scores = torch.matmul(index_q.float(), index_k.float().transpose(-1, -2))
    scores = scores.masked_fill(key_positions[None, None, None, :] > positions[None, None, :, None], float("-inf"))
    blocks = -(-m // size)
    scores = torch.nn.functional.pad(scores, (0, blocks * size - m), value=float("-inf"))
    block_scores = scores.view(B, heads, n, blocks, size).amax(dim=-1)
    own = positions // size
    for back in range(indexer.local_blocks):
        block_scores.scatter_(-1, (own - back).clamp(min=0).view(1, 1, n, 1).expand(B, heads, n, 1), float("inf"))
    chosen = select_keys(block_scores, min(indexer.topk_blocks, blocks))
    keep = torch.zeros(B, heads, n, blocks + 1, dtype=torch.bool, device=chosen.device)
    return keep.scatter_(-1, torch.where(chosen == EMPTY, blocks, chosen), True)[..., :blocks]


def _attend(q, k, v, kv_index, keep_blocks, positions, key_positions, scaling: float, block_size: int):
    """Query heads `[B, H, n, D]` over the keys and values `[B, Hk, m, D]` of their KV heads
    (`kv_index` `[H]`, taken here: not kept for the backward), a key visible when its block is
    kept (`keep_blocks` `[B, H, n, blocks]`) and it is not after the query; the softmax in
    float32 or wider: `[B, H, n, D]`."""
    k, v = k.index_select(1, kv_index), v.index_select(1, kv_index)
    keep = keep_blocks.repeat_interleave(block_size, dim=-1)[..., :k.shape[2]]
    keep = keep & (key_positions[None, :] <= positions[:, None])
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype)
    return torch.matmul(probs, v)


def block_sparse_attention(module, q, k, v, index_q, index_k, kv_index, positions=None, key_positions=None):
    """One document (or a chunk over the keys held): query heads `[B, n, Hl, D]`, their KV heads
    `[B, m, Hk, D]` (`kv_index` `[Hl]`: each query head's, which is also its index head among
    `index_q` `[B, n, Hk, Di]`), the index key `[B, m, 1, Di]`; positions from the document's
    start (default: `arange(n)` for both). `QUERY_TILE` queries at a time, each tile's attention
    recomputed in the backward: `[B, n, Hl, D]`."""
    n = q.shape[1]
    positions = torch.arange(n, device=q.device) if positions is None else positions
    key_positions = positions if key_positions is None else key_positions
    q, k, v, index_q, index_k = (t.transpose(1, 2) for t in (q, k, v, index_q, index_k))
    tiles = []
    for start in range(0, n, QUERY_TILE):
        part = slice(start, start + QUERY_TILE)
        keep = select_blocks(module.indexer, index_q[:, :, part], index_k, positions[part], key_positions)
        tiles.append(checkpoint(_attend, q[:, :, part], k, v, kv_index, keep.index_select(1, kv_index),
                                positions[part], key_positions, module.scaling, module.indexer.block_size,
                                use_reentrant=False))
    return torch.cat(tiles, dim=2).transpose(1, 2)


def _kv_index(module, q_heads, kv_heads, device):
    """Each local query head's KV (and index) head, as an index into the local KV heads."""
    return torch.tensor([h // module.num_key_value_groups - kv_heads.start for h in q_heads], device=device)


def heads_forward(module, cu_seqlens):
    """`ulysses_head_parallel`'s function: this rank's query heads over every document."""
    def run(local, heads):
        index = _kv_index(module, heads.heads("q"), heads.heads("k"), local["q"].device)

        def one(q, k, v, index_q, index_k):
            return block_sparse_attention(module, q, k, v, index_q, index_k, index)
        return over_documents(one, [local[name] for name in ("q", "k", "v", "iq", "ik")], cu_seqlens)
    return run


def generation_forward(module, hidden_states: torch.Tensor, cache, position_embeddings, **_):
    """The attention inside `generate` / `prefill` (the protocol around it: family.py): the
    chunk's KV heads join this rank's held ones (`update_own_heads`), its index keys every
    earlier token's (the layer's decoding state, on every rank); its query heads select and
    attend over them by heads. Returns (output, None)."""
    group = cache.ulysses[0]
    B, T, _ = hidden_states.shape
    tensors = _projections(module, hidden_states, position_embeddings)
    keys, values = cache.update_own_heads(tensors["k"].transpose(1, 2), tensors["v"].transpose(1, 2),
                                          module.layer_idx)
    index_k = tensors["ik"][:, :, 0]
    if cache.chunk_lens is not None:
        index_k = all_gather_sequence(index_k, cache.chunk_lens, 1, group)
    state = cache.mixer_state(module.layer_idx, T)
    held = state.get("index_keys")
    state["index_keys"] = index_k if held is None else torch.cat([held, index_k], dim=1)
    start, kv_heads = cache.forward_start, cache.kv_heads_held(module.config.num_key_value_heads)

    def run(local, heads):
        q = local["q"]
        index = _kv_index(module, heads.heads("q"), kv_heads, q.device)
        positions = torch.arange(start, start + q.shape[1], device=q.device)
        key_positions = torch.arange(keys.shape[2], device=q.device)
        return block_sparse_attention(module, q, keys.transpose(1, 2), values.transpose(1, 2), local["iq"],
                                      state["index_keys"][:, :, None], index, positions, key_positions)
    out = chunk_head_parallel(run, {"q": tensors["q"], "iq": tensors["iq"]}, cache)
    return module.o_proj(out.reshape(B, T, -1)), None


def m3_forward(self, call, hidden_states: torch.Tensor, position_embeddings, **_):
    """A sparse layer's forward over the sequence, by heads (the module doc; the protocol around
    it: family.py); returns (output, None)."""
    B, S, _ = hidden_states.shape
    tensors = _projections(self, hidden_states, position_embeddings)
    out = ulysses_head_parallel(heads_forward(self, call.cu_seqlens), tensors, call.group, seq_lens=call.lens)
    return self.o_proj(out.reshape(B, S, -1)), None


def dense_layer(module) -> bool:
    """A layer without an indexer: dense, which transformers' forward runs through the
    attention function (the package's)."""
    return module.indexer is None


FAMILY = Family("block_sparse", (Adapter(M3_CLASSES, "sparse_attention", m3_forward, SPARSE_ATTENTION,
                                         problem=placement_problem, generation=generation_forward,
                                         runs_as_written=dense_layer),),
                model_types=("minimax_m3_vl_text",))
