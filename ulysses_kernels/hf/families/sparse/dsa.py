"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5, A.X-K2, HY-V4, dots3) under sequence
parallelism, in training and generation: the queries stay on their sequence shard, what every
head shares is gathered (docs/hf_families.md, "Sparse attention: DeepSeek Sparse Attention";
the selection rule: selection.py).

One layer, as transformers 5.24 and 5.25 compute it (`DeepseekV32Attention`): MLA (queries
through a low-rank `q_resid`; keys and values expanded from one latent `c` of `kv_lora_rank`
per token plus a shared rotary key), and an indexer (without gradients) that scores every
visible key for each query, `sum_h w_h relu(q_h . k)` in float32, and keeps the `index_topk`
best; the attention runs over those only. The families differ in their projections and
output gates (`LAYOUTS`), their indexer's rope and scale (dsa_indexer.py); GLM-5's and HY-V4's "shared" layers reuse the previous full layer's
selection (passed from layer to layer as `prev_topk_indices`; here, the chosen keys).

Sequence-parallel: every rank gathers the latent and the rotary key (`kv_lora_rank +
qk_rope_head_dim` values a token, differentiable: the backward sums each token's gradient on
its owner) and the indexer key (`index_head_dim` a token, no gradient) of the whole sequence;
each rank scores its own queries over every key of their document up to them, selects its
top k by one rule (selection.py: the k largest, ties to the smaller global key index) and
attends over the selected keys in MLA's absorbed form (the queries into the latent space by
`kv_b_proj`'s key half, the output out of it by its value half): no head exchange, and no
rank expands the whole sequence's keys. Positions are global (each token's in its document).
In generation the decoding cache holds the same keys of every token on every rank
(`_generation_keys`), and a chunk's queries select and attend the same way.

