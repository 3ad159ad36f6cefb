"""Tiny random models of any causal LM family transformers ships, built from the family's
own default config (the sweep, tests/hf/families/test_hf_sweep.py).

A default config describes a real model (dozens of layers, thousands of channels). The
rule that makes it tiny, generically:

* **Sizes.** Every width, head count, vocabulary, expert count and low-rank dimension that
  the config names (`SIZES`) is set to a small value, in nested sub-configs too.
* **Layers.** Per-layer settings (lists with one value per layer, dicts keyed by layer
  index, lists of layer indices) are cut to a few layers that keep every *kind* of layer
  the default model has (its first layer of each distinct combination of per-layer
  values), so a hybrid model stays hybrid. Families whose layer kinds follow from a
  period and an offset get a period of 2.
* **Exceptions** the generic rule cannot know (a rotary dim larger than the tiny head
  dim, a dimension that must equal another) are in `FAMILY_OVERRIDES`, one line each.

`build_tiny_model(model_type, attn_implementation)` returns the model in float64 and
train mode, with fixed-seed weights (the reference and every rank hold the same
weights), or raises `CannotBuildTiny` saying why.
"""

import warnings
from typing import Dict, List, Optional, Tuple

import torch

VOCAB = 96
CHUNK = 8      # Llama 4's attention_chunk_size: shorter than the sweep's sequences
WINDOW = 7     # a sliding window shorter than the sweep's sequences

# The tiny value of every size field a config may name.
SIZES: Dict[str, Optional[int]] = {
    # widths
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "embed_dim": 64, "word_embed_proj_dim": 64,
    "intermediate_size": 96, "ffn_dim": 96, "decoder_ffn_dim": 96, "encoder_ffn_dim": 96, "n_inner": 96,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    "dense_intermediate_size": 96, "ffn_hidden_size": 96, "dim_ff": 96, "dff": 96, "d_inner": 96, "emb_dim": 64,
    "lru_width": 64, "expert_ffn_hidden_size": 32, "moe_shared_expert_intermediate_size": 32, "o_lora_rank": 32,
    "decoder_vocab_size": VOCAB, "shape_vocab_size": VOCAB, "pronunciation_vocab_size": VOCAB,
    "shape_embed_dim": 16, "pronunciation_embed_dim": 16, "zero_expert_num": 1,
    # depth (a hybrid's layer selection overrides num_hidden_layers)
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "decoder_layers": 2, "encoder_layers": 2,
    # heads
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "decoder_attention_heads": 4, "encoder_attention_heads": 4,
    "num_key_value_heads": 2, "n_kv_heads": 2, "num_kv_heads": 2, "multi_query_group_num": 2, "head_dim": 16,
    "d_head": 16, "rotary_dim": 8, "rotary_emb_dim": 8,
    # vocabulary and positions
    "vocab_size": VOCAB, "max_position_embeddings": 256, "n_positions": 256, "n_ctx": 256,
    # experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "moe_k": 2, "n_shared_experts": 1,
    "num_shared_experts": 1, "n_group": 1, "topk_group": 1, "num_expert_group": 1,
    # multi-head latent attention
    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    # windows and chunks shorter than the sweep's sequences
    "sliding_window": WINDOW, "attention_chunk_size": CHUNK,
    # state-space and linear-attention layers
    "state_size": 8, "mamba_d_state": 8, "ssm_state_size": 8, "mamba_n_heads": 8, "mamba_d_head": 16,
    "mamba_head_dim": 16, "mamba_num_heads": 8, "mamba_n_groups": 1, "n_groups": 1, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_head_dim": 16, "linear_num_heads": 4,
    "mamba_d_ssm": 128, "attention_hidden_size": 128, "attention_head_dim": 32, "mamba_headdim": 16,
    "embedding_dim": 64, "num_blocks": 2, "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16,
    "time_step_rank": 8, "mamba_dt_rank": 8, "expand": 2, "mamba_expand": 2,
}

