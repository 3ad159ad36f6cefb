"""ulysses_kernels.planner and `ulysses-kernels plan`: the published parameter counts of the
presets, the JSON contract, what each option saves, max_seq_len at the edge, and the
model against measured peak memory of training steps on CPU (bench/plan_validation.py)."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ulysses_kernels.planner import GIB, PRESETS, PlanOptions, max_seq_len, memory_terms, peak_bytes, plan

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name,billions", [("llama-3-8b", 8.03), ("llama-3-70b", 70.55), ("qwen2.5-7b", 7.62),
                                           ("qwen2.5-72b", 72.7), ("qwen3-8b", 8.19), ("mistral-7b", 7.24)])
def test_preset_parameter_counts_match_the_published_sizes(name, billions):
    assert abs(PRESETS[name].params / 1e9 - billions) / billions < 0.01, PRESETS[name].params


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ulysses_kernels.cli", "plan", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
def test_plan_cli_json_contract_and_options():
    base = ["--model", "llama-3-8b", "--seq-len", "1000000", "--gpus", "8", "--gpu-memory-gib", "80", "--json"]
    results = {}
    for extra in ((), ("--tiled",), ("--offload", "--tiled")):
        out = _cli(*base, *extra)
        assert out.returncode == 0, out.stderr
        data = json.loads(out.stdout)
        assert isinstance(data["fits"], bool) and isinstance(data["max_seq_len"], int)
        assert isinstance(data["per_gpu_gib"], float)
        results[extra] = data
    plain, tiled, offload = results.values()
    assert not plain["fits"] and tiled["fits"] and offload["fits"]
    assert plain["max_seq_len"] < tiled["max_seq_len"] < offload["max_seq_len"]
    assert offload["host_gib"] and not plain["host_gib"]
    table = _cli("--model", "llama-3-8b", "--seq-len", "1000000", "--gpus", "8", "--tiled")
    assert "longest sequence that fits" in table.stdout and "checkpointed layer inputs" in table.stdout
    bad = _cli("--model", "no-such-model", "--seq-len", "1000")
    assert bad.returncode == 2 and "neither a preset" in bad.stderr


def _plan_here(capsys, *args):
    """The CLI's `plan` run in this process (its main, as `python -m ulysses_kernels.cli`
    runs it; an argparse error's exit caught): (exit code, stdout, stderr)."""
    from ulysses_kernels.cli import main

    try:
        code = main(["plan", *args])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_ring_auto_and_an_sp_the_heads_do_not_allow(capsys):
    """--ring auto takes the smallest ring the heads allow and that keeps each Ulysses group
    inside a node, and says so (32 query heads on SP 64: ring 2 on one node of 64, ring 8
    on 8 nodes of 8); without it, SP 64 as pure Ulysses over 32 heads exits 2 naming the
    fix (it planned it silently); --ring takes 'auto' or an integer >= 1. (In this process:
    test_plan_cli_json_contract_and_options runs the CLI as a program.)"""
    base = ["--model", "llama-3-8b", "--seq-len", "1000000", "--gpus", "8", "--nodes", "8", "--sp", "64"]
    code, out, err = _plan_here(capsys, *base, "--ring", "auto", "--json")
    assert code == 0, err
    assert json.loads(out)["options"]["ring_size"] == 8
    assert "Ulysses 8 x ring 8 (each Ulysses group inside a node of 8 GPUs, the ring across nodes)" in err
    code, out, err = _plan_here(capsys, "--model", "llama-3-8b", "--seq-len", "1000000", "--gpus-per-node", "8",
                                "--nodes", "8", "--sp", "64", "--ring", "auto", "--json")   # --gpus's other name
    assert json.loads(out)["options"]["ring_size"] == 8, err
    code, out, err = _plan_here(capsys, "--model", "llama-3-8b", "--seq-len", "1000000", "--gpus", "64", "--sp", "64",
                                "--ring", "auto")
    assert "SP 64 (ring 2)" in out and "Ulysses 32 x ring 2 (one node)" in err
    code, out, err = _plan_here(capsys, *base)
    assert code == 2 and "SP 64 with --ring 1 is Ulysses 64" in err, err
    assert "use --ring 2 (Ulysses 32) or --ring auto" in err
    assert _plan_here(capsys, *base, "--ring", "4")[0] == 0
    code, out, err = _plan_here(capsys, *base, "--ring", "0")
    assert code == 2 and "must be 'auto' or an integer >= 1" in err


