"""Inkling 2 (`inkling2_text`, `inkling2_loop_text`) under sequence parallelism: its short
convolutions (static, and per-token taps in the full layers) by the sequence halo, its attention
by the head exchange with the relative bias and per-query sinks, its attention residuals over
the layers on each token (docs/hf_hybrids.md, "Hybrid models"; inkling.py holds what Inkling
and Inkling 2 share).

One decoder layer, as transformers 5.25 computes it:

- `Inkling2ShortConvolution`: `(x + conv(x)) / sqrt(K + 1)` in float32, K the kernel (the keys
  and values of a sliding layer; the attention's and the MLP's outputs of every layer);
- `Inkling2DynamicShortConvolution` (the keys and values of a full layer): taps per token, the
  static ones plus a projection of the token's key (or value) input, shared within a KV head,
  over the last K inputs: `(x + sum_lag taps[lag] x[t - lag]) / sqrt(2K + 1)`;
- the attention: queries and relative states scaled and L2-clipped per head (a full layer's
  log-scaled by the token's position, `position_ids`), keys L2-clipped, values RMS-normed, all
  per token; a relative bias `(r_t @ proj)[t - s]` within `rel_extent`; one sink logit per
  query and head (`sink_proj`); scale `1 / sqrt(head_dim)`; a sliding layer windowed; the
  output gated by the layer's input;
- `Inkling2BlockAttentionResidual`: a softmax over the layers' outputs at each token (the
  attention interface, but over depth, not the sequence).

Sequence-parallel: the convolutions read the last `K - 1` inputs of the shards before (the
halo; a dynamic convolution's inputs travel with their tokens' taps, so the history rows carry
K x channels more), the attention's q, k, v, relative states and sinks go to the head layout in
one exchange (inkling.py's `heads_forward`: dense per document and head), the residuals over
depth run on each rank's tokens. Positions are the model's `position_ids` (each token's in its
document, from `shard_batch`), never a shard's `arange`. Not on a ring (refused on every rank).

Generation: as Inkling's (inkling.py): each convolution's last inputs on the decoding cache,
this rank's KV heads cached and attended by its query heads; the Loop's later passes use cache
layers of their own (`layer_idx + cache_offset`), as transformers' cache does.
"""

import math

import torch

from ....api import ulysses_head_parallel
from ..family import BY_HEADS, DEPTH, HALO, Adapter, Family
from ..mixers import chunk_head_parallel
from .inkling import (
    CONV_KEPT,
    KEYS_KEPT,
    convolve,
    convolve_in_generation,
    decoding_heads,
    depthwise,
    heads_forward,
    placement_problem,
    refuse_padding,
    refuse_padding_and_dropout,
)

# Inkling 2 Loop's classes are Inkling 2's, renamed; its message residual is one more attention over depth
STATIC_CONV_CLASSES = ("Inkling2ShortConvolution", "Inkling2LoopShortConvolution")
DYNAMIC_CONV_CLASSES = ("Inkling2DynamicShortConvolution", "Inkling2LoopDynamicShortConvolution")
ATTENTION_CLASSES = ("Inkling2SlidingAttention", "Inkling2FullAttention", "Inkling2LoopSlidingAttention",
                     "Inkling2LoopFullAttention")
RESIDUAL_CLASSES = ("Inkling2BlockAttentionResidual", "Inkling2LoopBlockAttentionResidual")
MESSAGE_CLASSES = ("Inkling2LoopMessageAttentionResidual",)


def static_conv_generation(module, hidden_states: torch.Tensor, cache, cache_offset: int = 0, **_):
    """`(x + conv(x)) / sqrt(K + 1)` in float32 inside `generate` / `prefill`, after the state
    of cache layer `layer_idx + cache_offset` (the Loop's later passes have layers of their own)."""
    x = hidden_states.float()
    mixed = convolve_in_generation(module, x, depthwise(module.conv1d), cache, module.layer_idx + cache_offset,
                                   kept=x.shape[-1])
    return _static_output(module, mixed, x, hidden_states.dtype)


def static_conv_forward(self, call, hidden_states: torch.Tensor, **_):
    """`(x + conv(x)) / sqrt(K + 1)` in float32 over the global sequence (the module doc; the
    protocol around it: family.py)."""
    x = hidden_states.float()
    return _static_output(self, convolve(self, call, x, depthwise(self.conv1d)), x, hidden_states.dtype)


def _static_output(module, mixed, x, dtype):
    """The layer's output from the convolution `mixed` of its float32 inputs `x`."""
    return ((mixed + x) / math.sqrt(module.conv_kernel_size + 1)).to(dtype)


