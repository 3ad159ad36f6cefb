"""Sequence classification (reward models) under sequence parallelism (ulysses_kernels/hf/core/heads.py):
a tiny float64 `LlamaForSequenceClassification` called with `shard_batch(...).model_inputs()`
returns the whole batch's `[B, num_labels]` scores on every rank, equal to one process; the
same loss on every rank followed by `allreduce_gradients` gives the one-process gradients;
`labels=` gives the one-process loss. At SP 1, 2, 3, 4 and on a 2x2 Ulysses x Ring grid, on
right- and left-padded rows of unequal lengths (a row whose last token is the pad token:
transformers pools the token before it) and on rows without padding.

The reference runs each row's valid tokens on their own (one process, float64 eager
attention): what transformers computes for the padded batch with the positions counted from
each row's first token.
"""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from family_cases import register_exact_eager
from helpers import SLOW_SPAWN_TIMEOUT, rel_err

pytest.importorskip("transformers", reason="ulysses_kernels.hf needs Hugging Face transformers "
                                           "(pip install -e '.[hf]' in the checkout)")

import ulysses_kernels as uk  # noqa: E402
from ulysses_kernels import hf as ukhf  # noqa: E402
from ulysses_kernels.launch import spawn  # noqa: E402

# float64 weights and eager float64 reference attention; RMSNorm computes in float32 only
# when its input is 16-bit: measured 1e-15 .. 1e-13.
TOL = 1e-9
PAD = 0
LABELS = 3
# Each row's tokens at columns [first, end) of S columns; None: no padding (no mask).
CASES = {
    "right": (13, [(0, 13), (0, 8), (0, 11)]),
    "left": (13, [(5, 13), (0, 13), (2, 13)]),
    "unpadded": (11, None),
}
GRIDS = {1: [(1, 1)], 2: [(2, 1)], 3: [(3, 1)], 4: [(4, 1), (2, 2)]}   # world: [(ulysses, ring)]


def head_model(attn, ulysses=2, pad_token_id=PAD):
    """A tiny float64 Llama reward model with `LABELS` scores (same weights every call)."""
    from tiny_models import tiny_config
    from transformers import LlamaForSequenceClassification

    config = tiny_config("llama")
    config.num_labels, config.pad_token_id = LABELS, pad_token_id
    if ulysses == 3:
        config.num_attention_heads, config.num_key_value_heads = 6, 3
    torch.manual_seed(0)
    return LlamaForSequenceClassification._from_config(config, attn_implementation=attn).double().train()


def case_batch(case):
    """(input_ids, attention_mask or None, labels): fresh tokens that are not the pad token,
    but row 1's last one (a pad token that ends the content: pooled past)."""
    S, spans = CASES[case]
    rows = 3 if spans is None else len(spans)
    g = torch.Generator().manual_seed(S + len(case))
    ids = torch.randint(1, 96, (rows, S), generator=g)
    labels = torch.randint(0, LABELS, (rows,), generator=g)
    if spans is None:
        ids[1, -1] = PAD
        return ids, None, labels
    mask = torch.zeros_like(ids)
    for r, (first, end) in enumerate(spans):
        mask[r, first:end] = 1
    ids[1, spans[1][1] - 1] = PAD
    return ids.masked_fill(mask == 0, PAD), mask, labels


def reference(case, ulysses):
    """(scores [B, L], loss, {name: grad}) of one process, row by row."""
    ids, mask, labels = case_batch(case)
    model = head_model(register_exact_eager(), ulysses)
    rows = [ids[r] if mask is None else ids[r][mask[r] == 1] for r in range(ids.shape[0])]
    scores = torch.cat([model(input_ids=row.unsqueeze(0), use_cache=False).logits for row in rows])
    loss = F.cross_entropy(scores, labels)
    loss.backward()
    return scores.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def sp_run(groups, case, ulysses):
    """The documented calls: (scores, loss, {name: grad}, the model's own loss with labels=)."""
    ids, mask, labels = case_batch(case)
    model = head_model("ulysses", ulysses)
    batch = ukhf.shard_batch(ids, groups, attention_mask=mask)
    scores = model(**batch.model_inputs()).logits
    loss = F.cross_entropy(scores, labels)
    loss.backward()
    ukhf.allreduce_gradients(model, groups)
    with torch.no_grad():
        inside = model(**batch.model_inputs(), labels=labels).loss
    return scores.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, inside


