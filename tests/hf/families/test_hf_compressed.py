"""DeepSeek-V4's attention under sequence parallelism (hf/families/sparse/compressed.py): one training
step at SP 2, 3 and 4 of an HCA, a CSA and a sliding-window layer, one uneven document and two
packed documents whose boundaries do not line up with the shards, float64 (the
hyper-connections' float32 kept float64 in both runs: sweep.FLOAT32_ISLANDS), against one
process running each document alone: the loss, every gradient and the CSA windows every query
keeps (identical sets). Windows of 7 tokens;
compressed entries every 3 tokens (CSA, 2 kept a query by the indexer) and every 5 (HCA, all),
neither dividing the shards, so windows straddle ranks; every deciding query's 2nd and 3rd
entry scores are apart. The indexer scores 2 entries at a time, the attention runs 5 queries
at a time. Keeping every entry instead moves the loss. Generation: greedy tokens equal
`model.generate` at SP 2 and 3.
"""

import sys

import pytest
import torch
from helpers import SLOW_SPAWN_TIMEOUT
from sparse_cases import as_mask, check_generation, generation_outcome, recorded
from sweep import DOCUMENTS, S, largest_error, numerics, reference_step, sp_step

pytest.importorskip("transformers", reason="ulysses_kernels.hf needs Hugging Face transformers "
                                           "(pip install -e '.[hf]' in the checkout)")

import ulysses_kernels as uk  # noqa: E402
from ulysses_kernels import hf as ukhf  # noqa: E402
from ulysses_kernels.hf.families.sparse import compressed  # noqa: E402
from ulysses_kernels.launch import spawn  # noqa: E402

CSA, HCA, TOPK = 3, 5, 2
TOLERANCE = 1e-6   # the routers compute in float32 (the rest within 1e-14)


def v4_model(attn, **fields):
    from tiny_models import build_tiny_model

    overrides = dict(layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"],
                     compress_rates={"compressed_sparse_attention": CSA, "heavily_compressed_attention": HCA},
                     index_topk=TOPK, index_n_heads=8, index_head_dim=16, num_key_value_heads=1, head_dim=32,
                     o_groups=4)
    model = build_tiny_model("deepseek_v4", attn, overrides=dict(overrides, **fields))
    g = torch.Generator().manual_seed(11)
    for module in model.modules():   # hash-routed layers: a random token -> experts table (the default is all 0)
        if hasattr(module, "tid2eid"):
            module.tid2eid.copy_(torch.randint(0, module.num_experts, module.tid2eid.shape, generator=g))
    return model


WINDOWS = S // CSA + 1   # columns for a query's selected CSA windows (its document's, from its start)


def _sp_worker(rank, world):
    groups = uk.init_sequence_parallel(world)
    ukhf.register(groups)
    compressed.KEY_TILE, compressed.QUERY_TILE = 2, 5   # several tiles of entries (the indexer) and of queries

    def windows(args, chosen):   # each query's chosen CSA windows (counted from its document's start)
        entries = args[4]
        return as_mask(torch.where(chosen[0] >= 0, entries.windows[chosen[0].clamp(min=0)], -1), WINDOWS)

    out = {}
    with numerics("deepseek_v4"):
        for case, documents in DOCUMENTS.items():
            with recorded(compressed, "_select", windows) as chosen:
                out[case] = sp_step(v4_model("ulysses"), documents, groups)
            # every rank's queries, in global order
            out[(case, "chosen")] = uk.gather_sequence(chosen[0].to(torch.float64), groups, dim=0).bool()
        out["all entries"] = sp_step(v4_model("ulysses", index_topk=S), DOCUMENTS["one uneven document"], groups)
    return out


def _entry_scores(indexer, hidden, q_residual, position_ids):
    """`[n, entries]`: transformers' indexer scores of a document run alone, the entries whose
    window has not closed -inf."""
    with torch.no_grad():
        kv, gate = indexer.kv_proj(hidden), indexer.gate_proj(hidden)
        windows = kv.shape[1] // indexer.compress_rate
        if windows == 0:
            return None
        pooled = compressed._pooled(indexer, kv, gate, True, indexer.head_dim)
        positions = (torch.arange(windows) * indexer.compress_rate)[None]
        cos, sin = indexer.rotary_emb(pooled, position_ids=positions, layer_type=indexer.rope_layer_type)
        rope = sys.modules[type(indexer).__module__].apply_rotary_pos_emb
        entries = rope(pooled.unsqueeze(1), cos, sin).squeeze(1)
        cos_q, sin_q = indexer.rotary_emb(hidden, position_ids=position_ids, layer_type=indexer.rope_layer_type)
        q = indexer.q_b_proj(q_residual).view(1, hidden.shape[1], -1, indexer.head_dim).transpose(1, 2)
        q = rope(q, cos_q, sin_q).transpose(1, 2)
        scores = indexer.scorer(q, entries, hidden)[0]
        closed = (position_ids[0] + 1) // indexer.compress_rate
        return scores.masked_fill(torch.arange(windows)[None, :] >= closed[:, None], float("-inf"))


