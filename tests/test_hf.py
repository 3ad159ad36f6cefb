"""Hugging Face transformers integration (ulysses_kernels.hf) on CPU with gloo.

Sequence-parallel runs (SP = 2 and 4) of tiny random Llama / Qwen2 / Qwen3 GQA models must
equal a single-process eager run of the same model and batch: logits, loss and every
parameter gradient (float32, relative error < 1e-5). The models, batches and per-rank
workers are defined here; spawned ranks import them from this module by name.
"""

import os
import sys

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers", reason="ulysses_kernels.hf needs Hugging Face transformers "
                                           "(pip install 'ulysses-kernels[hf]')")

from helpers import SLOW_SPAWN_TIMEOUT, rel_err  # noqa: E402

from ulysses_kernels import hf as ukhf  # noqa: E402
from ulysses_kernels.launch import spawn  # noqa: E402

TOL = 1e-5

# ------------------------------------------------------ models, batches and workers

VOCAB = 128


def make_config(kind, **overrides):
    """Tiny GQA configs (4 query heads, 2 key/value heads), float32."""
    import transformers

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512, attention_dropout=0.0)
    common.update(overrides)
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common)
    if kind == "qwen3":
        return transformers.Qwen3Config(head_dim=16, **common)
    raise ValueError(kind)


def make_model(kind, attn, seed=0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(kind, **overrides), attn_implementation=attn)
    model.float().train()
    return model


def enable_checkpointing(model):
    """transformers >= 5.x renamed gradient_checkpointing_enable."""
    fn = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    fn()