# Per family: fields the generic rule cannot derive (the reason on each line).
FAMILY_OVERRIDES: Dict[str, dict] = {
    "dots1": dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2),   # the default has no experts
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),                       # the default has no layer types
    "lfm2": dict(layer_types=["conv", "full_attention"]),        # the default is all attention; checkpoints are not
    # the default has no indexer (the VLM's causal LM takes the text config); 16 index heads: with 2, many
    # blocks score 0 after the ReLU, a tie that torch.topk breaks by the tensor's shape
    "qwen4_exp": dict(indexer_n_heads=16, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                      indexer_compress_ratio=2),
    "qwen4_exp_text": dict(indexer_n_heads=16, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                           indexer_compress_ratio=2),
    "mamba2": dict(num_heads=8, head_dim=16),                                       # heads x head dim = 2 x hidden
    "gemma4_assistant": dict(hidden_size_per_layer_input=0),                       # an assistant has none
    "zaya": dict(num_experts_per_tok=1),                                            # its only choice
    # per-layer K/V sources and indexer layers name layer indices: one indexed, one sliding layer
    "kolibri1_1": dict(num_hidden_layers=2, layer_types=["indexed_attention", "sliding_attention"],
                       kv_source_layers=[0, 1], index_layers=[0], mlp_only_layers=[], index_num_heads=2),
    # to_dict writes each layer as two blocks (attention, mlp): three layers, one per stage
    "dory": dict(num_hidden_layers=6, n_input_layers=2, n_recurrent_layers=2, n_output_layers=2,
                 layer_types=["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention", "mlp"]),
    "dots3_note_text": dict(head_dim=24, index_head_dim=16, index_n_heads=2),       # window head dim = q/k head dim
    "dots3_note": dict(text_config=dict(head_dim=24, index_head_dim=16, index_n_heads=2)),
    "nemotron": dict(num_key_value_heads=2),                                        # the default leaves it unset
    "xlstm": dict(num_heads=4),
    "zamba": dict(num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"]),  # a shared block twice
    "gemma3n_text": dict(num_kv_shared_layers=2),                                   # the last two share KV
    "dbrx": dict(attn_config=dict(rope_theta=10000.0, clip_qkv=8.0)),               # DbrxAttention reads both
    "gemma4_assistant": dict(text_config=dict(hidden_size_per_layer_input=0)),
    "gemma4_unified_assistant": dict(num_kv_shared_layers=0),
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "reformer": dict(axial_pos_embds_dim=[32, 32], axial_pos_shape=[4, 8]),        # factors sum to the width
}

def _xlstm_kernels_in_float64(model):
    """xLSTM's mLSTM kernels compute in `autocast_kernel_dtype` (bf16 by default; the config
    admits no wider type) with float32 states: a float64 comparison would see bf16's rounding.
    Rebuilt here from a copy of the config that says float64 (the backends hold no weights)."""
    import copy

    config = copy.copy(model.config)
    object.__setattr__(config, "autocast_kernel_dtype", "float64")
    object.__setattr__(config, "inference_state_dtype", "float64")
    for module in model.modules():
        if type(module).__name__ == "xLSTMBackend":
            module.__init__(config)
    return model


# Per family: what the model needs after it is built.
def _float32_parts_in_float32(model):
    """Inkling 2's router (and Inkling 2 Loop's message gates) cast their inputs to float32
    and multiply them with weights a float64 model has in float64: their own forward raises.
    Those weights stay float32, as transformers declares them; the rest of the model is
    float64."""
    for module in model.modules():
        if type(module).__name__ in ("Inkling2TopKRouter", "Inkling2LoopTopKRouter"):
            module.float()
        if type(module).__name__ == "Inkling2LoopMessageGate":
            module.forget_gate_proj.float()
            module.message_gate_proj.float()
    return model


AFTER_BUILD = {
    "xmod": lambda model: model.set_default_language("en_XX"),   # its adapters need a language
    "xlstm": _xlstm_kernels_in_float64,
    "inkling2_text": _float32_parts_in_float32,
    "inkling2_loop_text": _float32_parts_in_float32,
}


