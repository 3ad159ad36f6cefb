"""The sequence-parallel context per model (ulysses_kernels/hf/context.py): a model's
attention, mask, loss and generation run on the groups of its own context; `register`'s
default context serves the models without one.

Four ranks (slow): a Llama on SP 4 (the default context) and a Qwen3 on SP 2 x DP 2 (its
own, `attach_context`) live in one process; their forwards and backwards interleave, each
trains one step equal to its single-device run, each generates what `model.generate`
gives on one device, and both decode at once (two decoding contexts open together, as a
draft model beside its target). One process (fast tier): how contexts attach and follow.
"""

import pytest
import torch
from family_cases import make_family_model
from helpers import SLOW_SPAWN_TIMEOUT, rel_err
from sweep import DOCUMENTS, batch_ids, reference_step
from sweep import positions as sweep_positions

pytest.importorskip("transformers", reason="ulysses_kernels.hf needs Hugging Face transformers "
                                           "(pip install -e '.[hf]' in the checkout)")

import ulysses_kernels as uk  # noqa: E402
from ulysses_kernels import hf as ukhf  # noqa: E402
from ulysses_kernels.hf.context import context_of, default_context
from ulysses_kernels.hf.core.attach import sequence_parallel_model  # noqa: E402
from ulysses_kernels.launch import spawn  # noqa: E402

PROMPT, NEW = 11, 5


def _ids(n, seed):
    return torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def two_models(rank, world):
    sp4 = uk.init_sequence_parallel(4)
    sp2 = uk.init_sequence_parallel(2)
    ukhf.register(sp4)                                   # the default: the Llama follows it
    llama = make_family_model("llama", "ulysses")
    qwen = make_family_model("qwen2_sliding", "ulysses", seed=1)
    ukhf.attach_context(qwen, sp2)                       # its own: SP 2 x DP 2
    ids, positions = batch_ids(), sweep_positions(DOCUMENTS["two packed documents"])
    batch4 = ukhf.shard_batch(ids, sp4, position_ids=positions)
    batch2 = ukhf.shard_batch(ids, sp2, position_ids=positions)   # both DP groups: the same batch
    out4 = llama(**batch4.model_inputs())                # forwards and backwards interleaved
    out2 = qwen(**batch2.model_inputs())
    loss4 = ukhf.sequence_parallel_loss(out4.logits, batch4.labels, sp4)
    loss2 = ukhf.sequence_parallel_loss(out2.logits, batch2.labels, sp2)
    loss2.backward()
    loss4.backward()
    ukhf.allreduce_gradients(llama, sp4)
    ukhf.allreduce_gradients(qwen, sp2)
    res = dict(llama=(loss4.detach(), _grads(llama)), qwen=(loss2.detach(), _grads(qwen)),
               sizes=(context_of(llama).sp_size, context_of(qwen).sp_size))
    llama.eval()
    qwen.eval()
    with torch.no_grad():
        res["llama tokens"] = ukhf.generate(llama, _ids(PROMPT, 7), max_new_tokens=NEW, do_sample=False)
        res["qwen tokens"] = ukhf.generate(qwen, _ids(PROMPT, 7), max_new_tokens=NEW, do_sample=False)
        logits4, cache4 = ukhf.prefill(llama, _ids(PROMPT, 7))
        logits2, cache2 = ukhf.prefill(qwen, _ids(PROMPT, 7))
        with ukhf.decoding(cache4), ukhf.decoding(cache2):   # both at once: each model reads its own
            for _ in range(3):
                logits4 = llama(input_ids=logits4.argmax(-1, keepdim=True), cache=cache4, use_cache=True).logits[:, -1]
                logits2 = qwen(input_ids=logits2.argmax(-1, keepdim=True), cache=cache2, use_cache=True).logits[:, -1]
        res["decoded"] = (logits4, logits2)
    return res


