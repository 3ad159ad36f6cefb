"""Memory planner: what one training step of a causal LM needs per GPU with Ulysses (x Ring)
sequence parallelism, and the longest sequence that fits (`ulysses-kernels plan`).

The model is a sum of named terms (bytes per GPU), each a formula of the model config and
the options; docs/architecture.md ("Memory planner") lists them. It describes this
package's training recipe: FSDP2 over all GPUs (fp32 sharded parameters, gradients and
AdamW states, bf16 compute copies gathered one layer at a time, one prefetched),
activation checkpointing per decoder layer, the Ulysses exchange and flash attention,
tiled MLP and tiled loss when asked, checkpoint offload when asked. Defaults that the code
chooses (tile sizes) come from the same functions the code uses.
"""

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Dict, List, NamedTuple, Optional, Sequence

GIB = float(1 << 30)
# Activation multiples of one decoder layer (see memory_terms), fitted on CPU measurements
# of Hugging Face Llama layers (bench/plan_validation.py).
SAVED_HIDDEN, SAVED_QKV, SAVED_OUT, SAVED_MLP, TRANSIENT_MLP = 4, 3, 2, 4, 3


@dataclass(frozen=True)
class MixerShape:
    """The linear-attention (Gated DeltaNet) or state-space (Mamba2) layers of a hybrid model
    (docs/hf_hybrids.md, "Hybrid models"), sequence-parallel by heads, or its short convolutions
    (LFM2, LFM3: the sequence halo). heads: value heads (GDN) or heads (Mamba2; 1 for a short
    convolution); groups: key heads (GDN) or groups of B and C (Mamba2; 0); key_dim: the key
    head dim (GDN) or the state size (Mamba2; 0); value_dim: the value head dim (GDN) or the
    head dim (Mamba2; the hidden size for a short convolution)."""

    kind: str          # "gated_deltanet", "kimi_delta" (groups = heads), "mamba2", "short_conv",
                       # "lightning" (MiniMax: groups = heads, no convolution: conv_kernel 1), "mamba1"
                       # (heads 1, groups 0, key_dim the state, value_dim the channels) or "rg_lru"
                       # (heads: the gates' blocks, value_dim the LRU width) or "cca" (ZAYA's convolutions
                       # of q|k before its attention: heads / groups the query / KV heads, key_dim the head
                       # dim, value_dim the hidden size, conv_kernel / second_kernel the two kernels) or
                       # "rwkv" (a block's time and channel mixing: key_dim the hidden size, value_dim the
                       # WKV channels, mlp_width the channel mixing's width, conv_kernel 2: the token shift) or
                       # "mlstm" (xLSTM: groups = heads, key_dim / value_dim the q/k and v head dims, no
                       # convolution: conv_kernel 1; proj_bias its `use_bias`) or "inkling" (the convolutions
                       # of Inkling's layers: heads / groups the full / sliding layers' K/V widths, key_dim their
                       # kernel, value_dim the hidden size, conv_kernel the hidden convolutions' kernel)
    layers: int
    heads: int
    groups: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    conv_bias: bool = True    # Mamba2's convolution bias (Gated DeltaNet has none)
    norm: bool = True         # Mamba2's gated RMSNorm (Falcon-H1's `mamba_rms_norm` may drop it)
    gate_rank: int = 0        # Kimi Delta Attention's gates: low rank (Kimi Linear: the head dim), 0 full (Ling);
                              # Mamba1's dt rank
    proj_bias: bool = False   # Mamba1's in_proj / out_proj bias
    norm_weights: bool = False   # Mamba1's dt/B/C norms with weights (Jamba; Falcon-Mamba's are weightless)
    second_kernel: int = 0    # ZAYA's grouped convolution (a group per head) after the depthwise one
    mlp_width: int = 0        # RWKV's channel mixing (its MLP) width
    sliding_layers: int = 0   # Inkling's layers with the sliding layers' K/V width (`groups`)
    dynamic: bool = False     # Inkling 2: its full layers' key and value convolutions take per-token taps

    @property
    def conv_channels(self) -> int:
        """q|k|v (GDN), x|B|C (Mamba2) or q|k (ZAYA): the depthwise convolution's channels."""
        if self.kind == "cca":
            return (self.heads + self.groups) * self.key_dim
        return 2 * self.groups * self.key_dim + self.heads * self.value_dim

    def total_params(self, hidden: int) -> int:
        """Every layer's token mixer (`params`; Inkling's full and sliding layers apart)."""
        if self.kind == "inkling":   # four depthwise convolutions a layer, no bias
            if self.dynamic:
                raise ValueError("plan: the parameters of Inkling 2's per-token convolutions are not modelled")
            full, sliding = self.layers - self.sliding_layers, self.sliding_layers
            return (full * 2 * self.heads + sliding * 2 * self.groups) * self.key_dim \
                + self.layers * 2 * hidden * self.conv_kernel
        return self.layers * self.params(hidden)

    def total_state_bytes(self, sp: int, *, batch: int = 1, dtype_bytes: int = 2) -> int:
        """Every layer's generation state on one of `sp` Ulysses ranks (`state_bytes`;
        Inkling's: the last inputs of its four convolutions, in float32 whatever the weights'
        dtype, as they compute, the same on every rank; `layers` counts a loop's passes)."""
        if self.kind == "inkling":
            widths = (self.layers - self.sliding_layers) * self.heads + self.sliding_layers * self.groups
            return batch * (2 * widths * (self.key_dim - 1) + self.layers * 2 * self.value_dim * (self.conv_kernel - 1)) * 4
        return self.layers * self.state_bytes(sp, batch=batch, dtype_bytes=dtype_bytes)

    def params(self, hidden: int) -> int:
        """One layer's token mixer (projections, convolution, per-head parameters, norm)."""
        inner = self.heads * self.value_dim
        conv = self.conv_channels * self.conv_kernel
        if self.kind == "short_conv":   # in_proj B|C|x, the convolution, out_proj (each with its bias or none)
            return 4 * hidden * hidden + hidden * self.conv_kernel + 5 * hidden * self.conv_bias
        if self.kind == "cca":          # the two convolutions (the attention's q/k/v/o are counted as attention's)
            channels = self.conv_channels
            return channels * (self.conv_kernel + 1) + channels * (channels // (self.heads + self.groups)) \
                * self.second_kernel + channels
        if self.kind == "rwkv":         # time mixing: decay, bonus, three mixes, key, value, receptance, output;
            h, a, w = hidden, self.value_dim, self.mlp_width   # channel mixing: two mixes, key, receptance, value
            return (2 * a + 3 * h + 4 * h * a) + (2 * h + 2 * h * w + h * h)
        if self.kind == "mlstm":        # q, k, v, the output gate, the input and forget gates (biased), the
            qk = self.heads * self.key_dim   # per-head norm, out_proj; biases where `use_bias`
            return (hidden * (2 * qk + 3 * inner + 2 * self.heads) + 2 * self.heads + inner
                    + self.proj_bias * (2 * qk + 3 * inner + hidden))
        if self.kind == "lightning":    # qkv_proj, output_gate, out_proj, the norm over all heads
            return 5 * hidden * inner + inner
        if self.kind == "rg_lru":       # linear_x, linear_y, linear_out, the convolution (biases), the two gates
            width, block = self.value_dim, self.value_dim // self.heads   # (one block per head), recurrent_param
            return 3 * hidden * width + 2 * width + hidden + width * self.conv_kernel + width + 2 * (width * block
                                                                                                  + width) + width
        if self.kind == "mamba1":       # in_proj x|z, the convolution, x_proj, dt_proj, A_log, D, out_proj, norms
            d, n, r = self.value_dim, self.key_dim, self.gate_rank
            return (2 * hidden * d + d * self.conv_kernel + d * (r + 2 * n) + r * d + d + d * n + d + d * hidden
                    + self.conv_bias * d + self.proj_bias * (2 * d + hidden) + self.norm_weights * (r + 2 * n))
        if self.kind == "kimi_delta":   # q|k|v, the convolution, the forget and output gates, b, dt_bias, A_log,
            r = self.gate_rank          # the per-head norm, o_proj
            gate = hidden * r + r * inner if r else hidden * inner
            return 4 * hidden * inner + conv + 2 * gate + hidden * self.heads + inner + self.heads + self.value_dim
        if self.kind == "gated_deltanet":   # in_proj q|k|v|z and b|a, A_log, dt_bias, a per-head norm
            return hidden * (self.conv_channels + inner + 2 * self.heads) + conv + 2 * self.heads + self.value_dim \
                + inner * hidden
        return (hidden * (self.conv_channels + inner + self.heads) + conv   # in_proj z|x|B|C|dt, the convolution
                + self.conv_channels * self.conv_bias + 3 * self.heads        # its bias, A_log, D, dt_bias
                + inner * self.norm + inner * hidden)                         # the gated norm, out_proj

    def state_bytes(self, sp: int, *, batch: int = 1, dtype_bytes: int = 2) -> int:
        """One layer's generation state on one of `sp` Ulysses ranks (hf/inference/cache.py's
        `mixer_states`): the last `conv_kernel - 1` inputs of this rank's channels (in the
        compute dtype) and the recurrent state of its heads (float32 at least: transformers'
        gated delta rule computes in float32, the package's Mamba2 scan in float32 or wider).
        Heads and groups fewer than the ranks are replicated, one to each rank. A short
        convolution's state is its last inputs, the same on every rank."""
        if self.kind == "short_conv":
            return batch * (self.conv_kernel - 1) * self.conv_channels * dtype_bytes
        if self.kind == "cca":      # the same on every rank: the last q|k projections and inputs the convolutions
            reach = max(1, self.conv_kernel + self.second_kernel - 2)   # and the delayed value read
            return batch * reach * (self.conv_channels + self.value_dim) * dtype_bytes
        if self.kind == "rwkv":     # the same on every rank: the two shifts' last input, WKV's (num, den, max)
            return batch * (2 * self.key_dim * dtype_bytes + 3 * self.value_dim * max(4, dtype_bytes))
        if self.kind == "rg_lru":   # the same on every rank: the conv history, the recurrent state (float32 at least)
            return batch * ((self.conv_kernel - 1) * self.value_dim * dtype_bytes + self.value_dim * max(4, dtype_bytes))
        if self.kind == "mamba1":   # the same on every rank: the conv history, the scan state (float32 at least)
            d, n = self.value_dim, self.key_dim
            return batch * ((self.conv_kernel - 1) * d * dtype_bytes + d * n * max(4, dtype_bytes))
        heads = max(1, self.heads // sp)
        if self.kind == "mlstm":    # this rank's heads: C, n and the stabiliser m (float32 at least)
            return batch * heads * (self.key_dim * self.value_dim + self.key_dim + 1) * max(4, dtype_bytes)
        groups = max(1, self.groups // sp)
        channels = 2 * groups * self.key_dim + heads * self.value_dim
        state_bytes = {"gated_deltanet": 4, "kimi_delta": 4, "lightning": dtype_bytes}.get(self.kind,
                                                                                          max(4, dtype_bytes))
        return batch * ((self.conv_kernel - 1) * channels * dtype_bytes
                        + heads * self.key_dim * self.value_dim * state_bytes)


@dataclass(frozen=True)
class ExpertShape:
    """The mixture-of-experts MLPs of a model (docs/planner.md, "Mixtures of experts"): in
    `layers` of its layers (the others dense, of the model's `intermediate` width), `experts`
    routed experts of `width` each (gate, up and down projections), `top_k` of them per
    token, beside shared experts of `shared_width` in all (0: none) and a router."""
    experts: int
    top_k: int
    width: int
    layers: int
    shared_width: int = 0
    shared_gate: bool = False    # a sigmoid gate on the shared expert's output (Qwen2-MoE)
    router_bias: bool = False    # a bias per expert in the router (GPT-OSS; DeepSeek-V3's is a buffer)
    expert_bias: bool = False    # biases in the experts' projections (GPT-OSS)

    def expert_params(self, hidden: int) -> int:
        """One routed expert's parameters."""
        return 3 * hidden * self.width + self.expert_bias * (2 * self.width + hidden)

    def layer_params(self, hidden: int) -> int:
        """One MoE layer's MLP: every routed expert, the router, the shared experts."""
        return (self.experts * self.expert_params(hidden) + self.experts * (hidden + self.router_bias)
                + 3 * hidden * self.shared_width + hidden * self.shared_gate)

    @property
    def token_width(self) -> int:
        """The intermediate width one token's activations run through: its top-k experts and
        the shared ones (what a layer keeps per token for its backward, as a dense MLP's
        `intermediate`)."""
        return self.top_k * self.width + self.shared_width


@dataclass(frozen=True)
class MlaShape:
    """Multi-head latent attention's projections (DeepSeek-V2/V3): queries through a
    low-rank `q_lora_rank` (0: a full projection), keys and values through one latent of
    `kv_lora_rank` plus a shared rotary key of `rope_dim`."""
    q_lora_rank: int
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    value_dim: int

    def params(self, hidden: int, heads: int) -> int:
        q_head = self.nope_dim + self.rope_dim
        q = (hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * q_head if self.q_lora_rank
             else hidden * heads * q_head)
        kv = hidden * (self.kv_lora_rank + self.rope_dim) + self.kv_lora_rank \
            + self.kv_lora_rank * heads * (self.nope_dim + self.value_dim)
        return q + kv + heads * self.value_dim * hidden


# hf/families/sparse/dsa.py's and dsa_indexer.py's tiles (QUERY_TILE, KEY_TILE; tests/test_planner.py checks they agree):
# the queries that attend at once over their selection, the keys the indexer scores at once.
DSA_QUERY_TILE, DSA_KEY_TILE = 256, 4096


@dataclass(frozen=True)
class DsaShape:
    """DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5, A.X-K2, HY-V4, dots3; hf/families/sparse/dsa.py,
    docs/planner.md, "Sparse attention"): MLA whose queries attend only to the `topk` keys an
    indexer of `index_heads` heads of `index_dim` picks for each. `layers`: the DSA layers
    (dots3: its indexed ones; its sliding-window layers are MLA under the head exchange);
    `indexer_layers`: those of them with an indexer of their own (GLM-5's and HY-V4's "shared"
    layers reuse the previous full layer's selection and keep no indexer key)."""
    topk: int
    index_heads: int
    index_dim: int
    layers: int
    indexer_layers: int

    def indexer_params(self, hidden: int, q_lora_rank: int) -> int:
        """One indexer: wq_b (from the low-rank query), wk, k_norm (a LayerNorm: weight and
        bias), weights_proj."""
        return (q_lora_rank * self.index_heads * self.index_dim + hidden * self.index_dim + 2 * self.index_dim
                + hidden * self.index_heads)

    def cache_bytes_per_token(self, mla: "MlaShape", dtype_bytes: int = 2) -> int:
        """The decoding cache of the DSA layers, per token, on every rank (not divided by P:
        `_generation_keys` keeps every token's keys on each rank): the latent and the rotary
        key of every DSA layer, the indexer key of those with an indexer, in the compute dtype."""
        return (self.layers * (mla.kv_lora_rank + mla.rope_dim) + self.indexer_layers * self.index_dim) * dtype_bytes


class DsaLayerBytes(NamedTuple):
    """One DSA layer's training bytes on one of P ranks, batch 1, S tokens, S/P of them this
    rank's queries (`dsa_layer_bytes`; R = kv_lora_rank, r = qk_rope_head_dim, k = topk, QT /
    KT the query / key tiles)."""
    gathered_keys: int        # [S, R + r]: the all-gathered latent and rotary key, kept for the backward
    gathered_index_keys: int  # [S, index_dim]: the all-gathered indexer key, the forward's (no gradient)
    visibility: int           # [QT, KT] bool: which keys a tile's queries see (dsa_indexer.Visibility)
    index_queries: int        # [S/P, index heads, index_dim] and their weights [S/P, index heads], float32
    index_tile: int           # [QT, index heads, KT] float32 twice (the scores and their relu), and the merge of
                              # the running top k with the tile: [QT, k + KT] float32 scores and int64 keys
    latent_queries: int       # [heads, S/P, R]: the queries in the latent space, kept
    selection: int            # [S/P, k] int64: the chosen keys, kept
    attention_tile: int       # [QT, k, R + r] chosen rows, [heads, QT, k] scores twice (the two einsums' sum,
                              # masked) and their fp32 softmax
    tile_backward: int        # [S, R + r] twice: a tile's gather backward (a scatter) and the keys' grad
    transformers_scores: int  # [S, index heads, S] float32: transformers' indexer on one device (comparison only)

    @property
    def saved(self) -> int:
        """What the layer keeps for its backward beyond a Ulysses layer's local projections."""
        return self.gathered_keys + self.latent_queries + self.selection

    @property
    def transient(self) -> int:
        """The largest moment of the layer's (re)computation: the forward's selection (the
        gathered indexer keys live through it, beside either the indexer's tiles and their mask
        or an attention tile) or a tile's backward."""
        forward = self.gathered_index_keys + max(self.index_queries + self.index_tile + self.visibility,
                                                 self.attention_tile)
        return max(forward, self.attention_tile + self.tile_backward)


def dsa_layer_bytes(shape: "ModelShape", seq_len: int, sp: int, dtype_bytes: int = 2, *,
                    indexer: bool = True) -> DsaLayerBytes:
    """One DSA layer (with its own indexer, or `indexer=False`: a "shared" layer) at `seq_len`
    tokens on one of `sp` ranks, as hf/families/sparse/dsa.py runs it: the queries stay on their
    shard, every rank all-gathers the whole sequence's latent + rotary key and indexer key
    (S tokens, not S/P); the indexer scores one [QT, KT] tile at a time with a running top k;
    the attention runs per query tile over the chosen rows, recomputed in the backward. The
    backward of a tile's row gather scatters into a zero tensor of the gathered keys' shape
    `[S, R + r]`, beside the keys' gradient accumulated over the tiles; which keys a query
    sees is asked one `[QT, KT]` tile at a time."""
    mla, dsa, p = shape.mla, shape.dsa, dtype_bytes
    S, s = seq_len, math.ceil(seq_len / sp)
    R, r = mla.kv_lora_rank, mla.rope_dim
    qt, kt, k = min(DSA_QUERY_TILE, s), min(DSA_KEY_TILE, S), min(dsa.topk, S)
    ih, idim = dsa.index_heads, dsa.index_dim
    return DsaLayerBytes(
        gathered_keys=S * (R + r) * p,
        gathered_index_keys=S * idim * p if indexer else 0,
        visibility=qt * kt,
        index_queries=s * ih * (idim + 1) * 4 if indexer else 0,
        index_tile=(2 * qt * ih * kt * 4 + qt * (k + kt) * (4 + 8)) if indexer else 0,
        latent_queries=shape.heads * s * R * p,
        selection=s * k * 8,
        attention_tile=qt * k * (R + r) * p + shape.heads * qt * k * (2 * p + 4),
        tile_backward=2 * S * (R + r) * p,
        transformers_scores=S * ih * S * 4)


def dsa_wire_bytes(shape: "ModelShape", seq_len: int, sp: int, dtype_bytes: int = 2) -> Dict[str, int]:
    """Bytes one rank receives in one DSA layer's forward: the all-gather of the latent,
    rotary and indexer keys, (P-1) x S/P tokens x (R + r + index_dim) values; against what
    the Ulysses head exchange of the same MLA layer receives: (P-1)/P of its S/P tokens of
    q and k (heads x qk head dim), v (heads x v head dim) in, the output (heads x v head dim)
    back."""
    mla, dsa, p = shape.mla, shape.dsa, dtype_bytes
    s = math.ceil(seq_len / sp)
    gather = (sp - 1) * s * (mla.kv_lora_rank + mla.rope_dim + dsa.index_dim) * p
    widths = shape.heads * (2 * (mla.nope_dim + mla.rope_dim) + 2 * mla.value_dim)
    return {"DSA all-gather": gather, "Ulysses head exchange": (sp - 1) * s * widths * p // sp}


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    mixer: Optional[MixerShape] = None          # a hybrid's linear-attention or state-space layers
    attention_layers: Optional[int] = None      # layers with attention (None: every layer)
    routed_experts: int = 0                     # a mixture-of-experts MLP's experts (0: dense)
    moe: Optional[ExpertShape] = None           # its experts, where the planner knows the family's keys
    mla: Optional[MlaShape] = None              # latent attention instead of q/k/v projections
    attention_extras: int = 0                   # per attention layer: an output bias, sinks (GPT-OSS)
    dsa: Optional[DsaShape] = None              # DeepSeek Sparse Attention (with `mla`)

    def dense_mlp_problem(self) -> Optional[str]:
        """Why the planner cannot count this model's weights and MLP activations (None when
        it can): a mixture of experts whose family's config keys it does not know (its
        terms would count a dense MLP of `intermediate` width and understate it several-fold:
        Mixtral 8x7B as 7.2e9 parameters instead of 4.7e10)."""
        if self.routed_experts and self.moe is None:
            return (f"mixture-of-experts models ({self.routed_experts} routed experts per MLP) are modelled for "
                    f"{', '.join(EXPERT_FAMILIES)} only: this family's expert layout is not known to the planner, "
                    "and counting it as dense would understate its weights and activations")
        return None

    @property
    def attention_layer_count(self) -> int:
        return self.layers if self.attention_layers is None else self.attention_layers

    @property
    def attention_params(self) -> int:
        h, d = self.hidden, self.head_dim
        if self.mla is not None:
            return self.mla.params(h, self.heads) + self.attention_extras
        attn = h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h
        bias = (self.heads + 2 * self.kv_heads) * d if self.qkv_bias else 0
        return attn + bias + self.attention_extras

    @property
    def expert_params(self) -> int:
        """Every routed expert of every MoE layer (0: a dense model)."""
        return self.moe.layers * self.moe.experts * self.moe.expert_params(self.hidden) if self.moe else 0

    @property
    def mlp_params(self) -> int:
        """Every layer's MLP: dense ones of `intermediate`, MoE ones with their experts."""
        dense = 3 * self.hidden * self.intermediate
        if self.moe is None:
            return self.layers * dense
        return (self.layers - self.moe.layers) * dense + self.moe.layers * self.moe.layer_params(self.hidden)

    @property
    def largest_mlp_params(self) -> int:
        dense = 3 * self.hidden * self.intermediate if self.moe is None or self.moe.layers < self.layers else 0
        return max(dense, self.moe.layer_params(self.hidden) if self.moe else 0)

    @property
    def mlp_token_width(self) -> int:
        """The widest intermediate a token's activations run through in one layer (a dense
        layer's, or an MoE layer's top-k and shared experts)."""
        dense = self.intermediate if self.moe is None or self.moe.layers < self.layers else 0
        return max(dense, self.moe.token_width if self.moe else 0)

    @property
    def indexer_params(self) -> int:
        """One DSA indexer's parameters (0: no DSA, or no layer with an indexer)."""
        if self.dsa is None or not self.dsa.indexer_layers:
            return 0
        return self.dsa.indexer_params(self.hidden, self.mla.q_lora_rank)

    @property
    def layer_params(self) -> int:
        """The largest attention layer's parameters (its MLP, norms and DSA indexer included)."""
        return self.attention_params + self.indexer_params + self.largest_mlp_params + 2 * self.hidden

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden
        mixers = self.mixer.total_params(self.hidden) if self.mixer is not None else 0
        indexers = self.dsa.indexer_layers * self.indexer_params if self.dsa is not None else 0
        return (embed * (1 if self.tied_embeddings else 2) + self.mlp_params + self.layers * 2 * self.hidden
                + self.attention_layer_count * self.attention_params + indexers + mixers + self.hidden)


# Published configurations (the models' config.json on the Hugging Face hub).
PRESETS: Dict[str, ModelShape] = {
    "llama-3-8b": ModelShape(4096, 32, 32, 8, 128, 14336, 128256),
    "llama-3-70b": ModelShape(8192, 80, 64, 8, 128, 28672, 128256),
    "qwen2.5-7b": ModelShape(3584, 28, 28, 4, 128, 18944, 152064, qkv_bias=True),
    "qwen2.5-72b": ModelShape(8192, 80, 64, 8, 128, 29568, 152064, qkv_bias=True),
    "qwen3-8b": ModelShape(4096, 36, 32, 8, 128, 12288, 151936),
    "mistral-7b": ModelShape(4096, 32, 32, 8, 128, 14336, 32000),
}
# Mixtures of experts, from their config.json on the hub (the keys experts_from_dict reads).
MOE_PRESET_CONFIGS: Dict[str, dict] = {
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
                          vocab_size=151936, tie_word_embeddings=False),
    # Qwen3.5-122B-A10B's language model. Published on its model card: 48 layers (12 x (3 Gated
    # DeltaNet, 1 gated attention)), hidden 3072, 32 query heads, 256 experts (8 routed + 1
    # shared), vocabulary 248320. The rest as the family's other sizes lay it out (2 KV heads of
    # 256; DeltaNet's 16 key and 64 value heads of 128; experts 1024 wide), checked by the card's
    # totals: 122.1e9 parameters, 9.8e9 active per token (docs/planner.md, "Expert parallelism (`--ep`)").
    "qwen3.5-122b-a10b": dict(model_type="qwen3_5_moe_text", hidden_size=3072, num_hidden_layers=48,
                              num_attention_heads=32, num_key_value_heads=2, head_dim=256, moe_intermediate_size=1024,
                              shared_expert_intermediate_size=1024, num_experts=256, num_experts_per_tok=8,
                              linear_num_value_heads=64, linear_num_key_heads=16, linear_key_head_dim=128,
                              linear_value_head_dim=128, linear_conv_kernel_dim=4,
                              layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 12,
                              vocab_size=248320, tie_word_embeddings=False),
}


def shape_from_model_type(model_type: str) -> ModelShape:
    """A ModelShape from a transformers model type at its default configuration (which is
    most families' flagship size: `mixtral` is Mixtral 8x7B, `deepseek_v3` DeepSeek-V3);
    KeyError for a name transformers does not know, ImportError without transformers."""
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    try:
        return shape_from_dict(config.to_dict())
    except KeyError as missing:
        raise ValueError(f"the planner cannot read {type(config).__name__}: it has no {missing} (a layout the planner "
                         "does not model)") from None


def shape_from_config(path: str) -> ModelShape:
    """A ModelShape from a local Hugging Face `config.json` (or the folder holding it)."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        return shape_from_dict(json.load(f))


ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention", "attention", "hybrid", "hybrid_sliding")
# "hybrid": attention beside a Mamba2 mixer (Falcon-H1); "conv": LFM2's short convolutions
MIXER_KINDS = ("linear_attention", "mamba", "hybrid", "hybrid_sliding", "conv", "recurrent", "rwkv", "mlstm")


def language_model_config(cfg: dict) -> dict:
    """The language model's config of a vision-language config whose decoder is all in its
    `text_config` (Qwen3.5, Qwen3.5-MoE: the planner plans the decoder; the vision tower's
    weights, under 1% of these models, are not counted), else `cfg` itself."""
    text = cfg.get("text_config")
    if isinstance(text, dict) and "num_attention_heads" not in cfg:
        # the model ties its embeddings as its top-level config says (transformers' tie_weights)
        tied = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        return dict(text, model_type=text.get("model_type") or f"{cfg.get('model_type')}_text",
                    tie_word_embeddings=tied)
    return cfg


def dense_width(cfg: dict, moe: Optional["ExpertShape"]) -> int:
    """A dense MLP layer's width: `intermediate_size`, which a config whose every layer has
    experts may lack (Qwen3.5-MoE); 0 there, since no layer uses it."""
    if "intermediate_size" not in cfg and moe is not None and moe.layers == cfg.get("num_hidden_layers"):
        return 0
    return cfg["intermediate_size"]


def shape_from_dict(cfg: dict) -> ModelShape:
    """A ModelShape from a Hugging Face config as a dict (`config.to_dict()`, config.json);
    a hybrid's per-layer kinds (`layer_types` / `layers_block_type`) give its attention and
    token-mixer layers (`mixer_from_dict`)."""
    cfg = language_model_config(cfg)
    heads = cfg["num_attention_heads"]
    kinds = layer_kinds(cfg)
    mixer = mixer_from_dict(cfg, kinds) if kinds else None
    moe = experts_from_dict(cfg)
    return ModelShape(hidden=cfg["hidden_size"], layers=cfg.get("num_hidden_layers") or len(kinds), heads=heads,
                      kv_heads=cfg.get("num_key_value_heads", heads),
                      head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                      intermediate=dense_width(cfg, moe), vocab=cfg["vocab_size"],
                      tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                      qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") in ("qwen2", "qwen2_moe"))),
                      mixer=mixer, attention_layers=sum(k in ATTENTION_KINDS for k in kinds) if mixer else None,
                      routed_experts=routed_experts(cfg), moe=moe, mla=mla_from_dict(cfg),
                      attention_extras=attention_extras(cfg), dsa=dsa_from_dict(cfg))


# Where the configs of transformers' MoE families keep their routed expert count (Mixtral,
# GPT-OSS: num_local_experts; Qwen2/3-MoE, Qwen3-Next: num_experts; DeepSeek-V2/V3: n_routed_experts).
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def routed_experts(cfg: dict) -> int:
    """The routed experts of a config's MLPs (0: dense; one expert is a dense MLP)."""
    experts = max([int(cfg.get(key) or 0) for key in EXPERT_KEYS] + [0])
    return experts if experts > 1 else 0


# The mixture-of-experts families whose layouts the planner knows (experts_from_dict), each
# checked against transformers' own modules (tests/test_planner.py).
EXPERT_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text", "deepseek_v2", "deepseek_v3",
                   "gpt_oss", "deepseek_v32", "glm_moe_dsa")


def experts_from_dict(cfg: dict) -> Optional[ExpertShape]:
    """The experts of a config of EXPERT_FAMILIES, as transformers 5.25 builds them (None:
    dense, or a family the planner does not know)."""
    experts, family = routed_experts(cfg), cfg.get("model_type")
    if not experts or family not in EXPERT_FAMILIES:
        return None
    layers, top_k = cfg["num_hidden_layers"], cfg["num_experts_per_tok"]
    if family in ("mixtral", "gpt_oss"):   # every layer; an expert as wide as `intermediate_size`
        return ExpertShape(experts, top_k, cfg["intermediate_size"], layers, router_bias=family == "gpt_oss",
                           expert_bias=family == "gpt_oss")
    if family in ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text"):   # every `decoder_sparse_step`-th
        step, dense = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or [])   # layer outside
        moe_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)   # `mlp_only_layers`
        shared = cfg.get("shared_expert_intermediate_size") or 0
        return ExpertShape(experts, top_k, cfg["moe_intermediate_size"], moe_layers, shared_width=shared,
                           shared_gate=bool(shared))
    # DeepSeek-V2/V3: dense below `first_k_dense_replace`, then every `moe_layer_freq`-th layer;
    # DeepSeek-V3.2, GLM-5: the layers `mlp_layer_types` calls "sparse" (the config derives it the same way)
    first, freq = cfg.get("first_k_dense_replace") or 0, cfg.get("moe_layer_freq") or 1
    moe_layers = sum(1 for i in range(first, layers) if i % freq == 0)
    if cfg.get("mlp_layer_types"):
        moe_layers = sum(kind == "sparse" for kind in cfg["mlp_layer_types"])
    return ExpertShape(experts, top_k, cfg["moe_intermediate_size"], moe_layers,
                       shared_width=(cfg.get("n_shared_experts") or 0) * cfg["moe_intermediate_size"])


