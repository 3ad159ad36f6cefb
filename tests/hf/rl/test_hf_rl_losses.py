"""The RL losses (ulysses_kernels/hf/rl/losses.py) against TRL 1.16's own code on one process: TRL's
`GRPOTrainer._compute_loss` and `DPOTrainer._compute_loss`, called on a stand-in trainer
whose log-probs come from one float64 logits tensor, and ours on the same log-probs laid
out as `shard_batch` lays them out (left-padded prompts, right-padded completions). Loss
values and the gradients of the logits."""

import collections
import types

import pytest
import torch

pytest.importorskip("trl", reason="the RL losses are compared with TRL's (pip install -e '.[hf]' in the checkout)")

from ulysses_kernels import hf as ukhf  # noqa: E402

PROMPTS, COMPLETIONS, VOCAB = (3, 6, 4, 6), (5, 2, 6, 1), 11


def _rollout(seed=0):
    """ids, attention mask, completion mask `[B, S]` (prompts left-padded to P, completions
    right-padded to C) and the logits leaf `[B, S, V]`."""
    P, C = max(PROMPTS), max(COMPLETIONS)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(PROMPTS), P + C), generator=g)
    mask = torch.zeros_like(ids)
    for row, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        mask[row, P - p:P + c] = 1
    completion = torch.zeros_like(mask)
    completion[:, P:] = mask[:, P:]
    logits = torch.randn(*ids.shape, VOCAB, generator=g, dtype=torch.float64).requires_grad_(True)
    return ids * mask, mask, completion, logits


def _next_token_logps(logits, ids):
    """`[B, S]`: position t's log-prob of token t + 1 (0 at the last column)."""
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.cat([logp, logp.new_zeros(logp.shape[0], 1)], dim=1)


def _accelerator():
    return types.SimpleNamespace(num_processes=1, gather=lambda x: x, gather_for_metrics=lambda x: x,
                                 reduce=lambda x, reduction="sum": x, sync_gradients=True, device="cpu")


def _ours(full_logp, ids, mask, completion):
    """Our layout: the batch of shard_batch (one process), the log-probs and the mask of the
    positions whose target is a completion token, laid out like batch.labels."""
    B, S = ids.shape
    batch = ukhf.shard_batch(ids, None, attention_mask=mask, position_ids=torch.arange(S).expand(B, S))
    targets = torch.zeros_like(completion, dtype=torch.float64)
    targets[:, :-1] = completion[:, 1:]
    return batch, batch.shard_tokens(full_logp), batch.shard_tokens(targets)


GRPO_CASES = [(loss_type, level, beta) for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo")
              for level in ("token", "sequence") for beta in (0.0, 0.04)]


