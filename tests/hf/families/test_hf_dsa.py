"""DeepSeek Sparse Attention under sequence parallelism
(hf/families/sparse/dsa.py): one training step at SP 2, 3 and 4, one uneven document and two packed documents whose
boundaries do not line up with the shards, float64 weights (the indexer in float32, as
transformers computes it), against one process running each document alone: the loss, every
gradient and the selected key sets of every layer, the indexer and the attention run in
tiles (7 keys, 5 queries). The families: DeepSeek-V3.2, GLM-5, A.X-K2 (a gate of each head's
output from its fused query projection), HY-V4 (per-head sinks and gates, hyper-connections
kept float64 as the sweep does: sweep.FLOAT32_ISLANDS) and dots3 (a sliding-window MLA layer
through the attention function after its DSA layers). The selection bites: 4 keys a query, fewer
than any shard holds, so a query on rank 1 drops keys of rank 0; every query's 4th and 5th best
scores are apart (no tie decides a set). Selecting every key instead moves the loss or the
gradients. GLM-5's
second layer reuses the first's selection ("shared"), its indexer's rope on interleaved pairs.
At SP 2, DeepSeek-V3.2 and GLM-5 also under `patch_model` (tiled MLP and loss) with activation
checkpointing (the shared selection passed to a recomputed layer).
"""

import pytest
import torch
from helpers import SLOW_SPAWN_TIMEOUT, raised
from sparse_cases import PROMPT, as_mask, check_generation, generation_outcome, recorded
from sweep import DOCUMENTS, S, largest_error, numerics, reference_step, sp_step

pytest.importorskip("transformers", reason="ulysses_kernels.hf needs Hugging Face transformers "
                                           "(pip install -e '.[hf]' in the checkout)")

import ulysses_kernels as uk  # noqa: E402
from ulysses_kernels import hf as ukhf  # noqa: E402
from ulysses_kernels.hf.families.sparse import dsa, dsa_indexer  # noqa: E402
from ulysses_kernels.launch import spawn  # noqa: E402

TOPK = 4   # below a shard at SP 4 (5-6 of 23 tokens)
FIELDS = dict(index_topk=TOPK, index_n_heads=16, index_head_dim=32)
# GLM-5 / HY-V4: a layer reusing the previous full layer's selection; dots3: a sliding-window
# MLA layer after its DSA layers, whose 12 heads the attention function exchanges at SP 2, 3, 4
FAMILIES = {"deepseek_v32": {}, "glm_moe_dsa": dict(indexer_types=["full", "shared"]), "axk2": {},
            "hy_v4": dict(indexer_types=["full", "full", "shared"]),
            "dots3_note_text": dict(num_attention_heads=12, num_key_value_heads=12)}
INDEXERS = ("DeepseekV32Indexer", "GlmMoeDsaIndexer", "AXK2Indexer", "HYV4Indexer", "Dots3NoteTextIndexer")
TOLERANCE = 1e-6   # the router computes in float32 (the rest within 1e-14)
PATCHED = ("deepseek_v32", "glm_moe_dsa")   # at SP 2: patch_model and activation checkpointing on top


def dsa_model(family, attn, **fields):
    from tiny_models import build_tiny_model

    return build_tiny_model(family, attn, overrides=dict(FIELDS, **FAMILIES[family], **fields))


def _bounds(documents):
    lengths = documents or [S]
    return [sum(lengths[:i]) for i in range(len(lengths) + 1)]


def _sp_worker(rank, world, families):
    """{family: this rank's steps and selections} (one spawn for every family)."""
    groups = uk.init_sequence_parallel(world)
    ukhf.register(groups)
    return {family: _sp_family(family, groups, world) for family in families}


def _sp_family(family, groups, world):
    # several tiles of keys and of queries (the indexer) and of queries (the attention)
    dsa_indexer.KEY_TILE, dsa_indexer.QUERY_TILE, dsa.QUERY_TILE = 7, 5, 5
    out = {}
    with numerics(family):
        for case, documents in DOCUMENTS.items():
            with recorded(dsa, "select", lambda args, chosen: as_mask(chosen[0], S)) as selections:
                out[case] = sp_step(dsa_model(family, "ulysses"), documents, groups)
            # every rank's queries of each layer, in global order
            out[(case, "selected")] = [uk.gather_sequence(keep.to(torch.float64), groups, dim=0).bool()
                                       for keep in selections]
        out["all keys"] = sp_step(dsa_model(family, "ulysses", index_topk=S), DOCUMENTS["one uneven document"],
                                  groups)
        if family in PATCHED and world == 2:   # patch_model (tiled MLP and loss) and checkpointing on top
            patched = ukhf.patch_model(dsa_model(family, "ulysses"), mlp_tile_tokens=5, loss_tile_tokens=5)
            patched.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
            out["patched"] = sp_step(patched, DOCUMENTS["two packed documents"], groups)
    return out