def make_batch(seed, S, doc_lens=None, B=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    if doc_lens is None:
        pos = torch.arange(S).unsqueeze(0).expand(B, S)
    else:
        assert sum(doc_lens) == S
        pos = torch.cat([torch.arange(n) for n in doc_lens]).unsqueeze(0)
    return ids, pos


def reference(case):
    """Single-process eager run: (logits, loss, {name: grad}) with HF's own loss."""
    model = make_model(case["kind"], "eager", seed=case.get("seed", 0), **case.get("config", {}))
    ids, pos = make_batch(case["batch_seed"], case["S"], case.get("doc_lens"), case.get("B", 1))
    # use_cache=False: with a cache, transformers (5.x) ignores packed position_ids in eager/sdpa
    out = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.logits.detach(), out.loss.detach(), grads


# ------------------------------------------------------------------ SP equivalence

def sp_cases(rank, world, cases, ring_size=None):
    """Every case on the whole world as pure Ulysses, or (ring_size) as Ulysses x Ring,
    where `init_sequence_parallel`'s groups go everywhere a group is asked for."""
    if ring_size is None:
        group = dist.group.WORLD
    else:
        import ulysses_kernels as uk

        group = uk.init_sequence_parallel(world, ring_size=ring_size)
        assert group.ring_size == ring_size
    ukhf.register(group)
    results = []
    for case in cases:
        model = make_model(case["kind"], "ulysses", seed=case.get("seed", 0))
        if case.get("tiled"):
            ukhf.patch_model(model, mlp_tile_tokens=case.get("mlp_tile", 4), loss_tile_tokens=case.get("loss_tile", 3))
        if case.get("checkpointing"):
            enable_checkpointing(model)
        ids, pos = make_batch(case["batch_seed"], case["S"], case.get("doc_lens"), case.get("B", 1))
        batch = ukhf.shard_batch(ids, group, position_ids=pos)
        res = {}
        if case.get("fallback_positions"):
            # No helper kwargs: the attention all-gathers position ids itself.
            out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
            loss = ukhf.sequence_parallel_loss(out.logits, batch.labels, group)
            res["logits"] = out.logits.detach()
        elif case.get("tiled"):
            loss = ukhf.causal_lm_loss(model, batch, group)
        else:
            out = model(**batch.model_inputs())
            loss = ukhf.sequence_parallel_loss(out.logits, batch.labels, group)
            res["logits"] = out.logits.detach()
        loss.backward()
        ukhf.allreduce_gradients(model, group)
        res["loss"] = loss.detach()
        res["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        results.append(res)
    return results


# ----------------------------------------------------------------------- errors

def _catch(fn):
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def error_cases(rank, world):
    group = dist.group.WORLD
    ukhf.register(group)
    model = make_model("llama", "ulysses")
    ids, pos = make_batch(1, 21)
    batch = ukhf.shard_batch(ids, group, position_ids=pos)
    report = {}
    # padding on rank 1 only: every rank must raise (no hang)
    mask = torch.ones_like(batch.input_ids)
    if rank == 1:
        mask[0, 0] = 0
    report["padding_one_rank"] = _catch(lambda: model(**batch.model_inputs(), attention_mask=mask))
    # an all-ones padding mask is fine
    out = model(**batch.model_inputs(), attention_mask=torch.ones_like(batch.input_ids))
    report["all_ones_ok"] = out.logits.shape[1] == batch.input_ids.shape[1]
    n = batch.input_ids.shape[1]
    custom = torch.zeros(1, 1, n, n)
    report["custom_4d"] = _catch(lambda: model(**batch.model_inputs(), attention_mask=custom))
    sw = make_model("qwen2", "ulysses", use_sliding_window=True, sliding_window=8, max_window_layers=0,
                    layer_types=["sliding_attention", "sliding_attention"])
    report["sliding"] = _catch(lambda: sw(**batch.model_inputs()))
    drop = make_model("llama", "ulysses", attention_dropout=0.1)
    report["dropout"] = _catch(lambda: drop(**batch.model_inputs()))
    # the group still works afterwards
    ref_model = make_model("llama", "ulysses")
    report["after"] = ref_model(**batch.model_inputs()).logits.detach()
    return report


# --------------------------------------------------------------------- DP x SP

def dp_sp_train(rank, world, sp_size, modes, steps, seqs):
    """For each mode (fsdp_world, fsdp_sp, ddp, manual): first-step grads + loss trajectory."""
    import ulysses_kernels as uk

    groups = uk.init_sequence_parallel(sp_size)
    ukhf.register(groups.sp_group)
    out = {}
    for mode in modes:
        model = make_model("llama", "ulysses")
        if mode.endswith("tiled"):
            ukhf.patch_model(model, mlp_tile_tokens=5, loss_tile_tokens=7)
        if mode.startswith("fsdp_world"):
            model = ukhf.apply_fsdp(model, groups, shard="world")
        elif mode.startswith("fsdp_sp"):
            model = ukhf.apply_fsdp(model, groups, shard="sp")
        elif mode.startswith("ddp"):
            model = ukhf.apply_ddp(model, groups)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        ids, pos = make_batch(seqs[groups.dp_rank]["seed"], seqs[groups.dp_rank]["S"],
                              seqs[groups.dp_rank].get("doc_lens"))
        batch = ukhf.shard_batch(ids, groups.sp_group, position_ids=pos)
        losses, first = [], None
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = ukhf.causal_lm_loss(model, batch, groups.sp_group)
            loss.backward()
            if mode.startswith("manual"):
                ukhf.allreduce_gradients(model, groups.sp_group, groups.dp_group)
            # mean over DP of the per-group global mean (for the log)
            lv = loss.detach().clone()
            dist.all_reduce(lv, group=groups.dp_group)
            losses.append(float(lv) / groups.dp_size)
            if step == 0:
                first = {}
                for n, p in model.named_parameters():
                    g = p.grad
                    if hasattr(g, "full_tensor"):
                        g = g.full_tensor()
                    first[n.replace("module.", "")] = g.detach().clone()
            opt.step()
        out[mode] = {"losses": losses, "grads": first}
        del model, opt
    return out


WIDE = dict(kind="qwen2", config=dict(num_attention_heads=28, num_key_value_heads=4, hidden_size=224,
                                      num_hidden_layers=1))  # Qwen2.5-7B's heads; world 8 on 2 cores: small
WIDE_BATCH = dict(S=29, doc_lens=[12, 17], batch_seed=8)


def wide_heads_train(rank, world, steps):
    """A 28-query / 4-KV-head model at SP = world = 8: pure Ulysses raises on every rank;
    ring_size="auto" (Ulysses 4 x ring 2) trains. Also reports the grid's groups."""
    import ulysses_kernels as uk

    plain = uk.init_sequence_parallel(world)
    ukhf.register(plain)
    model = make_model(WIDE["kind"], "ulysses", **WIDE["config"])
    ids, pos = make_batch(WIDE_BATCH["batch_seed"], WIDE_BATCH["S"], WIDE_BATCH["doc_lens"])
    pure_error = _catch(lambda: model(**ukhf.shard_batch(ids, plain, position_ids=pos).model_inputs()))
    groups = uk.init_sequence_parallel(world, ring_size="auto", num_heads=28, num_kv_heads=4)
    ukhf.register(groups)
    batch = ukhf.shard_batch(ids, groups, position_ids=pos)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, first = [], None
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = ukhf.causal_lm_loss(model, batch, groups)
        loss.backward()
        ukhf.allreduce_gradients(model, groups)
        losses.append(loss.item())
        first = first or {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
    members = dict(ulysses=dist.get_process_group_ranks(groups.ulysses_group),
                   ring=dist.get_process_group_ranks(groups.ring_group), sizes=(groups.ulysses_size, groups.ring_size))
    return dict(pure_error=pure_error, losses=losses, grads=first, members=members)


def offload_steps(model, ids, pos, group=None, steps=2):
    """Loss and gradients of `steps` training steps (no optimizer: the same weights)."""
    out = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        if group is None:
            loss = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss
        else:
            loss = ukhf.causal_lm_loss(model, ukhf.shard_batch(ids, group, position_ids=pos), group)
        loss.backward()
        if group is not None:
            ukhf.allreduce_gradients(model, group)
        out.append((loss.detach().clone(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}))
    return out


def offload_parity(rank, world):
    """SP = world, activation checkpointing, with and without checkpoint offload (the host
    and device roles simulated on CPU: device_type="cpu"): bitwise the same losses and
    gradients; the saved inputs went to the pool, reused on the second step."""
    group = dist.group.WORLD if world > 1 else None
    ukhf.register(group)
    ids, pos = make_batch(5, 41, [19, 22])
    results, offload = [], None
    for use in (False, True):
        model = make_model("llama", "ulysses", num_hidden_layers=3)
        enable_checkpointing(model)
        if use:
            offload = ukhf.CheckpointOffload(device_type="cpu", min_bytes=0)
            ukhf.patch_model(model, tiled_mlp=False, tiled_loss=False, offload_checkpoints=offload)
        results.append(offload_steps(model, ids, pos, group))
    same = all(torch.equal(la, lb) and all(torch.equal(ga[n], gb[n]) for n in ga)
               for (la, ga), (lb, gb) in zip(*results))
    return dict(same=same, packed=offload.packed, allocations=offload.pool.allocations)


# ------------------------------------------------------------------- generation

GEN_NEW_TOKENS = 24
# (kind, config overrides) per world: GQA with KV heads split and replicated, MHA, MQA.
GEN_MODELS = {
    2: [("llama", {}), ("qwen2", dict(num_key_value_heads=4))],
    3: [("qwen2", dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96)),
        ("llama", dict(num_attention_heads=6, num_key_value_heads=1, hidden_size=96))],
    4: [("qwen2", {}), ("llama", dict(num_key_value_heads=4))],
}


def gen_prompt(seed, S, B=2):
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))


