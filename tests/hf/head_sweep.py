"""The head sweep (tests/hf/core/test_hf_heads.py): every decoder family's sequence-classification,
token-classification and question-answering head of the installed transformers, built tiny
in float64 (tiny_models.py, 2 scores, pad token 0, no classifier dropout), one step at SP 2
through `register` / `attn_implementation="ulysses"` / `shard_batch(..., attention_mask=)` /
`model(**batch.model_inputs())` / `allreduce_gradients` on three right-padded rows of
unequal lengths, against the same weights on one process row by row.

The step's values: a sequence classifier's `[B, 2]` scores with a cross-entropy loss on
them; a per-token head's values gathered to the padded layout (`gather_tokens`) with the
mean of their squares over the valid tokens as the loss (question answering: its start and
end logits). Each family is exact (values, loss and every parameter gradient) or refused
with `NotSequenceParallelError` on every rank; nothing silently wrong, nothing raised on
some ranks only, no hang.
"""

import torch
import torch.nn.functional as F
from sweep import largest_error

HEADS = ("SequenceClassification", "TokenClassification", "QuestionAnswering")
LABELS = 2
PAD = 0
SPANS = [(0, 13), (0, 8), (0, 11)]   # each row's tokens at columns [first, end) of 13


def head_mappings():
    from transformers.models.auto import modeling_auto as auto

    return {"SequenceClassification": auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
            "TokenClassification": auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
            "QuestionAnswering": auto.MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES}


def head_cases():
    """["model_type/head"] of every decoder family (it has a causal LM) with such a head."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(f"{m}/{head}" for head, mapping in head_mappings().items() for m in mapping
                  if m in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def build_head(case, attn):
    import transformers
    from tiny_models import build_tiny_model

    model_type, head = case.split("/")
    model_class = getattr(transformers, head_mappings()[head][model_type])
    return build_tiny_model(model_type, attn, model_class=model_class,
                            overrides=dict(num_labels=LABELS, pad_token_id=PAD, classifier_dropout=0.0))


def rows():
    """(input_ids, attention_mask, labels) of the three padded rows."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, 90, (len(SPANS), 13), generator=g)
    mask = torch.zeros_like(ids)
    for r, (first, end) in enumerate(SPANS):
        mask[r, first:end] = 1
    return ids.masked_fill(mask == 0, PAD), mask, torch.randint(0, LABELS, (len(SPANS),), generator=g)


def _values(out, head):
    if head == "QuestionAnswering":
        return torch.stack([out.start_logits, out.end_logits], dim=-1)
    return out.logits


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def sp_head_step(model, head, groups):
    from ulysses_kernels import hf as ukhf

    ids, mask, labels = rows()
    batch = ukhf.shard_batch(ids, groups, attention_mask=mask)
    values = _values(model(**batch.model_inputs()), head)
    if head == "SequenceClassification":
        loss = F.cross_entropy(values, labels)
        gathered = values
    else:
        loss = ukhf.global_mean_from_sum(values.square().sum(), batch.input_ids.numel(), groups)
        gathered = ukhf.gather_tokens(values, batch, groups)
    loss.backward()
    ukhf.allreduce_gradients(model, groups)
    return gathered.detach(), loss.detach(), _grads(model)


def reference_head_step(model, head):
    ids, mask, labels = rows()
    outs = [_values(model(input_ids=ids[r][mask[r] == 1].unsqueeze(0), use_cache=False), head)
            for r in range(ids.shape[0])]
    if head == "SequenceClassification":
        values = torch.cat(outs)
        loss = F.cross_entropy(values, labels)
    else:
        values = torch.zeros(*ids.shape, *outs[0].shape[2:], dtype=outs[0].dtype)
        for r, out in enumerate(outs):
            values[r, mask[r] == 1] = out[0]
        loss = values.square().sum() / mask.sum()
    loss.backward()
    return values.detach(), loss.detach(), _grads(model)


def head_error(got, want):
    """(largest relative error over the values, the loss and every gradient, where)."""
    values, loss, grads = got
    want_values, want_loss, want_grads = want
    if values.shape != want_values.shape:
        return float("inf"), f"values of shape {tuple(values.shape)}, not {tuple(want_values.shape)}"
    worst, where = largest_error((loss, grads), (want_loss, want_grads))
    value_error = float((values.double() - want_values.double()).norm() / want_values.double().norm())
    if not value_error < float("inf"):   # NaN compares false with everything: never exact
        return float("inf"), "values (not finite)"
    return (value_error, "values") if value_error > worst else (worst, where)


def run_case(case, groups):
    """("ran", step) | ("refused", message) | ("unbuilt", why) | ("raised", what) on this rank."""
    from sweep import _first_line, _where, build_outcome

    from ulysses_kernels.hf import NotSequenceParallelError

    model, outcome = build_outcome(lambda: build_head(case, "ulysses"))
    if outcome is not None:
        return outcome
    try:
        return ("ran", sp_head_step(model, case.split("/")[1], groups))
    except NotSequenceParallelError as error:
        return ("refused", str(error))
    except Exception as error:  # noqa: BLE001 - a finding, reported by the test
        return ("raised", _first_line(error) + " @ " + _where(error))


def reference_case(case):
    from family_cases import register_exact_eager
    from sweep import _first_line

    try:
        return ("ran", reference_head_step(build_head(case, register_exact_eager()), case.split("/")[1]))
    except Exception as error:  # noqa: BLE001 - the family's own single-device forward failed
        return ("unbuilt", f"single-device forward: {_first_line(error)}")


def head_sweep_worker(rank, world, cases, progress_dir):
    """Every case on this rank: {case: outcome}; a step that ran is compared here against
    the reference one rank computes and broadcasts (in turn, so both cores work)."""
    import os
    import time
    import warnings

    import torch.distributed as dist
    import transformers

    import ulysses_kernels as uk
    from ulysses_kernels import hf as ukhf

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    log = open(os.path.join(progress_dir, f"rank{rank}.log"), "a", buffering=1)
    groups = uk.init_sequence_parallel(world)
    ukhf.register(groups)
    out, ran = {}, 0
    for case in cases:
        log.write(f"{time.monotonic():.2f} {case}\n")
        outcome = run_case(case, groups)
        kinds = [None] * world
        dist.all_gather_object(kinds, outcome[0])
        if all(kind == "ran" for kind in kinds):
            owner, ran = ran % world, ran + 1
            shared = [reference_case(case) if rank == owner else None]
            dist.broadcast_object_list(shared, src=owner)
            reference = shared[0]
            outcome = reference if reference[0] == "unbuilt" else ("ran", *head_error(outcome[1], reference[1]))
        out[case] = outcome
    log.write("done\n")
    return out