def _reference(family, seed):
    model = make_family_model(family, "eager64", seed=seed)
    step = reference_step(model, DOCUMENTS["two packed documents"])
    model.eval()
    with torch.no_grad():
        tokens = model.generate(_ids(PROMPT, 7), max_new_tokens=NEW, do_sample=False)
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        logits = model(input_ids=_ids(PROMPT, 7), cache=cache, use_cache=True).logits[:, -1]
        for _ in range(3):
            logits = model(input_ids=logits.argmax(-1, keepdim=True), cache=cache, use_cache=True).logits[:, -1]
    return step, tokens, logits


@pytest.mark.slow
def test_two_models_on_two_groups_train_and_generate_like_one_device():
    per_rank = spawn(two_models, 4, timeout=SLOW_SPAWN_TIMEOUT, start_method="forkserver",
                     preload=["torch", "transformers", "ulysses_kernels.hf"])
    for name, family, seed, index in (("llama", "llama", 0, 0), ("qwen", "qwen2_sliding", 1, 1)):
        (want_loss, want_grads), want_tokens, want_logits = _reference(family, seed)
        for rank, res in enumerate(per_rank):
            assert res["sizes"] == (4, 2)
            loss, grads = res[name]
            assert rel_err(loss, want_loss) < 1e-9, (name, rank)
            assert set(grads) == set(want_grads)
            for param, g in want_grads.items():
                assert rel_err(grads[param], g) < 1e-9, (name, rank, param)
            assert torch.equal(res[f"{name} tokens"], want_tokens), (name, rank)
            assert rel_err(res["decoded"][index], want_logits) < 1e-9, (name, rank)


# ------------------------------------------------------------------------ one process

def test_a_context_lives_on_every_module_and_follows_register():
    ukhf.register(None)
    model = make_family_model("llama", "ulysses")
    assert context_of(model) is None
    context = sequence_parallel_model(model)   # what the entry points call first
    assert context.follows_default and all(context_of(m) is context for m in model.modules())
    first = default_context()
    ukhf.register(None, backend="reference")             # a new default: followed
    assert context_of(model).backend == "reference" and default_context() is not first
    own = make_family_model("llama", "ulysses")
    mine = ukhf.attach_context(own, None, backend="triton")
    ukhf.register(None)
    assert context_of(own) is mine and mine.backend == "triton" and not mine.follows_default


def test_a_context_passes_its_engine_to_every_attention_call(monkeypatch):
    """attach_context(engine=): the model's attention calls run with the caller's engine
    (a stand-in here: the call itself is recorded, then run without it on CPU)."""
    from ulysses_kernels.hf.core import attention as hf_attention

    seen = []
    real = hf_attention.ulysses_attention

    def record(*args, engine=None, **kwargs):
        seen.append(engine)
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_attention, "ulysses_attention", record)
    ukhf.register(None)
    model = make_family_model("llama", "ulysses")
    held = object()
    context = ukhf.attach_context(model, None, engine=held)
    assert context.engine is held
    model(torch.randint(0, 64, (1, 12)))
    assert seen and all(engine is held for engine in seen)


def test_a_cache_points_decoding_at_its_models_context():
    ukhf.register(None)
    model = make_family_model("llama", "ulysses").eval()
    cache = ukhf.make_cache(model)
    assert cache.context is context_of(model)
    with ukhf.decoding(cache):
        assert context_of(model).inference_cache is cache
    assert context_of(model).inference_cache is None


def test_attach_context_checks_the_model():
    import transformers
    from tiny_models import build_tiny_model, tiny_config

    with pytest.raises(ukhf.NotSequenceParallelError, match="indexed_attention"):
        ukhf.attach_context(build_tiny_model("kolibri1_1", "eager"), None)
    # a model refused after its mixers were adapted (Qwen3-Next's question-answering head)
    # runs as transformers wrote it: the original forwards are back
    from ulysses_kernels.hf.families.adapters import adapted_kind

    answering = transformers.AutoModelForQuestionAnswering.from_config(tiny_config("qwen3_next"),
                                                                       attn_implementation="eager")
    mixers = [m for m in answering.modules() if type(m).__name__ == "Qwen3NextGatedDeltaNet"]
    with pytest.raises(ukhf.NotSequenceParallelError, match="pools over the sequence"):
        ukhf.attach_context(answering, None)
    assert mixers and all("forward" not in vars(m) and adapted_kind(m) is None for m in mixers)


