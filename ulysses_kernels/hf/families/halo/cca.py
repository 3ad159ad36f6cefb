"""ZAYA's Compressed Convolutional Attention projections (`ZayaCCAProjection`), sequence-parallel
by the sequence halo (docs/hf_hybrids.md, "The sequence halo"; halo.py).

One projection, as transformers 5.25 computes it: q and k projected per token; their
concatenation through a depthwise convolution of kernel `cca_time0`, then a grouped one (a
group per head) of kernel `cca_time1`, both unpadded, so each token reads the
`(cca_time0 - 1) + (cca_time1 - 1)` projections before it (zeros before its document); q and
k then add residual mixes of the token's own projections. Half the value channels are the
token's (`v_proj_current`), half the token before's (`v_proj_delayed`, concatenated after them
as transformers does; at a document's first
token, the projection of zeros). The attention after it is the package's (the head exchange),
through the attention function.

So the projections run on the local shard and the two convolutions and the delayed value read
the halo of the shards before it: the last `width` rows of `[q | k | hidden]` (`width` = the
convolutions' reach, at least 1 for the delayed value), zero across document starts. A stack
of two convolutions cannot zero its taps per output token, so each document piece runs on its
own (`halo.halo_map`).

Generation (hf/inference/cache.py): the layer's state is those last `width` rows, the same on
every rank (a sharded prefill chunk leaves every rank the chunk's last rows); a replicated
chunk (decoding) continues from it on every rank.
"""

import torch

from ..family import HALO, Adapter, Family
from ..mixers import refuse_conv_padding
from .halo import generation_layout, halo_map, training_layout

CCA_CLASSES = ("ZayaCCAProjection",)


def _width(module) -> int:
    """The earlier rows one token reads: the convolutions' reach, and the delayed value's one."""
    return max(module.conv_kernel_size, 1)


def _rows(module, hidden_states):
    """`[q | k | hidden]` of the local tokens, what the halo carries."""
    return torch.cat([module.q_proj(hidden_states), module.k_proj(hidden_states), hidden_states], dim=-1)


def _mixed_operator(module):
    """The causal part of the projection over `[B, width + m, q | k | hidden]` (the `width`
    rows before m tokens, then theirs) -> `[B, m, q | k (convolved) | delayed value]`."""
    width, reach = _width(module), module.conv_kernel_size
    qk_channels = module.conv_qk_depthwise.in_channels

    def operator(rows):
        qk = rows[:, width - reach:, :qk_channels].transpose(1, 2)
        convolved = module.conv_qk_grouped(module.conv_qk_depthwise(qk)).transpose(1, 2)
        delayed = module.v_proj_delayed(rows[:, width - 1:-1, qk_channels:])
        return torch.cat([convolved, delayed], dim=-1)

    return operator


def _projections(module, hidden_states, rows, mixed):
    """(query, key, value) `[B, m, heads, head_dim]` from the local rows and their causal part,
    with the residual mixes of transformers' projection."""
    shape = (*hidden_states.shape[:-1], -1, module.head_dim)
    groups = module.num_key_value_groups
    query_width = module.num_attention_heads * module.head_dim
    qk_channels = module.conv_qk_depthwise.in_channels
    query_proj = rows[..., :query_width].view(shape)
    key_proj = rows[..., query_width:qk_channels].view(shape)
    query_residual = (query_proj + key_proj.repeat_interleave(groups, dim=-2)) * 0.5
    key_residual = query_residual.view(*hidden_states.shape[:-1], -1, groups, module.head_dim).mean(dim=-2)
    query = mixed[..., :query_width].view(shape) + query_residual
    key = mixed[..., query_width:qk_channels].view(shape) + key_residual
    value = torch.cat([module.v_proj_current(hidden_states), mixed[..., qk_channels:]], dim=-1).view(shape)
    return query, key, value


def generation_forward(module, hidden_states, cache, conv_mask=None, **_):
    """A forward inside `generate` / `prefill`: the causal part continues from the layer's
    state (every rank's copy), which it then replaces."""
    refuse_conv_padding(module, conv_mask)
    state = cache.mixer_state(module.layer_idx, hidden_states.shape[1])
    rows = _rows(module, hidden_states)
    layout = generation_layout(cache, hidden_states.shape[1])   # the halo after the state (a sharded chunk)
    mixed, last = halo_map(rows, _mixed_operator(module), _width(module), layout, before=state.get("rows"))
    state["rows"] = last.detach().clone()
    return _projections(module, hidden_states, rows, mixed)


def cca_projection_forward(self, call, hidden_states: torch.Tensor, conv_mask=None, **_):
    """The projection of the local shard, its convolutions and delayed value over the global
    sequence (the module doc; the protocol around it: family.py). (The package's mask function
    refuses a padded batch first: a mask is never dropped here.)"""
    refuse_conv_padding(self, conv_mask)
    rows = _rows(self, hidden_states)
    mixed, _ = halo_map(rows, _mixed_operator(self), _width(self), training_layout(call.context, call.lens),
                        cu_seqlens=call.cu_seqlens)
    return _projections(self, hidden_states, rows, mixed)


# the halo reads the ring's chunks in their global order
FAMILY = Family("cca", (Adapter(CCA_CLASSES, "cca", cca_projection_forward, HALO, runs_on_a_ring=True,
                                generation=generation_forward, cache_kept="its convolution state is kept there only"),),
                model_types=("zaya",),
                planner_shape="cca")