def attention_extras(cfg: dict) -> int:
    """An attention layer's parameters beyond its projections: Qwen3's q and k norms (and in
    the Gated DeltaNet hybrids, Qwen3-Next and Qwen3.5, the output gate q_proj doubles for),
    GPT-OSS's output bias and sinks."""
    family = cfg.get("model_type") or ""
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if family.startswith("qwen3"):
        gate = cfg["hidden_size"] * heads * head_dim if "linear_num_value_heads" in cfg else 0
        return 2 * head_dim + gate
    return cfg["hidden_size"] + heads if family == "gpt_oss" else 0


def mla_from_dict(cfg: dict) -> Optional[MlaShape]:
    """Latent attention's sizes (a config with `kv_lora_rank`; None: q/k/v projections)."""
    if not cfg.get("kv_lora_rank"):
        return None
    return MlaShape(cfg.get("q_lora_rank") or 0, cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                    cfg["v_head_dim"])


def dsa_from_dict(cfg: dict) -> Optional[DsaShape]:
    """DeepSeek Sparse Attention's sizes (an MLA config with `index_topk`; None: none). Its
    layers: every layer, or those `layer_types` calls "indexed_attention" (dots3); of them,
    those with an indexer: all, or those `indexer_types` does not call "shared" (GLM-5, HY-V4)."""
    if not (cfg.get("index_topk") and cfg.get("kv_lora_rank")):
        return None
    kinds, indexers = cfg.get("layer_types"), cfg.get("indexer_types")
    layers = [i for i in range(cfg["num_hidden_layers"]) if not kinds or kinds[i] == "indexed_attention"]
    if not layers:
        return None
    return DsaShape(cfg["index_topk"], cfg["index_n_heads"], cfg["index_head_dim"], len(layers),
                    sum(1 for i in layers if not indexers or indexers[i] != "shared"))


