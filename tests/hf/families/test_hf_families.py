"""Training parity of the model families people train on long contexts under
`attn_implementation="ulysses"` (ulysses_kernels/hf/core/attention.py's `layer_variants`,
hf/training/loss.py, hf/training/patch.py over every attention variant): Mistral (window shorter than the
sequence), Qwen2 with `use_sliding_window` and packed documents, Gemma 2 (softcap, final
softcap, alternating windows; also with the tiled loss), Gemma 3 (alternating windows,
one KV head: fewer than the ranks), GPT-OSS (sinks, windows, MoE; also with the router's
auxiliary loss), DeepSeek-V3 (MLA, MoE), at SP 2, 3, 4 and on a 2x2 Ulysses x Ring grid,
against single-device eager attention (in float64: families.py, "eager64") with the same float64 weights: the loss and every
parameter gradient (summed over the SP group, `allreduce_gradients`'s rule) below 1e-9.
The reference runs each packed document on its own.
"""

import pytest
import torch
from family_cases import FAMILIES, WINDOW, make_family_model
from helpers import SLOW_SPAWN_TIMEOUT, rel_err

import ulysses_kernels as uk
from ulysses_kernels import hf as ukhf
from ulysses_kernels.hf.model import record_of
from ulysses_kernels.hf.training.loss import router_aux_loss
from ulysses_kernels.launch import spawn

S = 23  # > 3 windows of 7, not a multiple of any SP size


def cases(world):
    """(family, config overrides, documents, tiled loss) per case."""
    heads = dict(num_attention_heads=6, num_key_value_heads=3) if world == 3 else {}
    one_kv = dict(num_attention_heads=6, num_key_value_heads=1) if world == 3 else {}
    mla = dict(num_attention_heads=6, num_key_value_heads=6) if world == 3 else {}
    return [
        ("llama", heads, None, False),
        ("mistral", heads, None, False),
        ("qwen2_sliding", heads, [9, 14], False),
        ("gemma2", heads, None, False),
        ("gemma2", heads, None, True),
        ("gemma3", one_kv, None, False),
        ("gpt_oss", heads, None, False),
        ("gpt_oss", dict(heads, output_router_logits=True, router_aux_loss_coef=0.5), None, False),
        ("deepseek_v3", mla, None, False),
    ]


def _batch(seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 96, (1, S), generator=g)


def _positions(documents):
    if documents is None:
        return torch.arange(S).unsqueeze(0)
    return torch.cat([torch.arange(n) for n in documents]).unsqueeze(0)


def reference(family, overrides, documents):
    """Single-device eager: (mean loss over every target, {name: grad}); each document on
    its own (eager attention has no packed-document mask), its loss weighted by its
    targets, the router's auxiliary loss (if any) over all tokens as the model computes it."""
    model = make_family_model(family, "eager64", **overrides)
    ids = _batch()
    bounds = [0] + list(torch.tensor(documents).cumsum(0)) if documents else [0, S]
    total_targets = S - 1
    loss = 0.0
    for start, stop in zip(bounds[:-1], bounds[1:]):
        part = ids[:, start:stop]
        labels = torch.full_like(ids, -100)
        labels[:, start:stop - 1] = ids[:, start + 1:stop]
        if stop < S:
            labels[:, stop - 1] = ids[:, stop]  # the document's last token predicts the next (shard_batch's rule)
        targets = labels[:, start:stop]
        out = model(input_ids=part, use_cache=False)
        logits = out.logits
        loss = loss + torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                        ignore_index=-100, reduction="sum") / total_targets
        if getattr(model.config, "output_router_logits", False):
            # transformers' load_balancing_loss_func in float64 (it runs in float32: ~1e-8
            # off); test_router_aux_loss_is_transformers_load_balancing_loss ties the two.
            loss = loss + model.config.router_aux_loss_coef * router_aux_loss(
                out.router_logits, model.config.num_local_experts, model.config.num_experts_per_tok)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def run_world(rank, world, ring_size, all_cases):
    """Every case on this rank: (loss, {name: gradient summed over the SP group})."""
    groups = uk.init_sequence_parallel(world, ring_size=ring_size)
    ukhf.register(groups)
    results = []
    for family, overrides, documents, tiled in all_cases:
        model = make_family_model(family, "ulysses", **overrides)
        if tiled:
            ukhf.patch_model(model, tiled_mlp=False, tiled_loss=True, loss_tile_tokens=4)
        batch = ukhf.shard_batch(_batch(), groups, position_ids=_positions(documents))
        loss = ukhf.causal_lm_loss(model, batch, groups)
        loss.backward()
        ukhf.allreduce_gradients(model, groups)
        results.append((loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                        if p.grad is not None}))
    return results


def _tolerance(family, name):
    """1e-9, but where the model computes in float32 whatever the weights' dtype, its
    float32 rounding shows (measured ~1e-7 on either side): Gemma's RMSNorm (the
    gradients of its norm weights, sums over every token) and DeepSeek-V3's router (its
    routing weights scale every MoE layer's output)."""
    if (family.startswith("gemma") and "norm" in name) or family == "deepseek_v3":
        return 1e-6
    return 1e-9