# Families whose model takes no rows of text tokens: the sweep's [1, S] batch does not apply.
NOT_TOKEN_ROWS = {
    "musicgen": "input_ids are [batch x num_codebooks, S] rows of audio codes, not token rows",
    "musicgen_melody": "input_ids are [batch x num_codebooks, S] rows of audio codes, not token rows",
}


class CannotBuildTiny(Exception):
    """The family has no tiny CPU build here; the message says why."""


def _is_size(key, value) -> bool:
    return key in SIZES and not isinstance(value, bool) and (isinstance(value, int) or value is None)


def _shrink_value(key, value):
    if isinstance(value, list) and key in SIZES and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [SIZES[key] for _ in value]   # per-layer sizes (Gemma 3n's intermediate_size)
    if not _is_size(key, value):
        return value
    if value is None:   # an optional size (a derived head_dim, no q LoRA) stays derived
        return None
    return SIZES[key]


def _layer_key(key, width: int) -> str:
    return str(key).zfill(width)


def _layer_indices(value, layers: int) -> bool:
    """A list of layer indices (strictly increasing ints below the layer count)."""
    return (isinstance(value, list) and len(value) > 0 and all(isinstance(v, int) and not isinstance(v, bool)
                                                              for v in value)
            and all(a < b for a, b in zip(value, value[1:])) and 0 <= value[0] and value[-1] < layers)


def _per_layer_dict(value, layers: int) -> bool:
    return (isinstance(value, dict) and len(value) > 0
            and all(str(k).isdigit() and int(k) < layers for k in value))


def _per_layer_list(key, value, layers: int) -> bool:
    return isinstance(value, list) and len(value) == layers and layers > 1 and key not in ("architectures",)


def select_layers(fields: dict, layers: int) -> Tuple[List[int], dict]:
    """The layers to keep (the first of each kind) and the per-layer fields cut to them."""
    lists = {k: v for k, v in fields.items() if _per_layer_list(k, v, layers) and not _layer_indices(v, layers)}
    index_lists = {k: v for k, v in fields.items() if _layer_indices(v, layers)}
    dicts = {k: v for k, v in fields.items() if _per_layer_dict(v, layers)}
    if not (lists or index_lists or dicts):
        return list(range(min(layers, 2))), {}

    def entry(d, i):   # a per-layer dict keyed by int or by zero-padded digits
        return d.get(i, d.get(_layer_key(i, len(str(next(iter(d)))))))

    def kind(i):
        return (tuple(str(v[i]) for v in lists.values()) + tuple(i in v for v in index_lists.values())
                + tuple(str(entry(d, i)) for d in dicts.values()))

    keep, seen = [], set()
    for i in range(layers):
        if kind(i) not in seen:
            seen.add(kind(i))
            keep.append(i)
    for i in range(layers):          # at least two layers
        if len(keep) >= 2:
            break
        if i not in keep:
            keep.append(i)
    keep.sort()
    new = {k: [v[i] for i in keep] for k, v in lists.items()}
    new.update({k: [keep.index(i) for i in v if i in keep] for k, v in index_lists.items()})
    for k, d in dicts.items():
        width = len(str(next(iter(d))))
        out = {}
        for i in keep:
            for key in (i, _layer_key(i, width)):
                if key in d:
                    out[type(key)(keep.index(i)) if isinstance(key, int) else _layer_key(keep.index(i), width)] = d[key]
        new[k] = out
    return keep, new


def _depth_key(fields: dict) -> Optional[str]:
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"):
        if isinstance(fields.get(key), int):
            return key
    return None


_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_DROP = ("model_type", "transformers_version", "architectures", "_name_or_path", "id2label", "label2id",
         "dtype", "torch_dtype")