def _dropping_keyword_arguments(model):
    """Decoder layers that pass neither position_ids nor shard_batch's keys down to their
    attention (as some families' layers do not), the rotary tables already computed."""
    for layer in model.model.layers:
        original = layer.forward

        def forward(*args, _original=original, **kwargs):
            for key in ("position_ids", "ulysses_seq_lens", "ulysses_cu_seqlens"):
                kwargs.pop(key, None)
            return _original(*args, **kwargs)

        layer.forward = forward
    return model


def test_documents_reach_an_attention_whose_layer_drops_them():
    """Two packed documents at SP 1 through layers that drop the forward's keyword
    arguments: the context keeps the model's own inputs (context.py), so the documents
    stay apart, as each document on its own gives; recomputing such a layer in the backward
    (activation checkpointing) is refused, since the kept inputs are the last forward's."""
    ukhf.register(None)
    documents = DOCUMENTS["two packed documents"]
    want_loss, want_grads = reference_step(make_family_model("llama", "eager64"), documents)
    model = _dropping_keyword_arguments(make_family_model("llama", "ulysses"))
    batch = ukhf.shard_batch(batch_ids(), None, position_ids=sweep_positions(documents))
    loss = ukhf.causal_lm_loss(model, batch)
    loss.backward()
    assert rel_err(loss.detach(), want_loss) < 1e-12
    for name, g in want_grads.items():
        assert rel_err(dict(model.named_parameters())[name].grad, g) < 1e-9, name
    checkpointed = _dropping_keyword_arguments(make_family_model("llama", "ulysses"))
    checkpointed.gradient_checkpointing_enable()
    loss = ukhf.causal_lm_loss(checkpointed, batch)
    with pytest.raises(ukhf.NotSequenceParallelError, match="recomputed in the backward"):
        loss.backward()


def test_what_the_package_installs_is_one_record_and_undone_from_it():
    """docs/architecture.md, "The Hugging Face layer": what attach_context and patch_model
    install on a model lives in one record (model.py's `Installed`), the one attribute set on
    its modules, shared by all of them; unpatch_model gives the replaced forwards back from it.
    The decoding cache is the declared `DecodingCache`."""
    from tiny_models import build_tiny_model

    from ulysses_kernels.hf.context import DecodingCache
    from ulysses_kernels.hf.model import record_of

    ukhf.register(None)
    model = build_tiny_model("llama", "ulysses")
    before = {name: set(vars(m)) for name, m in model.named_modules()}
    ukhf.attach_context(model)
    ukhf.patch_model(model, mlp_tile_tokens=4)
    record = record_of(model)
    assert record is not None and record.context is context_of(model) is not None
    for name, module in model.named_modules():
        assert {k for k in set(vars(module)) - before[name] if k.startswith("_ulysses")} == {"_ulysses_record"}, name
        assert record_of(module) is record, name
    mlp = model.model.layers[0].mlp
    assert record.replaced(mlp) and record.replaced(model) and "forward" in vars(mlp)
    ids = _ids(12, seed=3)
    want = model(input_ids=ids, use_cache=False).logits
    ukhf.unpatch_model(model)
    assert not record.replaced(mlp) and "forward" not in vars(mlp) and "forward" not in vars(model)
    assert rel_err(model(input_ids=ids, use_cache=False).logits, want) < 1e-6
    assert isinstance(ukhf.make_cache(model), DecodingCache) and not isinstance(object(), DecodingCache)
