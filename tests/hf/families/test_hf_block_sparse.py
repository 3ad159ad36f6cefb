"""MiniMax-M3's block-sparse attention under sequence parallelism (hf/families/sparse/block_sparse.py):
one training step at SP 2, 3 and 4, one uneven document and two packed documents whose
boundaries do not line up with the shards, float64, against one process running each document
alone (transformers' eager attention with the blocks its indexer keeps), the loss, every
gradient and the blocks each index head keeps for each query (identical sets, on the rank that
holds the head); a sparse layer then a dense one. The selection bites: blocks of 4 keys, 2 kept a
query (its own and one more), fewer than any shard's blocks, so a query on rank 1 drops
blocks of rank 0; every deciding query's 2nd and 3rd block scores are apart (no tie decides a
set). Index heads are the KV heads: split at SP 2 and 3, replicated at SP 4 (2 KV heads);
queries attend in tiles of 5. Keeping every block instead moves the loss. Generation: greedy
tokens equal `model.generate` at SP 2 and 3.
"""

import pytest
import torch
from helpers import SLOW_SPAWN_TIMEOUT
from sparse_cases import as_mask, check_generation, generation_outcome, recorded
from sweep import DOCUMENTS, S, largest_error, reference_step, sp_step

pytest.importorskip("transformers", reason="ulysses_kernels.hf needs Hugging Face transformers "
                                           "(pip install -e '.[hf]' in the checkout)")

import ulysses_kernels as uk  # noqa: E402
from ulysses_kernels import hf as ukhf  # noqa: E402
from ulysses_kernels.hf.families.sparse import block_sparse  # noqa: E402
from ulysses_kernels.launch import spawn  # noqa: E402

BLOCK, KEPT = 4, 2
KV_HEADS = {2: 2, 3: 3, 4: 2}   # split at SP 2 and 3, each replicated on two ranks at SP 4
TOLERANCE = 1e-6   # the router computes in float32 (the rest within 1e-14)


def m3_model(attn, world, **fields):
    from tiny_models import build_tiny_model

    kv = KV_HEADS[world]
    overrides = dict(layer_types=["minimax_m3_sparse", "full_attention"], num_attention_heads=2 * kv,
                     num_key_value_heads=kv, index_n_heads=kv, index_head_dim=16, index_block_size=BLOCK,
                     index_topk_blocks=KEPT, index_local_blocks=1)
    return build_tiny_model("minimax_m3_vl_text", attn, overrides=dict(overrides, **fields))


def _sp_worker(rank, world):
    from ulysses_kernels.layout import place_heads

    groups = uk.init_sequence_parallel(world)
    ukhf.register(groups)
    block_sparse.QUERY_TILE = 5   # several query tiles
    out = {}
    for case, documents in DOCUMENTS.items():
        # each call's tile of kept blocks `[heads, n, blocks]` and whether it is a document's first
        with recorded(block_sparse, "select_blocks", lambda args, keep: (int(args[3][0]) == 0, keep[0])) as tiles:
            out[case] = sp_step(m3_model("ulysses", world), documents, groups)
        documents_blocks = []
        for first, keep in tiles:
            if first:
                documents_blocks.append([])
            documents_blocks[-1].append(keep)
        # this rank's index heads' kept blocks of each document `[heads, n, blocks]`
        out[(case, "blocks")] = [torch.cat(parts, dim=1) for parts in documents_blocks]
    place = place_heads(KV_HEADS[world], world)
    out["index heads"] = list(range(place.source_head(rank), place.source_head(rank) + place.local))
    out["all blocks"] = sp_step(m3_model("ulysses", world, index_topk_blocks=S), DOCUMENTS["one uneven document"],
                                groups)
    return out