def compare(got, want):
    """The largest relative error of (scores, loss, gradients, the labels= loss)."""
    scores, loss, grads, inside = got
    want_scores, want_loss, want_grads = want
    errors = [rel_err(scores, want_scores), rel_err(loss, want_loss), rel_err(inside, want_loss)]
    errors += [rel_err(grads[n], g) for n, g in want_grads.items()]
    return max(errors)


def _worker(rank, world):
    ukhf.register(None)
    out = {}
    for ulysses, ring in GRIDS[world]:
        groups = uk.init_sequence_parallel(world, ring_size=ring)
        ukhf.register(groups)
        for case in CASES:
            out[(ulysses, ring, case)] = compare(sp_run(groups, case, ulysses), reference(case, ulysses))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_sequence_classification_equals_one_process(world):
    per_rank = spawn(_worker, world, timeout=SLOW_SPAWN_TIMEOUT, start_method="forkserver",
                     preload=["torch", "transformers", "ulysses_kernels.hf"])
    for rank, out in enumerate(per_rank):
        assert set(out) == {(u, r, c) for u, r in GRIDS[world] for c in CASES}
        for key, error in out.items():
            assert error < TOL, (rank, key, error)


def test_sequence_classification_on_one_process():
    """SP 1: the padded batch unpadded by shard_batch still gives one score per row."""
    ukhf.register(None)
    for case in CASES:
        error = compare(sp_run(None, case, 2), reference(case, 2))
        assert error < TOL, (case, error)


def test_sequence_classification_refusals():
    """What transformers refuses it refuses too (several rows without a pad token), and so
    are rows with nothing but the pad token (transformers would pool a padding position) and
    a call that does not say where the rows are, on more than one rank (world 1: as
    transformers)."""
    ukhf.register(None)
    ids, mask, _ = case_batch("unpadded")
    batch = ukhf.shard_batch(ids, None)
    with pytest.raises(ValueError, match="Cannot handle batch sizes > 1 if no padding token is defined"):
        head_model("ulysses", pad_token_id=None)(**batch.model_inputs())
    one = ukhf.shard_batch(ids[:1], None)
    head_model("ulysses", pad_token_id=None)(**one.model_inputs())   # one row: its last token
    empty = ids.clone()
    empty[2] = PAD
    with pytest.raises(ukhf.NotSequenceParallelError, match=r"row\(s\) \[2\] of the batch hold no token other"):
        head_model("ulysses")(**ukhf.shard_batch(empty, None).model_inputs())
    model = head_model("ulysses")
    assert torch.equal(model(input_ids=ids).logits, head_model("sdpa")(input_ids=ids).logits.detach()) or \
        rel_err(model(input_ids=ids).logits, head_model("sdpa")(input_ids=ids).logits) < TOL


# ------------------------------------------------------------------ per-token heads

def token_model(attn, ulysses, labels):
    """A tiny float64 Llama token classifier (`labels` = 1: a critic's value head)."""
    from tiny_models import tiny_config
    from transformers import LlamaForTokenClassification

    config = tiny_config("llama")
    config.num_labels, config.pad_token_id = labels, PAD
    config.classifier_dropout = 0.0   # transformers' default is 0.1: random masks differ between the runs
    if ulysses == 3:
        config.num_attention_heads, config.num_key_value_heads = 6, 3
    torch.manual_seed(1)
    return LlamaForTokenClassification._from_config(config, attn_implementation=attn).double().train()


