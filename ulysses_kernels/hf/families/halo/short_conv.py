"""The short convolutions of LFM2, LFM2-MoE and LFM3, sequence-parallel by the sequence halo
(docs/hf_hybrids.md, "The sequence halo"; halo.py).

One layer, as transformers 5.24 and 5.25 compute it: `in_proj` gives B, C and x per token;
`y = C * conv(B * x)` with a depthwise causal convolution of kernel `conv_L_cache` (3 in
LFM2's checkpoints, 7 in LFM3's) and no activation; `out_proj`. Only the convolution reads
earlier tokens, `conv_L_cache - 1` of them: everything runs on the local shard, the
convolution after the halo of the shards before it (zero across document starts), so no
head exchange is needed.

Generation (hf/inference/cache.py): the layer's state is the last `conv_L_cache - 1` inputs of
the convolution, the same on every rank (a sharded prefill chunk leaves every rank the
chunk's last inputs, halo.py); a replicated chunk (decoding) continues from it on every rank.
"""


import torch

from ..family import HALO, Adapter, Family
from ..mixers import causal_conv1d, conv_history
from .halo import contiguous_layout, halo_conv, training_layout

SHORT_CONV_CLASSES = ("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv")


def _weights(module):
    return module.conv.weight[:, 0, :], module.conv.bias


def _gated_inputs(module, hidden_states):
    """(B * x, C) of the local tokens `[B, S, hidden]` each."""
    b, c, x = module.in_proj(hidden_states).chunk(3, dim=-1)
    return b * x, c


def generation_forward(module, hidden_states, cache, **_):
    """A forward inside `generate` / `prefill`: the convolution continues from the layer's
    state (every rank's copy), which it then replaces."""
    state = cache.mixer_state(module.layer_idx, hidden_states.shape[1])
    bx, c = _gated_inputs(module, hidden_states)
    weight, bias = _weights(module)
    before = state.get("conv")
    if cache.chunk_lens is not None:   # a chunk split along the sequence: the halo, after the state
        y, last = halo_conv(bx, weight, bias, contiguous_layout(cache.ulysses, cache.chunk_lens), before=before)
        state["conv"] = last.detach().clone()
    else:                              # every rank holds the whole chunk
        y = causal_conv1d(bx, weight, bias, None, None, history=before)
        state["conv"] = conv_history(before, bx, weight.shape[-1])
    return module.out_proj(c * y)


def short_conv_forward(self, call, hidden_states: torch.Tensor, **_):
    """The layer's forward on the local shard, its convolution over the global sequence (the
    module doc; the protocol around it: family.py)."""
    bx, c = _gated_inputs(self, hidden_states)
    weight, bias = _weights(self)
    y, _ = halo_conv(bx, weight, bias, training_layout(call.context, call.lens), cu_seqlens=call.cu_seqlens)
    return self.out_proj(c * y)


# the halo reads the ring's chunks in their global order
FAMILY = Family("short_conv", (Adapter(SHORT_CONV_CLASSES, "short_conv", short_conv_forward, HALO,
                                       runs_on_a_ring=True, generation=generation_forward, pads=True,
                                       cache_kept="its convolution state is kept there only"),),
                model_types=("lfm2", "lfm2_moe", "lfm3"),
                planner_shape="short_conv")
