"""Inkling (`inkling_text`) under sequence parallelism: its short convolutions by the sequence
halo, its attention by the head exchange with the relative bias and the query scaling
computed from global positions (docs/hf_hybrids.md, "Hybrid models"; halo.py).

One decoder layer, as transformers 5.25 computes it (`InklingAttention`,
`InklingShortConvolution`):

- four depthwise causal convolutions of kernel `sconv_kernel_size` / `conv_kernel_size`, each
  `x + conv(x)` in float32: on the keys and on the values before the attention (their own
  channels), on the attention's output and on the MLP's output (the hidden size);
- the attention: q and k RMS-normed per head, scaled by `1 / head_dim`; a relative bias per
  query and head, `(r_proj(h)_h @ proj)[t - s]` for `0 <= t - s < rel_extent` (zero beyond),
  added to the scores; a full layer's queries and bias scaled by
  `1 + alpha log(max(1, (t + 1) / n_floor))` when `log_scaling_n_floor` is set; a sliding
  layer (`hybrid_sliding`) sees the `sliding_window_size` last keys and its bias reaches as
  far. Positions `t`, `s` are counted from the sequence's first token (each document's, when
  documents run alone).

Sequence-parallel: the convolutions read the last `kernel - 1` inputs of the shards before
(the halo, zero across document starts); q, k, v and the relative states `r` go to the head
layout in one exchange, where each rank computes its heads' attention over every document
with the bias and scaling at the tokens' positions in their document, then the output comes
back. The attention is dense per document and head (`[n, n]` scores, as transformers' own):
the package's kernels take no additive bias. Not on a ring (refused on every rank).

Generation (`ulysses_kernels.hf.generate` / `prefill`): each convolution keeps its last inputs
on the decoding cache (the same on every rank; a sharded prefill chunk reads them through the
halo); the attention caches this rank's KV heads (`update_own_heads`: every key, a sliding
layer's too, its window a mask) and its query heads attend over them with the bias and scaling
at the tokens' global positions (`decoding_heads`).
"""

from typing import Optional

import torch

from ....api import ulysses_head_parallel
from ..family import BY_HEADS, HALO, Adapter, Family
from ..mixers import causal_conv1d, chunk_head_parallel, over_documents, refuse_attention_dropout, refuse_conv_padding
from .halo import generation_layout, halo_map, training_layout

SHORT_CONV_CLASSES = ("InklingShortConvolution",)
ATTENTION_CLASSES = ("InklingAttention",)
# where a layer's states live instead of a cache given outside generation (Inkling's and Inkling 2's)
CONV_KEPT = "its convolution state is kept there only"
KEYS_KEPT = "its keys are sharded by heads there only"


def placement_problem(module, world: int) -> Optional[str]:
    """Why this attention's heads have no placement over `world` ranks (None: they have)."""
    heads, kv_heads = module.num_heads, module.num_key_value_heads
    if heads % world:
        return f"its query heads ({heads}) are not divisible by the sequence-parallel size ({world})"
    if kv_heads % world and world % kv_heads:
        return (f"its key/value heads ({kv_heads}) neither divide nor are divisible by the sequence-parallel size "
                f"({world})")
    return None


def convolve(module, call, rows, operator):
    """An Inkling (or Inkling 2) convolution over the global sequence, each document on its own:
    `operator` (`halo.halo_map`'s, reach `module.conv_kernel_size - 1`) over the local `rows`
    `[B, S, C']` (`call`: the protocol's MixerCall)."""
    layout = training_layout(call.context, call.lens)
    return halo_map(rows, operator, module.conv_kernel_size - 1, layout, cu_seqlens=call.cu_seqlens)[0]


def convolve_in_generation(module, rows, operator, cache, layer: int, kept: int):
    """The same inside `generate` / `prefill`, after the layer's last rows on the decoding
    cache (every rank's copy, `cache.mixer_states[layer]`, `layer` its cache layer), which it
    replaces: their first `kept` channels (what the operator reads of the rows before a
    token), zeros after. A layer's first convolution (`conv_idx` 0) counts the layer into the
    forward in progress."""
    T = rows.shape[1]
    state = cache.mixer_state(layer, T) if module.conv_idx == 0 else cache.mixer_states.setdefault(layer, {})
    name = f"conv{module.conv_idx}"
    before = state.get(name)
    if before is not None:
        before = torch.cat([before, before.new_zeros(*before.shape[:2], rows.shape[2] - kept)], dim=-1)
    out, last = halo_map(rows, operator, module.conv_kernel_size - 1, generation_layout(cache, T), before=before)
    state[name] = last[..., :kept].detach().clone()
    return out