def _row_by_row(case, ulysses, labels):
    """(model, values [B, S, L] with 0 at padding, mask) of one process: each row's valid
    tokens run alone."""
    ids, mask, _ = case_batch(case)
    mask = torch.ones_like(ids) if mask is None else mask
    model = token_model(register_exact_eager(), ulysses, labels)
    values = torch.zeros(*ids.shape, labels, dtype=torch.float64)
    for r in range(ids.shape[0]):
        keep = mask[r] == 1
        values[r, keep] = model(input_ids=ids[r][keep].unsqueeze(0), use_cache=False).logits[0]
    return model, values, mask


def token_reference(case, ulysses, labels):
    """(values [B, S, L] with 0 at padding, loss: the mean of values^2 over the valid tokens,
    {name: grad}) of one process, row by row."""
    model, values, mask = _row_by_row(case, ulysses, labels)
    loss = values.square().sum() / mask.sum()
    loss.backward()
    return values.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def token_targets(case, labels):
    """Random class labels `[B, S]` with -100 at the padding and at a few valid tokens (as
    DataCollatorForTokenClassification pads them)."""
    ids, mask, _ = case_batch(case)
    g = torch.Generator().manual_seed(5)
    targets = torch.randint(0, labels, ids.shape, generator=g)
    targets[torch.rand(ids.shape, generator=g) < 0.2] = -100
    if mask is not None:
        targets[mask == 0] = -100
    return targets


def token_labels_reference(case, ulysses, labels):
    """(loss, {name: grad}) of transformers' own `labels=` loss on one process: the logits of
    each row's valid tokens alone, the loss over the whole padded batch (padding ignored)."""
    model, logits, _ = _row_by_row(case, ulysses, labels)
    loss = model.loss_function(logits, token_targets(case, labels), model.config)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _token_worker(rank, world):
    out = {}
    for ulysses, ring in GRIDS[world]:
        groups = uk.init_sequence_parallel(world, ring_size=ring)
        ukhf.register(groups)
        for case in ("right", "left"):
            for labels in (1, 3):
                ids, mask, _ = case_batch(case)
                model = token_model("ulysses", ulysses, labels)
                batch = ukhf.shard_batch(ids, groups, attention_mask=mask)
                values = model(**batch.model_inputs()).logits          # this rank's tokens
                loss = ukhf.global_mean_from_sum(values.square().sum(), batch.input_ids.numel(), groups)
                loss.backward()
                ukhf.allreduce_gradients(model, groups)
                gathered = ukhf.gather_tokens(values.detach(), batch, groups)
                want_values, want_loss, want_grads = token_reference(case, ulysses, labels)
                errors = [rel_err(gathered, want_values), rel_err(loss.detach(), want_loss)]
                errors += [rel_err(p.grad, want_grads[n]) for n, p in model.named_parameters()]
                label_errors = [0.0]
                if labels > 1:   # the model's own loss (one class: cross-entropy is 0)
                    model.zero_grad(set_to_none=True)
                    targets = batch.shard_tokens(token_targets(case, labels))
                    as_tuple = model(**batch.model_inputs(), labels=targets, return_dict=False)
                    own = model(**batch.model_inputs(), labels=targets)
                    assert torch.equal(as_tuple[0], own.loss) and torch.equal(as_tuple[1], own.logits)
                    own.loss.backward()
                    ukhf.allreduce_gradients(model, groups)
                    want_loss, want_grads = token_labels_reference(case, ulysses, labels)
                    label_errors = [rel_err(own.loss.detach(), want_loss)]
                    label_errors += [rel_err(p.grad, want_grads[n]) for n, p in model.named_parameters()]
                out[(ulysses, ring, case, labels)] = (max(errors), max(label_errors))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_token_classification_and_a_critic_equal_one_process(world):
    """Per-token heads (`num_labels` 3, and 1 as verl and OpenRLHF build critics): this
    rank's tokens' values, gathered to the padded layout with `gather_tokens`, and a loss
    over every valid token with its gradients, equal one process; so do the model's own loss
    with `labels=` (the whole batch's mean, not this rank's) and its gradients. transformers
    computes that loss in float32: TOKEN_LABELS_TOL."""
    per_rank = spawn(_token_worker, world, timeout=SLOW_SPAWN_TIMEOUT, start_method="forkserver",
                     preload=["torch", "transformers", "ulysses_kernels.hf"])
    for rank, out in enumerate(per_rank):
        for key, (error, label_error) in out.items():
            assert error < TOL and label_error < TOKEN_LABELS_TOL, (rank, key, error, label_error)
    print(f"world {world}: worst {max(e for out in per_rank for e, _ in out.values()):.1e}, labels= loss "
          f"{max(e for out in per_rank for _, e in out.values()):.1e}")