Memory per rank: the gathered latent and indexer keys of the whole sequence (704 values a
token), the queries in the latent space (`[B, heads, S_local, kv_lora_rank]`), and one tile at
a time of the indexer's scores (`[B, QUERY_TILE, index heads, KEY_TILE]`, float32, a running
top k across the key tiles) and of the attention (each tile's chosen rows and scores,
recomputed in the backward), never `[S, heads, T]`. Not on a ring (refused on every rank).
"""

from typing import Callable, NamedTuple, Optional

import torch
from torch.utils.checkpoint import checkpoint

from ....api import gather_sequence
from ....exchange.sequence import all_gather_sequence
from ....layout import head_plan_error
from ..family import SPARSE_ATTENTION, Adapter, Family
from .dsa_indexer import Visibility, indexer_keys, rope_of, select, visibility

DSA_CLASSES = ("DeepseekV32Attention", "AXK2Attention")
# some layers reuse the previous full layer's selection ("shared"): GLM-5, HY-V4
SHARED_SELECTION_CLASSES = ("GlmMoeDsaAttention", "HYV4Attention")
DOTS3_CLASSES = ("Dots3NoteTextAttention",)   # DSA layers between sliding-window MLA layers
QUERY_TILE = 256    # queries attending at once over their selection (recomputed in the backward)


def _attend_tile(q_latent, q_rot, latent, rot_keys, chosen, scaling, sinks):
    """Queries `[B, H, q, R]` (in the latent) / `[B, H, q, r]` over their chosen keys `[B, q,
    k]` (EMPTY: none) of the latent `[B, T, R]` and rotary keys `[B, T, r]`: `[B, H, q, R]`.
    `sinks` `[H]` (HY-V4; None: none): one more logit a head in the softmax, with no value."""
    B, q, k = chosen.shape
    index = chosen.clamp(min=0)

    def picked(x):   # [B, T, C] -> each query's chosen rows [B, q, k, C]; the backward scatters into [B, T, C]
        rows = index.reshape(B, q * k, 1).expand(B, q * k, x.shape[-1])
        return x.gather(1, rows).view(B, q, k, x.shape[-1])
    c, r = picked(latent), picked(rot_keys)
    scores = (torch.einsum("bhqr,bqkr->bhqk", q_latent, c) + torch.einsum("bhqd,bqkd->bhqk", q_rot, r)) * scaling
    scores = scores.masked_fill((chosen < 0)[:, None], float("-inf"))
    if sinks is not None:   # float32 as transformers keeps them: torch.cat promotes as transformers' does
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(B, -1, q, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(c.dtype)
    return torch.einsum("bhqk,bqkr->bhqr", probs[..., :k], c)


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
                                chosen[:, part], module.scaling, getattr(module, "sinks", None),
                                use_reentrant=False))
    return torch.einsum("bhsr,hvr->bhsv", torch.cat(tiles, dim=2), weight[:, dn:])


class Projected(NamedTuple):
    """A DSA layer's projections of its local tokens: the indexer's query input `q_resid` `[B,
    S, q_lora_rank]`, the queries `[B, H, S, qk_head_dim]` and the shared latent `[B, S,
    kv_lora_rank]` and rotary key `[B, 1, S, qk_rope_head_dim]` (both before rope), and the
    output gate (None: none)."""
    q_resid: torch.Tensor
    queries: torch.Tensor
    latent: torch.Tensor
    rot_key: torch.Tensor
    gate: Optional[torch.Tensor]


def _latent_and_rot_key(module, hidden_states):
    B, S, _ = hidden_states.shape
    kv_pass, k_rot = torch.split(module.kv_a_proj_with_mqa(hidden_states),
                                 [module.kv_lora_rank, module.qk_rope_head_dim], dim=-1)
    return module.kv_a_layernorm(kv_pass.contiguous()), k_rot.view(B, 1, S, module.qk_rope_head_dim)


def _queries(module, q_resid):
    B, S, _ = q_resid.shape
    return module.q_b_proj(q_resid).view(B, S, -1, module.qk_head_dim).transpose(1, 2)


def _deepseek_projections(module, hidden_states):
    """DeepSeek-V3.2, GLM-5: MLA with a low-rank query."""
    q_resid = module.q_a_layernorm(module.q_a_proj(hidden_states))
    return Projected(q_resid, _queries(module, q_resid), *_latent_and_rot_key(module, hidden_states), gate=None)


def _axk2_projections(module, hidden_states):
    """A.X-K2: the queries and a sigmoid gate of each head's output from one projection of the
    normed and raw low-rank query."""
    B, S, _ = hidden_states.shape
    q_compressed = module.q_a_proj(hidden_states)
    q_resid = module.q_a_layernorm(q_compressed)
    both = module.q_gate_proj(torch.cat([q_resid, q_compressed], dim=-1)).view(B, S, -1,
                                                                              module.qk_head_dim + module.v_head_dim)
    queries, gate = torch.split(both, [module.qk_head_dim, module.v_head_dim], dim=-1)
    return Projected(q_resid, queries.transpose(1, 2), *_latent_and_rot_key(module, hidden_states), gate=gate)


def _hyv4_projections(module, hidden_states):
    """HY-V4: a sigmoid gate of each head's output from the hidden states (and sinks, read by
    `_attend_tile`)."""
    B, S, _ = hidden_states.shape
    gate = module.gate_proj(hidden_states).view(B, S, -1, module.gate_projection_size)
    return _deepseek_projections(module, hidden_states)._replace(gate=gate)


def _dots3_projections(module, hidden_states):
    """dots3: the normed query and latent rescaled, the rotary key normed, a sigmoid gate a head."""
    B, S, _ = hidden_states.shape
    q_resid = module.q_a_layernorm(module.q_a_proj(hidden_states)) * module.q_lora_scale
    latent, rot_key = _latent_and_rot_key(module, hidden_states)
    return Projected(q_resid, _queries(module, q_resid), latent * module.kv_lora_scale,
                     module.k_rope_only_layernorm(rot_key), gate=module.g_proj(hidden_states).view(B, S, -1, 1))


def _float_gate(out, gate):   # A.X-K2 takes the gate's sigmoid in float32
    return (out * torch.sigmoid(gate.float())).to(out.dtype)


def _gate(out, gate):
    return out * torch.sigmoid(gate)


class Layout(NamedTuple):
    projections: Callable
    gated: Callable   # (output `[B, S, H, v_head_dim]`, gate) -> the gated output


LAYOUTS = {"DeepseekV32Attention": Layout(_deepseek_projections, _gate),
           "GlmMoeDsaAttention": Layout(_deepseek_projections, _gate),
           "AXK2Attention": Layout(_axk2_projections, _float_gate),
           "HYV4Attention": Layout(_hyv4_projections, _gate),
           "Dots3NoteTextAttention": Layout(_dots3_projections, _gate)}


_PACKAGE = __name__.split(".")[0]


def _base_class(module) -> type:
    """transformers' class of an adapted module: the first in its MRO with a forward not the
    package's (the adapted class's forward is family.py's protocol, the layer's is its model's)."""
    return next(c for c in type(module).__mro__
                if "forward" in vars(c) and vars(c)["forward"].__module__.split(".")[0] != _PACKAGE)


