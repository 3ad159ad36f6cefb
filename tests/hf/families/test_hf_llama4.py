"""Llama 4 under sequence parallelism (ulysses_kernels/hf/families/attention/llama4.py): its chunked layers
see the keys of their own chunk only (`attention_chunk_size` = 5 here, shorter than the
23-token sequence), chunks cut from each packed document's start; its NoPE layer scales
the queries by position (temperature tuning, `floor_scale` = 4, so the factor changes
inside the sequence) at the tokens' global positions.

Training: one step at SP 2, SP 3 (6 query / 3 KV heads) and Ulysses 2 x ring 2, on one
document and on two packed documents (9 + 14 tokens: chunks cross neither), against one
process with transformers' eager attention in float64 (each packed document on its own).
Generation: `ukhf.generate` against `model.generate` on one device, the prompt prefilled
whole and in chunks, and the logits after a prefill and decode steps. The fast tier checks
the rules on synthetic tensors.
"""

import pytest
import torch
from helpers import SLOW_SPAWN_TIMEOUT, SpawnedRuns, rel_err

pytest.importorskip("transformers", reason="ulysses_kernels.hf needs Hugging Face transformers "
                                           "(pip install -e '.[hf]' in the checkout)")

from family_cases import over_grids, register_exact_eager  # noqa: E402
from sweep import DOCUMENTS, reference_step, sp_step  # noqa: E402
from test_hf_generation_families import decode_greedily  # noqa: E402

from ulysses_kernels import hf as ukhf  # noqa: E402
from ulysses_kernels.hf.families.attention.llama4 import chunk_bounds, retune_queries, temperature  # noqa: E402

CHUNK, FLOOR = 5, 4
PROMPT, NEW_TOKENS, DECODE_STEPS = 13, 6, 4
PREFILL_CHUNKS = (None, 4, 7)
GRIDS = {2: [(2, 1)], 3: [(3, 1)], 4: [(2, 2)]}   # world -> (Ulysses, ring)


def llama4(attn: str, ulysses: int = 2):
    """A tiny Llama 4 text model: two chunked (RoPE) layers and a full NoPE layer with
    temperature tuning, MoE on every layer, float64, fixed weights."""
    import transformers

    heads = dict(num_attention_heads=6, num_key_value_heads=3) if ulysses == 3 else \
        dict(num_attention_heads=4, num_key_value_heads=2)
    config = transformers.Llama4TextConfig(
        hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=3, head_dim=16,
        vocab_size=96, max_position_embeddings=256, num_local_experts=2, num_experts_per_tok=1,
        attention_chunk_size=CHUNK, no_rope_layers=[1, 1, 0], attn_temperature_tuning=True, floor_scale=FLOOR,
        attn_scale=1.0, attention_dropout=0.0, **heads)
    torch.manual_seed(0)
    from transformers import Llama4ForCausalLM

    model = Llama4ForCausalLM._from_config(config, attn_implementation=attn, experts_implementation="eager")
    return model.to(torch.float64)


def prompt():
    return torch.randint(3, 96, (1, PROMPT), generator=torch.Generator().manual_seed(3))


def llama4_cases(groups, ulysses):
    """One grid's training steps, the two-row refusal, generation and decoding."""
    res = {}
    model = llama4("ulysses", ulysses).train()
    for case, documents in DOCUMENTS.items():
        model.zero_grad(set_to_none=True)
        res[case] = sp_step(model, documents, groups)
    two_rows = ukhf.shard_batch(torch.randint(0, 96, (2, 23)), groups)
    try:
        ukhf.causal_lm_loss(model, two_rows, groups)
        res["two rows"] = None
    except ValueError as error:
        res["two rows"] = str(error)
    model.eval()
    with torch.no_grad():
        res["greedy"] = [ukhf.generate(model, prompt(), max_new_tokens=NEW_TOKENS, do_sample=False,
                                       prefill_chunk_size=c) for c in PREFILL_CHUNKS]
        logits, cache = ukhf.prefill(model, prompt(), chunk_size=7)   # the last forward sharded
        res["prefill"] = logits
        with ukhf.decoding(cache):
            res["decoded"] = decode_greedily(model, logits, cache, DECODE_STEPS)
    return res


def run_grid(rank, world):
    return over_grids(world, GRIDS, llama4_cases)


_run = SpawnedRuns(lambda world: (run_grid, ()), timeout=SLOW_SPAWN_TIMEOUT)


def reference(ulysses):
    model = llama4(register_exact_eager(), ulysses).train()
    out = {}
    for case, documents in DOCUMENTS.items():
        model.zero_grad(set_to_none=True)
        out[case] = reference_step(model, documents)
    model.eval()
    with torch.no_grad():
        out["greedy"] = model.generate(prompt(), max_new_tokens=NEW_TOKENS, do_sample=False)
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        logits = model(input_ids=prompt(), cache=cache, use_cache=True).logits[:, -1]
        out["prefill"] = logits
        out["decoded"] = decode_greedily(model, logits, cache, DECODE_STEPS)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4], ids=["sp2", "sp3", "2x2"])