def _dynamic_taps(module, dynamic_input, B, S):
    """Every token's taps `[B, S, heads, channels / heads, K]` (lag order: `[..., 0]` the token
    itself), float32 or wider, as transformers sums them."""
    K = module.conv_kernel_size
    dynamic = module.weight_proj(dynamic_input).float().view(B, S, module.num_heads, 1, K)
    return module.static_weight.float().T.view(module.num_heads, -1, K) + dynamic


def _per_token_taps(B, C, K, heads):
    """`halo.halo_map`'s operator of a convolution whose taps travel with the tokens: a piece
    `[B, K - 1 + m, C (1 + K)]` (inputs, then each token's `C x K` taps) -> `[B, m, C]`."""
    def operator(piece):
        m = piece.shape[1] - (K - 1)
        windows = piece[..., :C].unfold(1, K, 1).flip(-1).reshape(B, m, heads, C // heads, K)
        own = piece[:, K - 1:, C:].reshape(B, m, heads, C // heads, K)
        return (windows * own).sum(-1).reshape(B, m, C)
    return operator


def _dynamic_rows(module, hidden_states, dynamic_input):
    """(the rows the halo carries, `[B, S, C (1 + K)]`: each token's input, then its `C x K`
    taps; the inputs `x` in float32)."""
    B, S, C = hidden_states.shape
    x = hidden_states.float()
    taps = _dynamic_taps(module, dynamic_input, B, S).to(x.dtype).reshape(B, S, C * module.conv_kernel_size)
    return torch.cat([x, taps], dim=-1), x


def _dynamic_output(module, mixed, x, dtype):
    """The layer's output from the convolution `mixed` of its float32 inputs `x`."""
    return ((mixed + x) / math.sqrt(2 * module.conv_kernel_size + 1)).to(dtype)


def dynamic_conv_generation(module, hidden_states: torch.Tensor, cache, dynamic_input: torch.Tensor,
                            cache_offset: int = 0, **_):
    """The convolution with per-token taps inside `generate` / `prefill`: the state keeps the
    inputs only (of cache layer `layer_idx + cache_offset`)."""
    B, S, C = hidden_states.shape
    rows, x = _dynamic_rows(module, hidden_states, dynamic_input)
    mixed = convolve_in_generation(module, rows, _per_token_taps(B, C, module.conv_kernel_size, module.num_heads),
                                   cache, module.layer_idx + cache_offset, kept=C)
    return _dynamic_output(module, mixed, x, hidden_states.dtype)


def dynamic_conv_forward(self, call, hidden_states: torch.Tensor, dynamic_input: torch.Tensor, **_):
    """The convolution with per-token taps over the global sequence (the module doc; the
    protocol around it: family.py): each token's taps travel with its input through the halo."""
    B, S, C = hidden_states.shape
    rows, x = _dynamic_rows(self, hidden_states, dynamic_input)
    mixed = convolve(self, call, rows, _per_token_taps(B, C, self.conv_kernel_size, self.num_heads))
    return _dynamic_output(self, mixed, x, hidden_states.dtype)


def _inputs(hidden_states, key_hidden_states, value_hidden_states):
    """What the keys and the values are projected from (the layer's input where not given)."""
    return (hidden_states if key_hidden_states is None else key_hidden_states,
            hidden_states if value_hidden_states is None else value_hidden_states)


# The attention's forwards name attention_mask, relative_distance and conv_mask so that they stay
# out of what the projections' convolutions get (the layer's `**kwargs`: position ids, documents).
def attention_forward(self, call, hidden_states: torch.Tensor, key_hidden_states=None, value_hidden_states=None,
                      attention_mask=None, relative_distance=None, conv_mask=None, cache_offset: int = 0, **kwargs):
    """Inkling2SlidingAttention's and Inkling2FullAttention's forward, sequence-parallel (the
    module doc; the protocol around it: family.py); returns (output, None)."""
    keys_from, values_from = _inputs(hidden_states, key_hidden_states, value_hidden_states)
    B, S, _ = hidden_states.shape
    q, k, v, r, sinks = _projections(self, hidden_states, keys_from, values_from, dict(kwargs, conv_mask=conv_mask))
    out = ulysses_head_parallel(heads_forward(self, call.cu_seqlens, table=self.relative_position_bias),
                                {"q": q, "k": k.transpose(1, 2), "v": v.transpose(1, 2), "r": r, "sinks": sinks},
                                call.group, seq_lens=call.lens)
    return self.o_proj(out.reshape(B, S, -1), hidden_states), None


def _projections(module, hidden_states, keys_from, values_from, kwargs):
    """q `[B, S, heads, D]`, k and v `[B, kv heads, S, D]` (after their convolutions: `kwargs`
    carries the cache and its offset in generation), the relative states `[B, S, heads,
    d_rel]` and the sinks `[B, S, heads, 1]`, as transformers computes them per token."""
    B, S, _ = hidden_states.shape
    position_ids = kwargs["position_ids"]
    q = module.q_proj(hidden_states, position_ids).transpose(1, 2)
    k = module.k_proj(keys_from, **kwargs)
    v = module.v_proj(values_from, **kwargs)
    table = module.relative_position_bias
    r = table.norm(table.linear(hidden_states).view(B, S, table.num_heads, -1), position_ids)
    return q, k, v, r, module.sink_proj(hidden_states).unsqueeze(-1)


def _over_depth(module, block_states, partial_block_states, queries):
    """`[B, S, queries, hidden]`: each token's attention of `queries` `[queries, hidden]` over
    its layers' outputs (normed), as transformers' eager attention computes it (softmax in
    float32 or wider), on this rank's tokens: never through the attention function, which is
    the sequence's."""
    stacked = module.norm(torch.cat([block_states, partial_block_states.unsqueeze(-2)], dim=-2).float())
    hidden = stacked.shape[-1]
    queries = queries.float().view(-1, hidden).to(stacked.dtype)
    scores = torch.einsum("qh,bslh->bsql", queries, stacked) * hidden ** -0.5
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(stacked.dtype)
    return torch.einsum("bsql,bslh->bsqh", probs, stacked)


def attention_generation(module, hidden_states: torch.Tensor, cache, key_hidden_states=None,
                         value_hidden_states=None, attention_mask=None, relative_distance=None, conv_mask=None,
                         cache_offset: int = 0, **kwargs):
    """The attention inside `generate` / `prefill` (inkling.py's `decoding_heads`): the chunk's
    K/V join this rank's held heads of cache layer `layer_idx + cache_offset` (the Loop's later
    passes have layers of their own), its queries, relative states and sinks attend by heads;
    returns (output, None)."""
    keys_from, values_from = _inputs(hidden_states, key_hidden_states, value_hidden_states)
    B, T, _ = hidden_states.shape
    q, k, v, r, sinks = _projections(module, hidden_states, keys_from, values_from,
                                     dict(kwargs, cache=cache, cache_offset=cache_offset))
    keys, values = cache.update_own_heads(k, v, module.layer_idx + cache_offset)
    run = decoding_heads(module, cache, keys, values, table=module.relative_position_bias)
    out = chunk_head_parallel(run, {"q": q, "r": r, "sinks": sinks}, cache)
    return module.o_proj(out.reshape(B, T, -1), hidden_states), None


def block_residual_forward(self, block_states: torch.Tensor, partial_block_states: torch.Tensor):
    """`Inkling2BlockAttentionResidual`'s forward on this rank's tokens (`_over_depth`)."""
    return _over_depth(self, block_states, partial_block_states, self.query).unbind(-2)


def message_residual_forward(self, block_states: torch.Tensor, partial_block_states: torch.Tensor,
                             loop_layer_idx: int):
    """`Inkling2LoopMessageAttentionResidual`'s forward on this rank's tokens (`_over_depth`)."""
    return _over_depth(self, block_states, partial_block_states, self.query[loop_layer_idx])


# the residuals over depth read each token's own states only: the same forward in generation
FAMILY = Family("inkling2", (Adapter(STATIC_CONV_CLASSES, "short_conv", static_conv_forward, HALO,
                                     generation=static_conv_generation, refuse_first=refuse_padding,
                                     cache_kept=CONV_KEPT),
                             Adapter(DYNAMIC_CONV_CLASSES, "short_conv", dynamic_conv_forward, HALO,
                                     generation=dynamic_conv_generation, refuse_first=refuse_padding,
                                     cache_kept=CONV_KEPT),
                             Adapter(ATTENTION_CLASSES, "inkling_attention", attention_forward, BY_HEADS,
                                     problem=placement_problem, generation=attention_generation,
                                     refuse_first=refuse_padding_and_dropout, cache_kept=KEYS_KEPT),
                             Adapter(RESIDUAL_CLASSES, "depth_attention", block_residual_forward, DEPTH,
                                     generation=block_residual_forward),
                             Adapter(MESSAGE_CLASSES, "depth_attention", message_residual_forward, DEPTH,
                                     generation=message_residual_forward)),
                model_types=("inkling2_text", "inkling2_loop_text"),
                planner_shape="inkling")
