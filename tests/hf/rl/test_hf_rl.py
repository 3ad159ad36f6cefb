"""RL under sequence parallelism (ulysses_kernels/hf/rl/logprobs.py, rl.py): per-token log-probs
and entropy through the tiled LM head on TRL-shaped rollouts (left-padded prompts,
right-padded completions of unequal lengths) against the single-device float64 model run
row by row, at SP 2, 3 and a 2 x 2 ring, at a temperature != 1, tiled and untiled; the GRPO
loss built on `row_sums` with the single-device value and gradients."""

import pytest
import torch
from helpers import SLOW_SPAWN_TIMEOUT, rel_err

pytest.importorskip("transformers", reason="ulysses_kernels.hf needs Hugging Face transformers "
                                           "(pip install -e '.[hf]' in the checkout)")

from hf_cases import VOCAB, make_model  # noqa: E402

import ulysses_kernels as uk  # noqa: E402
from ulysses_kernels import hf as ukhf  # noqa: E402
from ulysses_kernels.launch import spawn  # noqa: E402

# 12 query heads, 6 KV heads: SP 2, SP 3 and a Ulysses degree 2 all split them
CONFIG = dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=6, head_dim=8)
TEMPERATURE = 0.7
# float64 models, but Llama's RMSNorm rounds to float32 (transformers): 1e-16 differences in the
# attention flip float32 roundings (measured up to 3e-7 in a gradient; a lost share of a gradient is O(1))
TOL = 1e-6
PROMPTS, COMPLETIONS = (5, 9, 7, 9), (6, 3, 8, 1)      # per row; padded to 9 + 8
LOSSES = [("grpo", "token", 0.0), ("grpo", "sequence", 0.04), ("bnpo", "token", 0.04), ("dr_grpo", "token", 0.0),
          ("dapo", "sequence", 0.0)]


def rollout():
    """(input_ids, attention_mask, completion targets) `[B, S]` as TRL builds them: prompts
    left-padded, completions right-padded; the third marks the positions whose target (the
    next token) is a completion token, where the GRPO loss counts a log-prob."""
    P, C = max(PROMPTS), max(COMPLETIONS)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, VOCAB, (len(PROMPTS), P + C), generator=g)
    mask = torch.zeros_like(ids)
    for row, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        mask[row, P - p:P + c] = 1
    ids = ids * mask
    completion = torch.zeros_like(mask)
    completion[:, P:] = mask[:, P:]
    targets = torch.zeros_like(mask)
    targets[:, :-1] = completion[:, 1:]
    return ids, mask, targets


def rl_inputs(S):
    """Fixed per-token old / reference log-prob offsets and per-row advantages."""
    g = torch.Generator().manual_seed(5)
    B = len(PROMPTS)
    return (0.3 * torch.randn(B, S, generator=g, dtype=torch.float64),
            0.3 * torch.randn(B, S, generator=g, dtype=torch.float64),
            torch.randn(B, generator=g, dtype=torch.float64))


