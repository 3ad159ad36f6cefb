"""Training on padded batches under sequence parallelism (`shard_batch(...,
attention_mask=mask)`, ulysses_kernels/hf/core/batch.py) equals single-device training on the
valid tokens: a tiny float64 Llama (family_cases.py) under `attn_implementation="ulysses"` at
SP 2, 3, 4 and on a 2x2 Ulysses x Ring grid, one step on batches with right padding, left
padding and a mix (both sides, none, a row that is all padding); the right-padded one
with a collator's labels (-100 at padding and at prompt tokens), the others with none
(shard_batch's default, the input ids: the padding's ids are then labels, which must not
become targets). The reference runs each unpadded row on its own with float64 eager
attention ("eager64"): the sum of the rows' target losses over the count of all their
targets. The loss and every parameter gradient (summed over the SP group) agree below
1e-9, and so do the per-token log-probs gathered back to the padded layout
(`gather_tokens`, 0 at padding and where there is no target).
"""

import pytest
import torch
import torch.nn.functional as F
from family_cases import make_family_model
from helpers import SLOW_SPAWN_TIMEOUT, rel_err

import ulysses_kernels as uk
from ulysses_kernels import hf as ukhf
from ulysses_kernels.launch import spawn

pytestmark = pytest.mark.slow  # spawned groups running Hugging Face models

TOL = 1e-9
IGNORE = ukhf.IGNORE_INDEX

# Each row's tokens at columns [first, end).
CASES = {
    "right": (13, [(0, 13), (0, 8), (0, 11)]),
    "left": (13, [(5, 13), (0, 13), (2, 13)]),
    "mixed": (12, [(2, 9), (0, 0), (0, 12), (4, 12), (0, 3)]),
}


def padded_batch(case):
    """(input_ids, attention_mask, labels) `[B, S]`: fresh random tokens (random ids at the
    padding too: they must not matter). Labels: "right" -100 at padding and at row 0's
    first two tokens (a prompt); the others None (the input ids)."""
    S, spans = CASES[case]
    g = torch.Generator().manual_seed(len(case) + S)
    ids = torch.randint(0, 96, (len(spans), S), generator=g)
    mask = torch.zeros_like(ids)
    for r, (first, end) in enumerate(spans):
        mask[r, first:end] = 1
    if case != "right":
        return ids, mask, None
    labels = ids.masked_fill(mask == 0, IGNORE)
    labels[0, :2] = IGNORE
    return ids, mask, labels


def model_overrides(ulysses):
    """Heads that split over the Ulysses degree (6 / 3 at 3)."""
    return dict(num_attention_heads=6, num_key_value_heads=3) if ulysses == 3 else {}


def target_log_probs(logits, targets):
    """log p(target) per token, 0 where there is no target."""
    logp = F.log_softmax(logits, dim=-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return logp.masked_fill(targets == IGNORE, 0.0)


def run_world(rank, world, ring_size):
    """Every case on this rank: (loss, {name: gradient summed over the SP group},
    the gathered per-token log-probs `[B, S]`)."""
    groups = uk.init_sequence_parallel(world, ring_size=ring_size)
    ukhf.register(groups)
    results = {}
    for case in CASES:
        model = make_family_model("llama", "ulysses", **model_overrides(world // ring_size))
        ids, mask, labels = padded_batch(case)
        batch = ukhf.shard_batch(ids, groups, attention_mask=mask, labels=labels)
        logits = model(**batch.model_inputs()).logits
        loss = ukhf.sequence_parallel_loss(logits, batch.labels, groups)
        loss.backward()
        ukhf.allreduce_gradients(model, groups)
        logp = ukhf.gather_tokens(target_log_probs(logits.detach(), batch.labels), batch, groups)
        results[case] = (loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}, logp)
    return results


def reference(case, ulysses):
    """Single device, float64 eager: each row's valid tokens on their own; (the mean over
    every row's targets, {name: grad}, per-token log-probs `[B, S]`)."""
    model = make_family_model("llama", "eager64", **model_overrides(ulysses))
    ids, mask, labels = padded_batch(case)
    labels = ids if labels is None else labels
    logp = torch.zeros(ids.shape, dtype=torch.float64)
    total, count = 0.0, 0
    for r, (first, end) in enumerate(CASES[case][1]):
        if end - first == 0:
            continue
        targets = torch.full((end - first,), IGNORE)
        targets[:-1] = labels[r, first + 1:end]
        logits = model(input_ids=ids[r:r + 1, first:end], use_cache=False).logits[0]
        total = total + F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
        count += int((targets != IGNORE).sum())
        logp[r, first:end] = target_log_probs(logits.detach(), targets)
    loss = total / count
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}, logp


@pytest.mark.parametrize("world,ring_size", [(2, 1), (3, 1), (4, 1), (4, 2)], ids=["sp2", "sp3", "sp4", "2x2"])
def test_padded_batches_train_like_each_row_on_one_device(world, ring_size):
    per_rank = spawn(run_world, world, args=(ring_size,), timeout=SLOW_SPAWN_TIMEOUT)
    failures, worst = [], {}
    for case in CASES:
        want_loss, want_grads, want_logp = reference(case, world // ring_size)
        for rank, results in enumerate(per_rank):
            loss, grads, logp = results[case]
            errors = dict(loss=rel_err(loss, want_loss), log_probs=rel_err(logp, want_logp),
                          **{name: rel_err(grads[name], want) for name, want in want_grads.items()})
            worst[case] = max(worst.get(case, 0.0), max(errors.values()))
            failures += [f"{case} rank {rank} {name}: {err:.2e}" for name, err in errors.items() if not err < TOL]
    print(f"world {world} ring {ring_size}: worst rel err per case " +
          ", ".join(f"{case} {err:.1e}" for case, err in worst.items()))
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:30])