def layer_kinds(cfg: dict) -> list:
    """Every layer's kind: the config's own list (`layer_types`, `layers_block_type`), or, for
    the families that derive it, attention at `attn_layer_indices` and Mamba2 elsewhere
    (Bamba, GraniteMoeHybrid), attention beside Mamba2 in every layer (Falcon-H1); [] for
    a model whose layers are all attention."""
    kinds = cfg.get("layer_types") or cfg.get("layers_block_type")
    if kinds:
        return list(kinds)
    layers = cfg.get("num_hidden_layers") or 0
    if cfg.get("model_type") == "falcon_h1":
        return ["hybrid"] * layers
    if cfg.get("model_type") in ("mamba2", "mamba", "falcon_mamba"):   # no attention: every layer a mixer
        return ["mamba"] * layers
    if cfg.get("model_type") in ("rwkv", "xlstm"):   # no attention: every block its mixer
        return [{"rwkv": "rwkv", "xlstm": "mlstm"}[cfg["model_type"]]] * layers
    if cfg.get("model_type") == "recurrent_gemma":   # a pattern of block types the layers repeat
        pattern = cfg.get("block_types") or []
        return ["recurrent" if pattern[i % len(pattern)] == "recurrent" else "sliding_attention" for i in range(layers)]
    if cfg.get("model_type") == "jamba":
        period, offset = cfg.get("attn_layer_period") or 1, cfg.get("attn_layer_offset") or 0
        return ["full_attention" if i % period == offset else "mamba" for i in range(layers)]
    if cfg.get("mamba_n_heads") and "attn_layer_indices" in cfg:
        attention = set(cfg.get("attn_layer_indices") or [])
        return ["full_attention" if i in attention else "mamba" for i in range(layers)]
    return []


