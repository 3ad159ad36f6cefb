"""Sequence-parallel generation of the model families of families.py (ulysses_kernels/hf/
cache.py, generation.py): Mistral and Qwen2 (sliding windows, Qwen2 on its upper layers
only), Gemma 2 (softcap, alternating windows), Gemma 3 (alternating windows, one KV
head), GPT-OSS (sinks, windows, MoE), DeepSeek-V3 (MLA: a one-head latent cache, keys 24
and values 16 wide), with a window of 7 shorter than the 20-token prompts.

Against single-device `model.generate` with the same float64 weights and transformers'
eager attention in float64 (family_cases.py, "eager64"): greedy tokens on every rank, with the
prompt prefilled whole and in chunks shorter and longer than the window; seeded sampling
(the first rank's seed); the logits after a prefill and decode steps; the cache of a
windowed layer holds the last W - 1 tokens, as transformers' own sliding-window cache.
At Ulysses 2, at Ulysses 3 (6 query heads; 3 KV heads, Gemma 3 one, DeepSeek-V3 six), and
with a ring of 2 (Ulysses 1 x ring 2 and 2 x 2: the ring's chunk holders, windowed layers
on every ring rank, the sinks merged once). One spawn per world runs every family.

The single-process units below check the cache's rules on synthetic tensors (fast tier).
"""

from functools import lru_cache
from types import SimpleNamespace

import pytest
import torch
from family_cases import VOCAB, WINDOW, make_family_model, over_grids
from helpers import SLOW_SPAWN_TIMEOUT, SpawnedRuns, rel_err

from ulysses_kernels import hf as ukhf
from ulysses_kernels.reference.attention import reference_attention

GEN_FAMILIES = ("mistral", "qwen2_sliding", "gemma2", "gemma3", "gpt_oss", "deepseek_v3")
PROMPT, NEW_TOKENS, DECODE_STEPS = 20, 6, 5
CHUNKS = (None, 3, 10)   # the whole prompt; chunks shorter than the window and longer
TOL = 1e-9               # float64 weights, float64 attention on both sides
# (Ulysses degree, ring degree) per spawned world
GRIDS = {2: [(2, 1), (1, 2)], 3: [(3, 1)], 4: [(2, 2)]}


def head_overrides(family: str, ulysses: int) -> dict:
    """The tiny configs' 4 query heads do not split over 3 ranks: 6 there (3 KV heads; Gemma
    3 keeps its single KV head, DeepSeek-V3's MLA has as many as query heads)."""
    if ulysses != 3:
        return {}
    kv_heads = {"gemma3": 1, "deepseek_v3": 6}.get(family, 3)
    return dict(num_attention_heads=6, num_key_value_heads=kv_heads)


def family_model(family: str, attn: str, ulysses: int):
    return make_family_model(family, attn, **head_overrides(family, ulysses)).eval()


def prompt(B: int = 2):
    # No ids 0..2: they are pad/bos/eos ids of some families, from which generate would
    # infer a padding mask.
    return torch.randint(3, VOCAB, (B, PROMPT), generator=torch.Generator().manual_seed(3))


def decode_greedily(model, logits, cache, steps: int):
    """`steps` greedy tokens fed one by one over `cache`; the last logits `[B, vocab]`."""
    for _ in range(steps):
        next_ids = logits.argmax(-1, keepdim=True)
        logits = model(input_ids=next_ids, cache=cache, use_cache=True).logits[:, -1]
    return logits


def held_tokens(cache):
    return [layer.keys.shape[2] for layer in cache.layers]


def family_cases(rank, ulysses):
    """What the tests compare, for every family on this rank's grid."""
    out = {}
    ids = prompt()
    for family in GEN_FAMILIES:
        model = family_model(family, "ulysses", ulysses)
        res = {"greedy": [ukhf.generate(model, ids, max_new_tokens=NEW_TOKENS, do_sample=False, prefill_chunk_size=c)
                          for c in CHUNKS]}
        logits, cache = ukhf.prefill(model, ids, chunk_size=4)
        res["prefill"] = logits
        with ukhf.decoding(cache):
            res["decoded"] = decode_greedily(model, logits, cache, DECODE_STEPS)
        res["layer_bytes"], res["layer_tokens"], res["held"] = cache.bytes_per_layer(), held_tokens(cache), cache.held
        torch.manual_seed(100 + rank)   # different on every rank: generate shares the first rank's state
        res["sampled"] = ukhf.generate(model, ids[:1], max_new_tokens=NEW_TOKENS, do_sample=True, top_k=20,
                                       temperature=0.9)
        out[family] = res
    return out