@pytest.mark.slow
@pytest.mark.parametrize("world,ring_size", [(2, 1), (3, 1), (4, 1), (4, 2)], ids=["sp2", "sp3", "sp4", "2x2"])
def test_families_train_like_single_device_eager(world, ring_size):
    per_rank = spawn(run_world, world, args=(ring_size, cases(world // ring_size)), timeout=SLOW_SPAWN_TIMEOUT)
    failures = []
    for i, (family, overrides, documents, tiled) in enumerate(cases(world // ring_size)):
        want_loss, want_grads = reference(family, overrides, documents)
        for rank, results in enumerate(per_rank):
            loss, grads = results[i]
            if not rel_err(loss, want_loss) < _tolerance(family, "loss"):
                failures.append(f"{family} {overrides} tiled={tiled} rank {rank}: loss {loss} vs {want_loss}")
            missing = set(want_grads) - set(grads)
            if missing:
                failures.append(f"{family}: no gradient for {sorted(missing)[:3]}")
            for name, want in want_grads.items():
                if name in grads and not rel_err(grads[name], want) < _tolerance(family, name):
                    failures.append(f"{family} {overrides} tiled={tiled} rank {rank} {name}: "
                                    f"{rel_err(grads[name], want):.2e}")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:30])


def test_every_family_builds():
    """The tiny configs exist in this transformers and take the window they test."""
    for family in FAMILIES:
        model = make_family_model(family, "eager")
        window = getattr(model.config, "sliding_window", None)
        assert window in (None, WINDOW), (family, window)


def test_router_aux_loss_is_transformers_load_balancing_loss():
    """One process: `router_aux_loss` is GPT-OSS's `load_balancing_loss_func` (float32
    there), on router logits of a real forward."""
    from transformers.models.gpt_oss.modeling_gpt_oss import load_balancing_loss_func

    model = make_family_model("gpt_oss", "eager64", output_router_logits=True)
    out = model(input_ids=_batch(), use_cache=False)
    config = model.config
    want = load_balancing_loss_func(out.router_logits, config.num_local_experts, config.num_experts_per_tok)
    got = router_aux_loss(out.router_logits, config.num_local_experts, config.num_experts_per_tok)
    assert got.dtype == torch.float64
    assert rel_err(got, want) < 1e-6, (float(got), float(want))


def test_patch_model_on_mixture_of_experts():
    """Tiled MLPs tile DeepSeek-V3's dense and shared-expert MLPs exactly and leave MoE
    blocks alone; a model of MoE blocks only, and the tiled loss with router logits (it
    would drop the load-balancing loss), raise."""
    ids = _batch()
    model = make_family_model("deepseek_v3", "eager64")
    want = model(input_ids=ids, use_cache=False).logits
    ukhf.patch_model(model, tiled_loss=False, mlp_tile_tokens=6)
    record = record_of(model)
    assert record.replaced(model.model.layers[0].mlp)
    assert record.replaced(model.model.layers[1].mlp.shared_experts)
    assert not record.replaced(model.model.layers[1].mlp)
    assert rel_err(model(input_ids=ids, use_cache=False).logits, want) < 1e-13
    with pytest.raises(ValueError, match="no dense .*MLP.* tiled_mlp=False"):
        ukhf.patch_model(make_family_model("gpt_oss", "eager64"))
    with pytest.raises(ValueError, match="router logits"):
        ukhf.patch_model(make_family_model("gpt_oss", "eager64", output_router_logits=True), tiled_mlp=False)


def test_layer_variants_follow_the_layer_arguments():
    """transformers' per-layer arguments -> the attention variants: HF's window W is the
    last W keys (the query included), both sides without a causal mask; none or 0: no
    window; softcap and sinks (either keyword) pass through."""
    from torch import nn

    from ulysses_kernels.hf.core.attention import layer_variants

    layer, sinks = nn.Module(), torch.zeros(4)
    assert layer_variants(layer, dict(sliding_window=8), causal=True)["window_size"] == (7, 0)
    assert layer_variants(layer, dict(sliding_window=8), causal=False)["window_size"] == (7, 7)
    for off in (dict(sliding_window=None), dict(sliding_window=0), {}):
        assert layer_variants(layer, off, causal=True)["window_size"] == (-1, -1)
    layer.sliding_window = 5  # the module's attribute when the call does not pass it
    assert layer_variants(layer, {}, causal=True)["window_size"] == (4, 0)
    assert layer_variants(layer, dict(softcap=50.0, s_aux=sinks), causal=True)["softcap"] == 50.0
    assert layer_variants(layer, dict(s_aux=sinks), causal=True)["sinks"] is sinks
    assert layer_variants(layer, dict(sinks=sinks), causal=True)["sinks"] is sinks
    assert layer_variants(layer, dict(softcap=None), causal=True)["softcap"] == 0.0