# The labels= loss of a token classifier is computed in float32 by transformers (its
# ForTokenClassification upcasts with .float()), in both runs: the float32 floor.
TOKEN_LABELS_TOL = 1e-6


# ------------------------------------------------------------------ the head sweep

HEAD_OUTCOMES = Path(__file__).parent.parent / "head_sweep_outcomes.json"
HEAD_SWEEP_TIMEOUT = 420


@pytest.mark.slow
def test_every_head_is_exact_or_refused_on_every_rank(tmp_path):
    """The head sweep (head_sweep.py): every decoder family's sequence-classification,
    token-classification and question-answering head, at SP 2, exact (< 1e-6) or refused
    with the same error on both ranks; the outcomes are pinned per transformers minor."""
    from head_sweep import head_cases, head_sweep_worker
    from test_hf_sweep import classify, pinned_outcomes

    cases = head_cases()
    try:
        per_rank = spawn(head_sweep_worker, 2, args=(cases, str(tmp_path)), timeout=HEAD_SWEEP_TIMEOUT,
                         start_method="forkserver", preload=["torch", "transformers", "ulysses_kernels.hf"])
    except TimeoutError as error:
        logs = {p.name: p.read_text().splitlines()[-1:] for p in tmp_path.glob("rank*.log")}
        raise AssertionError(f"the head sweep hung or ran past {HEAD_SWEEP_TIMEOUT} s; last case per rank: {logs}") \
            from error
    report = {case: classify(case, per_rank) for case in cases}
    counts = {}
    for outcome, _ in report.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    print(f"\nhead sweep of {len(cases)} cases: {counts}\n" +
          "\n".join(f"{c:48s} {o:10s} {d[:160]}" for c, (o, d) in sorted(report.items())))
    bad = {c: r for c, r in report.items() if r[0] not in ("exact", "refused", "unbuilt")}
    assert not bad, "heads neither exact nor refused on every rank:\n" + "\n".join(
        f"{c}: {o}: {d}" for c, (o, d) in sorted(bad.items()))
    pinned = pinned_outcomes(path=HEAD_OUTCOMES)
    changed = {c: (pinned.get(c), o) for c, (o, _) in report.items() if pinned.get(c) != o}
    assert not changed, f"outcomes differ from {HEAD_OUTCOMES.name} (pinned, now): {changed}"
    assert sorted(pinned) == cases


def test_docs_list_every_head_with_its_pinned_outcome():
    """docs/hf_families.md's head sweep table lists every case of the newest pinned transformers,
    with its outcome."""
    from helpers import ROOT
    from test_hf_sweep import newest_pinned_version, pinned_outcomes

    pinned = pinned_outcomes(newest_pinned_version(HEAD_OUTCOMES), HEAD_OUTCOMES)
    text = (ROOT / "docs" / "hf_families.md").read_text()
    table = text[text.index("## Heads: the head sweep"):]
    table = table[:table.index("\n## ", 1)] if "\n## " in table[1:] else table
    heads = {"sequence classification": "SequenceClassification", "token classification": "TokenClassification",
             "question answering": "QuestionAnswering"}
    listed = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] in heads:
            for family in cells[2].split(","):
                listed[f"{family.strip()}/{heads[cells[0]]}"] = cells[1]
    assert listed == pinned