def run_grids(rank, world):
    """Every grid of GRIDS[world] in one process group: {(ulysses, ring): family_cases}."""
    return over_grids(world, GRIDS, lambda groups, ulysses: family_cases(rank, ulysses))


_run = SpawnedRuns(lambda world: (run_grids, ()), timeout=SLOW_SPAWN_TIMEOUT)


@lru_cache(maxsize=None)   # grids of one Ulysses degree share the model
def reference(family, ulysses):
    """Single-device eager64: greedy tokens per prompt chunking (the same: one device does
    not chunk), the prompt's logits, the logits after the decode steps and the per-layer
    bytes and tokens of transformers' own cache (sliding-window layers for windowed ones),
    the tokens sampled from seed 100."""
    from transformers import DynamicCache

    model = family_model(family, "eager64", ulysses)
    ids = prompt()
    greedy = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
    decoded = decode_greedily(model, logits, cache, DECODE_STEPS)
    torch.manual_seed(100)
    sampled = model.generate(ids[:1], max_new_tokens=NEW_TOKENS, do_sample=True, top_k=20, temperature=0.9)
    layer_bytes = [sum(t.numel() * t.element_size() for t in (layer.keys, layer.values)) for layer in cache.layers]
    heads = [layer.keys.shape[1] for layer in cache.layers]
    return dict(greedy=greedy, prefill=logits, decoded=decoded, sampled=sampled, layer_bytes=layer_bytes,
                heads=heads, windowed=[layer.is_sliding for layer in cache.layers])


def _compare(family, grid, ranks, want):
    """Failures of one family on one grid (every rank against the single device)."""
    ulysses, ring = grid
    where = f"{family} Ulysses {ulysses} x ring {ring}"
    failures = []
    for r, got in enumerate(ranks):
        for chunk, tokens in zip(CHUNKS, got["greedy"]):
            if not torch.equal(tokens, want["greedy"]):
                failures.append(f"{where} rank {r} prefill chunks {chunk}: greedy tokens differ")
        if not torch.equal(got["sampled"], want["sampled"]):
            failures.append(f"{where} rank {r}: sampled tokens differ from the single device's with seed 100")
        for name in ("prefill", "decoded"):
            err = rel_err(got[name], want[name])
            if not err < TOL:
                failures.append(f"{where} rank {r}: {name} logits rel err {err:.1e}")
        failures += _cache_failures(where, r, got, want, ulysses, ring)
    return failures


def _cache_failures(where, r, got, want, ulysses, ring):
    """A windowed layer holds W - 1 tokens (on every ring rank), a full one every token (its
    ring rank's share); the bytes are the single-device cache's, split over the Ulysses
    ranks like its heads (a one-head latent or a single KV head: whole on every rank)."""
    failures = []
    total = PROMPT + DECODE_STEPS
    for layer, (tokens, nbytes) in enumerate(zip(got["layer_tokens"], got["layer_bytes"])):
        heads = want["heads"][layer]
        share = ulysses if heads % ulysses == 0 else heads
        windowed = want["windowed"][layer]
        expect_tokens = WINDOW - 1 if windowed else got["held"][r // ulysses]   # ring rank major
        full_tokens = WINDOW - 1 if windowed else total
        expect_bytes = want["layer_bytes"][layer] * expect_tokens // full_tokens // share
        if tokens != expect_tokens or nbytes != expect_bytes:
            failures.append(f"{where} rank {r} layer {layer} ({'windowed' if windowed else 'full'}): holds {tokens} "
                            f"tokens in {nbytes} B, expected {expect_tokens} in {expect_bytes} B")
    return failures


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(GRIDS))
def test_families_generate_like_single_device(world):
    """Every family on every grid of the world: tokens, logits and cache (the module doc)."""
    per_rank = _run(world)
    failures = []
    for grid in GRIDS[world]:
        for family in GEN_FAMILIES:
            want = reference(family, grid[0])
            failures += _compare(family, grid, [got[grid][family] for got in per_rank], want)
        if grid[1] > 1:   # the ring ranks took turns: each holds part of the tokens
            held = per_rank[0][grid][GEN_FAMILIES[0]]["held"]
            assert len(held) == grid[1] and sum(held) == PROMPT + DECODE_STEPS and min(held) > 0, held
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:30])