def losses_and_gradients(model, logp, batch, groups, targets, reduce_gradients):
    """Each of LOSSES built on `logp` (laid out like batch.labels): (value, {name: gradient})."""
    old_offset, ref_offset, advantages = rl_inputs(targets.shape[1])
    mask = batch.shard_tokens(targets.to(torch.float64))
    old = logp.detach() + batch.shard_tokens(old_offset) * mask
    ref = logp.detach() + batch.shard_tokens(ref_offset) * mask
    out = []
    for loss_type, level, beta in LOSSES:
        model.zero_grad(set_to_none=True)
        loss = ukhf.grpo_loss(logp, advantages, mask, batch, groups, old_logp=old, ref_logp=ref, beta=beta,
                              loss_type=loss_type, importance_sampling_level=level, max_completion_length=8,
                              use_bias_correction_kl=level == "sequence")
        loss.backward(retain_graph=True)
        reduce_gradients()
        out.append((float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    return out


def sp_worker(rank, world, ring):
    groups = uk.init_sequence_parallel(world, ring_size=ring)
    ukhf.register(groups)
    model = make_model("llama", "ulysses", **CONFIG).double()
    ids, mask, targets = rollout()
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    batch = ukhf.shard_batch(ids, groups, attention_mask=mask, position_ids=positions)
    result = {}
    for tile in (3, None):
        logp, entropy = ukhf.token_logprobs(model, batch, groups, temperature=TEMPERATURE, with_entropy=True,
                                            tile_tokens=tile)
        result[tile] = (ukhf.gather_tokens(logp.detach(), batch, groups),
                        ukhf.gather_tokens(entropy.detach(), batch, groups))
    result["losses"] = losses_and_gradients(model, logp, batch, groups, targets,
                                            lambda: ukhf.allreduce_gradients(model, groups))
    return result


def single_device():
    """The float64 eager model row by row: ([B, S] log-probs, [B, S] entropies, the losses)."""
    model = make_model("llama", "eager", **CONFIG).double()
    ids, mask, targets = rollout()
    B, S = ids.shape
    logp_rows, entropy_rows = [], []
    for row in range(B):
        cols = torch.nonzero(mask[row]).flatten()
        logits = model(input_ids=ids[row, cols][None], position_ids=cols[None], use_cache=False).logits[0]
        logp_all = torch.log_softmax(logits / TEMPERATURE, dim=-1)
        logp = torch.zeros(S, dtype=torch.float64)
        entropy = torch.zeros(S, dtype=torch.float64)
        picked = logp_all[:-1].gather(-1, ids[row, cols[1:]][:, None])[:, 0]
        logp = logp.index_put((cols[:-1],), picked)
        entropy = entropy.index_put((cols[:-1],), -(logp_all.exp() * logp_all).sum(-1)[:-1])
        logp_rows.append(logp)
        entropy_rows.append(entropy.detach())
    full_logp = torch.stack(logp_rows)
    batch = ukhf.shard_batch(ids, None, attention_mask=mask, position_ids=torch.arange(S).expand(B, S))
    losses = losses_and_gradients(model, batch.shard_tokens(full_logp), batch, None, targets, lambda: None)
    return full_logp.detach(), torch.stack(entropy_rows), losses


@pytest.fixture(scope="module")
def reference():
    return single_device()


@pytest.mark.slow
@pytest.mark.parametrize("world,ring", [(2, 1), (3, 1), (4, 2)], ids=["SP2", "SP3", "2x2 ring"])
def test_token_logprobs_and_grpo_losses_equal_single_device(world, ring, reference):
    want_logp, want_entropy, want_losses = reference
    per_rank = spawn(sp_worker, world, args=(ring,), timeout=SLOW_SPAWN_TIMEOUT, start_method="forkserver",
                     preload=["torch", "transformers", "ulysses_kernels.hf"])
    for result in per_rank:
        for tile in (3, None):
            logp, entropy = result[tile]
            assert rel_err(logp, want_logp) < TOL, (tile, rel_err(logp, want_logp))
            assert rel_err(entropy, want_entropy) < TOL, (tile, rel_err(entropy, want_entropy))
        for (loss_type, level, beta), (value, grads), (want, want_grads) in zip(LOSSES, result["losses"],
                                                                                 want_losses):
            assert abs(value - want) <= TOL * max(1.0, abs(want)), (loss_type, level, value, want)
            assert grads.keys() == want_grads.keys()
            worst = max(rel_err(grads[n], want_grads[n]) for n in want_grads)
            assert worst < TOL, (loss_type, level, beta, worst)


def test_token_logprobs_apply_the_final_softcap_before_the_temperature():
    """Gemma 2's final logit softcap (inside its forward) comes before the temperature (TRL's
    order), one process, tiles of 4 positions; the log-probs of the last position (no
    target) are 0."""
    import copy

    import transformers

    ukhf.register(None)
    config = transformers.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                                       final_logit_softcapping=0.2, sliding_window=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="ulysses").double()
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),   # not the ulysses model's config
                                                          attn_implementation="eager").double()
    eager.load_state_dict(model.state_dict())
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(2))
    logp, entropy = ukhf.token_logprobs(model, ukhf.shard_batch(ids, None), None, temperature=0.5,
                                        with_entropy=True, tile_tokens=4)
    assert "forward" not in vars(model)       # the tiled forward was this call's only
    assert rel_err(model(input_ids=ids, use_cache=False).logits, eager(input_ids=ids, use_cache=False).logits) < 1e-6
    logits = eager(input_ids=ids, use_cache=False).logits                  # capped at 0.2
    logp_all = torch.log_softmax(logits / 0.5, dim=-1)
    want = logp_all[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    assert rel_err(logp[:, :-1], want) < 1e-6 and float(logp[:, -1].abs().max()) == 0.0
    assert rel_err(entropy[:, :-1], -(logp_all.exp() * logp_all).sum(-1)[:, :-1]) < 1e-6
    uncapped = torch.log_softmax(eager.lm_head(eager.model(input_ids=ids).last_hidden_state) / 0.5, dim=-1)
    assert rel_err(logp[:, :-1], uncapped[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]) > 1e-2


def test_token_fields_give_trl_fused_head_fields():
    """token_fields (what the DPO mixin reads): the mean logit over the vocabulary after the
    temperature and whether the label is the argmax, equal to the model's own logits', in
    one tiled pass with the log-probs; 0 / False where the label is -100."""
    from ulysses_kernels.hf.rl.logprobs import token_fields

    ukhf.register(None)
    model = make_model("llama", "ulysses", **CONFIG).double()
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():                                  # one target is the argmax (position 5's prediction)
        ids[1, 6] = model(input_ids=ids[1:, :6], use_cache=False).logits[0, 5].argmax()
    labels = ids.clone()
    labels[0, :4] = -100                                   # a prompt without targets
    batch = ukhf.shard_batch(ids, None, labels=labels)
    got = token_fields(model, batch, None, fields=("log_probs", "mean_logits", "is_top1"), temperature=0.5,
                       tile_tokens=3)
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1] / 0.5
    scored = labels[:, 1:] != -100
    assert rel_err(got["mean_logits"][:, :-1], logits.mean(-1) * scored) < 1e-12
    assert torch.equal(got["is_top1"][:, :-1], (logits.argmax(-1) == ids[:, 1:]) & scored)
    assert bool(got["is_top1"][1, 5]), got["is_top1"]
    want = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0] * scored
    assert rel_err(got["log_probs"][:, :-1], want) < 1e-12
    assert not got["mean_logits"].requires_grad and got["log_probs"].requires_grad
    with pytest.raises(ValueError, match="must include 'log_probs'"):
        token_fields(model, batch, None, fields=("entropy",))