@pytest.mark.slow
def test_plan_from_a_config_file(tmp_path):
    cfg = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
               intermediate_size=704, vocab_size=2048, model_type="llama")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = _cli("--model", str(tmp_path), "--seq-len", "4096", "--gpus", "2", "--gpu-memory-gib", "1", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["params"] == 2 * 2048 * 256 + 4 * (256 * 12 * 32 + 256 * 256 + 3 * 256 * 704
                                                                      + 2 * 256) + 256


def test_each_option_lowers_the_peak_and_max_seq_len_is_the_edge():
    shape = PRESETS["qwen2.5-7b"]
    base = dict(seq_len=262144, gpus_per_node=8, ring_size=2)
    peaks = []
    for extra in ({}, dict(tiled_loss=True), dict(tiled_loss=True, tiled_mlp=True),
                  dict(tiled_loss=True, tiled_mlp=True, checkpoint_offload=True),
                  dict(tiled_loss=True, tiled_mlp=True, checkpoint_offload=True, fsdp_cpu_offload=True)):
        peaks.append(peak_bytes(memory_terms(shape, PlanOptions(**base, **extra))))
    assert all(b < a for a, b in zip(peaks, peaks[1:])), peaks
    o = PlanOptions(seq_len=1024, gpus_per_node=8, gpu_memory_gib=80, tiled_loss=True, tiled_mlp=True)
    edge = max_seq_len(shape, o)
    fits = lambda S: peak_bytes(memory_terms(shape, PlanOptions(**{**o.__dict__, "seq_len": S}))) <= 80 * GIB  # noqa: E731
    assert fits(edge) and not fits(edge + 1024)
    with pytest.raises(ValueError, match="must divide"):
        plan(shape, PlanOptions(seq_len=1024, gpus_per_node=8, ring_size=3))


@pytest.mark.slow
def test_planner_within_15_percent_of_measured_cpu_peaks():
    """Two of bench/plan_validation.py's cases at SP 2 (the attention-dominated and the
    logits-dominated one); the full table is bench/results/plan_validation_cpu.md."""
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "plan_validation.py"), "--sp", "2", "--cases", "0",
                          "4", "--check", "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads(out.stdout[out.stdout.index("["):out.stdout.rindex("]") + 1])
    assert len(rows) == 2 and all(0.85 <= r["ratio"] <= 1.15 for r in rows), rows


def test_prefill_terms_kv_cache_and_limits():
    """The prefill model: the KV cache term is this rank's heads (1/P split, one head when
    replicated) of layers x 2 x head_dim x S; the longest prefill grows with memory and
    with a tiled MLP, and fits exactly at its own answer."""
    from ulysses_kernels.planner import GIB, max_prefill_len, prefill_terms

    llama = PRESETS["llama-3-8b"]          # 8 KV heads: split over 8, replicated over 16
    S = 1 << 20
    per_token = llama.layers * 2 * llama.head_dim * 2
    assert prefill_terms(llama, S, 8)["KV cache (this rank's heads)"] == per_token * S
    assert prefill_terms(llama, S, 16)["KV cache (this rank's heads)"] == per_token * S
    assert prefill_terms(llama, S, 4)["KV cache (this rank's heads)"] == 2 * per_token * S
    n = max_prefill_len(llama, 8, 80.0)
    assert n > 0 and sum(prefill_terms(llama, n, 8).values()) <= 80 * GIB
    assert sum(prefill_terms(llama, n + (1 << 14), 8).values()) > 80 * GIB
    assert max_prefill_len(llama, 8, 80.0, mlp_tile=4096) > n > max_prefill_len(llama, 8, 40.0)