# ------------------------------------------------------- single-process units (fast)

def _stand_in_model(heads=4, kv_heads=2):
    return SimpleNamespace(config=SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads))


def test_a_windowed_layer_keeps_what_later_queries_see():
    """One process: chunks of 5, 3, 1, 1, 4, 1 tokens through a layer with a window of 4
    (window_size (3, 0)), softcap, sinks and v 8 wide against attention over every key so
    far; the layer holds the last 3 tokens after each chunk; a full layer beside it all."""
    from ulysses_kernels.hf.inference.cache import HeadShardedCache

    g = torch.Generator().manual_seed(0)
    cache = HeadShardedCache(_stand_in_model())
    sinks = torch.randn(4, generator=g, dtype=torch.float64)
    history = {0: ([], []), 1: ([], [])}
    for T in (5, 3, 1, 1, 4, 1):
        for layer, window in ((0, (3, 0)), (1, (-1, -1))):
            k = torch.randn(1, 2, T, 16, generator=g, dtype=torch.float64)
            v = torch.randn(1, 2, T, 8, generator=g, dtype=torch.float64)
            q = torch.randn(1, 4, T, 16, generator=g, dtype=torch.float64)
            keys, values = cache.update(k, v, layer)
            got = cache.attention(q, keys, values, 0.25, True, window_size=window, softcap=2.0, sinks=sinks)
            history[layer][0].append(k)
            history[layer][1].append(v)
            all_k, all_v = (torch.cat(h, dim=2).transpose(1, 2) for h in history[layer])
            want, _ = reference_attention(q.transpose(1, 2), all_k, all_v, causal=True, softmax_scale=0.25,
                                          window_size=window, softcap=2.0, sinks=sinks)
            assert rel_err(got, want) < 1e-12, (T, layer)
        total = all_k.shape[1]
        assert held_tokens(cache) == [min(total, 3), total]


def test_a_layer_expanding_a_latent_cache():
    """One process: a layer that caches a one-head latent (values of their own width) and
    expands it into every query head's keys and values (MLA) attends like the reference."""
    from ulysses_kernels.hf.inference.cache import HeadShardedCache

    g = torch.Generator().manual_seed(1)
    cache = HeadShardedCache(_stand_in_model(heads=4, kv_heads=4))
    to_k, to_v = (torch.randn(10, 4 * n, generator=g, dtype=torch.float64) for n in (16, 8))
    seen = []
    for T in (6, 1, 2):
        latent, rope = torch.randn(1, 1, T, 10, generator=g, dtype=torch.float64), torch.zeros(1, 1, T, 2,
                                                                                            dtype=torch.float64)
        held, held_rope = cache.update(latent, rope, 0)
        assert held_rope.shape[3] == 2
        seen.append(latent)
        k, v = ((held[:, 0] @ w).view(1, -1, 4, w.shape[1] // 4).transpose(1, 2) for w in (to_k, to_v))
        q = torch.randn(1, 4, T, 16, generator=g, dtype=torch.float64)
        got = cache.attention(q, k, v, 0.25, True)
        assert got.shape == (1, T, 4, 8)
        want, _ = reference_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                                      softmax_scale=0.25)
        assert rel_err(got, want) < 1e-12
    assert torch.equal(cache.layers[0].keys, torch.cat(seen, dim=2))


def test_the_cache_refuses_what_it_cannot_hold():
    """One process: cached tensors of an unknown head count, and an attention call without
    its layer's update, raise a ValueError that says so."""
    from ulysses_kernels.hf.inference.cache import HeadShardedCache

    cache = HeadShardedCache(_stand_in_model(heads=6, kv_heads=2))
    x = torch.zeros(1, 3, 2, 8)
    with pytest.raises(ValueError, match="caches keys of 3 heads"):
        cache.update(x, x, 0)
    with pytest.raises(ValueError, match="without its layer's cache update"):
        cache.attention(torch.zeros(1, 6, 2, 8), x, x, 1.0, True)
