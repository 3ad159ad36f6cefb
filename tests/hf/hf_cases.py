"""What the Hugging Face tests (tests/hf/test_hf_*.py) share: tiny random Llama / Qwen2 /
Qwen3 GQA models, batches, single-process references and the per-rank workers.

Spawned ranks import the workers from this module by name. Process start-up dominates on
CPU, so every worker a world size needs runs in one spawned group (`_run(world)`, cached
for the session), and the tests of every file read their part of its results.
"""

import sys

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers", reason="ulysses_kernels.hf needs Hugging Face transformers "
                                           "(pip install -e '.[hf]' in the checkout)")

from helpers import ROOT, SLOW_SPAWN_TIMEOUT, SpawnedRuns  # noqa: E402

from ulysses_kernels import hf as ukhf  # noqa: E402

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
    drop = make_model("llama", "ulysses", attention_dropout=0.1)
    report["dropout"] = _catch(lambda: drop(**batch.model_inputs()))
    # a keyword the attention function would ignore (a sparse attention's selection) reaching it
    picked = torch.arange(batch.input_ids.shape[1]).reshape(1, -1, 1)
    report["indices"] = _catch(lambda: model(**batch.model_inputs(), indices=picked))
    # labels to the model: its own loss would be this rank's local mean
    report["labels"] = _catch(lambda: model(**batch.model_inputs(), labels=batch.labels))
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


def fused_generation_cases(rank, world):
    """Prefill logits and greedy tokens on the fused path, run on CPU with its stand-ins (the
    torch pack/unpack ops and the host transport; the attention on the Triton kernels in the
    interpreter): the inference exchanges go through the fused engine."""
    from ulysses_kernels import testing
    from ulysses_kernels.fused import engine as fused_engine

    group = dist.group.WORLD
    restore = testing.enable_fused_stand_ins(group)
    try:
        ukhf.register(group, backend="fused")
        kind, config = GEN_MODELS[world][0]
        model = gen_model(kind, "ulysses", config)
        ids = gen_prompt(3, FUSED_PROMPT)
        logits, cache = ukhf.prefill(model, ids)
        transports = sorted({e.transport.name for e in fused_engine._engines.values()})
        tokens = ukhf.generate(model, ids, max_new_tokens=FUSED_NEW_TOKENS, do_sample=False)
        return dict(logits=logits, tokens=tokens, path=cache.path.name, transports=transports)
    finally:
        restore()
        ukhf.register(group)   # automatic paths again for the jobs after this one


FUSED_PROMPT, FUSED_NEW_TOKENS = 21, 4


def run_jobs(rank, world, jobs):
    """Runs on every rank: several workers in one process group (spawning costs seconds),
    {name: result}."""
    funcs = {"sp": sp_cases, "errors": error_cases, "dp_sp": dp_sp_train, "example": example_run,
             "sp_ring": sp_cases, "wide": wide_heads_train, "offload": offload_parity,
             "generate": generation_cases, "generate_ring": ring_generation_cases,
             "example_generate": example_generate_run, "generate_fused": fused_generation_cases}
    return {name: funcs[name](rank, world, *args) for name, args in jobs}


def example_generate_run(rank, world, argv):
    """examples/generate_hf.py's run() in this process group."""
    sys.path.insert(0, str(ROOT / "examples"))
    import generate_hf

    return generate_hf.run(rank, world, argv)


def example_run(rank, world, argv):
    """examples/train_hf.py's run() in this process group; returns its per-step losses."""
    sys.path.insert(0, str(ROOT / "examples"))
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
                      "--parallel", "fsdp"],)),
        ("generate_fused", ())],
    3: [("generate", ())],
    4: [("sp", (SP_CASES,)), ("dp_sp", (2, DP_MODES, DP_STEPS, DP_SEQS)), ("sp_ring", (SP_CASES, 2)),
        ("generate", ()), ("generate_ring", ())],
    8: [("wide", (2,))],
}
_run = SpawnedRuns(lambda world: (run_jobs, (_JOBS[world],)), timeout=SLOW_SPAWN_TIMEOUT)


# ------------------------------------------------------------- single-process units