def refuse_padding(module, conv_mask=None, **_):
    """A convolution's refusal before anything else, in generation or not, whatever the cache:
    a padding mask (`mixers.refuse_conv_padding`)."""
    refuse_conv_padding(module, conv_mask)


def refuse_padding_and_dropout(module, conv_mask=None, **_):
    """An attention's refusals before anything else: a padding mask for its convolutions, then
    attention dropout in training."""
    refuse_conv_padding(module, conv_mask)
    refuse_attention_dropout(module)


def depthwise(conv1d: torch.nn.Conv1d):
    """`halo.halo_map`'s operator of a depthwise convolution without bias, in float32 or wider:
    a piece `[B, K - 1 + m, C]` (its history first) -> `[B, m, C]`."""
    weight, width = conv1d.weight[:, 0, :].float(), conv1d.kernel_size[0] - 1
    return lambda piece: causal_conv1d(piece[:, width:], weight, None, None, None, history=piece[:, :width])


def short_conv_generation(module, hidden_states: torch.Tensor, cache, **_):
    """`x + conv(x)` in float32 inside `generate` / `prefill`, after the layer's state."""
    x = hidden_states.float()
    mixed = convolve_in_generation(module, x, depthwise(module.conv1d), cache, module.layer_idx, kept=x.shape[-1])
    return (mixed + x).to(hidden_states.dtype)


def short_conv_forward(self, call, hidden_states: torch.Tensor, **_):
    """`x + conv(x)` in float32 over the global sequence (the module doc; the protocol around
    it: family.py)."""
    x = hidden_states.float()
    return (convolve(self, call, x, depthwise(self.conv1d)) + x).to(hidden_states.dtype)


def relative_bias(table, relative, distance):
    """`[B, Hl, n, m]`: each query's bias over the keys (`relative` `[B, n, Hl, d_rel]`;
    `distance` `[n, m]`, the query's position less the key's), zero outside
    `0 <= distance < rel_extent`, as `InklingRelativeLogits` (`table`: it, or Inkling 2's
    `Inkling2RelativePositionBias`: the same `proj` and `rel_extent`)."""
    logits = (relative @ table.proj).transpose(1, 2)
    distance = distance[None, None]
    index = distance.clamp(0, table.rel_extent - 1).expand(*logits.shape[:2], -1, -1)
    return logits.gather(-1, index).masked_fill((distance < 0) | (distance >= table.rel_extent), 0.0)


def _query_scale(module, positions):
    """A full layer's log scaling of the queries and the bias at `positions` (None: none)."""
    config = module.config
    if module.is_sliding or config.log_scaling_n_floor is None:
        return None
    n = (positions + 1).float()
    return 1.0 + config.log_scaling_alpha * torch.log((n / config.log_scaling_n_floor).clamp(min=1.0))


def document_attention(module, q, k, v, relative, *, table, scale_queries: bool = False, sinks=None,
                       positions=None, key_positions=None):
    """Queries `[B, n, Hl, D]` over keys and values `[B, m, Hl, D]` (one per query head) of
    one document, `positions` / `key_positions` from its start (default: `arange(n)` for
    both, a document attending to itself): causal (and windowed: `module.sliding_window`)
    attention scaled by `module.scaling`, with the relative bias of `table`, Inkling's log
    scaling of queries and bias (`scale_queries`) and Inkling 2's sinks (`[B, n, Hl, 1]`: a
    logit per query and head with a zero value); the softmax in float32 or wider."""
    n = q.shape[1]
    positions = torch.arange(n, device=q.device) if positions is None else positions
    key_positions = positions if key_positions is None else key_positions
    distance = positions[:, None] - key_positions[None, :]
    bias = relative_bias(table, relative, distance)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    tau = _query_scale(module, positions) if scale_queries else None
    if tau is not None:
        tau = tau.view(1, 1, -1, 1)
        q = (q.float() * tau).to(q.dtype)
        bias = (bias.float() * tau).to(bias.dtype)
    scores = torch.matmul(q, k.transpose(2, 3)) * module.scaling + bias
    hidden = distance < 0
    if module.sliding_window is not None:
        hidden = hidden | (distance >= module.sliding_window)
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.transpose(1, 2).to(scores.dtype)], dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(v.dtype)
    return torch.matmul(probs[..., :k.shape[2]], v).transpose(1, 2)


