"""RL losses under sequence parallelism (docs/hf_rl.md, "RL"): sums over each row of the batch
across the SP group with one gradient convention, and the GRPO and DPO losses of TRL 1.16
written on them.

The convention (that of `global_mean_from_sum`): a row sum's *value* is global (every rank's
tokens), its *gradient* flows only through this rank's tokens. Each rank computes the same
loss from such sums; each rank's backward then covers its own tokens and
`allreduce_gradients` (or DDP / FSDP over the SP group) sums them into the single-device
gradient. That holds for any loss that is a function of row sums of per-token values
computed on this rank's tokens. A row sum must never be spread back over the tokens and
summed again (each rank would then miss the other ranks' share of its gradient): the
losses here use per-row quantities per row (GSPO's sequence-level ratio, the KL's bias
correction) and never inside another row sum.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from ..core.batch import SequenceParallelBatch
from ..groups import sum_over_group

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
DPO_LOSS_TYPES = ("sigmoid", "ipo")


def batch_rows(batch: SequenceParallelBatch) -> int:
    """The number of rows of the batch given to `shard_batch` (padded rows included)."""
    return batch.padding.shape[0] if batch.padding is not None else batch.input_ids.shape[0]


def token_rows(batch: SequenceParallelBatch, device=None) -> torch.Tensor:
    """The row (of the batch given to `shard_batch`) of each of this rank's tokens, laid out
    like `batch.labels` (int64)."""
    B = batch_rows(batch)
    S = batch.padding.shape[1] if batch.padding is not None else sum(batch.seq_lens)
    rows = torch.arange(B, device=batch.input_ids.device).unsqueeze(1).expand(B, S)
    return batch.shard_tokens(rows).to(device if device is not None else batch.input_ids.device)


def row_sums(values: torch.Tensor, batch: SequenceParallelBatch, groups=None) -> torch.Tensor:
    """`[B]`: each row of the batch given to `shard_batch` (padded rows included, 0 for a row
    with no token) summed over every rank's tokens. `values`: per-token values laid out like
    `batch.labels` (this rank's shard). The value is global, the gradient flows only through
    this rank's tokens (see the module doc); one all-reduce of `[B]` in float64. `groups`: the
    SP group or `init_sequence_parallel`'s groups (with a ring: the whole grid)."""
    if tuple(values.shape) != tuple(batch.labels.shape):
        raise ValueError(f"row_sums: values of shape {tuple(values.shape)} are not laid out like batch.labels "
                         f"{tuple(batch.labels.shape)} (bring [B, S] values to the shard with batch.shard_tokens)")
    rows = token_rows(batch, values.device).reshape(-1)
    local = values.new_zeros(batch_rows(batch)).index_add(0, rows, values.reshape(-1))
    return sum_over_group(local, groups)


def grpo_loss(logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, batch: SequenceParallelBatch,
              groups=None, *, old_logp: Optional[torch.Tensor] = None, ref_logp: Optional[torch.Tensor] = None,
              beta: float = 0.0, loss_type: str = "grpo", epsilon_low: float = 0.2,
              epsilon_high: Optional[float] = None, delta: Optional[float] = None,
              importance_sampling_level: str = "token", use_bias_correction_kl: bool = False,
              max_completion_length: Optional[int] = None,
              num_items_in_batch: Optional[float] = None) -> torch.Tensor:
    """TRL 1.16's GRPO loss (`GRPOTrainer._compute_loss` for `loss_type` grpo, bnpo, dr_grpo
    and dapo; GSPO with `importance_sampling_level="sequence"`), on every rank, from this
    rank's per-token tensors laid out like `batch.labels`: `logp` (`token_logprobs`),
    `mask` (1 at the completion tokens whose log-probs count), `old_logp` (None: `logp`
    detached, TRL's single-iteration case) and `ref_logp` (for `beta > 0`).

    advantages: `[B]` per row of the batch (or, at token level, per token like `logp`).
    epsilon_high: None is `epsilon_low`. max_completion_length: dr_grpo's length.
    num_items_in_batch: dapo's normalizer (TRL: the generation batch's completion tokens
    over the processes, rescaled to one accumulation window); None: this batch's completion
    tokens. Gradient accumulation's division is the caller's (TRL divides grpo, bnpo and
    dr_grpo by the accumulation steps). The value is the single-device loss; see the module
    doc for the gradients.
    """
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"grpo_loss: loss_type {loss_type!r} is not one of {', '.join(GRPO_LOSS_TYPES)}")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"grpo_loss: importance_sampling_level must be 'token' or 'sequence', got "
                         f"{importance_sampling_level!r}")
    if beta != 0.0 and ref_logp is None:
        raise ValueError("grpo_loss: beta != 0 needs ref_logp (the reference model's token_logprobs)")
    if loss_type == "dr_grpo" and not max_completion_length:
        raise ValueError("grpo_loss: loss_type 'dr_grpo' divides by max_completion_length; pass it")
    B = batch_rows(batch)
    per_row = advantages.dim() == 1
    if per_row and advantages.shape[0] != B:
        raise ValueError(f"grpo_loss: advantages has {advantages.shape[0]} rows, the batch {B}")
    if not per_row and importance_sampling_level == "sequence":
        raise ValueError("grpo_loss: the sequence-level ratio takes one advantage per row ([B])")
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    mask = mask.to(logp.dtype)
    old_logp = logp.detach() if old_logp is None else old_logp
    log_ratio = logp - old_logp
    completion = row_sums(mask, batch, groups)                        # M_b, constants
    kl = None
    if beta != 0.0:
        diff = ref_logp - logp
        kl = torch.exp(diff) - diff - 1
    if importance_sampling_level == "token":
        coef_1 = torch.exp(log_ratio)
        if kl is not None and use_bias_correction_kl:
            kl = kl * coef_1
        adv = advantages[token_rows(batch, logp.device)] if per_row else advantages
        per_token = _clipped_objective(coef_1, adv, epsilon_low, epsilon_high, delta)
        if kl is not None:
            per_token = per_token + beta * kl
        totals = row_sums(per_token * mask, batch, groups)
    else:   # GSPO: one ratio per row, the mean log-ratio over its completion tokens
        coef_1 = torch.exp(row_sums(log_ratio * mask, batch, groups) / completion.clamp(min=1.0))
        totals = _clipped_objective(coef_1, advantages.to(coef_1.dtype), epsilon_low, epsilon_high, delta) * completion
        if kl is not None:
            kl_totals = row_sums(kl * mask, batch, groups)
            totals = totals + beta * (kl_totals * coef_1 if use_bias_correction_kl else kl_totals)
    if loss_type == "grpo":
        return (totals / completion.clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return totals.sum() / completion.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return totals.sum() / (B * max_completion_length)
    normalizer = completion.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
    return totals.sum() / normalizer.to(totals.dtype).clamp(min=1.0)


def _clipped_objective(coef_1, advantages, epsilon_low, epsilon_high, delta):
    """PPO's clipped objective, negated: `-min(r A, clip(r, 1 - e_low, 1 + e_high) A)`, with
    TRL's two-sided clip of r at `delta`."""
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    return -torch.min(coef_1 * advantages, coef_2 * advantages)


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, *, beta: float = 0.1, loss_type: str = "sigmoid",
             chosen_lengths: Optional[torch.Tensor] = None,
             rejected_lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
    """TRL 1.16's DPO loss (`DPOTrainer._compute_loss`, reverse KL, one loss type) from
    per-pair sequence log-probs `[N]`: the sums of the completion tokens' log-probs (under
    SP: `row_sums(logp * mask, ...)` of the chosen and the rejected rows). sigmoid:
    `-logsigmoid(beta * delta)`; ipo: the log-ratios divided by the completion lengths
    (`chosen_lengths`, `rejected_lengths`: completion tokens per row), then
    `(delta - 1 / (2 beta))^2`; the mean over the pairs."""
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"dpo_loss: loss_type {loss_type!r} is not one of {', '.join(DPO_LOSS_TYPES)}")
    chosen = chosen_logps - ref_chosen_logps
    rejected = rejected_logps - ref_rejected_logps
    if loss_type == "sigmoid":
        return (-F.logsigmoid(beta * (chosen - rejected))).mean()
    if chosen_lengths is None or rejected_lengths is None:
        raise ValueError("dpo_loss: loss_type 'ipo' averages over the completion tokens; pass chosen_lengths and "
                         "rejected_lengths")
    delta = chosen / chosen_lengths.to(chosen.dtype).clamp(min=1.0) - \
        rejected / rejected_lengths.to(rejected.dtype).clamp(min=1.0)
    return ((delta - 1 / (2 * beta)) ** 2).mean()