def _short_conv_shape(cfg, layers, kinds):   # LFM2 / LFM3
    return MixerShape("short_conv", layers, 1, 0, 0, cfg["hidden_size"], cfg["conv_L_cache"],
                      conv_bias=bool(cfg.get("conv_bias", False)))


def _cca_shape(cfg, layers, kinds):   # ZAYA: the convolutions of q|k in every attention layer (hybrid kinds)
    return MixerShape("cca", layers, cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
                      cfg["hidden_size"], cfg["cca_time0"], second_kernel=cfg["cca_time1"])


def _lightning_shape(cfg, layers, kinds):   # MiniMax: one state [D, D] per head, in the compute dtype
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return MixerShape("lightning", layers, heads, heads, head_dim, head_dim, 1)


def _rwkv_shape(cfg, layers, kinds):   # transformers' defaults for the widths left unset
    hidden = cfg["hidden_size"]
    return MixerShape("rwkv", layers, 1, 0, hidden, cfg.get("attention_hidden_size") or hidden, 2,
                      mlp_width=cfg.get("intermediate_size") or 4 * hidden)


def _inkling_shape(cfg, layers, kinds):   # their convolutions (the attention is counted as attention's);
    # the Loop's looped layers hold a state per pass
    looped = kinds[cfg.get("loop_layer_index_start", 0):cfg.get("loop_layer_index_end", 0)]
    passes = (cfg.get("loop_num_passes") or 1) - 1
    sliding = sum(kind == "hybrid_sliding" for kind in kinds + looped * passes)
    return MixerShape("inkling", layers + len(looped) * passes, cfg["num_key_value_heads"] * cfg["head_dim"],
                      cfg["swa_num_key_value_heads"] * cfg["swa_head_dim"],
                      cfg.get("sconv_kernel_size") or cfg["conv_kernel_size"],   # an alias in the config class
                      cfg["hidden_size"], cfg["conv_kernel_size"], sliding_layers=sliding,
                      dynamic=cfg["model_type"] != "inkling_text")


