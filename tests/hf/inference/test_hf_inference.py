"""Sequence-parallel inference (ulysses_kernels/hf/inference/generation.py, cache.py): `generate` and
`prefill` against single-device `model.generate` at SP 2, 3, 4 and Ulysses 2 x ring 2, on
the reference path and on the fused path with its CPU stand-ins; the refused modes."""

import pytest
import torch
from helpers import rel_err
from hf_cases import FUSED_NEW_TOKENS, FUSED_PROMPT, GEN_MODELS, GEN_NEW_TOKENS, TOL, _run, gen_model, gen_prompt

from ulysses_kernels import hf as ukhf

pytestmark = pytest.mark.slow

@pytest.mark.parametrize("world", [2, 3, 4])
def test_generate_matches_single_device(world):
    """Greedy tokens equal single-device `model.generate` (eager) on every rank; prefill
    logits < 1e-5; every rank's cache holds 1/P of the single-device cache (1/Hkv when
    the KV heads are replicated); seeded sampling identical on every rank."""
    from transformers import DynamicCache

    per_rank = [r["generate"] for r in _run(world)]
    ids = gen_prompt(3, 37)
    failures = []
    for i, (kind, config) in enumerate(GEN_MODELS[world]):
        ref = gen_model(kind, "eager", config)
        want = ref.generate(ids, max_new_tokens=GEN_NEW_TOKENS, do_sample=False)
        cache = DynamicCache()
        logits = ref(ids, past_key_values=cache, use_cache=True).logits[:, -1]
        full_bytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        kv_heads = config.get("num_key_value_heads", 2)
        share = world if kv_heads % world == 0 else kv_heads
        for r, got in enumerate(per_rank):
            if not torch.equal(got["greedy"][i], want):
                failures.append(f"{kind} {config} rank {r}: tokens differ")
            err = rel_err(got["prefill"][i], logits)
            if not err < TOL:
                failures.append(f"{kind} {config} rank {r}: prefill logits rel err {err:.2e}")
            if got["cache_bytes"][i] * share != full_bytes:
                failures.append(f"{kind} {config} rank {r}: cache {got['cache_bytes'][i]} B, single device "
                                f"{full_bytes} B, expected 1/{share}")
    kind, config = GEN_MODELS[world][0]
    ref = gen_model(kind, "eager", config)
    assert torch.equal(per_rank[0]["short"], ref.generate(gen_prompt(4, 2, B=1), max_new_tokens=5, do_sample=False))
    for r, got in enumerate(per_rank):
        assert torch.equal(got["sampled"], per_rank[0]["sampled"]), f"rank {r} sampled other tokens"
        assert torch.equal(got["short"], per_rank[0]["short"]) and torch.equal(got["after"], per_rank[0]["after"])
        assert "beam search" in got["beam_error"], got["beam_error"]
        assert "padded prompts" in got["padding_error"], got["padding_error"]
        assert "different prompts" in got["prompt_error"], got["prompt_error"]
    assert per_rank[0]["sampled"].shape == (1, 19 + 12)
    if world == 2:
        kind, config = GEN_MODELS[2][0]
        ref = gen_model(kind, "eager", config)
        want_logits = ref(ids).logits[:, -1]
        want = ref.generate(ids, max_new_tokens=8, do_sample=False)
        for r, got in enumerate(per_rank):
            for n, (logits, tokens) in zip((10, 1), got["chunked"]):
                err = rel_err(logits, want_logits)
                if not err < TOL:
                    failures.append(f"rank {r} chunk {n}: prefill logits rel err {err:.2e}")
                if not torch.equal(tokens, want):
                    failures.append(f"rank {r} chunk {n}: tokens differ")
    assert not failures, "\n".join(failures)


def test_example_generate_hf_runs():
    """examples/generate_hf.py at SP 2: the tokens of single-device generate, the same on
    both ranks, and its measurements."""
    per_rank = [r["example_generate"] for r in _run(2)]
    assert per_rank[0]["matches_single_device"] is True
    assert torch.equal(per_rank[0]["tokens"], per_rank[1]["tokens"])
    assert per_rank[0]["tokens"].shape == (1, 61 + 6)
    for r in per_rank:
        assert r["ttft_s"] > 0 and r["decode_tokens_per_s"] > 0 and r["cache_bytes"] > 0 and r["peak_bytes"] > 0