def _reference(documents):
    """One process per document: the step, the CSA windows each query keeps `[S, WINDOWS]`
    (from its document's start) and the smallest gap between a deciding query's 2nd and 3rd
    entry scores."""
    from family_cases import register_exact_eager

    with numerics("deepseek_v4"):
        model = v4_model(register_exact_eager())
        calls = []
        hooks = [m.register_forward_hook(lambda mod, args, out: calls.append((mod, args, out)))
                 for m in model.modules() if type(m).__name__ == "DeepseekV4Indexer"]
        step = reference_step(model, documents)
        for hook in hooks:
            hook.remove()
        chosen, start = torch.zeros(S, WINDOWS, dtype=torch.bool), 0
        for *_, indices in calls:   # one CSA layer: one call per document, in order
            n = indices.shape[1]
            chosen[start:start + n] = as_mask(indices[0], WINDOWS)
            start += n
        gap = float("inf")
        for indexer, (hidden, q_residual, position_ids, *_), _ in calls:
            scores = _entry_scores(indexer, hidden, q_residual, position_ids)
            if scores is None or scores.shape[-1] <= TOPK:
                continue
            ranked = scores.sort(dim=-1, descending=True).values
            deciding = torch.isfinite(ranked[:, TOPK])
            if deciding.any():
                gap = min(gap, float((ranked[:, TOPK - 1] - ranked[:, TOPK])[deciding].min()))
    return step, chosen, gap


@pytest.fixture(scope="module")
def references():
    return {case: _reference(documents) for case, documents in DOCUMENTS.items()}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_training_equals_one_process_per_document_with_the_selection_biting(world, references):
    per_rank = spawn(_sp_worker, world, timeout=SLOW_SPAWN_TIMEOUT, start_method="forkserver",
                     preload=["torch", "transformers", "ulysses_kernels.hf"])
    for case, (step, chosen, gap) in references.items():
        assert 1e-6 < gap < float("inf"), (case, gap)   # the indexer decides, and no near-tie decides a set
        assert int(chosen.sum(-1).max()) == TOPK   # while later queries see up to 7 windows
        for rank, out in enumerate(per_rank):
            error, where = largest_error(out[case], step)
            assert error < TOLERANCE, (world, rank, case, error, where)
            assert torch.equal(out[(case, "chosen")], chosen), (world, rank, case)
    moved, where = largest_error(per_rank[0]["all entries"], references["one uneven document"][0])
    assert moved > 1e-3, (moved, where)   # every entry instead of the selected ones


def _generation_worker(rank, world):
    groups = uk.init_sequence_parallel(world)
    ukhf.register(groups)
    with numerics("deepseek_v4"):
        out, cache = generation_outcome(v4_model("eager").eval(), v4_model("ulysses").eval(), groups,
                                        extra_chunks=(1,))
    # the state keeps its own rows, not views of a chunk's whole tensors
    out["compact"] = all(t.untyped_storage().nbytes() == t.numel() * t.element_size()
                         for state in cache.mixer_states.values() for t in state.values()
                         if isinstance(t, torch.Tensor))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_generation_equals_one_process(world):
    """Greedy `ukhf.generate` gives `model.generate`'s tokens on every rank, batch 2, the
    prompt (13 tokens: 4 CSA entries, 2 HCA entries, the indexer choosing) prefilled whole and
    in chunks of 4 and of 1 (windows and compressor windows straddling chunks); the prefill
    logits in chunks of 5 against one process; the decoding state holds its own rows."""
    per_rank = spawn(_generation_worker, world, timeout=SLOW_SPAWN_TIMEOUT, start_method="forkserver",
                     preload=["torch", "transformers", "ulysses_kernels.hf"])
    check_generation(per_rank, TOLERANCE)
    assert all(out["compact"] for out in per_rank), per_rank
