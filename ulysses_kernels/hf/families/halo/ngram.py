"""Qwen4-Exp's per-layer n-gram embeddings (PLE, `ple_layer_ids`) under sequence parallelism, by
the sequence halo (halo.py; docs/hf_families.md, "Sparse attention: Qwen4-Exp").

One PLE layer, as transformers 5.25 computes it (`Qwen4ExpTextPLELayer`): each token's hashed
n-grams of its `ngram_size - 1` previous token ids (the end-of-sequence id before a document's
first token, and a segment restarting after an end-of-sequence id) index an embedding; its
projections gate each residual stream per token; a depthwise convolution of kernel
`ple_conv_kernel_size`, dilated by `ngram_size`, reads the gated values of the
`(kernel - 1) x ngram_size` tokens before, zero before a document's first token.

Sequence-parallel: both read a fixed number of earlier rows, so both run through the halo: the
token ids (as float64, shifted by one so that the halo's zeros before a document read as the
end-of-sequence id) and the normed gated values. In generation both keep their last rows on the
decoding cache, the same on every rank.
"""

import math

import torch
import torch.nn.functional as F

from ..family import HALO, Adapter, Family
from ..mixers import refuse_conv_padding
from .halo import generation_layout, halo_map, training_layout

PLE_CLASSES = ("Qwen4ExpTextPLELayer",)


def _ngram_operator(embedding):
    """`halo.halo_map`'s operator of the n-gram embedding: a piece `[B, context + m, 1]` of token
    ids + 1 (0: before the document) -> the `m` tokens' embeddings `[B, m, E]`, as transformers'
    `Qwen4ExpTextNGramEmbedding` computes them from that history."""
    def run(piece):
        ids = piece[..., 0].round().long() - 1
        history = torch.where(ids < 0, embedding.eos_token_id, ids)
        m = piece.shape[1] - embedding.context_len
        shifted = [embedding._shift_right_ignore_eos(history, shift) for shift in range(embedding.ngram_size)]
        blocks = []
        for ngram in range(2, embedding.ngram_size + 1):
            first = (ngram - 2) * embedding.heads_per_ngram
            mixed = shifted[0] * embedding.layer_multipliers[0]
            for position in range(1, ngram):
                mixed = torch.bitwise_xor(mixed, shifted[position] * embedding.layer_multipliers[position])
            sizes = embedding.ngram_heads_vocab_sizes[first:first + embedding.heads_per_ngram]
            offsets = embedding.ngram_heads_offsets[first:first + embedding.heads_per_ngram]
            blocks.append(torch.remainder(mixed.unsqueeze(-1), sizes.view(1, 1, -1)) + offsets.view(1, 1, -1))
        return embedding.ngram_embedding(torch.cat(blocks, dim=-1)[:, -m:]).flatten(-2)
    return run


def _dilated_operator(module):
    """`halo.halo_map`'s operator of the dilated depthwise convolution and its SiLU: a piece `[B,
    reach + m, C]` -> `[B, m, C]`."""
    conv = module.conv1d
    return lambda piece: F.silu(F.conv1d(piece.transpose(1, 2), conv.weight, None, dilation=conv.dilation,
                                         groups=conv.groups)).transpose(1, 2)


def _gated_embeddings(module, hidden_states, input_ids, run):
    """The layer's output from `run(name, rows, operator, width)`, `operator` over the global
    sequence of `rows` (the module doc): the n-gram embeddings of the token ids, then the
    dilated convolution of the normed gated values."""
    embedding = module.ple_embedding
    ids = (input_ids.long() + 1).to(torch.float64).unsqueeze(-1)
    embeddings = run("ngram", ids, _ngram_operator(embedding), embedding.context_len)
    key_normed = module.norm_key(module.key_proj(embeddings)).unflatten(-1, (module.hc_count, module.hidden_size))
    value = module.value_proj(embeddings)
    query_normed = module.norm_query(hidden_states).unflatten(-1, (module.hc_count, module.hidden_size))
    gate = (key_normed * query_normed).sum(dim=-1, keepdim=True) / math.sqrt(module.hidden_size)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gated_value = torch.sigmoid(gate) * value.unsqueeze(-2)
    gated_value_normed = module.norm_conv(gated_value.flatten(-2))
    return gated_value.flatten(-2) + run("conv", gated_value_normed, _dilated_operator(module),
                                         module.short_conv_state_len)


def generation_forward(module, hidden_states, cache, input_ids, **_):
    """A forward inside `generate` / `prefill`: both halos continue from the layer's last rows
    on the decoding cache (every rank's copy), which they then replace."""
    state = cache.mixer_states.setdefault((module.layer_idx, "ple"), {})

    def run(name, rows, operator, width):
        out, last = halo_map(rows, operator, width, generation_layout(cache, rows.shape[1]), before=state.get(name))
        state[name] = last.detach().clone()
        return out
    return _gated_embeddings(module, hidden_states, input_ids, run)


def ple_forward(self, call, hidden_states: torch.Tensor, input_ids: torch.Tensor, **_):
    """Qwen4ExpTextPLELayer's forward, sequence-parallel (the module doc; the protocol around
    it: family.py): each document's halo on its own."""
    layout = training_layout(call.context, call.lens)

    def run(name, rows, operator, width):
        return halo_map(rows, operator, width, layout, cu_seqlens=call.cu_seqlens)[0]
    return _gated_embeddings(self, hidden_states, input_ids, run)


def refuse_padding(module, conv_mask=None, **_):
    """Before anything else, in generation or not: a padding mask for the convolution
    (`mixers.refuse_conv_padding`), whatever the cache."""
    refuse_conv_padding(module, conv_mask)


# No planner shape: its n-gram convolution (a few channels per token) is left out of the
# planner's memory model, which has no Qwen4-Exp preset.
FAMILY = Family("ngram", (Adapter(PLE_CLASSES, "short_conv", ple_forward, HALO, generation=generation_forward,
                                  refuse_first=refuse_padding, cache_kept="its convolution state is kept there only"),),
                model_types=("qwen4_exp_text", "qwen4_exp"))