@pytest.mark.slow
def test_plan_cli_inference_and_chunks():
    """`plan --inference`: the prefill terms, JSON contract; chunks shrink the activations
    (never the cache), so the longest prompt grows."""
    import json
    import subprocess
    import sys

    def run(*extra):
        out = subprocess.run([sys.executable, "-m", "ulysses_kernels.cli", "plan", "--model", "llama-3-8b",
                              "--seq-len", "1048576", "--inference", "--json", *extra],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    one, chunked = run(), run("--chunk", "65536")
    assert one["fits"] and one["sp"] == 8 and one["max_prefill_len"] > 1048576
    cache = "KV cache (this rank's heads)"
    assert chunked["terms_gib"][cache] == one["terms_gib"][cache] == 16.0
    assert chunked["terms_gib"]["one layer (peak phase)"] < one["terms_gib"]["one layer (peak phase)"]
    assert chunked["max_prefill_len"] > one["max_prefill_len"]


def test_flash_backward_counts_the_fp32_dq_accumulator(monkeypatch):
    """The default Triton backward's fp32 dQ accumulator is in the backward's peak phase:
    Llama-3-8B at SP 8 and 1M tokens, 4 query heads per rank: 2 GiB; with a tiled MLP it is
    the largest temporary, so the phase grows by it minus the MLP tile's temporaries."""
    from ulysses_kernels import planner

    shape = PRESETS["llama-3-8b"]
    S = 1 << 20
    assert planner.dq_accumulator_bytes(shape, shape.heads // 8, S) == 2 * GIB
    o = PlanOptions(seq_len=S, gpus_per_node=8, tiled_mlp=True, tiled_loss=True)
    key = "one layer in its backward (peak phase)"
    with_acc = memory_terms(shape, o)[key]
    monkeypatch.setattr(planner, "dq_accumulator_bytes", lambda *a: 0)
    without = memory_terms(shape, o)[key]
    mlp = min(S // 8, planner.mlp_tile_tokens(shape.hidden)) * o.dtype_bytes * planner.TRANSIENT_MLP \
        * shape.intermediate
    assert with_acc - without == 2 * GIB - mlp


def test_hybrid_configs_count_their_token_mixers():
    """A hybrid config (transformers' Qwen3-Next and Bamba defaults, as config.json holds
    them): its linear-attention / Mamba2 layers keep no KV cache but a conv window and a
    recurrent state of this rank's heads, whatever the prompt's length; the exact bytes
    against the cache's are in tests/hf/families/test_hf_hybrid.py."""
    transformers = pytest.importorskip("transformers")
    from ulysses_kernels.planner import prefill_terms, shape_from_dict

    qwen = shape_from_dict(transformers.Qwen3NextConfig().to_dict())
    assert qwen.mixer.kind == "gated_deltanet" and qwen.mixer.layers == 36 and qwen.attention_layer_count == 12
    bamba = shape_from_dict(transformers.BambaConfig(attn_layer_indices=[3, 7]).to_dict())
    assert bamba.mixer.kind == "mamba2" and bamba.mixer.layers == bamba.layers - 2 and bamba.attention_layer_count == 2
    for shape in (qwen, bamba):
        short = prefill_terms(shape, 1 << 14, 8)
        long = prefill_terms(shape, 1 << 17, 8)
        states = "token-mixer states (this rank's heads)"
        assert short[states] == long[states] > 0
        assert long["KV cache (this rank's heads)"] == 8 * short["KV cache (this rank's heads)"]
        assert shape.mixer.state_bytes(8) < shape.mixer.state_bytes(2)   # heads split over more ranks


# Tiny configs of the mixture-of-experts families the planner knows: dense and MoE layers
# mixed (Qwen: `decoder_sparse_step`, `mlp_only_layers`; DeepSeek: `first_k_dense_replace`),
# shared experts, latent attention with and without a query rank, GPT-OSS's biases and sinks.
TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=96, vocab_size=128)
LINEAR = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"] * 2)
MLA = dict(kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=2, topk_group=1)
TINY_EXPERTS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2,
                      mlp_only_layers=[3]),
    "qwen2_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, mlp_only_layers=[0]),
    "deepseek_v3": dict(MLA, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2,
                        first_k_dense_replace=1, q_lora_rank=24),
    "deepseek_v2": dict(MLA, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                        first_k_dense_replace=1, q_lora_rank=None),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"] * 2),
    # DeepSeek Sparse Attention: MLA and an indexer a layer (GLM-5: none in its "shared" layers)
    "deepseek_v32": dict(MLA, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2,
                         first_k_dense_replace=1, q_lora_rank=24, index_topk=8, index_n_heads=2, index_head_dim=16),
    # the Gated DeltaNet hybrids: shared experts with a gate, attention with an output gate
    # (Qwen3-Next: `mlp_only_layers`; Qwen3.5-MoE: every layer, no dense width in its config)
    "qwen3_next": dict(LINEAR, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, mlp_only_layers=[0]),
    "qwen3_5_moe_text": dict(LINEAR, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=48, intermediate_size=None),
    "glm_moe_dsa": dict(MLA, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                        first_k_dense_replace=1, mlp_layer_types=["dense", "sparse", "dense", "sparse"], q_lora_rank=24,
                        index_topk=8, index_n_heads=2, index_head_dim=16, indexer_types=["full", "shared", "full", "shared"]),
}


@pytest.mark.slow   # builds Hugging Face models
@pytest.mark.parametrize("family", list(TINY_EXPERTS) + ["qwen3", "llama", "qwen3_5_text"])
def test_the_planner_counts_a_mixture_of_experts_as_transformers_builds_it(family):
    """Every parameter of the model and of its routed experts, against transformers' own
    modules (DeepSeek-V3's router correction bias is a buffer, not a parameter)."""
    transformers = pytest.importorskip("transformers")
    from ulysses_kernels.planner import shape_from_dict

    fields = dict(TINY, **TINY_EXPERTS.get(family, LINEAR if family == "qwen3_5_text" else {}))
    config = transformers.AutoConfig.for_model(family, **{k: v for k, v in fields.items() if v is not None})
    model = transformers.AutoModelForCausalLM.from_config(config)
    shape = shape_from_dict(config.to_dict())
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.expert_params == sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert (shape.moe is not None) == (family in TINY_EXPERTS) and shape.dense_mlp_problem() is None


