"""Qwen4-Exp's query-selected attention under sequence parallelism (hf/families/sparse/qsa.py, and its
n-gram embeddings: ngram.py): one training step at SP 2, 3 and 4 of a Gated DeltaNet layer then
a QSA layer, both with n-gram embeddings, one uneven document
and two packed documents whose boundaries do not line up with the shards, float64, against
one process running each document alone: the loss, every gradient and the tokens every query
keeps (identical sets). The selection bites:
blocks of 2 tokens, 4 kept a query (8 tokens) besides its tail, fewer than a query on rank 3
sees at SP 4; every deciding query's 4th and 5th block scores are apart (16 index heads: with
2, many blocks score 0 after the ReLU, a tie). The indexer scores 3 blocks at a time, the
attention runs 5 queries at a time. Keeping every block instead moves the loss. Generation:
greedy tokens equal `model.generate` at SP 2 and 3.
"""

import math
import sys

import pytest
import torch
from helpers import SLOW_SPAWN_TIMEOUT
from sparse_cases import NEW_TOKENS, as_mask, check_generation, generation_outcome, prompt_ids, recorded
from sweep import DOCUMENTS, S, largest_error, numerics, reference_step, sp_step

pytest.importorskip("transformers", reason="ulysses_kernels.hf needs Hugging Face transformers "
                                           "(pip install -e '.[hf]' in the checkout)")

import ulysses_kernels as uk  # noqa: E402
from ulysses_kernels import hf as ukhf  # noqa: E402
from ulysses_kernels.hf.families.sparse import qsa  # noqa: E402
from ulysses_kernels.launch import spawn  # noqa: E402

RATIO, BLOCKS_KEPT = 2, 4
LINEAR_HEADS = {2: (2, 4), 3: (3, 6), 4: (4, 8)}   # the Gated DeltaNet's key and value heads: a placement at each SP
TOLERANCE = 1e-6   # the router computes in float32 (the rest within 1e-14)
# both layers' n-gram embeddings (trigrams; their convolution of kernel 4 dilated by 3 reads 9
# tokens back, across several shards at SP 4); token 30, the end of a segment, sits at 11 and 14
NGRAMS = dict(ple_layer_ids=[1, 2], eos_token_id=30, ple_embed_dim=32, heads_per_ngram=2, ngram_vocab_size_base=101)


def qsa_model(attn, world, **fields):
    from tiny_models import build_tiny_model

    keys, values = LINEAR_HEADS[world]
    overrides = dict(layer_types=["linear_attention", "indexed_attention"], linear_num_key_heads=keys,
                     linear_num_value_heads=values, indexer_n_heads=16, indexer_budget=RATIO * BLOCKS_KEPT,
                     indexer_compress_ratio=RATIO, **NGRAMS)
    model = build_tiny_model("qwen4_exp_text", attn, overrides=dict(overrides, **fields))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():   # transformers starts the n-grams' convolution and norms at 0: the halo would not show
        for name, p in model.named_parameters():
            if ".ple." in name and ("conv1d" in name or "norm" in name):
                p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _sp_worker(rank, world):
    groups = uk.init_sequence_parallel(world)
    ukhf.register(groups)
    with numerics("qwen4_exp_text"):   # its Gated DeltaNet rule's float32 kept float64 (sweep.FLOAT32_ISLANDS)
        return _sp_steps(world, groups)


def _sp_steps(world, groups):
    qsa.KEY_TILE, qsa.QUERY_TILE = 3, 5   # several tiles of blocks (the indexer) and of queries (the attention)
    out = {}
    for case, documents in DOCUMENTS.items():
        with recorded(qsa, "select_tokens", lambda args, kept: as_mask(kept[0], S)) as kept:
            out[case] = sp_step(qsa_model("ulysses", world), documents, groups)
        # every rank's queries, in global order
        out[(case, "kept")] = uk.gather_sequence(kept[0].to(torch.float64), groups, dim=0).bool()
    out["all blocks"] = sp_step(qsa_model("ulysses", world, indexer_budget=RATIO * S), DOCUMENTS["one uneven document"],
                                groups)
    return out


def _block_scores(indexer, hidden, position_embeddings):
    """`[n, blocks]`: each query's score of each complete block it sees (-inf: none), as
    transformers' indexer computes them for a document run alone."""
    rope = sys.modules[type(indexer).__module__].apply_rotary_pos_emb
    n, d = hidden.shape[1], indexer.index_head_dim
    cos, sin = position_embeddings
    q, raw = torch.split(indexer.index_qk_proj(hidden), [indexer.index_n_heads * d, d], dim=-1)
    q = rope(indexer.q_layernorm(q.reshape(1, n, -1, d)), cos=cos, sin=sin, unsqueeze_dim=2)[0]
    blocks = n // RATIO
    pooled = indexer.k_layernorm(raw[0, :blocks * RATIO].view(blocks, RATIO, d).float().mean(1).to(raw.dtype))
    starts = torch.arange(blocks) * RATIO
    keys = rope(pooled.unsqueeze(1), cos=cos[0, starts], sin=sin[0, starts]).squeeze(1)
    scores = torch.relu(torch.einsum("qhd,kd->qkh", q.float(), keys.float())).sum(-1) / math.sqrt(d)
    complete = (torch.arange(n)[:, None] + 1) // RATIO > torch.arange(blocks)[None, :]
    return scores.masked_fill(~complete, float("-inf"))