def _mlstm_shape(cfg, layers, kinds):   # xLSTM: the layer's head dims (its config's qk_head_dim rounds up to 64)
    heads, hidden = cfg["num_heads"], cfg["hidden_size"]
    return MixerShape("mlstm", layers, heads, heads, int(hidden * cfg["qk_dim_factor"]) // heads,
                      int(hidden * cfg["v_dim_factor"]) // heads, 1, proj_bias=bool(cfg.get("use_bias")))


def _rg_lru_shape(cfg, layers, kinds):   # Griffin's RG-LRU: heads = its gates' blocks
    return MixerShape("rg_lru", layers, cfg["num_attention_heads"], 0, 0, cfg["lru_width"], cfg["conv1d_width"])


def _mamba1_shape(cfg, layers, kinds):   # Mamba, Falcon-Mamba; Jamba, Zamba (their heads split x_proj and
    jamba = cfg.get("model_type") in ("jamba", "zamba")   # dt_proj, same sizes) name the fields mamba_*
    channels = cfg["mamba_expand"] * cfg["hidden_size"] if jamba else cfg["intermediate_size"]
    rank = cfg["mamba_dt_rank"] if jamba else cfg["time_step_rank"]
    return MixerShape("mamba1", layers, 1, 0, cfg["mamba_d_state" if jamba else "state_size"], channels,
                      cfg["mamba_d_conv" if jamba else "conv_kernel"],
                      conv_bias=bool(cfg["mamba_conv_bias" if jamba else "use_conv_bias"]), gate_rank=rank,
                      proj_bias=bool(cfg["mamba_proj_bias" if jamba else "use_bias"]),
                      norm_weights=cfg.get("model_type") == "jamba")


def _kimi_delta_shape(cfg, layers, kinds):   # Kimi Delta Attention (Kimi Linear, Ling)
    heads, head_dim = cfg["linear_num_heads"], cfg["linear_head_dim"]
    return MixerShape("kimi_delta", layers, heads, heads, head_dim, head_dim, cfg["linear_conv_kernel_dim"],
                      conv_bias=False, gate_rank=head_dim if cfg.get("model_type") == "kimi_linear" else 0)


def _gated_deltanet_shape(cfg, layers, kinds):
    return MixerShape("gated_deltanet", layers, cfg["linear_num_value_heads"], cfg["linear_num_key_heads"],
                      cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"])


def _mamba2_shape(cfg, layers, kinds):
    if cfg.get("model_type") == "mamba2":   # Mamba2's own config: the mixer's fields without a prefix
        cfg = dict(cfg, mamba_n_heads=cfg.get("num_heads"), mamba_d_head=cfg.get("head_dim"),
                   mamba_d_state=cfg.get("state_size"))
    heads = cfg.get("mamba_n_heads") or cfg.get("mamba_num_heads") or cfg.get("n_mamba_heads")   # Zamba2: the last
    head_dim = cfg.get("mamba_d_head") or cfg.get("mamba_head_dim") or cfg.get("mamba_headdim")
    groups = cfg.get("mamba_n_groups") or cfg.get("n_groups") or cfg.get("mamba_ngroups") or 1
    state = cfg.get("mamba_d_state") or cfg.get("ssm_state_size")
    kernel = cfg.get("mamba_d_conv") or cfg.get("conv_kernel")
    if not (heads and head_dim and state and kernel):
        raise ValueError("plan: a hybrid config whose token-mixer layers are neither Gated DeltaNet (linear_*) nor "
                         "Mamba2 (mamba_*) fields")
    conv_bias = cfg.get("mamba_conv_bias", cfg.get("use_conv_bias", True))
    return MixerShape("mamba2", layers, heads, groups, state, head_dim, kernel, conv_bias=bool(conv_bias),
                      norm=bool(cfg.get("mamba_rms_norm", True)))


# The token-mixer layers' shape of each kind, from the config, keyed by the `planner_shape` the
# families declare (hf/families: each family module's `FAMILY`). The planner imports nothing of
# hf/ (it runs without transformers), hence the tables here, which tests/hf/families/
# test_hf_family_declarations.py holds to the declarations: one shape per declared
# `planner_shape`, every entry of MIXER_MODEL_TYPES a model type (`Family.model_types`) of a
# family of that shape, and the tests' tiny models of the others read as theirs by their fields.
MIXER_SHAPES = {
    "gated_deltanet": _gated_deltanet_shape, "kimi_delta": _kimi_delta_shape, "lightning": _lightning_shape,
    "mamba2": _mamba2_shape, "mlstm": _mlstm_shape, "short_conv": _short_conv_shape, "cca": _cca_shape,
    "mamba1": _mamba1_shape, "rg_lru": _rg_lru_shape, "rwkv": _rwkv_shape, "inkling": _inkling_shape,
}
# model type -> its mixers' shape (see MIXER_SHAPES)
MIXER_MODEL_TYPES = {
    "zaya": "cca", "minimax": "lightning", "rwkv": "rwkv", "inkling_text": "inkling",
    "inkling2_text": "inkling", "inkling2_loop_text": "inkling", "xlstm": "mlstm",
    "recurrent_gemma": "rg_lru", "mamba": "mamba1", "falcon_mamba": "mamba1", "jamba": "mamba1", "zamba": "mamba1",
    "kimi_linear": "kimi_delta", "bailing_hybrid": "kimi_delta", "mamba2": "mamba2",
}


def mixer_shape_kind(cfg: dict) -> str:
    """The shape of a hybrid config's token mixers: by its model type (MIXER_MODEL_TYPES), else
    by its fields (a model type the planner does not list: LFM's `conv_L_cache`, Gated
    DeltaNet's `linear_*`, else Mamba2's `mamba_*`)."""
    known = MIXER_MODEL_TYPES.get(cfg.get("model_type"))
    if known:
        return known
    if "conv_L_cache" in cfg:
        return "short_conv"
    return "gated_deltanet" if "linear_num_value_heads" in cfg else "mamba2"


def mixer_from_dict(cfg: dict, kinds) -> Optional[MixerShape]:
    """The token-mixer layers of a hybrid config (its shape's entry of MIXER_SHAPES), None
    without any."""
    layers = sum(k in MIXER_KINDS for k in kinds)
    if not layers:
        return None
    return MIXER_SHAPES[mixer_shape_kind(cfg)](cfg, layers, kinds)


def mlp_tile_tokens(hidden: int) -> int:
    """patch_model's default MLP tile (hf/training/patch.py uses this function)."""
    return max(16, hidden)


def loss_tile_tokens(vocab: int) -> int:
    """patch_model's default loss tile: about 16M logits (hf/training/patch.py uses this function)."""
    return max(16, (1 << 24) // vocab)


@dataclass
class PlanOptions:
    seq_len: int
    gpus_per_node: int = 8
    nodes: int = 1
    gpu_memory_gib: float = 80.0
    sp_size: Optional[int] = None     # default: every GPU (DP 1)
    ring_size: int = 1
    ep_size: int = 1                  # expert parallelism: each GPU holds experts / ep_size of every MoE layer
    fsdp: bool = True                 # parameters, gradients, optimizer states sharded over all GPUs
    fsdp_cpu_offload: bool = False    # ... and kept in host memory
    checkpointing: bool = True
    checkpoint_offload: bool = False
    tiled_mlp: bool = False
    tiled_loss: bool = False
    dtype_bytes: int = 2              # compute dtype (bf16); master weights and AdamW states fp32
    reserve_gib: float = 2.0          # CUDA context, NCCL buffers, allocator fragmentation
    # "flash": O(S) attention state (the Triton and fused paths, and the reference path's
    # torch SDPA calls); "reference": O(S^2) probabilities kept (the reference attention
    # proper: float64, sinks, softcap, MLA's own value head dim).
    attention: str = "flash"


@dataclass
class Plan:
    gpus: int
    sp_size: int
    local_tokens: int
    terms_gib: Dict[str, float] = field(default_factory=dict)
    host_gib: Dict[str, float] = field(default_factory=dict)
    per_gpu_gib: float = 0.0
    fits: bool = False
    max_seq_len: int = 0
    dsa_gib: Dict[str, float] = field(default_factory=dict)   # a DSA model's layer, by part (dsa_terms)
    dsa_notes: list = field(default_factory=list)             # its decoding cache and forward wire bytes


def dq_accumulator_bytes(shape: ModelShape, heads: int, queries: int) -> int:
    """The default (atomic) Triton backward adds dQ into an fp32 `[heads, queries, D']`
    buffer (D' the head dim padded to a power of two), live while the layer's saved
    tensors are (ulysses_kernels/triton/flash_bwd.py); the deterministic backward has none."""
    return heads * queries * max(16, 1 << (shape.head_dim - 1).bit_length()) * 4


def _require_dense(shape: ModelShape) -> None:
    problem = shape.dense_mlp_problem()
    if problem:
        raise ValueError(f"planner: {problem}")


def expert_layer_params(shape: ModelShape) -> int:
    """One MoE layer's routed experts (0: a dense model)."""
    return shape.moe.experts * shape.moe.expert_params(shape.hidden) if shape.moe else 0


def held_params(shape: ModelShape, o: PlanOptions) -> float:
    """The parameters one GPU holds: the dense ones sharded by FSDP over every GPU (else
    whole); the routed experts split over `ep_size` GPUs, each GPU's share sharded by FSDP
    over the `world / ep_size` GPUs that hold the same experts (transformers' efsdp)."""
    world = o.gpus_per_node * o.nodes
    dense = shape.params - shape.expert_params
    return dense / (world if o.fsdp else 1) + shape.expert_params / o.ep_size / (world // o.ep_size if o.fsdp else 1)


def expert_dispatch_bytes(shape: ModelShape, tokens: int, dtype_bytes: int) -> int:
    """Expert parallelism's buffers in an MoE layer: each of this GPU's `tokens` sent to its
    top-k experts and as many routed tokens received (hidden-sized rows; the backward moves
    their gradients through buffers of the same size)."""
    return 2 * tokens * shape.moe.top_k * shape.hidden * dtype_bytes if shape.moe else 0


def memory_terms(shape: ModelShape, o: PlanOptions) -> Dict[str, float]:
    """Bytes per GPU, by term, for one training step at o.seq_len tokens. A model the
    planner cannot count (ModelShape.dense_mlp_problem) raises ValueError."""
    _require_dense(shape)
    if shape.dsa is not None and o.ring_size > 1:
        raise ValueError("plan: DeepSeek Sparse Attention does not run on a ring (hf/families/sparse/dsa.py refuses one): "
                         "use --ring 1")
    world = o.gpus_per_node * o.nodes
    sp = o.sp_size or world
    S, p = o.seq_len, o.dtype_bytes
    s = math.ceil(S / sp)                   # tokens per rank
    n = held_params(shape, o)
    on_gpu = 0.0 if o.fsdp_cpu_offload else 1.0
    t: Dict[str, float] = {}
    t["weights (fp32, sharded)"] = on_gpu * 4 * n
    t["gradients (fp32, sharded)"] = on_gpu * 4 * n
    t["optimizer (AdamW fp32 m, v)"] = on_gpu * 8 * n
    # a layer + the prefetched one (with EP, only this GPU's experts of it), the head
    gathered = 2 * (shape.layer_params - expert_layer_params(shape) * (1 - 1 / o.ep_size)) + shape.vocab * shape.hidden
    t["gathered compute weights"] = p * gathered if o.fsdp else 0.0
    kept = shape.layers if o.checkpointing else 0
    if o.checkpoint_offload:
        kept = min(kept, 1)                 # the last layer's input stays
    t["checkpointed layer inputs"] = kept * s * shape.hidden * p
    qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    # What one decoder layer keeps for its backward (its recomputation, with checkpointing):
    # norm inputs, residual, projections' inputs (SAVED_HIDDEN x hidden), q|k|v before and
    # after rotary and the exchange (SAVED_QKV x q|k|v width), the attention output and
    # o_proj input (SAVED_OUT x query width); the MLP's gate, up, activation and product
    # (SAVED_MLP x intermediate), or only its input when tiled.
    saved = s * p * (SAVED_HIDDEN * shape.hidden + SAVED_QKV * qkv + SAVED_OUT * shape.heads * shape.head_dim)
    tiled = o.tiled_mlp and shape.moe is None   # patch_model tiles dense MLPs only, never an MoE block
    saved += s * p * (shape.hidden if tiled else SAVED_MLP * shape.mlp_token_width)
    if shape.moe is not None:   # the router's probabilities (fp32) and each token's top-k choice
        saved += s * (4 * shape.moe.experts + 8 * shape.moe.top_k)
    mlp_rows = min(s, mlp_tile_tokens(shape.hidden)) if tiled else s
    transient = mlp_rows * p * TRANSIENT_MLP * shape.mlp_token_width  # the MLP backward of a tile
    if o.ep_size > 1:   # EP's all-to-all: the top-k copies of this GPU's tokens sent, as many received
        transient += expert_dispatch_bytes(shape, s, p)
    local, mlp_transient = saved, transient   # a DSA layer's too (its local projections, its MLP)
    ulysses = sp // o.ring_size
    heads_here = math.ceil(shape.heads / ulysses)
    queries = S // o.ring_size if o.ring_size > 1 else S
    if o.attention == "reference":  # probabilities kept (fp32) and, per chunk, their gradients
        saved += heads_here * queries * S * 4
        transient = max(transient, 2 * 4 * min(heads_here * queries * S, 1 << 24))
    else:
        saved += 2 * heads_here * queries * 4  # LSE and delta (fp32)
        # The attention backward's temporaries and the MLP's come at different moments.
        transient = max(transient, dq_accumulator_bytes(shape, heads_here, queries))
    if o.ring_size > 1:
        kv_heads_here = max(1, shape.kv_heads // ulysses)
        saved += queries * kv_heads_here * shape.head_dim * (2 * 2 * p + 2 * 4)  # K|V x2 buffers, fp32 dK|dV
    layer, every_layer = saved + transient, shape.layers * saved
    if shape.dsa is not None:   # DSA layers: no head exchange nor flash state, their own gathered keys and tiles
        dsa = dsa_layer_bytes(shape, S, sp, p, indexer=shape.dsa.indexer_layers > 0)   # the largest: with one
        dsa_saved, dsa_transient = local + dsa.saved, max(mlp_transient, dsa.transient)
        others = shape.layers - shape.dsa.layers   # dots3's sliding-window MLA layers: the head exchange's
        layer = max(dsa_saved + dsa_transient, layer if others else 0)
        every_layer = shape.dsa.layers * dsa_saved + others * saved
        transient = max(dsa_transient, transient if others else 0)
    if o.checkpointing:
        t["one layer in its backward (peak phase)"] = layer
    else:
        t["every layer's saved activations"] = every_layer
        t["the backward's temporaries (peak phase)"] = transient
    logit_rows = min(s, loss_tile_tokens(shape.vocab)) if o.tiled_loss else s
    t["logits and loss (peak phase)"] = logit_rows * shape.vocab * (p + 4 + 4)  # logits, fp32 softmax, its grad
    t["reserve (context, NCCL, fragmentation)"] = o.reserve_gib * GIB
    return t


# memory_terms' keys by kind: what lives through the step regardless of its length (the
# states and the reserve) and the activations that live through it; the rest are the
# "(peak phase)" terms, of which only the largest is live at the peak.
STATE_TERMS = ("weights (fp32, sharded)", "gradients (fp32, sharded)", "optimizer (AdamW fp32 m, v)",
               "gathered compute weights", "reserve (context, NCCL, fragmentation)")
ACTIVATION_TERMS = ("checkpointed layer inputs", "every layer's saved activations")


def peak_phase_bytes(terms: Dict[str, float]) -> float:
    """The largest of the phases that never coexist ("(peak phase)": the logits and loss,
    one layer's backward)."""
    return max((v for k, v in terms.items() if k.endswith("(peak phase)")), default=0.0)


def peak_bytes(terms: Dict[str, float]) -> float:
    """The step's peak: everything that lives through the step, plus the largest of the
    phases that do not overlap (the loss, one layer's backward), marked "(peak phase)"."""
    return sum(v for k, v in terms.items() if not k.endswith("(peak phase)")) + peak_phase_bytes(terms)


def activation_bytes(terms: Dict[str, float]) -> float:
    """What the step's activations hold at its peak (the peak without the states and the
    reserve): the activations kept through the step plus the largest peak phase."""
    return sum(terms.get(k, 0.0) for k in ACTIVATION_TERMS) + peak_phase_bytes(terms)


def host_terms(shape: ModelShape, o: PlanOptions) -> Dict[str, float]:
    world = o.gpus_per_node * o.nodes
    s = math.ceil(o.seq_len / (o.sp_size or world))
    host: Dict[str, float] = {}
    if o.fsdp_cpu_offload:
        host["parameters, gradients, optimizer (fp32)"] = 16 * shape.params / (world if o.fsdp else 1)
    if o.checkpoint_offload and o.checkpointing:
        host["offloaded layer inputs"] = (shape.layers - 1) * s * shape.hidden * o.dtype_bytes
    return host


def plan(shape: ModelShape, o: PlanOptions) -> Plan:
    world = o.gpus_per_node * o.nodes
    sp = o.sp_size or world
    if world % sp or sp % o.ring_size:
        raise ValueError(f"plan: sp_size {sp} must divide the {world} GPUs and ring_size {o.ring_size} divide sp_size")
    check_ep(shape, o.ep_size, world)
    terms = memory_terms(shape, o)
    total = peak_bytes(terms)
    result = Plan(gpus=world, sp_size=sp, local_tokens=math.ceil(o.seq_len / sp),
                  terms_gib={k: v / GIB for k, v in terms.items()},
                  host_gib={k: v / GIB for k, v in host_terms(shape, o).items()},
                  per_gpu_gib=total / GIB, fits=total <= o.gpu_memory_gib * GIB)
    result.max_seq_len = max_seq_len(shape, o)
    if shape.dsa is not None:
        result.dsa_gib = {k: v / GIB for k, v in dsa_terms(shape, o).items()}
        result.dsa_notes = dsa_notes(shape, o)
    return result


def dsa_terms(shape: ModelShape, o: PlanOptions) -> Dict[str, float]:
    """The parts of one DSA layer with an indexer on one rank (`dsa_layer_bytes`), labelled
    with their shapes, for `plan` to print: the layer phase of memory_terms counts them (kept
    ones in what the layer saves, the forward's and the backward's at their larger moment);
    transformers' own indexer scores are printed beside them, never counted."""
    S, sp = o.seq_len, o.sp_size or o.gpus_per_node * o.nodes
    b = dsa_layer_bytes(shape, S, sp, o.dtype_bytes)
    R, r, d = shape.mla.kv_lora_rank, shape.mla.rope_dim, shape.dsa
    k, qt, kt = min(d.topk, S), min(DSA_QUERY_TILE, math.ceil(S / sp)), min(DSA_KEY_TILE, S)
    return {f"gathered latent + rotary keys [S, {R + r}], kept": b.gathered_keys,
            f"gathered indexer keys [S, {d.index_dim}], forward": b.gathered_index_keys,
            f"visible keys [{qt}, {kt}] bool, a tile": b.visibility,
            f"indexer queries [S/P, {d.index_heads}, {d.index_dim}] fp32, forward": b.index_queries,
            f"indexer scores [{qt}, {d.index_heads}, {kt}] fp32 x2 + top-{k} merge": b.index_tile,
            f"latent queries [{shape.heads}, S/P, {R}], kept": b.latent_queries,
            f"selection [S/P, {k}] int64, kept": b.selection,
            f"attention tile [{qt}, {k}, {R + r}] rows + [{shape.heads}, {qt}, {k}] scores": b.attention_tile,
            f"a tile's backward: gather grad [S, {R + r}] + keys' grad [S, {R + r}]": b.tile_backward,
            f"transformers' indexer scores [S, {d.index_heads}, S] fp32 (not counted)": b.transformers_scores}


def dsa_notes(shape: ModelShape, o: PlanOptions) -> list:
    """A DSA model's decoding cache per token and the bytes one rank receives per DSA layer
    in the forward (`DsaShape.cache_bytes_per_token`, `dsa_wire_bytes`)."""
    d, mla, p = shape.dsa, shape.mla, o.dtype_bytes
    wire = dsa_wire_bytes(shape, o.seq_len, o.sp_size or o.gpus_per_node * o.nodes, p)
    return [f"decoding cache per token, the same on every rank: {d.cache_bytes_per_token(mla, p):,} bytes ({d.layers} "
            f"layers x {mla.kv_lora_rank + mla.rope_dim} + {d.indexer_layers} indexers x {d.index_dim} values)",
            f"received per DSA layer and rank in the forward: {wire['DSA all-gather'] / 2**20:,.1f} MiB "
            f"(the keys' all-gather); a Ulysses head exchange of the same layer: "
            f"{wire['Ulysses head exchange'] / 2**20:,.1f} MiB"]


def max_seq_len(shape: ModelShape, o: PlanOptions, granularity: int = 1024) -> int:
    """The longest sequence (a multiple of `granularity`) whose plan fits; 0 if none."""
    def fits(S):
        trial = PlanOptions(**{**asdict(o), "seq_len": S})
        return peak_bytes(memory_terms(shape, trial)) <= o.gpu_memory_gib * GIB
    lo, hi = 0, granularity
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 34:
            break
    while hi - lo > granularity:
        mid = (lo + hi) // 2 // granularity * granularity
        if mid <= lo:
            break
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def check_ep(shape: ModelShape, ep: int, world: int) -> None:
    """An EP size the model and the GPUs allow, or ValueError: it divides the GPUs and the
    routed experts of a mixture of experts (a dense model has none to split)."""
    if ep == 1:
        return
    if shape.moe is None:
        raise ValueError(f"plan: --ep {ep}: the model has no routed experts to split (a dense model: use --ep 1)")
    if world % ep or shape.moe.experts % ep:
        raise ValueError(f"plan: --ep {ep} must divide the {world} GPUs and the {shape.moe.experts} routed experts")


@dataclass
class Layout:
    """The SP, ring and EP sizes `choose_layout` picked, their plan, and why (one line each
    for what it tried)."""
    options: PlanOptions
    plan: Plan
    reasons: List[str]


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def choose_layout(shape: ModelShape, o: PlanOptions, *, sp_sizes: Optional[Sequence[int]] = None,
                  ep_sizes: Optional[Sequence[int]] = None, ring_size: Optional[int] = None) -> Layout:
    """The layout of a training step at `o.seq_len`: the smallest SP size whose step fits
    with some EP size (fewer tokens exchanged, more DP groups), each SP size as Ulysses x
    ring by `layout.choose_ring_size` (the heads, the node); at it, the smallest EP size
    that fits (each token's top-k copies cross the fewest GPUs; an EP group within a node
    keeps its all-to-all on the node's links). Every SP size dividing the GPUs and every EP
    size dividing the GPUs and the experts are tried unless given; `ring_size` given, every SP
    size it divides runs that ring. None fits: the layout with the lowest peak, its plan
    saying so."""
    from .layout import choose_ring_size

    world = o.gpus_per_node * o.nodes
    budget = o.gpu_memory_gib * GIB
    sps = sorted(sp_sizes or _divisors(world))
    eps = sorted(ep_sizes or ([e for e in _divisors(world) if shape.moe.experts % e == 0] if shape.moe else [1]))
    node = o.gpus_per_node if o.nodes > 1 else None
    reasons: List[str] = []
    lowest = None
    if ring_size is not None:
        sps = [sp for sp in sps if sp % ring_size == 0]
    for sp in sps:
        ring = ring_size or choose_ring_size(sp, shape.heads, shape.kv_heads, gpus_per_node=node)
        tried = []
        for ep in eps:
            trial = PlanOptions(**{**asdict(o), "sp_size": sp, "ring_size": ring, "ep_size": ep})
            terms = memory_terms(shape, trial)
            tried.append((peak_bytes(terms), ep, trial, terms))
        layout = f"SP {sp}" + (f" (Ulysses {sp // ring} x ring {ring})" if ring > 1 else "")
        fitting = [t for t in tried if t[0] <= budget]
        if not fitting:
            peak, ep, trial, _ = min(tried, key=lambda t: t[0])
            reasons.append(f"{layout}: does not fit, {peak / GIB:.1f} GiB at best (EP {ep}) > {o.gpu_memory_gib:g} GiB")
            lowest = min(lowest or (peak, trial), (peak, trial), key=lambda x: x[0])
            continue
        peak, ep, trial, terms = fitting[0]
        for other_peak, other_ep, other, other_terms in tried:
            if other_ep < ep:
                reasons.append(f"EP {other_ep} at {layout}: {other_peak / GIB:.1f} GiB > {o.gpu_memory_gib:g} GiB "
                               f"({_expert_bytes_text(shape, other, other_terms)})")
        reasons.append(f"{layout}, EP {ep}: fits, {peak / GIB:.1f} GiB of {o.gpu_memory_gib:g} "
                       f"({_expert_bytes_text(shape, trial, terms)}): the smallest SP size that "
                       f"fits{', with the smallest EP size that fits there' if len(eps) > 1 else ''}")
        return Layout(trial, plan(shape, trial), reasons)
    _, trial = lowest
    reasons.append("nothing fits: the layout with the lowest peak")
    return Layout(trial, plan(shape, trial), reasons)


def _expert_bytes_text(shape: ModelShape, o: PlanOptions, terms: Dict[str, float]) -> str:
    """What EP changes on one GPU: its experts' fp32 weights, gradients and AdamW states (on
    the GPU), the gathered compute weights, the dispatch buffers."""
    world = o.gpus_per_node * o.nodes
    held = shape.expert_params / o.ep_size / (world // o.ep_size if o.fsdp else 1)
    states = 0.0 if o.fsdp_cpu_offload else 16 * held
    text = (f"experts' weights, gradients and AdamW states {states / GIB:.1f} GiB, gathered compute weights "
            f"{terms['gathered compute weights'] / GIB:.1f} GiB")
    if o.ep_size > 1:
        tokens = math.ceil(o.seq_len / (o.sp_size or world))
        text += f", dispatch buffers {expert_dispatch_bytes(shape, tokens, o.dtype_bytes) / GIB:.1f} GiB"
    return text


def format_plan(name: str, o: PlanOptions, result: Plan) -> str:
    lines = [f"{name}: {o.seq_len:,} tokens on {result.gpus} GPU(s) x {o.gpu_memory_gib:g} GiB, SP {result.sp_size}"
             f"{f' (ring {o.ring_size})' if o.ring_size > 1 else ''}{f', EP {o.ep_size}' if o.ep_size > 1 else ''}, "
             f"{result.local_tokens:,} tokens per GPU", ""]
    total_label = "peak per GPU (the largest phase counted)"
    width = max(len(k) for k in list(result.terms_gib) + [total_label])
    for k, v in result.terms_gib.items():
        lines.append(f"  {k:<{width}}  {v:9.2f} GiB")
    lines.append(f"  {total_label:<{width}}  {result.per_gpu_gib:9.2f} GiB  "
                 f"({'fits' if result.fits else 'does NOT fit'} in {o.gpu_memory_gib:g} GiB)")
    for k, v in result.host_gib.items():
        lines.append(f"  host memory per GPU: {k}: {v:.2f} GiB")
    if result.dsa_gib:
        lines.append("\nDeepSeek Sparse Attention, one layer on one GPU (in the layer phase above):")
        width = max(len(k) for k in result.dsa_gib)
        lines += [f"  {k:<{width}}  {v:9.2f} GiB" for k, v in result.dsa_gib.items()]
        lines += [f"  {note}" for note in result.dsa_notes]
    lines.append(f"\nlongest sequence that fits with these options: {result.max_seq_len:,} tokens")
    return "\n".join(lines)


# ---------------------------------------------------------------- inference (prefill)

def prefill_terms(shape: ModelShape, seq_len: int, sp: int, *, dtype_bytes: int = 2, batch: int = 1,
                  mlp_tile: Optional[int] = None, chunk: Optional[int] = None,
                  reserve_gib: float = 2.0) -> Dict[str, float]:
    """Per-GPU bytes of `hf.prefill` of `seq_len` tokens over `sp` GPUs (no gradients,
    ``logits_to_keep=1``): the replicated weights, this rank's head-sharded KV cache of
    every layer, and the largest phase of one layer (attention: the sequence shard's
    q/k/v and output, their head-sharded copies over the whole sequence and the cache's
    own K/V exchange; MLP: gate, up and their product, over the local tokens or one
    `mlp_tile` of them with `patch_model`'s tiled MLP); a hybrid's token-mixer layers keep
    no KV cache but their conv window and recurrent state, of this rank's heads, whatever
    the prompt's length (`MixerShape.state_bytes`). `chunk`: tokens per forward of a
    chunked prefill (the activations are the chunk's; the cache still holds every token).
    A DSA model's DSA layers cache the latent, rotary and indexer keys of every token on
    every rank (`DsaShape.cache_bytes_per_token`; their layer phase is still the head-sharded
    attention's). A model, not a measurement. A model the planner cannot count
    (ModelShape.dense_mlp_problem) raises ValueError."""
    _require_dense(shape)
    active = min(seq_len, chunk or seq_len)
    local = math.ceil(active / sp) * batch
    total = active * batch
    d, b = shape.head_dim, dtype_bytes
    kv_local = shape.kv_heads // sp if shape.kv_heads % sp == 0 else 1
    q_local = shape.heads // sp
    hidden = 2 * local * shape.hidden * b                          # residual stream + its norm
    attention = (local * (2 * shape.heads + 2 * shape.kv_heads) * d * b   # q, k, v and the output, local
                 + total * (2 * q_local + 2 * kv_local) * d * b           # the same, head-sharded
                 + total * 2 * kv_local * d * b)                          # the cache's K/V exchange
    mlp = 3 * min(local, mlp_tile or local) * shape.mlp_token_width * b
    mixer = shape.mixer
    states = mixer.total_state_bytes(sp, batch=batch, dtype_bytes=b) if mixer is not None else 0
    dsa = shape.dsa   # DSA layers cache their latent and indexer keys on every rank instead (no heads to split)
    kv_layers = shape.attention_layer_count - (dsa.layers if dsa is not None else 0)
    terms = {
        "weights (replicated)": shape.params * b,
        "KV cache (this rank's heads)": kv_layers * 2 * kv_local * d * seq_len * batch * b,
    }
    if dsa is not None:
        terms["DSA key cache (every rank)"] = dsa.cache_bytes_per_token(shape.mla, b) * seq_len * batch
    return {
        **terms,
        "token-mixer states (this rank's heads)": states,
        "hidden states": hidden,
        "one layer (peak phase)": max(attention, mlp),
        "last-position logits": batch * shape.vocab * 4,
        "reserve": reserve_gib * GIB,
    }


def max_prefill_len(shape: ModelShape, sp: int, gpu_memory_gib: float, granularity: int = 1 << 14,
                    **options) -> int:
    """The longest prompt (a multiple of `granularity`) whose `prefill_terms` fit; 0 if none."""
    def fits(S):
        return sum(prefill_terms(shape, S, sp, **options).values()) <= gpu_memory_gib * GIB
    lo, hi = 0, granularity
    while fits(hi) and hi < 1 << 34:
        lo, hi = hi, hi * 2
    while hi - lo > granularity:
        mid = (lo + hi) // 2 // granularity * granularity
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


PRESETS.update({name: shape_from_dict(cfg) for name, cfg in MOE_PRESET_CONFIGS.items()})