def _reference(family, documents):
    """One process per document: the step, the selected sets `[S, S]` per layer (global
    indices) and the smallest gap between a query's 4th and 5th visible scores."""
    with numerics(family):
        return _reference_in_numerics(family, documents)


def _reference_in_numerics(family, documents):
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
        # transformers' top k also names keys the mask hid (fewer visible than k): not selected
        causal = torch.where(indices[0] <= torch.arange(n)[:, None], indices[0].long(), -1)
        selected[layer][start:start + n, start:start + n] = as_mask(causal, n)
        keys = dsa_indexer.indexer_keys(indexer, hidden, position_embeddings)
        scores = dsa_indexer.index_scores(indexer, hidden, q_resid, position_embeddings, keys)[0]
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
@pytest.mark.parametrize("world", [2, 3, 4])
def test_training_equals_one_process_per_document_with_the_selection_biting(world, references):
    per_family = spawn(_sp_worker, world, args=(list(FAMILIES),), timeout=SLOW_SPAWN_TIMEOUT,
                       start_method="forkserver", preload=["torch", "transformers", "ulysses_kernels.hf"])
    for family in FAMILIES:
        per_rank = [outs[family] for outs in per_family]
        for case in DOCUMENTS:
            step, selected, gap = references[family][case]
            assert gap > 1e-6, (family, case, gap)   # no near-tie decides a set
            for rank, out in enumerate(per_rank):
                error, where = largest_error(out[case], step)
                assert error < TOLERANCE, (family, world, rank, case, error, where)
                for layer, (got, want) in enumerate(zip(out[(case, "selected")], selected)):
                    assert torch.equal(got, want), (family, world, rank, case, layer)
                assert int(selected[0].sum(-1).max()) == TOPK
            if case == "one uneven document":   # the last rank's queries keep some of the first rank's keys, not all
                shards = torch.tensor_split(torch.arange(S), world)
                across = selected[0][shards[-1]][:, shards[0]]
                assert across.any() and not across.all(), (family, world)
        if family in PATCHED and world == 2:
            for rank, out in enumerate(per_rank):
                error, where = largest_error(out["patched"], references[family]["two packed documents"][0])
                assert error < TOLERANCE, (family, "patched", rank, error, where)
        # every key instead of the selected ones moves the loss or some gradient (HY-V4's loss
        # by 5e-5 only, its gradients by more)
        moved, where = largest_error(per_rank[0]["all keys"], references[family]["one uneven document"][0])
        assert moved > 1e-3, (family, moved, where)


# ------------------------------------------------------------------ generation

def _generation_worker(rank, world, families):
    """{family: `sparse_cases.generation_outcome`, and the bytes the cache holds on this rank
    against the planner's (every token's keys on every rank)}."""
    from ulysses_kernels import planner

    groups = uk.init_sequence_parallel(world)
    ukhf.register(groups)
    out = {}
    for family in families:
        with numerics(family):
            model = dsa_model(family, "ulysses").eval()
            out[family], cache = generation_outcome(dsa_model(family, "eager").eval(), model, groups)
        shape = planner.shape_from_dict(model.config.to_dict())
        per_token = shape.dsa.cache_bytes_per_token(shape.mla, dtype_bytes=8)
        out[family]["cache bytes"] = (cache.bytes_per_rank(), per_token * PROMPT * 2)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_generation_equals_one_process(world):
    """Greedy `ukhf.generate` gives `model.generate`'s tokens on every rank, batch 2, the
    prompt (13 tokens: the selection bites from the 5th) prefilled whole and in chunks of 4;
    the prefill logits in chunks of 5 against one process; every rank holds every token's
    latent, rotary key and indexer key (a layer reusing a selection: no indexer key)."""
    per_rank = spawn(_generation_worker, world, args=(list(FAMILIES),), timeout=SLOW_SPAWN_TIMEOUT,
                     start_method="forkserver", preload=["torch", "transformers", "ulysses_kernels.hf"])
    for family in FAMILIES:
        check_generation([out[family] for out in per_rank], TOLERANCE, family)
        if family != "dots3_note_text":   # its sliding layers' window is the head-sharded cache's
            held, planned = per_rank[0][family]["cache bytes"]
            assert held == planned, (family, held, planned)