def test_mixture_of_experts_is_planned_where_its_layout_is_known():
    """The flagship MoE configs (transformers' defaults) plan with their published sizes
    (Mixtral 8x7B 46.7e9, DeepSeek-V3 671e9, GPT-OSS 117e9), an MoE layer's activations
    wider than a dense layer's of its experts' width (top-k routed tokens); a family whose
    expert layout the planner does not know (OLMoE) gets a clear ValueError from the
    training and prefill terms, never a plan of dense MLPs; dense configs plan."""
    transformers = pytest.importorskip("transformers")
    from ulysses_kernels.planner import PlanOptions, memory_terms, prefill_terms, shape_from_dict

    published = {"Mixtral": (transformers.MixtralConfig(), 46.7e9), "DeepSeek-V3": (transformers.DeepseekV3Config(), 671e9),
                 "GPT-OSS": (transformers.GptOssConfig(), 116.8e9),
                 "Qwen3-Next": (transformers.Qwen3NextConfig(), 80e9)}
    for name, (config, params) in published.items():
        shape = shape_from_dict(config.to_dict())
        assert abs(shape.params - params) / params < 0.005, (name, shape.params)
        terms = memory_terms(shape, PlanOptions(seq_len=4096, gpus_per_node=8))
        dense = dataclasses.replace(shape, moe=None, routed_experts=0, intermediate=shape.moe.width)
        assert terms["one layer in its backward (peak phase)"] > \
            memory_terms(dense, PlanOptions(seq_len=4096, gpus_per_node=8))["one layer in its backward (peak phase)"]
        assert prefill_terms(shape, 4096, 8)["weights (replicated)"] == shape.params * 2
    unknown = shape_from_dict(transformers.OlmoeConfig().to_dict())
    assert unknown.routed_experts == 64 and unknown.moe is None
    with pytest.raises(ValueError, match="mixture-of-experts models \\(64 routed experts per MLP\\) are modelled for"):
        memory_terms(unknown, PlanOptions(seq_len=4096, gpus_per_node=8))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        prefill_terms(unknown, 4096, 8)
    for config in (transformers.LlamaConfig(), transformers.Qwen2Config(), transformers.MistralConfig()):
        shape = shape_from_dict(config.to_dict())
        assert shape.routed_experts == 0 and shape.dense_mlp_problem() is None
        assert sum(memory_terms(shape, PlanOptions(seq_len=4096, gpus_per_node=8)).values()) > 0
    assert shape_from_dict(dict(transformers.LlamaConfig().to_dict(), num_local_experts=1)).routed_experts == 0


@pytest.mark.slow   # builds transformers' flagship configs
def test_plan_cli_plans_mixtures_of_experts_by_model_type(tmp_path, capsys):
    """`--model` takes a transformers model type at its default configuration: Qwen3-MoE,
    Mixtral, DeepSeek-V3 and GPT-OSS plan, their routed experts counted from the config;
    an MoE layout the planner does not know (OLMoE, as a config file) exits 2. (The
    CLI's `main` in this process: one transformers import for the four plans.)"""
    transformers = pytest.importorskip("transformers")
    from ulysses_kernels.cli import main

    base = ["--seq-len", "1000000", "--gpus", "8", "--gpu-memory-gib", "80", "--tiled", "--offload"]
    for family, experts in (("qwen3_moe", "24 MoE layers x 128 experts x 4,718,592"),
                            ("mixtral", "32 MoE layers x 8 experts x 176,160,768"),
                            ("deepseek_v3", "58 MoE layers x 256 experts x 44,040,192"),
                            ("gpt_oss", "36 MoE layers x 128 experts x 24,891,840")):
        assert main(["plan", "--model", family, *base]) == 0
        out = capsys.readouterr().out
        assert "longest sequence that fits" in out and experts in out, out
    path = tmp_path / "config.json"
    path.write_text(json.dumps(transformers.OlmoeConfig().to_dict()))
    out = _cli("--model", str(tmp_path), "--seq-len", "4096")
    assert out.returncode == 2 and "are modelled for mixtral, qwen2_moe, qwen3_moe" in out.stderr, out.stderr
    unknown = _cli("--model", "no_such_model_type", "--seq-len", "4096")
    assert unknown.returncode == 2 and "nor a transformers model type" in unknown.stderr
    unmodelled = _cli("--model", "rwkv", "--seq-len", "4096")   # a model type without attention heads
    assert unmodelled.returncode == 2 and "the planner cannot read RwkvConfig" in unmodelled.stderr, unmodelled.stderr


def test_a_tiled_mlp_saves_nothing_in_a_mixture_of_experts():
    """patch_model tiles dense MLPs only (it refuses MoE blocks): `--tiled` leaves an MoE
    model's per-layer activations as they are, and still shrinks a dense model's."""
    from ulysses_kernels.planner import shape_from_model_type

    base = dict(seq_len=65536, gpus_per_node=8)
    for name, shape in (("mixtral", shape_from_model_type("mixtral")), ("llama-3-8b", PRESETS["llama-3-8b"])):
        tiled, untiled = (memory_terms(shape, PlanOptions(**base, tiled_mlp=t)) for t in (True, False))
        assert (tiled == untiled) == (shape.moe is not None), name