def gen_model(kind, attn, config):
    model = make_model(kind, attn, seed=7, **config)
    return model.eval()


def generation_cases(rank, world):
    """Greedy generate, prefill logits and cache bytes for GEN_MODELS[world] (odd prompt,
    batch 2), a prompt shorter than the group, seeded sampling with a different seed on
    every rank, and the errors (on every rank)."""
    group = dist.group.WORLD
    ukhf.register(group)
    out = {"greedy": [], "prefill": [], "cache_bytes": []}
    ids = gen_prompt(3, 37)
    for kind, config in GEN_MODELS[world]:
        model = gen_model(kind, "ulysses", config)
        out["greedy"].append(ukhf.generate(model, ids, max_new_tokens=GEN_NEW_TOKENS, do_sample=False))
        logits, cache = ukhf.prefill(model, ids)
        out["prefill"].append(logits)
        out["cache_bytes"].append(cache.bytes_per_rank())
    model = gen_model(GEN_MODELS[world][0][0], "ulysses", GEN_MODELS[world][0][1])
    out["short"] = ukhf.generate(model, gen_prompt(4, 2, B=1), max_new_tokens=5, do_sample=False)
    torch.manual_seed(100 + rank)   # different on every rank: generate shares the first rank's state
    out["sampled"] = ukhf.generate(model, gen_prompt(5, 19, B=1), max_new_tokens=12, do_sample=True,
                                   top_k=20, temperature=0.9)
    out["beam_error"] = _catch(lambda: ukhf.generate(model, ids, max_new_tokens=3, num_beams=2))
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    out["padding_error"] = _catch(lambda: ukhf.generate(model, ids, max_new_tokens=3, attention_mask=mask))
    out["prompt_error"] = _catch(lambda: ukhf.generate(model, gen_prompt(6 + rank, 37), max_new_tokens=3))
    out["after"] = ukhf.generate(model, ids[:1], max_new_tokens=3, do_sample=False)   # the group still works
    if world == 2:   # chunked prefill: chunks of 10 (the last of 7), and of 1 (every chunk replicated)
        out["chunked"] = [(ukhf.prefill(model, ids, chunk_size=n)[0],
                           ukhf.generate(model, ids, max_new_tokens=8, do_sample=False, prefill_chunk_size=n))
                          for n in (10, 1)]
    return out