def test_generate_with_ulysses_x_ring():
    """SP 4 = Ulysses 2 x ring 2: the same tokens as single-device generate; the ring ranks
    hold the prompt's tokens between them (19 + 18), each for its Ulysses rank's KV head."""
    from transformers import DynamicCache

    per_rank = [r["generate_ring"] for r in _run(4)]
    kind, config = GEN_MODELS[4][0]
    ref = gen_model(kind, "eager", config)
    ids = gen_prompt(3, 37)
    want = ref.generate(ids, max_new_tokens=GEN_NEW_TOKENS, do_sample=False)
    want_short = ref.generate(ids, max_new_tokens=6, do_sample=False)
    cache = DynamicCache()
    logits = ref(ids, past_key_values=cache, use_cache=True).logits[:, -1]
    full_bytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    for r, got in enumerate(per_rank):
        assert torch.equal(got["greedy"], want), f"rank {r}"
        assert torch.equal(got["greedy_chunked"], want_short), f"rank {r} (chunks of 5)"
        assert rel_err(got["prefill"], logits) < TOL
        assert got["held"] == [19, 18]
    by_ulysses = {}
    for got in per_rank:
        by_ulysses.setdefault(got["ranks"][0], 0)
        by_ulysses[got["ranks"][0]] += got["cache_bytes"]
    assert all(b * 2 == full_bytes for b in by_ulysses.values()), (by_ulysses, full_bytes)


def test_generate_refuses_unsupported_modes_before_any_collective():
    """Checked from the arguments alone, so every rank raises the same error without
    communicating: beam search, assisted generation, padded prompts. Sliding windows are
    no longer refused (test_hf_generation_families.py generates the windowed families)."""
    ukhf.register(None)
    model = gen_model("llama", "ulysses", {})
    ids = gen_prompt(3, 9)
    with pytest.raises(ValueError, match="beam search"):
        ukhf.generate(model, ids, max_new_tokens=2, num_beams=3)
    with pytest.raises(ValueError, match="assisted generation"):
        ukhf.generate(model, ids, max_new_tokens=2, assistant_model=model)
    mask = torch.ones_like(ids)
    mask[1, 0] = 0
    with pytest.raises(ValueError, match="padded prompts"):
        ukhf.generate(model, ids, max_new_tokens=2, attention_mask=mask)
    # no attention_mask: transformers masks the prompt's pad tokens, from kwargs or a generation
    # config, so that is padding too; a pad token that is an eos token, or one the prompt does
    # not hold, masks nothing, and the tokens are model.generate's
    from transformers import GenerationConfig

    pad = int(ids[1, 4])
    for given in (dict(pad_token_id=pad, max_new_tokens=2), dict(generation_config=GenerationConfig(pad_token_id=pad))):
        with pytest.raises(ValueError, match=f"padded prompts .*pad_token_id {pad}"):
            ukhf.generate(model, ids, **given)
    absent = next(t for t in range(model.config.vocab_size) if not bool((ids == t).any()))
    for tokens in (dict(pad_token_id=pad, eos_token_id=pad), dict(pad_token_id=absent)):
        assert torch.equal(ukhf.generate(model, ids, max_new_tokens=4, do_sample=False, **tokens),
                           gen_model("llama", "eager", {}).generate(ids, max_new_tokens=4, do_sample=False, **tokens))
    # a sliding-window model generates (a window of 4 over a prompt of 9), like model.generate
    sliding = dict(use_sliding_window=True, sliding_window=4, max_window_layers=0,
                   layer_types=["sliding_attention", "sliding_attention"])
    assert torch.equal(ukhf.generate(gen_model("qwen2", "ulysses", sliding), ids, max_new_tokens=4, do_sample=False),
                       gen_model("qwen2", "eager", sliding).generate(ids, max_new_tokens=4, do_sample=False))
    # a single process (no group) generates like model.generate
    assert torch.equal(ukhf.generate(model, ids, max_new_tokens=4, do_sample=False),
                       gen_model("llama", "eager", {}).generate(ids, max_new_tokens=4, do_sample=False))


def test_generate_on_the_fused_path_with_stand_ins():
    """backend="fused" reaches inference: the cache runs on the fused path (its engine's
    exchange, the host transport of the stand-ins) and generates the single-device tokens."""
    per_rank = [r["generate_fused"] for r in _run(2)]
    kind, config = GEN_MODELS[2][0]
    ref = gen_model(kind, "eager", config)
    ids = gen_prompt(3, FUSED_PROMPT)
    want = ref.generate(ids, max_new_tokens=FUSED_NEW_TOKENS, do_sample=False)
    logits = ref(ids).logits[:, -1]
    for r, got in enumerate(per_rank):
        assert got["path"] == "fused" and got["transports"] == ["host"], (r, got["path"], got["transports"])
        assert torch.equal(got["tokens"], want), f"rank {r}: tokens differ"
        assert rel_err(got["logits"], logits) < TOL

