"""Tiny random configs of the model families people train on long contexts, for the
Hugging Face tests (training parity in test_hf_families.py, generation in
test_hf_inference.py): what each family needs of the attention (a sliding window shorter
than the test sequences, softcap, sinks, MLA's value head dim, MoE routers) at the
smallest size that still exercises it. Float64 weights: parity is checked at 1e-9.

`make_family_model(name, attn_implementation)` builds one with a fixed seed, so the
single-device reference and every rank hold the same weights.
"""

import contextlib

import pytest
import torch

pytest.importorskip("transformers", reason="ulysses_kernels.hf needs Hugging Face transformers "
                                           "(pip install -e '.[hf]' in the checkout)")

VOCAB = 96
WINDOW = 7  # shorter than every test sequence: the window changes the result

_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, attention_dropout=0.0)


@contextlib.contextmanager
def hf_keeps_float64():
    """transformers' upcasts to float32 (`.float()`, `.to(torch.float32)`, a float32
    `zeros_like` of a float64 tensor) keep float64 tensors float64, so that a float64
    comparison of a family that computes parts in float32 whatever its weights' dtype (Mamba2's
    scan, HY-V4's hyper-connections) sits at rounding, not at float32's ~1e-7 (summed over
    tokens in a different order on P ranks: up to ~1e-6); everything else is untouched."""
    to_float, to, zeros_like = torch.Tensor.float, torch.Tensor.to, torch.zeros_like

    def keep_float(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else to_float(self, *args, **kwargs)

    def keep_zeros_like(self, *args, **kwargs):   # a float32 accumulator for float64 tensors (Inkling 2's experts)
        if self.dtype == torch.float64 and kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        return zeros_like(self, *args, **kwargs)

    def keep_to(self, *args, **kwargs):
        if self.dtype == torch.float64:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
        return to(self, *args, **kwargs)

    torch.Tensor.float, torch.Tensor.to, torch.zeros_like = keep_float, keep_to, keep_zeros_like
    try:
        yield
    finally:
        torch.Tensor.float, torch.Tensor.to, torch.zeros_like = to_float, to, zeros_like


def family_config(name: str, **overrides):
    """The tiny config of family `name` (see FAMILIES)."""
    import transformers

    common = dict(_COMMON)
    if name == "llama":
        config = transformers.LlamaConfig(**common)
    elif name == "mistral":
        config = transformers.MistralConfig(sliding_window=WINDOW, **common)
    elif name == "qwen2_sliding":  # layer 0 full, layer 1 windowed (max_window_layers)
        config = transformers.Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                          **common)
    elif name == "gemma2":  # softcap, final softcap, alternating windows
        config = transformers.Gemma2Config(head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=5.0,
                                           final_logit_softcapping=3.0, query_pre_attn_scalar=16,
                                           layer_types=["sliding_attention", "full_attention"], **common)
    elif name == "gemma3":  # alternating windows, one KV head (fewer than the ranks)
        common.update(num_key_value_heads=1)
        config = transformers.Gemma3TextConfig(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                               layer_types=["sliding_attention", "full_attention"], **common)
    elif name == "gpt_oss":  # sinks, windows, MoE
        common.update(intermediate_size=32)
        config = transformers.GptOssConfig(head_dim=16, sliding_window=WINDOW, num_local_experts=4,
                                           num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
                                           **common)
    elif name == "deepseek_v3":  # MLA (q/k 24, v 16), MoE after the first layer
        common.update(num_key_value_heads=4)
        config = transformers.DeepseekV3Config(kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
                                               qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                                               n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                                               first_k_dense_replace=1, moe_intermediate_size=32, **common)
    elif name == "qwen3_moe":  # q/k norms, every layer a mixture of experts (the mesh tests only)
        config = transformers.Qwen3MoeConfig(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=32, **common)
    else:
        raise ValueError(f"unknown family {name!r}; one of {', '.join(FAMILIES)}, qwen3_moe")
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def exact_eager_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                          s_aux=None, position_bias=None, sinks=None, indices=None, block_indices=None, **kwargs):
    """transformers' eager attention (Gemma 2's softcap, GPT-OSS's sinks, Inkling's relative
    `position_bias` and Inkling 2's per-query `sinks`, DeepSeek-V3.2's selected key `indices`
    `[B, S, k]` and MiniMax-M3's key blocks per KV group `block_indices` `[B, KV heads, S, k]`
    (what transformers' eager folds into the mask), the additive masks eager
    builds, windows included) with the softmax in the inputs' dtype: eager upcasts to float32
    only, which would bound a float64 comparison at ~1e-7."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = torch.matmul(query, key.transpose(2, 3)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if position_bias is not None:
        scores = scores + position_bias
    if attention_mask is not None:
        scores = scores + attention_mask
    if indices is not None:   # keys the indexer did not select
        dropped = torch.ones_like(scores[:, 0], dtype=torch.bool).scatter(-1, indices.long(), False)
        scores = scores.masked_fill(dropped[:, None], torch.finfo(scores.dtype).min)
    if block_indices is not None:   # key blocks the group's index head did not select (-1: none)
        size, keys = module.indexer.block_size, key.shape[2]
        blocks = -(-keys // size)
        kept = torch.zeros(*block_indices.shape[:3], blocks + 1, dtype=torch.bool, device=scores.device)
        kept = kept.scatter(-1, block_indices.masked_fill(block_indices < 0, blocks).long(), True)[..., :blocks]
        kept = kept.repeat_interleave(size, dim=-1)[..., :keys].repeat_interleave(group, dim=1)
        scores = scores.masked_fill(~kept, torch.finfo(scores.dtype).min)
    if s_aux is not None:   # a logit per head (GPT-OSS)
        sinks = s_aux.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[2], 1)
    if sinks is not None:   # a logit per query and head `[B, H, S, 1]` with a zero value
        scores = torch.cat([scores, sinks.to(scores.dtype)], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if s_aux is not None or sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def register_exact_eager() -> str:
    """Register `exact_eager_attention` (with eager's masks) as "eager64"; its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register("eager64", exact_eager_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("eager64", ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    return "eager64"


FAMILIES = ("llama", "mistral", "qwen2_sliding", "gemma2", "gemma3", "gpt_oss", "deepseek_v3")


def make_family_model(name: str, attn_implementation: str, *, seed: int = 0, dtype=torch.float64, **overrides):
    """A tiny random model of family `name` (same weights for the same seed), in train mode.
    `attn_implementation="eager64"`: transformers' eager attention in float64 (the
    single-device reference)."""
    from transformers import AutoModelForCausalLM

    if attn_implementation == "eager64":
        register_exact_eager()
    torch.manual_seed(seed)
    # MoE experts as plain loops: the grouped-GEMM kernels take no float64.
    model = AutoModelForCausalLM.from_config(family_config(name, **overrides), attn_implementation=attn_implementation,
                                             experts_implementation="eager")
    return model.to(dtype).train()


def over_grids(world: int, grids: dict, cases):
    """`cases(groups, ulysses)` on every (Ulysses degree, ring degree) grid `grids[world]`
    lists, in one process group, each after `register(groups)`: {(ulysses, ring): result}."""
    import ulysses_kernels as uk
    from ulysses_kernels import hf as ukhf

    results = {}
    for ulysses, ring in grids[world]:
        groups = uk.init_sequence_parallel(world, ring_size=ring)
        ukhf.register(groups)
        results[ulysses, ring] = cases(groups, ulysses)
    return results


def gated_delta_rule_float64(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                             use_qk_l2norm_in_kernel=False, **kwargs):
    """The gated delta rule by its definition, token by token, in float64: the arguments and
    results of transformers' `torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule`
    (q, k `[B, S, Hk, Dk]`, v `[B, S, Hv, Dv]`, g, beta `[B, S, Hv]`; q and k L2-normalised
    when asked, q scaled by `Dk ** -0.5`; per token the state decays by `exp(g)` (Kimi Delta
    Attention's `chunk_kimi_delta_attention`: g `[B, S, H, Dk]`, a decay per key channel), then
    `S += k (beta (v - S^T k))^T` and the output is `S^T q`). Equal to the chunked form in
    exact arithmetic; `chunk_size` only chooses the chunking there."""
    if kwargs.get("cu_seqlens") is not None:
        raise ValueError("gated_delta_rule_float64 keeps no packed documents apart (neither does transformers' "
                         "torch rule without flash-linear-attention)")
    initial_dtype = query.dtype

    def l2norm(x):   # transformers' l2norm (eps 1e-6)
        return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)

    if key.shape[2] != value.shape[2]:   # each key head serves Hv / Hk consecutive value heads
        query, key = (x.repeat_interleave(value.shape[2] // key.shape[2], dim=2) for x in (query, key))
    query, key, value, beta, g = (x.transpose(1, 2).to(torch.float64) for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        query, key = l2norm(query), l2norm(key)
    query = query * query.shape[-1] ** -0.5
    B, H, S, Dk = key.shape
    state = (torch.zeros(B, H, Dk, value.shape[-1], dtype=torch.float64, device=value.device)
             if initial_state is None else initial_state.to(torch.float64))
    out = []
    for t in range(S):
        decay = g[:, :, t].exp()
        state = state * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
        remembered = (state * key[:, :, t, :, None]).sum(dim=-2)
        delta = (value[:, :, t] - remembered) * beta[:, :, t, None]
        state = state + key[:, :, t, :, None] * delta[:, :, None, :]
        out.append((state * query[:, :, t, :, None]).sum(dim=-2))
    out = torch.stack(out, dim=2) if out else value.new_zeros(value.shape)
    return out.transpose(1, 2).contiguous().to(initial_dtype), (state if output_final_state else None)


@contextlib.contextmanager
def float64_delta_rule():
    """Every Gated DeltaNet modeling module's gated delta rule (chunked and recurrent) made
    `gated_delta_rule_float64`, through the module attributes that transformers' layers and
    the package's adapter (gated_deltanet.py) call. transformers' own rule computes in
    float32 whatever the inputs' dtype, and its float32 sums of the decay gradients cancel:
    on one device, float32 against float64 moves A_log's and dt_bias's gradients by 0.4 %
    (tiny Qwen3-Next) to 17 % (tiny Qwen3.5), so a different but exact order of the same
    float32 work (the ring's chunks) differs from the one-device run at that level. In
    float64 the ring must match to rounding. The rule is replaced, not rewritten from
    transformers' source text (which 5.25 wraps in a hub-kernel module)."""
    import importlib

    gated = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
    kimi = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")
    patched = []
    for family, names in (("qwen3_next", gated), ("qwen3_5", gated), ("qwen3_5_moe", gated), ("lara_mini", gated),
                          ("olmo_hybrid", gated), ("kimi_linear", kimi), ("bailing_hybrid", kimi)):
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        for name in names:
            patched.append((module, name, getattr(module, name)))
            setattr(module, name, gated_delta_rule_float64)
    try:
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)