def _kv_index(module, q_heads, kv_heads, device):
    """Each local query head's key/value head, as an index into the local KV heads."""
    return torch.tensor([h // module.num_key_value_groups - kv_heads.start for h in q_heads], device=device)


def heads_forward(module, cu_seqlens, *, table, scale_queries: bool = False):
    """`ulysses_head_parallel`'s function: this rank's query heads (tensors "q", "k", "v",
    "r" and optionally "sinks") over every document (`document_attention`)."""
    def run(local, heads):
        index = _kv_index(module, heads.heads("q"), heads.heads("k"), local["q"].device)
        k, v = local["k"].index_select(2, index), local["v"].index_select(2, index)
        tensors = [local["q"], k, v, local["r"]] + ([local["sinks"]] if "sinks" in local else [])

        def one(q, k, v, r, sinks=None):
            return document_attention(module, q, k, v, r, table=table, scale_queries=scale_queries, sinks=sinks)
        return over_documents(one, tensors, cu_seqlens)
    return run


def decoding_heads(module, cache, keys, values, *, table, scale_queries: bool = False):
    """`chunk_head_parallel`'s function in generation: this rank's query heads of the chunk
    (global positions from the cache's `forward_start`) over the keys this rank holds
    (`update_own_heads`: every earlier token and the chunk, positions from 0)."""
    start, kv_heads = cache.forward_start, cache.kv_heads_held(module.num_key_value_heads)

    def run(local, heads):
        q = local["q"]
        index = _kv_index(module, heads.heads("q"), kv_heads, q.device)
        k, v = (t.transpose(1, 2).index_select(2, index) for t in (keys, values))
        positions = torch.arange(start, start + q.shape[1], device=q.device)
        return document_attention(module, q, k, v, local["r"], table=table, scale_queries=scale_queries,
                                  sinks=local.get("sinks"), positions=positions,
                                  key_positions=torch.arange(k.shape[1], device=q.device))
    return run


def _projections(module, hidden_states, cache, kwargs=None):
    """q, k, v `[B, S, heads, head_dim]` (k and v after their convolutions, given the cache
    of a generation or None) and the relative states `[B, S, heads, d_rel]`, as transformers'."""
    B, S, _ = hidden_states.shape
    shape = (B, S, -1, module.head_dim)
    q = module.q_norm(module.q_proj(hidden_states).view(shape))
    k = module.k_norm(module.k_sconv(module.k_proj(hidden_states), cache=cache, **(kwargs or {})).view(shape))
    v = module.v_sconv(module.v_proj(hidden_states), cache=cache, **(kwargs or {})).view(shape)
    return q, k, v, module.r_proj(hidden_states).view(B, S, module.num_heads, -1)


def attention_generation(module, hidden_states: torch.Tensor, cache, **_):
    """The attention inside `generate` / `prefill`: the chunk's K/V join this rank's held
    heads (`update_own_heads`), its queries attend over them by heads (`decoding_heads`);
    returns (output, None)."""
    B, T, _ = hidden_states.shape
    q, k, v, r = _projections(module, hidden_states, cache)
    keys, values = cache.update_own_heads(k.transpose(1, 2), v.transpose(1, 2), module.layer_idx)
    run = decoding_heads(module, cache, keys, values, table=module.rel_logits_proj, scale_queries=True)
    return module.o_proj(chunk_head_parallel(run, {"q": q, "r": r}, cache).reshape(B, T, -1)), None


def attention_forward(self, call, hidden_states: torch.Tensor, attention_mask=None, conv_mask=None, **kwargs):
    """InklingAttention's forward, sequence-parallel (the module doc; the protocol around it:
    family.py); its convolutions get the layer's other keyword arguments (the documents);
    returns (output, None)."""
    B, S, _ = hidden_states.shape
    q, k, v, r = _projections(self, hidden_states, None, kwargs)
    run = heads_forward(self, call.cu_seqlens, table=self.rel_logits_proj, scale_queries=True)
    out = ulysses_head_parallel(run, {"q": q, "k": k, "v": v, "r": r}, call.group, seq_lens=call.lens)
    return self.o_proj(out.reshape(B, S, -1)), None


FAMILY = Family("inkling", (Adapter(SHORT_CONV_CLASSES, "short_conv", short_conv_forward, HALO,
                                    generation=short_conv_generation, refuse_first=refuse_padding, cache_kept=CONV_KEPT),
                            Adapter(ATTENTION_CLASSES, "inkling_attention", attention_forward, BY_HEADS,
                                    problem=placement_problem, generation=attention_generation,
                                    refuse_first=refuse_padding_and_dropout, cache_kept=KEYS_KEPT)),
                model_types=("inkling_text",),
                planner_shape="inkling")