def _reference(world, documents):
    """One process per document: the step, the tokens each query keeps `[S, S]` (global
    indices) and the smallest gap between a deciding query's 4th and 5th block scores."""
    with numerics("qwen4_exp_text"):
        return _reference_steps(world, documents)


def _reference_steps(world, documents):
    from family_cases import register_exact_eager

    model = qsa_model(register_exact_eager(), world)
    calls = []
    hooks = [m.register_forward_hook(lambda mod, args, out: calls.append((mod, args, out)))
             for m in model.modules() if type(m).__name__ == "Qwen4ExpTextQSAIndexer"]
    step = reference_step(model, documents)
    for hook in hooks:
        hook.remove()
    kept, start = torch.zeros(S, S, dtype=torch.bool), 0
    for *_, mask in calls:   # one QSA layer: one call per document, in order
        n = mask.shape[-1]
        kept[start:start + n, start:start + n] = mask[0, 0]
        start += n
    gap = float("inf")
    with torch.no_grad():
        for indexer, (hidden, position_embeddings, *_), _ in calls:
            ranked = _block_scores(indexer, hidden, position_embeddings).sort(dim=-1, descending=True).values
            if ranked.shape[-1] <= BLOCKS_KEPT:
                continue
            deciding = torch.isfinite(ranked[:, BLOCKS_KEPT])
            if deciding.any():
                gap = min(gap, float((ranked[:, BLOCKS_KEPT - 1] - ranked[:, BLOCKS_KEPT])[deciding].min()))
    return step, kept, gap


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_training_equals_one_process_per_document_with_the_selection_biting(world):
    per_rank = spawn(_sp_worker, world, timeout=SLOW_SPAWN_TIMEOUT, start_method="forkserver",
                     preload=["torch", "transformers", "ulysses_kernels.hf"])
    references = {case: _reference(world, documents) for case, documents in DOCUMENTS.items()}
    for case, (step, kept, gap) in references.items():
        assert 1e-6 < gap < float("inf"), (case, gap)   # the selection decides, and no near-tie decides a set
        # the budget and a tail at most: fewer than the last queries see (up to 14 and 23 tokens)
        assert int(kept.sum(-1).max()) == RATIO * BLOCKS_KEPT + RATIO - 1
        for rank, out in enumerate(per_rank):
            error, where = largest_error(out[case], step)
            assert error < TOLERANCE, (world, rank, case, error, where)
            assert torch.equal(out[(case, "kept")], kept), (world, rank, case)
    moved, where = largest_error(per_rank[0]["all blocks"], references["one uneven document"][0])
    assert moved > 1e-3, (moved, where)   # every block instead of the selected ones


def _greedy(model, ids, new_tokens):
    """Greedy decoding by whole forwards without a cache: transformers 5.25's own generate of
    Qwen4-Exp raises with n-gram embeddings (its cache has no n-gram state for them)."""
    for _ in range(new_tokens):
        ids = torch.cat([ids, model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def _generation_worker(rank, world):
    groups = uk.init_sequence_parallel(world)
    ukhf.register(groups)
    out = {}
    for case, fields in (("plain", dict(ple_layer_ids=[])), ("n-grams", {})):
        with numerics("qwen4_exp_text"):
            reference, model = qsa_model("eager", world, **fields).eval(), qsa_model("ulysses", world, **fields).eval()
            want = None if case == "plain" else _greedy(reference, prompt_ids(), NEW_TOKENS)
            # chunks of 1: a first chunk without a complete block
            out[case] = generation_outcome(reference, model, groups, want=want, extra_chunks=(1,))[0]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_generation_equals_one_process(world):
    """Greedy `ukhf.generate` gives `model.generate`'s tokens on every rank (with n-gram
    embeddings: greedy whole forwards', which transformers' generate cannot run), batch 2, the
    prompt (13 tokens: 6 complete blocks, 4 kept) prefilled whole, in chunks of 4 and of 1 (a
    first chunk without a complete block); the prefill logits in chunks of 5 against one
    process."""
    per_rank = spawn(_generation_worker, world, timeout=SLOW_SPAWN_TIMEOUT, start_method="forkserver",
                     preload=["torch", "transformers", "ulysses_kernels.hf"])
    for case in per_rank[0]:
        check_generation([out[case] for out in per_rank], TOLERANCE, case)