def _family(module):
    return LAYOUTS[type(module).__name__]


def _training_keys(call):
    """`keys(shared, index_keys)` of a forward over the sequence (`call`: family.MixerCall): the
    latent and rotary keys `[B, S, R + r]` (gathered with a backward) and the indexer keys `[B,
    S, D]` (or None) of this rank's tokens -> those of the whole sequence, and which of them
    each local query sees (a `Visibility`: its document's, up to itself)."""
    lens, group, rank = call.lens, call.group, call.context.ulysses()[2]

    def keys(shared, index_keys):
        gathered = None if index_keys is None else all_gather_sequence(index_keys, lens, 1, group)
        return (gather_sequence(shared, group, dim=1, seq_lens=lens), gathered,
                visibility(lens, rank, call.cu_seqlens, shared.device))
    return keys


def _generation_keys(module, cache):
    """`keys(shared, index_keys)` inside `generate` / `prefill`: the chunk's keys join the ones
    the cache holds (`update_own_heads`: one head, so every rank holds every token, like MLA's
    latent), and each query of the chunk sees every key up to its position (one document a
    row: generation refuses padding)."""
    rank, layer = cache.ulysses[2], module.layer_idx

    def keys(shared, index_keys):
        if index_keys is None:   # a layer reusing a selection keeps no indexer key: latent and rotary key apart
            latent, rot_key = torch.split(shared, [module.kv_lora_rank, module.qk_rope_head_dim], dim=-1)
            held = torch.cat([t[:, 0] for t in cache.update_own_heads(latent[:, None], rot_key[:, None], layer)],
                             dim=-1)
            held_index = None
        else:
            held, held_index = (t[:, 0] for t in cache.update_own_heads(shared[:, None], index_keys[:, None], layer))
        first = cache.forward_start + (sum(cache.chunk_lens[:rank]) if cache.chunk_lens is not None else 0)
        return held, held_index, Visibility(torch.arange(first, first + shared.shape[1], device=shared.device), None)
    return keys