def _pooled(indexer, q, k, positions):
    """Block scores `[B, heads, n, blocks]` as transformers' indexer pools them for a document
    run alone (index queries `q` `[B, heads, n, D]`, key `k` `[B, 1, n, D]`), its own block
    and the `local_blocks - 1` before it forced (+inf)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2))
    n = scores.shape[-1]
    scores = scores.masked_fill(positions[None, None, None, :] > positions[None, None, :, None], float("-inf"))
    blocks = -(-n // BLOCK)
    scores = torch.nn.functional.pad(scores, (0, blocks * BLOCK - n), value=float("-inf"))
    pooled = scores.view(*scores.shape[:3], blocks, BLOCK).amax(-1)
    for back in range(indexer.local_blocks):   # the query's own block and the ones before it, forced
        forced = (positions // BLOCK - back).clamp(min=0).view(1, 1, -1, 1).expand(*pooled.shape[:3], 1)
        pooled = pooled.scatter(-1, forced, float("inf"))
    return pooled


def _reference(world, documents):
    """One process per document: the step, the blocks each index head keeps for each query
    of each document, and the smallest gap between a deciding query's 2nd and 3rd block
    scores."""
    from family_cases import register_exact_eager

    model = m3_model(register_exact_eager(), world)
    calls = []
    hooks = [m.register_forward_hook(lambda mod, args, out: calls.append((mod, args, out)))
             for m in model.modules() if type(m).__name__ == "MiniMaxM3VLIndexer"]
    step = reference_step(model, documents)
    for hook in hooks:
        hook.remove()
    blocks = []   # each document's kept blocks `[index heads, n, blocks]` (one sparse layer: a call a document)
    for *_, indices in calls:
        blocks.append(as_mask(indices[0], -(-indices.shape[2] // BLOCK)))
    gap = float("inf")
    for indexer, (hidden, position_embeddings, _, position_ids), _ in calls:
        ranked = _pooled_from(indexer, hidden, position_embeddings, position_ids).sort(dim=-1, descending=True).values
        deciding = torch.isfinite(ranked[..., KEPT - 1]) & torch.isfinite(ranked[..., KEPT])
        if deciding.any():
            gap = min(gap, float((ranked[..., KEPT - 1] - ranked[..., KEPT])[deciding].min()))
    return step, blocks, gap


def _pooled_from(indexer, hidden, position_embeddings, position_ids):
    import sys

    rope = sys.modules[type(indexer).__module__].apply_rotary_pos_emb
    B, n, _ = hidden.shape
    with torch.no_grad():
        q = indexer.q_norm(indexer.q_proj(hidden).view(B, n, -1, indexer.head_dim)).transpose(1, 2)
        k = indexer.k_norm(indexer.k_proj(hidden).view(B, n, 1, indexer.head_dim)).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = rope(q, k, cos[..., :indexer.head_dim], sin[..., :indexer.head_dim])
        return _pooled(indexer, q, k, position_ids[0])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_training_equals_one_process_per_document_with_the_selection_biting(world):
    per_rank = spawn(_sp_worker, world, timeout=SLOW_SPAWN_TIMEOUT, start_method="forkserver",
                     preload=["torch", "transformers", "ulysses_kernels.hf"])
    references = {case: _reference(world, documents) for case, documents in DOCUMENTS.items()}
    for case, (step, blocks, gap) in references.items():
        assert gap > 1e-6, (case, gap)   # no near-tie decides a set
        assert max(int(b.sum(-1).max()) for b in blocks) == KEPT   # while later queries see up to 6 blocks
        for rank, out in enumerate(per_rank):
            error, where = largest_error(out[case], step)
            assert error < TOLERANCE, (world, rank, case, error, where)
            heads = out["index heads"]
            assert len(out[(case, "blocks")]) == len(blocks), (world, rank, case)
            for got, want in zip(out[(case, "blocks")], blocks):
                assert torch.equal(got, want[heads]), (world, rank, case)
    moved, where = largest_error(per_rank[0]["all blocks"], references["one uneven document"][0])
    assert moved > 1e-3, (moved, where)   # every block instead of the selected ones


def _generation_worker(rank, world):
    groups = uk.init_sequence_parallel(world)
    ukhf.register(groups)
    return generation_outcome(m3_model("eager", world).eval(), m3_model("ulysses", world).eval(), groups)[0]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_generation_equals_one_process(world):
    """Greedy `ukhf.generate` gives `model.generate`'s tokens on every rank, batch 2, the
    prompt (13 tokens, 4 blocks: the selection bites) prefilled whole and in chunks of 4; the
    prefill logits in chunks of 5 against one process."""
    per_rank = spawn(_generation_worker, world, timeout=SLOW_SPAWN_TIMEOUT, start_method="forkserver",
                     preload=["torch", "transformers", "ulysses_kernels.hf"])
    check_generation(per_rank, TOLERANCE)
