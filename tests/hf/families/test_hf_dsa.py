"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) under sequence parallelism
(hf/families/dsa.py): one training step at SP 2, 3 and 4, one uneven document and two packed documents whose
boundaries do not line up with the shards, float64 weights (the indexer in float32, as
transformers computes it), against one process running each document alone: the loss, every
gradient and the selected key sets of every layer, the indexer and the attention run in
tiles (7 keys, 5 queries). The selection bites: 4 keys a query, fewer
than any shard holds, so a query on rank 1 drops keys of rank 0; every query's 4th and 5th best
scores are apart (no tie decides a set). Selecting every key instead moves the loss. GLM-5's
second layer reuses the first's selection ("shared"), its indexer's rope on interleaved pairs.
"""

import pytest
import torch
from helpers import SLOW_SPAWN_TIMEOUT, rel_err
from sweep import DOCUMENTS, S, largest_error, reference_step, sp_step

pytest.importorskip("transformers", reason="ulysses_kernels.hf needs Hugging Face transformers "
                                           "(pip install -e '.[hf]' in the checkout)")

import ulysses_kernels as uk  # noqa: E402
from ulysses_kernels import hf as ukhf  # noqa: E402
from ulysses_kernels.hf.families import dsa  # noqa: E402
from ulysses_kernels.launch import spawn  # noqa: E402

TOPK = 4   # below a shard at SP 4 (5-6 of 23 tokens)
FIELDS = dict(index_topk=TOPK, index_n_heads=16, index_head_dim=32)
FAMILIES = {"deepseek_v32": {}, "glm_moe_dsa": dict(indexer_types=["full", "shared"])}
INDEXERS = ("DeepseekV32Indexer", "GlmMoeDsaIndexer")
TOLERANCE = 1e-6   # the router computes in float32 (the rest within 1e-14)


def dsa_model(family, attn, **fields):
    from tiny_models import build_tiny_model

    return build_tiny_model(family, attn, overrides=dict(FIELDS, **FAMILIES[family], **fields))


def _bounds(documents):
    lengths = documents or [S]
    return [sum(lengths[:i]) for i in range(len(lengths) + 1)]


def _sp_worker(rank, world, family):
    groups = uk.init_sequence_parallel(world)
    ukhf.register(groups)
    select, recorded = dsa.select, []
    dsa.KEY_TILE, dsa.QUERY_TILE = 7, 5   # several tiles of keys (the indexer) and of queries (the attention)

    def record(*args):
        chosen = select(*args)
        keep = torch.zeros(chosen.shape[1], S + 1, dtype=torch.bool)   # empty slots into a last column
        keep.scatter_(-1, torch.where(chosen[0] >= 0, chosen[0], S), True)
        recorded.append(keep[:, :S])
        return chosen

    dsa.select = record
    out = {}
    try:
        for case, documents in DOCUMENTS.items():
            recorded.clear()
            out[case] = sp_step(dsa_model(family, "ulysses"), documents, groups)
            # every rank's queries of each layer, in global order
            out[(case, "selected")] = [uk.gather_sequence(keep.to(torch.float64), groups, dim=0).bool()
                                       for keep in recorded]
        out["all keys"] = sp_step(dsa_model(family, "ulysses", index_topk=S), DOCUMENTS["one uneven document"], groups)
    finally:
        dsa.select = select
    return out


def _reference(family, documents):
    """One process per document: the step, the selected sets `[S, S]` per layer (global
    indices) and the smallest gap between a query's 4th and 5th visible scores."""
    from family_cases import register_exact_eager

    model = dsa_model(family, register_exact_eager())
    bounds = _bounds(documents)
    calls = []

    def keep_inputs(indexer, args, kwargs, output):
        calls.append((indexer, args, kwargs, output))

    hooks = [m.register_forward_hook(keep_inputs, with_kwargs=True) for m in model.modules()
             if type(m).__name__ in INDEXERS]
    step = reference_step(model, documents)
    for hook in hooks:
        hook.remove()
    layers = len(hooks)
    selected = [torch.zeros(S, S, dtype=torch.bool) for _ in range(layers)]
    gap = float("inf")
    for call, (indexer, args, kwargs, indices) in enumerate(calls):
        start = bounds[call // layers]
        layer = call % layers
        hidden, q_resid, position_embeddings = args[:3]
        n = hidden.shape[1]
        visible = torch.ones(n, n, dtype=torch.bool).tril()
        for query in range(n):
            keys = [int(i) for i in indices[0, query] if int(i) <= query]
            selected[layer][start + query, [start + k for k in keys]] = True
        keys = dsa._indexer_keys(indexer, hidden, position_embeddings)
        scores = dsa.index_scores(indexer, hidden, q_resid, position_embeddings, keys)[0]
        ranked = scores.masked_fill(~visible, float("-inf")).sort(dim=-1, descending=True).values
        deciding = visible.sum(-1) > TOPK   # queries whose set the indexer picks (more visible keys than k)
        if deciding.any():
            gap = min(gap, float((ranked[deciding, TOPK - 1] - ranked[deciding, TOPK]).min()))
    return step, selected, gap


@pytest.fixture(scope="module")
def references():
    return {family: {case: _reference(family, documents) for case, documents in DOCUMENTS.items()}
            for family in FAMILIES}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_training_equals_one_process_per_document_with_the_selection_biting(world, family, references):
    references = references[family]
    per_rank = spawn(_sp_worker, world, args=(family,), timeout=SLOW_SPAWN_TIMEOUT, start_method="forkserver",
                     preload=["torch", "transformers", "ulysses_kernels.hf"])
    for case in DOCUMENTS:
        step, selected, gap = references[case]
        assert gap > 1e-6, (case, gap)   # no near-tie decides a set
        for rank, out in enumerate(per_rank):
            error, where = largest_error(out[case], step)
            assert error < TOLERANCE, (world, rank, case, error, where)
            for layer, (got, want) in enumerate(zip(out[(case, "selected")], selected)):
                assert torch.equal(got, want), (world, rank, case, layer)
            # the selection bites: some query keeps fewer keys than it sees, across a shard
            assert int(selected[0].sum(-1).max()) == TOPK
    moved = rel_err(per_rank[0]["all keys"][0], references["one uneven document"][0][0])
    assert moved > 1e-3, moved   # every key instead of the selected ones