@pytest.mark.parametrize("loss_type,level,beta", GRPO_CASES)
def test_grpo_loss_equals_trl(loss_type, level, beta):
    from trl import GRPOTrainer

    ids, mask, completion, logits = _rollout()
    P, C = max(PROMPTS), max(COMPLETIONS)
    g = torch.Generator().manual_seed(1)
    old = 0.2 * torch.randn(ids.shape[0], C, generator=g, dtype=torch.float64)
    ref = 0.2 * torch.randn(ids.shape[0], C, generator=g, dtype=torch.float64)
    advantages = torch.randn(ids.shape[0], generator=g, dtype=torch.float64)
    bias_correction = level == "sequence"

    full_logp = _next_token_logps(logits, ids)
    trl_logp = full_logp[:, P - 1:-1]                          # TRL's per-token log-probs of the completion
    inputs = dict(prompt_ids=ids[:, :P], prompt_mask=mask[:, :P], completion_ids=ids[:, P:],
                  completion_mask=completion[:, P:], advantages=advantages,
                  old_per_token_logps=trl_logp.detach() + old, ref_per_token_logps=trl_logp.detach() + ref,
                  num_items_in_batch=completion.sum().double())
    trainer = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (trl_logp, torch.zeros_like(trl_logp), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=beta, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28,
        use_vllm=False, model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=C, accelerator=_accelerator(), _entropy_bonus_enabled=False,
        _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
        args=types.SimpleNamespace(use_bias_correction_kl=bias_correction, delta=None, steps_per_generation=1))
    want = GRPOTrainer._compute_loss(trainer, None, inputs)
    want_grad, = torch.autograd.grad(want, logits, retain_graph=True)

    def on_full_layout(values):   # TRL's completion columns -> our [B, S] positions
        out = torch.zeros_like(full_logp.detach())
        out[:, P - 1:-1] = values
        return out

    batch, logp, targets = _ours(full_logp, ids, mask, completion)
    loss = ukhf.grpo_loss(logp, advantages, targets, batch, old_logp=logp.detach() + batch.shard_tokens(
                              on_full_layout(old)), ref_logp=logp.detach() + batch.shard_tokens(on_full_layout(ref)),
                          beta=beta, loss_type=loss_type, importance_sampling_level=level, epsilon_low=0.2,
                          epsilon_high=0.28, use_bias_correction_kl=bias_correction, max_completion_length=C)
    grad, = torch.autograd.grad(loss, logits)
    assert abs(float(loss) - float(want)) < 1e-14 * max(1.0, abs(float(want)))
    assert torch.allclose(grad, want_grad, rtol=0, atol=1e-15), (grad - want_grad).abs().max()
    assert float(want_grad.abs().max()) > 0


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_loss_equals_trl(loss_type):
    from trl import DPOTrainer

    ids, mask, completion, logits = _rollout(seed=3)   # rows [chosen 0, chosen 1, rejected 0, rejected 1]
    full_logp = _next_token_logps(logits, ids)
    shift_completion = completion[:, 1:]
    log_probs = full_logp[:, :-1] * shift_completion           # TRL's fused head: 0 where the label is -100
    g = torch.Generator().manual_seed(4)
    ref_chosen, ref_rejected = (torch.randn(2, generator=g, dtype=torch.float64) for _ in range(2))
    outputs = types.SimpleNamespace(log_probs=log_probs, entropy=torch.zeros_like(log_probs),
                                    mean_logits=torch.zeros_like(log_probs),
                                    is_top1=torch.zeros_like(log_probs, dtype=torch.bool))
    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=_accelerator(), aux_loss_enabled=False,
        precompute_ref_logps=True, ld_alpha=None, f_divergence_type="reverse_kl", loss_types=[loss_type],
        loss_weights=[1.0], beta=0.1, use_weighting=False, label_smoothing=0.0, _total_train_tokens=0, _tp_size=1,
        _metrics=collections.defaultdict(lambda: collections.defaultdict(list)))
    inputs = dict(input_ids=ids, attention_mask=mask, completion_mask=completion, ref_chosen_logps=ref_chosen,
                  ref_rejected_logps=ref_rejected)
    want = DPOTrainer._compute_loss(trainer, lambda **kwargs: outputs, inputs, return_outputs=False)
    want_grad, = torch.autograd.grad(want, logits, retain_graph=True)

    batch, logp, targets = _ours(full_logp, ids, mask, completion)
    sums = ukhf.row_sums(logp * targets, batch)
    lengths = completion.sum(dim=1)
    loss = ukhf.dpo_loss(sums[:2], sums[2:], ref_chosen, ref_rejected, beta=0.1, loss_type=loss_type,
                         chosen_lengths=lengths[:2], rejected_lengths=lengths[2:])
    grad, = torch.autograd.grad(loss, logits)
    assert abs(float(loss) - float(want)) < 1e-14 * max(1.0, abs(float(want)))
    assert torch.allclose(grad, want_grad, rtol=0, atol=1e-15), (grad - want_grad).abs().max()
    assert float(want_grad.abs().max()) > 0


def test_errors():
    ids, mask, completion, logits = _rollout()
    full_logp = _next_token_logps(logits, ids)
    batch, logp, targets = _ours(full_logp, ids, mask, completion)
    advantages = torch.zeros(len(PROMPTS), dtype=torch.float64)
    with pytest.raises(ValueError, match="loss_type 'cispo' is not one of grpo, bnpo, dr_grpo, dapo"):
        ukhf.grpo_loss(logp, advantages, targets, batch, loss_type="cispo")
    with pytest.raises(ValueError, match="beta != 0 needs ref_logp"):
        ukhf.grpo_loss(logp, advantages, targets, batch, beta=0.1)
    with pytest.raises(ValueError, match="dr_grpo' divides by max_completion_length"):
        ukhf.grpo_loss(logp, advantages, targets, batch, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="advantages has 3 rows, the batch 4"):
        ukhf.grpo_loss(logp, advantages[:3], targets, batch)
    with pytest.raises(ValueError, match="one advantage per row"):
        ukhf.grpo_loss(logp, torch.zeros_like(logp), targets, batch, importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="not laid out like batch.labels"):
        ukhf.row_sums(full_logp, batch)
    with pytest.raises(ValueError, match="pass chosen_lengths and rejected_lengths"):
        ukhf.dpo_loss(*torch.zeros(4, 2), loss_type="ipo")