def ring_generation_cases(rank, world):
    """Ulysses 2 x ring 2: greedy tokens, prefill logits (one chunk per ring rank, and
    chunks of 5) and the cache (each ring rank holds its chunks' tokens)."""
    import ulysses_kernels as uk

    groups = uk.init_sequence_parallel(world, ring_size=2)
    ukhf.register(groups)
    ids = gen_prompt(3, 37)
    kind, config = GEN_MODELS[4][0]
    model = gen_model(kind, "ulysses", config)
    logits, cache = ukhf.prefill(model, ids, groups)
    return dict(greedy=ukhf.generate(model, ids, groups, max_new_tokens=GEN_NEW_TOKENS, do_sample=False),
                greedy_chunked=ukhf.generate(model, ids, max_new_tokens=6, do_sample=False, prefill_chunk_size=5),
                prefill=logits, cache_bytes=cache.bytes_per_rank(), held=list(cache.held),
                ranks=(groups.ulysses_rank, groups.ring_rank))


def run_jobs(rank, world, jobs):
    """Runs on every rank: several workers in one process group (spawning costs seconds),
    {name: result}."""
    funcs = {"sp": sp_cases, "errors": error_cases, "dp_sp": dp_sp_train, "example": example_run,
             "sp_ring": sp_cases, "wide": wide_heads_train, "offload": offload_parity,
             "generate": generation_cases, "generate_ring": ring_generation_cases,
             "example_generate": example_generate_run}
    return {name: funcs[name](rank, world, *args) for name, args in jobs}


def example_generate_run(rank, world, argv):
    """examples/generate_hf.py's run() in this process group."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import generate_hf

    return generate_hf.run(rank, world, argv)


def example_run(rank, world, argv):
    """examples/train_hf.py's run() in this process group; returns its per-step losses."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import train_hf

    return train_hf.run(rank, world, argv)


# ------------------------------------------------------------------------- tests

def _grad_errors(got, ref, tol=TOL):
    # Gradients are compared relative to their own norm, with a floor at 1e-6 of the
    # largest gradient norm (a parameter whose true gradient is ~0 would otherwise
    # compare float noise with float noise).
    floor = 1e-6 * max(g.norm().item() for g in ref.values())
    bad = []
    assert set(got) == set(ref), (sorted(set(got) ^ set(ref)))
    for name, r in ref.items():
        g = got[name]
        err = (g.double() - r.double()).norm().item() / max(r.double().norm().item(), floor)
        if not err < tol:
            bad.append(f"{name}: rel err {err:.2e}")
    return bad


SP_CASES = [
    # length not divisible by 2 or 4, two packed documents
    dict(kind="llama", S=37, doc_lens=[10, 27], batch_seed=1),
    # a single document, batch of 2
    dict(kind="qwen2", S=30, B=2, batch_seed=2),
    # three packed documents, tiled MLP + tiled loss + activation checkpointing
    dict(kind="qwen3", S=33, doc_lens=[5, 17, 11], batch_seed=3, tiled=True, checkpointing=True),
    # no helper kwargs: the attention gathers the position ids itself
    dict(kind="llama", S=26, doc_lens=[13, 1, 12], batch_seed=4, fallback_positions=True),
]

DP_SEQS = [dict(seed=11, S=29, doc_lens=[12, 17]), dict(seed=12, S=29)]
DP_MODES = ["fsdp_world_tiled", "fsdp_sp", "ddp", "manual"]
DP_STEPS = 3