def tiny_fields(fields: dict) -> dict:
    """A (sub-)config's fields made tiny (see the module doc)."""
    fields = {k: v for k, v in fields.items() if k not in _DROP}
    depth = _depth_key(fields)
    if depth is not None:
        layers = fields[depth]
        keep, per_layer = select_layers(fields, layers)
        fields.update(per_layer)
    out = {}
    for key, value in fields.items():
        if key == "per_layer_config" and isinstance(value, dict):   # {layer: {field: value}}
            out[key] = {k: _mla_heads({kk: _shrink_value(kk, vv) for kk, vv in v.items()}) for k, v in value.items()}
        elif isinstance(value, dict) and (key.endswith("config") or key.endswith("_cfg")):
            out[key] = tiny_fields(value)
        elif key.endswith("_period") and isinstance(value, int) and value > 2:
            out[key] = 2
        elif key.endswith("_offset") and isinstance(value, int) and not isinstance(value, bool) and value > 1:
            out[key] = 1
        elif ("dropout" in key or "pdrop" in key or "jitter" in key) and isinstance(value, float):
            out[key] = 0.0   # the sweep compares one step: no randomness
        elif key.endswith("_token_id") and isinstance(value, int) and not isinstance(value, bool) and value >= VOCAB:
            out[key] = VOCAB - 1
        else:
            out[key] = _shrink_value(key, value)
    if depth is not None:
        out[depth] = max(len(keep), SIZES.get(depth, 2)) if not per_layer else len(keep)
    if out.get("head_dim", 0) is None and isinstance(out.get("num_attention_heads"), int) \
            and isinstance(out.get("hidden_size"), int):
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    if out.get("num_experts_per_tok", 0) is None and any(isinstance(out.get(k), int) for k in _EXPERTS):
        out["num_experts_per_tok"] = SIZES["num_experts_per_tok"]
    if "qk_head_dim" in out and isinstance(out.get("qk_nope_head_dim"), int):
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    if isinstance(out.get("kv_lora_rank"), int):   # MLA: every head has its own keys, the rotary part is head_dim
        if "head_dim" in out and isinstance(out.get("qk_rope_head_dim"), int):
            out["head_dim"] = out["qk_rope_head_dim"]
        if "num_key_value_heads" in out:
            out["num_key_value_heads"] = out.get("num_attention_heads")
    return out


def _merge(fields: dict, overrides: dict) -> None:
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(fields.get(key), dict):
            _merge(fields[key], value)
        else:
            fields[key] = value


def _mla_heads(fields: dict) -> dict:
    """Multi-head latent attention expands keys per query head: as many KV heads as heads."""
    if "kv_lora_rank" in fields and "num_key_value_heads" in fields and "num_attention_heads" in fields:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    return fields


def causal_lm_class(model_type: str):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def tiny_config(model_type: str):
    """The family's default config made tiny."""
    model_class = causal_lm_class(model_type)
    config_class = model_class.config_class
    fields = tiny_fields(config_class().to_dict())
    _merge(fields, FAMILY_OVERRIDES.get(model_type, {}))
    if "is_decoder" in fields:        # encoder families' causal LM heads (BERT and kin)
        fields["is_decoder"] = True
    return config_class(**fields)


def build_tiny_model(model_type: str, attn_implementation: str, *, seed: int = 0, overrides: Optional[dict] = None,
                     model_class=None):
    """The family's tiny model, float64, train mode, weights from `seed`; `overrides`: config
    fields set after the tiny rule (head counts for a test's SP size); `model_class`: another
    head of the family (its causal LM by default)."""
    if model_type in NOT_TOKEN_ROWS:
        raise CannotBuildTiny(NOT_TOKEN_ROWS[model_type])
    model_class = model_class or causal_lm_class(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config = tiny_config(model_type)
            for key, value in (overrides or {}).items():
                setattr(config, key, value)
        except Exception as error:
            raise CannotBuildTiny(f"config: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        torch.manual_seed(seed)
        kwargs = dict(attn_implementation=attn_implementation)
        try:
            model = model_class._from_config(config, experts_implementation="eager", **kwargs)
        except TypeError:
            model = model_class._from_config(config, **kwargs)
    model = model.to(torch.float64).train()
    if model_type in AFTER_BUILD:
        AFTER_BUILD[model_type](model)
    return model