def test_plan_ring_auto_follows_the_runtime_node_rule():
    """Two nodes of 6 GPUs, SP 4: the second SP group (ranks 4-7) spans both nodes, so
    `--ring auto` keeps Ulysses inside what a node holds of it, as init_sequence_parallel's
    rule does (`choose_ring_size` with the node size whenever the world spans nodes)."""
    from ulysses_kernels.layout import choose_ring_size

    proc = _cli("--model", "llama-3-8b", "--seq-len", "4096", "--gpus", "6", "--nodes", "2", "--sp", "4",
                "--ring", "auto")
    ring = choose_ring_size(4, 32, 8, gpus_per_node=6)
    assert f"Ulysses {4 // ring} x ring {ring} (each Ulysses group inside a node of 6 GPUs" in proc.stderr, proc.stderr


# A small DeepSeek-V3.2 config (dense MLPs) whose DSA terms are worked out by hand below:
# R = kv_lora_rank 16, r = qk_rope_head_dim 8, 4 heads, index heads 2 of dim 16, top 8.
DSA_CONFIG = dict(model_type="deepseek_v32", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, head_dim=8, intermediate_size=96, vocab_size=128, q_lora_rank=24,
                  kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, index_topk=8,
                  index_n_heads=2, index_head_dim=16)