# One spawn per world size (process start-up dominates on CPU); the tests share it.
_JOBS = {
    2: [("sp", (SP_CASES,)), ("errors", ()), ("offload", ()), ("generate", ()),
        ("example_generate", (["--prompt-len", "61", "--new-tokens", "6", "--check"],)),
        ("example", (["--sp", "2", "--seq-len", "97", "--steps", "3", "--tiled", "--checkpointing",
                      "--parallel", "fsdp"],))],
    3: [("generate", ())],
    4: [("sp", (SP_CASES,)), ("dp_sp", (2, DP_MODES, DP_STEPS, DP_SEQS)), ("sp_ring", (SP_CASES, 2)),
        ("generate", ()), ("generate_ring", ())],
    8: [("wide", (2,))],
}
_RESULTS = {}


def _run(world):
    if world not in _RESULTS:
        try:
            _RESULTS[world] = spawn(run_jobs, world, args=(_JOBS[world],), timeout=SLOW_SPAWN_TIMEOUT)
        except Exception as exc:  # report the same failure in every test that needs it
            _RESULTS[world] = exc
    if isinstance(_RESULTS[world], Exception):
        raise _RESULTS[world]
    return _RESULTS[world]


@pytest.mark.parametrize("world,job", [(2, "sp"), (4, "sp"), (4, "sp_ring")], ids=["2", "4", "4=2x2ring"])
def test_sp_matches_single_process(world, job):
    per_rank = [r[job] for r in _run(world)]
    failures = []
    for i, case in enumerate(SP_CASES):
        logits, loss, grads = reference(case)
        for r in range(world):
            err = rel_err(per_rank[r][i]["loss"], loss)
            if not err < TOL:
                failures.append(f"case {i} rank {r} loss {per_rank[r][i]['loss']} vs {loss}: {err:.2e}")
        if "logits" in per_rank[0][i]:
            got = _global_order(torch.cat([per_rank[r][i]["logits"] for r in range(world)], dim=1),
                                world, 2 if job == "sp_ring" else 1)
            err = rel_err(got, logits)
            if not err < TOL:
                failures.append(f"case {i} logits rel err {err:.2e}")
        for r in range(world):  # after the SP all-reduce every rank holds the full gradient
            failures += [f"case {i} rank {r} {m}" for m in _grad_errors(per_rank[r][i]["grads"], grads)]
    assert not failures, "\n".join(failures)


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