# ------------------------------------------------------------------ Trainer mixin

def _trainer_worker(rank, world, sp):
    """Trainer + SequenceParallelTrainerMixin on a tiny DeepSeek-V3.2 (float32, packed rows of
    two documents, SGD without clipping: trainer_cases.py), at SP `sp` x DP world / sp."""
    from trainer_cases import mixin_run

    return mixin_run(rank, world, sp, lambda vocab: dsa_model("deepseek_v32", "ulysses", vocab_size=vocab),
                     "dsa")


@pytest.mark.slow
def test_trainer_mixin_sp2_dp2_matches_the_dp_only_run():
    """SP 2 x DP 2 against DP 2 (the adapter on one rank each, which equals transformers' per
    document above): per-step losses and every parameter's update."""
    from trainer_cases import check_mixin_sp2_dp2

    check_mixin_sp2_dp2(_trainer_worker, SLOW_SPAWN_TIMEOUT)


# ------------------------------------------------------------------ what the sparse attentions refuse

def _refusal_worker(rank, world):
    """{case: the error's type and message} of the sparse attentions' refusals on this rank."""
    from sweep import batch_ids
    from tiny_models import build_tiny_model

    groups = uk.init_sequence_parallel(world)
    ukhf.register(groups)
    out = {}

    def attempt(case, call):
        out[case] = raised(call, (ValueError, ukhf.NotSequenceParallelError))

    sparse = {"deepseek_v32": dict(FIELDS), "qwen4_exp_text": dict(layer_types=["indexed_attention"] * 2),
              "deepseek_v4": dict(layer_types=["compressed_sparse_attention"] * 3),
              "minimax_m3_vl_text": dict(layer_types=["minimax_m3_sparse"] * 2, index_n_heads=2)}
    batch = ukhf.shard_batch(batch_ids(), groups)
    for family, fields in sparse.items():
        dropping = build_tiny_model(family, "ulysses", overrides=dict(fields, attention_dropout=0.5)).train()
        attempt(f"{family} dropout", lambda: ukhf.causal_lm_loss(dropping, batch, groups))
        model = build_tiny_model(family, "ulysses", overrides=fields).eval()
        attempt(f"{family} cache", lambda: model(**dict(batch.model_inputs(), use_cache=True)))
    # the Inklings compute their own softmax too
    dropping = build_tiny_model("inkling_text", "ulysses", overrides=dict(attention_dropout=0.5)).train()
    attempt("inkling_text dropout", lambda: ukhf.causal_lm_loss(dropping, batch, groups))
    if world > 1:   # query heads without a placement, met where the prefill first exchanges them (not at the cache)
        llama = build_tiny_model("llama", "ulysses", overrides=dict(num_attention_heads=3, num_key_value_heads=1))
        attempt("heads generate", lambda: ukhf.generate(llama.eval(), batch_ids()[:, :9], groups, max_new_tokens=2,
                                                        do_sample=False))
    forcing = build_tiny_model("minimax_m3_vl_text", "ulysses", overrides=dict(
        sparse["minimax_m3_vl_text"], index_local_blocks=3, index_topk_blocks=2))
    attempt("forced blocks", lambda: ukhf.causal_lm_loss(forcing, batch, groups))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_the_sparse_attentions_refuse_what_they_cannot_honour_on_every_rank(world):
    """Attention dropout in training (a ValueError: the adapted softmax has none), a cache
    outside generate / prefill (transformers' own forward of these layers needs eager's masks:
    refused at any size), MiniMax-M3 forcing more local blocks than it keeps (transformers'
    choice among them is torch.topk's order of equal scores), and in generation query heads
    the Ulysses group cannot split (the cache no longer refuses them when it is made, so that a
    sparse attention without head exchange generates at any size):
    the same error on every rank. The Inklings refuse attention dropout too."""
    per_rank = spawn(_refusal_worker, world, timeout=SLOW_SPAWN_TIMEOUT, start_method="forkserver",
                     preload=["torch", "transformers", "ulysses_kernels.hf"])
    for case, message in per_rank[0].items():
        assert all(out[case] == message for out in per_rank), case
        if case.endswith("dropout"):
            assert message.startswith("ValueError") and "attention dropout 0.5" in message, (case, message)
        elif case.endswith("cache"):
            assert message.startswith("NotSequenceParallelError") and "got a cache outside" in message, message
        elif case == "heads generate":
            assert message.startswith("ValueError: 3 heads can be neither split over nor replicated to 2 ranks"), \
                message
        else:
            assert "forces 3 local blocks into 2 slots" in message, message