def test_dsa_layer_terms_by_hand():
    """One DSA layer at S = 8192 on P = 4 (2048 queries a rank; query tile 256, key tile
    4096, top 8), bf16, each part against its hand arithmetic; the layer phase of the
    training step is the local projections' and MLP's terms plus the DSA layer's kept parts
    and its larger moment (here the indexer's tiles), not
    a head-exchanged flash attention's; a ring is refused (dsa.py refuses one)."""
    from ulysses_kernels import planner

    shape = planner.shape_from_dict(DSA_CONFIG)
    assert shape.dsa == planner.DsaShape(topk=8, index_heads=2, index_dim=16, layers=4, indexer_layers=4)
    b = planner.dsa_layer_bytes(shape, 8192, 4)
    assert b.gathered_keys == 8192 * (16 + 8) * 2 == 393_216              # S tokens, not S/P
    assert b.gathered_index_keys == 8192 * 16 * 2 == 262_144
    assert b.visibility == 256 * 4096 == 1_048_576                         # [QT, KT] bool, a tile
    assert b.index_queries == 2048 * 2 * (16 + 1) * 4 == 278_528           # queries and weights, fp32
    assert b.index_tile == 2 * 256 * 2 * 4096 * 4 + 256 * (8 + 4096) * 12 == 29_384_704
    assert b.latent_queries == 4 * 2048 * 16 * 2 == 262_144                # every head: no head exchange
    assert b.selection == 2048 * 8 * 8 == 131_072
    assert b.attention_tile == 256 * 8 * 24 * 2 + 4 * 256 * 8 * (2 * 2 + 4) == 163_840
    assert b.tile_backward == 2 * 8192 * 24 * 2 == 786_432                 # a scatter into [S, R + r], the keys' grad
    assert b.transformers_scores == 8192 * 2 * 8192 * 4 == 536_870_912
    assert b.saved == 786_432 and b.transient == 262_144 + 278_528 + 29_384_704 + 1_048_576 == 30_973_952
    # the whole layer: local activations 2048 x 2 x (4 x 64 + 3 x 12 x 8 + 2 x 4 x 8 + 4 x 96) = 4,063,232
    o = PlanOptions(seq_len=8192, gpus_per_node=4)
    assert memory_terms(shape, o)["one layer in its backward (peak phase)"] == 4_063_232 + 786_432 + 30_973_952
    # the reference attention's [heads, S, S] probabilities (1 GiB here) are no DSA layer's
    reference = memory_terms(shape, dataclasses.replace(o, attention="reference"))
    assert reference["one layer in its backward (peak phase)"] == 4_063_232 + 786_432 + 30_973_952
    every = memory_terms(shape, dataclasses.replace(o, checkpointing=False))["every layer's saved activations"]
    assert every == 4 * (4_063_232 + 786_432)
    # on the wire per layer and rank: 3 x 2048 tokens x (16 + 8 + 16), against q|k (4 x 24) and v|out (4 x 16)
    assert planner.dsa_wire_bytes(shape, 8192, 4) == {"DSA all-gather": 3 * 2048 * 40 * 2,
                                                      "Ulysses head exchange": 3 * 2048 * 4 * 80 * 2 // 4}
    with pytest.raises(ValueError, match="does not run on a ring"):
        memory_terms(shape, PlanOptions(seq_len=8192, gpus_per_node=4, ring_size=2))


def test_dsa_tiles_are_the_code_s():
    """The planner's DSA tiles are the ones hf/families/sparse/dsa.py runs with (the planner may not
    import it)."""
    pytest.importorskip("torch")
    from ulysses_kernels import planner
    from ulysses_kernels.hf.families.sparse import dsa, dsa_indexer

    assert planner.DSA_QUERY_TILE == dsa.QUERY_TILE == dsa_indexer.QUERY_TILE
    assert planner.DSA_KEY_TILE == dsa_indexer.KEY_TILE


def test_dsa_decoding_cache_is_replicated_and_shared_layers_keep_no_indexer_key():
    """The decoding cache per token, the same on every rank: the latent and rotary key of
    each DSA layer (16 + 8), the indexer key (16) of each layer with an indexer: GLM-5's
    "shared" layers have none (nor its parameters), dots3's sliding-window layers keep the
    head-sharded KV cache instead."""
    from ulysses_kernels import planner

    v32 = planner.shape_from_dict(DSA_CONFIG)
    glm = planner.shape_from_dict(dict(DSA_CONFIG, model_type="glm_moe_dsa",
                                       indexer_types=["full", "shared", "full", "shared"]))
    assert glm.dsa.layers == 4 and glm.dsa.indexer_layers == 2
    assert v32.dsa.cache_bytes_per_token(v32.mla) == (4 * 24 + 4 * 16) * 2 == 320
    assert glm.dsa.cache_bytes_per_token(glm.mla) == (4 * 24 + 2 * 16) * 2 == 256
    indexer = 24 * 2 * 16 + 64 * 16 + 2 * 16 + 64 * 2     # wq_b, wk, k_norm (weight, bias), weights_proj
    assert v32.params - glm.params == 2 * indexer == 3904
    shared = planner.dsa_layer_bytes(glm, 8192, 4, indexer=False)
    assert shared.gathered_index_keys == shared.index_queries == shared.index_tile == 0
    assert shared.gathered_keys == 393_216
    S, key = 1 << 16, "DSA key cache (every rank)"
    for sp in (2, 4):   # replicated: not divided by P
        terms = planner.prefill_terms(glm, S, sp)
        assert terms[key] == 256 * S and terms["KV cache (this rank's heads)"] == 0
    dots3 = planner.shape_from_dict(dict(DSA_CONFIG, model_type="dots3_note_text", layer_types=[
        "indexed_attention", "sliding_attention", "sliding_attention", "indexed_attention"]))
    assert dots3.dsa.layers == dots3.dsa.indexer_layers == 2
    terms = planner.prefill_terms(dots3, S, 4)
    assert terms[key] == (2 * 24 + 2 * 16) * 2 * S
    assert terms["KV cache (this rank's heads)"] == 2 * 2 * 1 * 8 * S * 2   # 2 layers x K|V x 1 head x 8 x S x bf16


def test_a_latent_attention_model_without_dsa_is_planned_as_before():
    """DeepSeek-V3 (MLA, no indexer): no DSA terms, and its numbers are the ones the planner
    gave before it knew DSA (S = 131072, P = 8)."""
    transformers = pytest.importorskip("transformers")
    from ulysses_kernels.planner import format_plan, prefill_terms, shape_from_dict

    shape = shape_from_dict(transformers.DeepseekV3Config().to_dict())
    assert shape.dsa is None and shape.params == 671_026_404_352
    o = PlanOptions(seq_len=131072, gpus_per_node=8)
    terms = memory_terms(shape, o)
    assert terms["one layer in its backward (peak phase)"] == 8_154_775_552
    assert terms["gathered compute weights"] == 47_882_502_144
    prefill = prefill_terms(shape, 131072, 8)
    assert prefill["KV cache (this rank's heads)"] == 32_749_125_632
    assert not any("DSA" in k for k in prefill)
    result = plan(shape, o)
    assert not result.dsa_gib and "Sparse Attention" not in format_plan("deepseek_v3", o, result)


def test_plan_cli_prints_deepseek_v32_s_dsa_terms(capsys):
    """`plan --model deepseek_v32` (transformers' default: DeepSeek-V3.2, 61 DSA layers with
    an indexer) at 131072 tokens on 8 GPUs: the DSA parts of one layer, the cache per token
    and the forward's bytes on the wire; the indexers' parameters are counted."""
    pytest.importorskip("transformers")
    from ulysses_kernels.cli import main

    assert main(["plan", "--model", "deepseek_v32", "--seq-len", "131072", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    lines = {line.strip().split("  ")[0]: line.split()[-2] for line in out.splitlines() if line.endswith(" GiB")}
    assert lines["a tile's backward: gather grad [S, 576] + keys' grad [S, 576]"] == "0.28"   # 2 x 131072 x 576 x 2
    assert lines["latent queries [128, S/P, 512], kept"] == "2.00"                 # 128 x 16384 x 512 x 2
    assert lines["gathered latent + rotary keys [S, 576], kept"] == "0.14"         # 131072 x 576 x 2
    assert lines["transformers' indexer scores [S, 64, S] fp32 (not counted)"] == "4096.00"
    assert "decoding cache per token, the same on every rank: 85,888 bytes" in out   # 61 x (576 + 128) x 2
    assert "154.0 MiB (the keys' all-gather); a Ulysses head exchange of the same layer: 2,240.0 MiB" in out
    indexers = 61 * (1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64)
    assert f"parameters: {671_026_404_352 + indexers:,}" in out


def test_a_vision_language_config_plans_its_language_model():
    """Qwen3.5-MoE's config (transformers' default: Qwen3.5-35B-A3B) keeps its decoder in
    `text_config` and no dense width: the planner reads the decoder, 40 layers of 256 experts
    of 512, 34.7e9 parameters (the published 35e9 has the vision tower too)."""
    transformers = pytest.importorskip("transformers")
    from ulysses_kernels.planner import shape_from_dict

    shape = shape_from_dict(transformers.AutoConfig.for_model("qwen3_5_moe").to_dict())
    assert (shape.moe.layers, shape.moe.experts, shape.moe.width, shape.moe.shared_width) == (40, 256, 512, 512)
    assert shape.mixer.kind == "gated_deltanet" and shape.attention_layer_count == 10 and shape.intermediate == 0
    assert shape.params == 34_660_610_688
    # its top-level config says whether the embeddings are tied (transformers ties by it)
    tied = shape_from_dict(transformers.AutoConfig.for_model("qwen3_5_moe", tie_word_embeddings=True).to_dict())
    assert tied.tied_embeddings and tied.params == shape.params - 248320 * 2048


def test_qwen3_5_122b_a10b_preset_counts_its_experts_and_totals():
    """The preset's published sizes and its inferred ones (planner.MOE_PRESET_CONFIGS) give the
    model card's totals: 122e9 parameters (the vision tower's 0.4e9 aside), 10e9 active per
    token; its routed experts counted by hand: 48 layers x 256 experts x 3 x 3072 x 1024."""
    shape = PRESETS["qwen3.5-122b-a10b"]
    assert shape.expert_params == 48 * 256 * 3 * 3072 * 1024 == 115_964_116_992
    active = shape.params - shape.expert_params + 48 * 8 * 3 * 3072 * 1024
    assert abs(shape.params - 122e9) / 122e9 < 0.005 and abs(active - 10e9) / 10e9 < 0.03
    assert shape.mixer.layers == 36 and shape.attention_layer_count == 12


def test_choose_layout_for_qwen3_5_122b_a10b():
    """The layouts docs/planner.md tabulates for Qwen3.5-122B-A10B on 64 GPUs of 80 GiB with
    tiled MLP and loss: SP 4 at 256K, SP 16 (Ulysses 8 x ring 2 across nodes) at 1M, EP 1
    both; on one node of 8 the states alone (16 B x 122e9 / 8 = 227 GiB) exceed a GPU."""
    from ulysses_kernels.planner import choose_layout

    shape = PRESETS["qwen3.5-122b-a10b"]
    nodes = PlanOptions(seq_len=262144, gpus_per_node=8, nodes=8, tiled_mlp=True, tiled_loss=True)
    layout = choose_layout(shape, nodes)
    assert (layout.options.sp_size, layout.options.ring_size, layout.options.ep_size) == (4, 1, 1) and layout.plan.fits
    layout = choose_layout(shape, dataclasses.replace(nodes, seq_len=1 << 20))
    assert (layout.options.sp_size, layout.options.ring_size, layout.options.ep_size) == (16, 2, 1) and layout.plan.fits
    one_node = choose_layout(shape, dataclasses.replace(nodes, nodes=1))
    assert not one_node.plan.fits and one_node.reasons[-1] == "nothing fits: the layout with the lowest peak"


# Qwen3-30B-A3B's config.json (planner.MOE_PRESET_CONFIGS), counted by hand: 48 MoE layers of
# 128 experts, each expert gate, up and down projections of 2048 x 768.
QWEN3_30B_EXPERTS = 48 * 128 * 3 * 2048 * 768
QWEN3_30B_EXPERT_LAYER = 128 * 3 * 2048 * 768


def test_expert_parallelism_divides_the_experts_and_adds_its_dispatch():
    from ulysses_kernels.planner import expert_dispatch_bytes

    shape = PRESETS["qwen3-30b-a3b"]
    assert shape.expert_params == QWEN3_30B_EXPERTS == 28_991_029_248
    dense = shape.params - QWEN3_30B_EXPERTS
    base = PlanOptions(seq_len=65536, gpus_per_node=8, fsdp=False)
    for ep in (1, 2, 8):   # replicated: each GPU holds its experts whole
        terms = memory_terms(shape, dataclasses.replace(base, ep_size=ep))
        assert terms["weights (fp32, sharded)"] == 4 * (dense + QWEN3_30B_EXPERTS / ep)
        assert terms["optimizer (AdamW fp32 m, v)"] == 8 * (dense + QWEN3_30B_EXPERTS / ep)
    sharded = dataclasses.replace(base, fsdp=True)
    one, eight = memory_terms(shape, sharded), memory_terms(shape, dataclasses.replace(sharded, ep_size=8))
    # FSDP over the 8 GPUs; with EP 8 each GPU's 16 experts are its own (efsdp 1): the same bytes
    assert one["weights (fp32, sharded)"] == pytest.approx(eight["weights (fp32, sharded)"], rel=1e-12)
    assert one["weights (fp32, sharded)"] == pytest.approx(4 * (dense + QWEN3_30B_EXPERTS) / 8, rel=1e-12)
    # FSDP gathers a layer and the next: with EP only this GPU's 16 of the 128 experts
    assert one["gathered compute weights"] - eight["gathered compute weights"] == pytest.approx(
        2 * 2 * QWEN3_30B_EXPERT_LAYER * (1 - 1 / 8), rel=1e-12)
    tokens = 65536 // 8
    assert expert_dispatch_bytes(shape, tokens, 2) == 2 * tokens * 8 * 2048 * 2


def test_an_ep_size_the_model_or_the_gpus_cannot_take_is_refused():
    with pytest.raises(ValueError, match="the model has no routed experts to split"):
        plan(PRESETS["llama-3-8b"], PlanOptions(seq_len=4096, ep_size=2))
    with pytest.raises(ValueError, match="--ep 3 must divide the 6 GPUs and the 128 routed experts"):
        plan(PRESETS["qwen3-30b-a3b"], PlanOptions(seq_len=4096, gpus_per_node=6, ep_size=3))


def test_choose_layout_takes_the_smallest_sp_then_the_smallest_ep_that_fit_and_says_why():
    from ulysses_kernels.planner import choose_layout

    shape = PRESETS["qwen3-30b-a3b"]
    # replicated states (no FSDP) on 141 GiB GPUs: only EP 8 brings the experts' states down
    layout = choose_layout(shape, PlanOptions(seq_len=32768, gpus_per_node=8, fsdp=False, gpu_memory_gib=141.0))
    assert (layout.options.sp_size, layout.options.ep_size) == (1, 8) and layout.plan.fits
    assert [r.split(":")[0] for r in layout.reasons] == ["EP 1 at SP 1", "EP 2 at SP 1", "EP 4 at SP 1", "SP 1, EP 8"]
    assert "the smallest SP size that fits, with the smallest EP size that fits there" in layout.reasons[-1]
    assert "experts' weights, gradients and AdamW states 216.0 GiB" in layout.reasons[1]   # 16 B x experts / 2
    # FSDP, tiled, 256K tokens on 8 GPUs: SP 8 is the first that fits, and EP 1 fits there
    tiled = PlanOptions(seq_len=262144, gpus_per_node=8, tiled_mlp=True, tiled_loss=True)
    layout = choose_layout(shape, tiled)
    assert (layout.options.sp_size, layout.options.ep_size) == (8, 1) and layout.plan.fits
    assert [r.split(":")[0] for r in layout.reasons[:3]] == ["SP 1", "SP 2", "SP 4"]
    assert all("does not fit" in r for r in layout.reasons[:3])
    # a ring the user chose is kept (--sp 8 --ring 2 --ep auto)
    ringed = choose_layout(shape, tiled, sp_sizes=[8], ring_size=2)
    assert (ringed.options.sp_size, ringed.options.ring_size) == (8, 2)
    assert ringed.reasons[-1].startswith("SP 8 (Ulysses 4 x ring 2), EP 1: fits")
    # nothing fits: the lowest peak, and the plan says it does not fit
    layout = choose_layout(shape, dataclasses.replace(tiled, seq_len=1 << 22))
    assert not layout.plan.fits and layout.reasons[-1] == "nothing fits: the layout with the lowest peak"


def test_plan_cli_ep(capsys):
    code, out, err = _plan_here(capsys, "--model", "qwen3-30b-a3b", "--seq-len", "262144", "--gpus", "8", "--nodes",
                                "8", "--ep", "auto", "--tiled")
    assert code == 0, err
    assert "layout (--ep auto):" in out and "SP 2, EP 1: fits" in out, out
    code, out, err = _plan_here(capsys, "--model", "qwen3-30b-a3b", "--seq-len", "65536", "--ep", "3")
    assert code == 2 and "--ep 3 must divide the 8 GPUs and the 128 routed experts" in err