def _global_order(local_concat, world, ring):
    """Rank-order concatenation of the shards -> global sequence order (the zigzag layout
    with a ring; the identity without)."""
    from ulysses_kernels.zigzag import local_ranges

    S = local_concat.shape[1]
    positions = [s + i for rank in range(world)
                 for s, n in local_ranges(S, ring, world // ring, rank // (world // ring), rank % (world // ring))
                 for i in range(n)]
    out = torch.empty_like(local_concat)
    out[:, positions] = local_concat
    return out


def test_wide_heads_train_with_a_ring_where_pure_ulysses_raises():
    per_rank = [r["wide"] for r in _run(8)]
    _, ref_loss, ref_grads = reference(dict(WIDE_BATCH, **WIDE))
    failures = []
    for rank, r in enumerate(per_rank):
        assert r["pure_error"] and "query heads (28)" in r["pure_error"], r["pure_error"]
        assert r["members"]["sizes"] == (4, 2)  # 28 heads split over 4, not 8
        assert r["members"]["ulysses"] == [4 * (rank // 4) + u for u in range(4)]  # consecutive ranks
        assert r["members"]["ring"] == [rank % 4, rank % 4 + 4]                     # strided ranks
        if not abs(r["losses"][0] - ref_loss.item()) < TOL * abs(ref_loss.item()):
            failures.append(f"rank {rank}: first loss {r['losses'][0]} vs {ref_loss.item()}")
        failures += [f"rank {rank} {m}" for m in _grad_errors(r["grads"], ref_grads)]
        assert r["losses"][-1] < r["losses"][0], r["losses"]
    assert not failures, "\n".join(failures)


def test_checkpoint_offload_is_exact_at_sp2():
    for r in [r["offload"] for r in _run(2)]:
        assert r["same"], "losses or gradients differ with checkpoint offload"
        # 3 layers: the inputs of the first 2 are offloaded (the last stays), on each of 2 steps;
        # the second step reuses the first step's host buffers
        assert r["packed"] == 4 and r["allocations"] == 2, r


def test_checkpoint_offload_saves_host_buffers_from_the_pool():
    model = make_model("qwen2", "eager", num_hidden_layers=3)
    enable_checkpointing(model)
    offload = ukhf.CheckpointOffload(device_type="cpu", min_bytes=0)
    ukhf.patch_model(model, tiled_mlp=False, tiled_loss=False, offload_checkpoints=offload)
    ids, pos = make_batch(6, 23)
    out = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False)
    handles, h = [], offload._last
    while h is not None:  # what the autograd graph holds now: host buffers of the pool
        handles.append(h)
        h = h.previous
    assert len(handles) == 2 and all(offload.pool.owns(h.host) and h.host.device.type == "cpu" for h in handles)
    assert [h.shape for h in handles] == [(1, 23, 64)] * 2
    out.loss.backward()
    assert all(h.host is None for h in handles)  # read back once, buffers returned to the pool
    with pytest.raises(ValueError, match="needs activation checkpointing"):
        ukhf.patch_model(make_model("llama", "eager"), tiled_mlp=False, tiled_loss=False, offload_checkpoints=True)
    ukhf.unpatch_model(model)
    model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss.backward()
    assert offload.packed == 2  # unpatched: nothing more offloaded


@pytest.mark.gpu
def test_checkpoint_offload_gpu_pinned_and_exact():
    """On a GPU: the saved inputs go to pinned host buffers on a side stream and come back
    bitwise; the second step allocates no host memory."""
    ids, pos = make_batch(7, 257)
    ids, pos = ids.cuda(), pos.cuda()
    results, offload = [], None
    for use in (False, True):
        model = make_model("llama", "eager", num_hidden_layers=3).cuda()
        enable_checkpointing(model)
        if use:
            offload = ukhf.CheckpointOffload(min_bytes=0)
            ukhf.patch_model(model, tiled_mlp=False, tiled_loss=False, offload_checkpoints=offload)
        results.append(offload_steps(model, ids, pos))
    for (la, ga), (lb, gb) in zip(*results):
        assert torch.equal(la, lb) and all(torch.equal(ga[n], gb[n]) for n in ga)
    assert offload.packed == 4 and offload.pool.allocations == 2 and offload.pool.pin


def test_unsupported_masks_raise_on_every_rank():
    per_rank = [r["errors"] for r in _run(2)]
    for r, rep in enumerate(per_rank):
        msg = rep["padding_one_rank"] or ""
        assert "padding" in msg or "another rank" in msg, (r, msg)
        assert rep["all_ones_ok"]
        assert rep["custom_4d"] and "mask" in rep["custom_4d"], rep["custom_4d"]
        assert rep["sliding"] and "sliding-window" in rep["sliding"], rep["sliding"]
        assert rep["dropout"] and "dropout" in rep["dropout"], rep["dropout"]
    ref_logits, _, _ = reference(dict(kind="llama", S=21, batch_seed=1))
    got = torch.cat([rep["after"] for rep in per_rank], dim=1)
    assert rel_err(got, ref_logits) < TOL


def test_dp_x_sp_fsdp_ddp_match_and_train():
    """World 4 = DP 2 x SP 2: FSDP2 sharded over the whole world (with tiling), FSDP2 HSDP
    (sharded inside SP groups), DDP and manual all-reduces all give the first-step gradients
    of the single-process mean over the two DP batches, and the loss decreases."""
    per_rank = [r["dp_sp"] for r in _run(4)]
    # reference: mean over the DP groups of the single-process gradients of each batch
    refs = [reference(dict(kind="llama", S=s["S"], doc_lens=s.get("doc_lens"), batch_seed=s["seed"]))
            for s in DP_SEQS]
    ref_loss = sum(r[1] for r in refs) / len(refs)
    ref_grads = {n: sum(r[2][n] for r in refs) / len(refs) for n in refs[0][2]}
    failures = []
    for mode in DP_MODES:
        for r in range(4):
            res = per_rank[r][mode]
            if not abs(res["losses"][0] - ref_loss.item()) < 1e-5 * abs(ref_loss.item()):
                failures.append(f"{mode} rank {r}: first loss {res['losses'][0]} vs {ref_loss.item()}")
            failures += [f"{mode} rank {r} {m}" for m in _grad_errors(res["grads"], ref_grads)]
            if not all(b < a for a, b in zip(res["losses"], res["losses"][1:])):
                failures.append(f"{mode} rank {r}: loss did not decrease: {res['losses']}")
    assert not failures, "\n".join(failures)


def test_example_train_hf_runs():
    losses = [r["example"] for r in _run(2)]
    assert losses[0] == losses[1] and len(losses[0]) == 3
    assert all(torch.isfinite(torch.tensor(losses[0]))) and losses[0][-1] < losses[0][0], losses[0]


# ------------------------------------------------------------- single-process units

def test_shard_batch_shifts_before_sharding():
    ids = torch.arange(11).unsqueeze(0) + 100
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2]])
    b = ukhf.shard_batch(ids, None, position_ids=pos)
    assert b.labels.tolist() == [[*range(101, 111), -100]]
    assert b.cu_seqlens.tolist() == [0, 3, 8, 11]
    m = ukhf.shard_batch(ids, None, position_ids=pos, mask_document_ends=True)
    assert m.labels[0, 2] == -100 and m.labels[0, 7] == -100 and m.labels[0, 3] == 104


