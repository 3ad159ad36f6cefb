"""Models, batches and per-rank worker functions for the Hugging Face integration tests.

Workers run on every rank via ulysses_kernels.launch.spawn and return plain tensors; the
parent test compares them with a single-process run of the same model (eager attention).
"""

import torch
import torch.distributed as dist

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
    model = make_model(case["kind"], "eager", seed=case.get("seed", 0))
    ids, pos = make_batch(case["batch_seed"], case["S"], case.get("doc_lens"), case.get("B", 1))
    # use_cache=False: with a cache, transformers (5.x) ignores packed position_ids in eager/sdpa
    out = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.logits.detach(), out.loss.detach(), grads


# ------------------------------------------------------------------ SP equivalence

def sp_cases(rank, world, cases):
    from ulysses_kernels import hf as ukhf

    group = dist.group.WORLD
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
    from ulysses_kernels import hf as ukhf

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
    from ulysses_kernels import hf as ukhf

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


def run_jobs(rank, world, jobs):
    """Several workers in one process group (spawning costs seconds): {name: result}."""
    funcs = {"sp": sp_cases, "errors": error_cases, "dp_sp": dp_sp_train, "example": example_run}
    return {name: funcs[name](rank, world, *args) for name, args in jobs}


def example_run(rank, world, argv):
    """examples/train_hf.py's run() in this process group; returns its per-step losses."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import train_hf

    return train_hf.run(rank, world, argv)