def _sparse_attention(module, hidden_states, position_embeddings, keys, shared_chosen=None):
    """(output, the chosen keys `[B, S_local, k]`) of a DSA layer (the module doc) over the keys
    that `keys` (`_training_keys`, `_generation_keys`) gives; a layer without an indexer of its
    own reuses `shared_chosen`, the previous full layer's."""
    B, S, _ = hidden_states.shape
    family = _family(module)
    rope = rope_of(_base_class(module))
    projected = family.projections(module, hidden_states)
    q_pass, q_rot = torch.split(projected.queries, [module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)
    cos, sin = position_embeddings
    rotated_q, rotated_k = rope(q_rot, projected.rot_key, cos, sin)
    q_rot, k_rot = rotated_q.to(q_rot.dtype), rotated_k.to(projected.rot_key.dtype)
    local = torch.cat([projected.latent, k_rot[:, 0]], dim=-1)   # what every head reads of a token
    index_keys = None
    if module.indexer is not None:
        with torch.no_grad():
            index_keys = indexer_keys(module.indexer, hidden_states, position_embeddings)
    shared, index_keys, visible = keys(local, index_keys)
    latent, rot_keys = torch.split(shared, [module.kv_lora_rank, module.qk_rope_head_dim], dim=-1)
    chosen = shared_chosen
    if module.indexer is not None:
        chosen = select(module.indexer, hidden_states, projected.q_resid, position_embeddings, index_keys, visible)
    elif chosen is None:
        raise ValueError(f"ulysses_kernels.hf: {type(module).__name__} shares the selection of a previous layer, "
                         "which gave none")
    out = _absorbed_attention(module, q_pass, q_rot, latent, rot_keys, chosen).transpose(1, 2)
    if projected.gate is not None:
        out = family.gated(out, projected.gate.reshape(B, S, module.num_heads, -1))
    return module.o_proj(out.reshape(B, S, -1)), chosen


def dsa_forward(self, call, hidden_states: torch.Tensor, position_embeddings, **_):
    """DeepseekV32Attention's, AXK2Attention's and dots3's DSA layers' forward over the sequence
    (the module doc; the protocol around it: family.py); returns (output, None)."""
    return _sparse_attention(self, hidden_states, position_embeddings, _training_keys(call))[0], None


def dsa_generation(self, hidden_states: torch.Tensor, cache, position_embeddings, **_):
    """`dsa_forward` inside `generate` / `prefill`: the same attention, over the keys the
    decoding cache holds."""
    return _sparse_attention(self, hidden_states, position_embeddings, _generation_keys(self, cache))[0], None


def shared_selection_forward(self, call, hidden_states: torch.Tensor, position_embeddings, prev_topk_indices=None,
                             **_):
    """GlmMoeDsaAttention's and HYV4Attention's forward over the sequence; returns (output,
    None, the chosen keys `[B, S_local, k]`, global indices), which the model hands to the next
    layer as `prev_topk_indices` (a "shared" layer's)."""
    out, chosen = _sparse_attention(self, hidden_states, position_embeddings, _training_keys(call),
                                    shared_chosen=prev_topk_indices)
    return out, None, chosen


def shared_selection_generation(self, hidden_states: torch.Tensor, cache, position_embeddings,
                                prev_topk_indices=None, **_):
    """`shared_selection_forward` inside `generate` / `prefill`, over the keys the decoding
    cache holds."""
    out, chosen = _sparse_attention(self, hidden_states, position_embeddings, _generation_keys(self, cache),
                                    shared_chosen=prev_topk_indices)
    return out, None, chosen


def sliding_window_layer(module) -> bool:
    """A dots3 layer without an indexer: a sliding-window MLA layer, which transformers' forward
    runs through the attention function (the package's)."""
    return module.indexer is None


def dots3_placement_problem(module, world: int) -> Optional[str]:
    """Why a dots3 sliding-window layer's heads (exchanged by the attention function) have no
    placement over `world` ranks (None: they have, or a DSA layer, whose queries stay on their
    shard)."""
    if not sliding_window_layer(module):
        return None
    return head_plan_error(world, module.num_heads, module.num_heads)   # MLA expands keys to every head


# Each class's generation is its training forward's attention over the keys the decoding cache
# holds (`_generation_keys`) instead of the gathered ones (`_training_keys`).
FAMILY = Family("dsa", (Adapter(DSA_CLASSES, "sparse_attention", dsa_forward, SPARSE_ATTENTION,
                                generation=dsa_generation),
                        Adapter(SHARED_SELECTION_CLASSES, "sparse_attention", shared_selection_forward,
                                SPARSE_ATTENTION, generation=shared_selection_generation),
                        Adapter(DOTS3_CLASSES, "sparse_attention", dsa_forward, SPARSE_ATTENTION,
                                problem=dots3_placement_problem, generation=dsa_generation,
                                runs_as_written=sliding_window_layer)),
                model_types=("deepseek_v32", "glm_moe_dsa", "axk2", "hy_v4", "dots3_note_text"))