def test_llama4_trains_and_generates_like_one_device(world):
    per_rank = _run(world)
    for grid in GRIDS[world]:
        want = reference(grid[0])
        for rank, results in enumerate(per_rank):
            got = results[grid]
            for case in DOCUMENTS:
                (loss, grads), (want_loss, want_grads) = got[case], want[case]
                assert rel_err(loss, want_loss) < 1e-6, (grid, rank, case)
                floor = 1e-6 * max(float(g.norm()) for g in want_grads.values())
                for name, g in want_grads.items():
                    err = float((grads[name] - g).norm()) / max(float(g.norm()), floor)
                    assert err < 1e-6, (grid, rank, case, name, err)
            assert got["two rows"] and "batch size 1" in got["two rows"], got["two rows"]
            for tokens in got["greedy"]:
                assert torch.equal(tokens, want["greedy"]), (grid, rank)
            assert rel_err(got["prefill"], want["prefill"]) < 1e-6, (grid, rank)
            assert rel_err(got["decoded"], want["decoded"]) < 1e-6, (grid, rank)


# ------------------------------------------------------------------ the rules, one process

def test_chunks_are_cut_from_each_document_start():
    assert chunk_bounds([0, 23], 5) == [0, 5, 10, 15, 20, 23]
    assert chunk_bounds([0, 9, 23], 5) == [0, 5, 9, 14, 19, 23]
    assert chunk_bounds([0, 4], 5) == [0, 4]


def test_the_temperature_changes_inside_the_test_sequences():
    """HF's factor at local positions differs from the global one for rank 1 of SP 2 (so
    the training test covers the correction), and retune_queries restores it exactly."""
    module = llama4("eager").model.layers[2].self_attn
    local, true = torch.arange(11), torch.arange(12, 23)
    assert not torch.equal(temperature(module, local), temperature(module, true))
    q = torch.randn(1, 4, 11, 16, dtype=torch.float64)
    hf = q * temperature(module, local).to(q.dtype).view(1, 1, -1, 1)
    want = q * temperature(module, true).to(q.dtype).view(1, 1, -1, 1)
    assert rel_err(retune_queries(module, hf, local, true), want) < 1e-15
    assert retune_queries(module, hf, local, local) is hf


def test_a_chunked_layer_keeps_its_current_chunk():
    """One process: forwards of 3, 2, 1, 1, 3 tokens through a chunked layer (chunk 5)
    attend to the keys of their own chunk only; a forward crossing a chunk boundary raises."""
    from test_hf_generation_families import _stand_in_model

    from ulysses_kernels.hf.inference.cache import HeadShardedCache
    from ulysses_kernels.reference.attention import reference_attention

    g = torch.Generator().manual_seed(0)
    cache = HeadShardedCache(_stand_in_model())
    keys, values, seen = [], [], 0
    for T in (3, 2, 1, 1, 3):
        k = torch.randn(1, 2, T, 16, generator=g, dtype=torch.float64)
        v = torch.randn(1, 2, T, 16, generator=g, dtype=torch.float64)
        q = torch.randn(1, 4, T, 16, generator=g, dtype=torch.float64)
        held_k, held_v = cache.update(k, v, 0)
        got = cache.attention(q, held_k, held_v, 0.25, True, attention_chunk=CHUNK)
        cache.update(k, v, 1)   # a full layer beside it
        cache.attention(q, *cache._held(1), 0.25, True)
        keys.append(k)
        values.append(v)
        start = (seen // CHUNK) * CHUNK
        all_k, all_v = (torch.cat(t, dim=2)[:, :, start:].transpose(1, 2) for t in (keys, values))
        want, _ = reference_attention(q.transpose(1, 2), all_k, all_v, causal=True, softmax_scale=0.25)
        assert rel_err(got, want) < 1e-12, T
        seen += T
        assert cache.layers[0].keys.shape[2] == seen % CHUNK
    k = torch.randn(1, 2, 6, 16, dtype=torch.float64)   # tokens 10..15: 15 starts a chunk
    held = cache.update(k, k, 0)
    with pytest.raises(ValueError, match="crosses a multiple of the attention_chunk_size 5"):
        cache.attention(torch.randn(1, 4, 6, 16, dtype=torch.float64), *held, 0.25, True, attention_chunk=CHUNK)


def test_prefill_cuts_its_forwards_at_the_chunks():
    from ulysses_kernels.hf.inference.generation import forward_spans

    assert forward_spans(13, 13, 0, 5) == [(0, 5), (5, 10), (10, 13)]
    assert forward_spans(13, 4, 0, 5) == [(0, 4), (4, 5), (5, 8), (8, 10), (10, 12), (12, 13)]
    assert forward_spans(6, 6, 3, 5) == [(0, 2), (2, 6)]   # a cache of 3 tokens: the chunk ends at 5
    assert forward_spans(7, 3, 0, None) == [(0, 3), (3, 6), (6, 7)]