def test_cu_seqlens_from_position_ids():
    assert ukhf.cu_seqlens_from_position_ids(torch.arange(7)[None]) is None
    assert ukhf.cu_seqlens_from_position_ids(torch.tensor([[5, 6, 0, 1, 0]])).tolist() == [0, 2, 4, 5]
    with pytest.raises(ValueError, match="batch size 1"):
        ukhf.cu_seqlens_from_position_ids(torch.tensor([[0, 1, 0], [0, 1, 2]]))


def _mlp():
    cfg = make_config("llama")
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    return LlamaMLP(cfg)


@pytest.mark.parametrize("tile", [1, 4, 7, 64])
def test_tiled_mlp_matches_plain(tile):
    mlp = _mlp()
    x = torch.randn(2, 23, 64, requires_grad=True)
    gy = torch.randn(2, 23, 64)
    y = mlp(x)
    y.backward(gy)
    ref = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    yt = ukhf.tiled_mlp(mlp, x, tile)
    yt.backward(gy)
    assert rel_err(yt, y) < 1e-6
    got = [x.grad] + [p.grad for p in mlp.parameters()]
    for a, b in zip(got, ref):
        assert rel_err(a, b) < 1e-6


@pytest.mark.parametrize("tile", [1, 5, 64])
def test_tiled_cross_entropy_matches_plain(tile):
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 97, bias=False)
    h = torch.randn(2, 19, 64, requires_grad=True)
    labels = torch.randint(0, 97, (2, 19))
    labels[0, :4] = -100
    logits = head(h).float()
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 97), labels.reshape(-1), reduction="sum")
    ref.backward()
    rh, rw = h.grad.clone(), head.weight.grad.clone()
    h.grad = None
    head.weight.grad = None
    got = ukhf.tiled_cross_entropy_sum(h, head, labels, tile_tokens=tile)
    (got * 0.5).backward()
    assert rel_err(got, ref) < 1e-6
    assert rel_err(h.grad, rh * 0.5) < 1e-6
    assert rel_err(head.weight.grad, rw * 0.5) < 1e-6


def test_patched_model_single_process_with_checkpointing():
    ukhf.register(None)
    ref = make_model("llama", "eager")
    model = make_model("llama", "ulysses")
    ukhf.patch_model(model, mlp_tile_tokens=3, loss_tile_tokens=4)
    enable_checkpointing(model)
    ids, pos = make_batch(7, 19, [9, 10])
    loss_ref = ref(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss
    loss_ref.backward()
    loss = ukhf.causal_lm_loss(model, ukhf.shard_batch(ids, None, position_ids=pos))
    loss.backward()
    assert rel_err(loss, loss_ref) < TOL
    got = {n: p.grad for n, p in model.named_parameters()}
    want = {n: p.grad for n, p in ref.named_parameters()}
    assert not _grad_errors(got, want)
    ukhf.unpatch_model(model)
    assert not hasattr(model.model.layers[0].mlp, "_ulysses_orig_forward")


def test_generate_refuses_unsupported_modes_before_any_collective():
    """Checked from the arguments and the config alone, so every rank raises the same error
    without communicating: beam search, assisted generation, padded prompts, sliding windows."""
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
    sliding = gen_model("qwen2", "ulysses", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0,
                                                 layer_types=["sliding_attention", "sliding_attention"]))
    with pytest.raises(ValueError, match="sliding-window"):
        ukhf.generate(sliding, ids, max_new_tokens=2)
    # a single process (no group) generates like model.generate
    assert torch.equal(ukhf.generate(model, ids, max_new_tokens=4, do_sample=False),
                       gen_model("llama", "eager", {}).generate(ids, max_new_tokens=4, do_sample=False))
