"""The families sweep (tests/hf/families/test_hf_sweep.py): every causal LM family transformers
ships, built tiny (tiny_models.py), one training step at SP 2 through the documented calls
against the same weights on one process, in float64.

Two cases per family: one document of uneven length (23 tokens: shards of 12 and 11) and
two packed documents (9 + 14 tokens). Every rank returns, per family, what happened:

* ``("unbuilt", why)``: no tiny CPU build (the same on every rank: the build is local);
* ``("refused", message)``: `ulysses_kernels.hf` raised its `NotSequenceParallelError`;
* ``("raised", message)``: anything else raised (an incidental error: a finding);
* ``("ran", error, where)``: the step ran on every rank; its largest relative error (the
  loss and every parameter gradient, summed over the SP group by `allreduce_gradients`)
  against the single-device reference (`reference_step`: eager attention with a float64
  softmax, each packed document on its own), which one rank computes and broadcasts.
"""

import contextlib
import os
import time
import traceback
import warnings

import torch

VOCAB = 96
S = 23
DOCUMENTS = {"one uneven document": None, "two packed documents": [9, 14]}


def batch_ids(seed: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, S), generator=g)


def positions(documents):
    if documents is None:
        return torch.arange(S).unsqueeze(0)
    return torch.cat([torch.arange(n) for n in documents]).unsqueeze(0)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def reference_step(model, documents):
    """One step on one process: (mean loss over every target, {name: grad}); each document
    on its own, the last token of a document predicting the next one's first (shard_batch's
    rule), the loss weighted by the targets of the whole batch."""
    ids = batch_ids()
    bounds = [0] + [int(b) for b in torch.tensor(documents).cumsum(0)] if documents else [0, S]
    loss = 0.0
    for start, stop in zip(bounds[:-1], bounds[1:]):
        labels = torch.full((1, stop - start), -100)
        labels[:, :-1] = ids[:, start + 1:stop]
        if stop < S:
            labels[:, -1] = ids[:, stop]
        logits = model(input_ids=ids[:, start:stop], use_cache=False).logits
        loss = loss + torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(),
                                                        labels.reshape(-1), ignore_index=-100,
                                                        reduction="sum") / (S - 1)
    loss.backward()
    return loss.detach(), _grads(model)


def sp_step(model, documents, groups):
    from ulysses_kernels import hf as ukhf

    batch = ukhf.shard_batch(batch_ids(), groups, position_ids=positions(documents))
    loss = ukhf.causal_lm_loss(model, batch, groups)
    loss.backward()
    ukhf.allreduce_gradients(model, groups)
    return loss.detach(), _grads(model)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def build_outcome(build):
    """(model, None) from `build()`, or (None, outcome): ("unbuilt", why) when the family
    cannot be built tiny, ("refused", message) when it is refused at load time (an
    attention table of its own)."""
    from tiny_models import CannotBuildTiny

    from ulysses_kernels.hf import NotSequenceParallelError

    try:
        return build(), None
    except CannotBuildTiny as error:
        return None, ("unbuilt", str(error))
    except NotSequenceParallelError as error:
        return None, ("refused", str(error))
    except Exception as error:  # noqa: BLE001 - the family's own construction failed
        return None, ("unbuilt", f"construction: {_first_line(error)}")


# Families with float32 islands whatever the weights' dtype that sum over tokens, so that P ranks
# and one process differ by float32 rounding, beyond 1e-6 (the hyper-connections of HY-V4: 2.3e-6
# on their scale's gradient, 6.8e-8 with them in float64; of DeepSeek-V4: 1.6e-5, 8.3e-8): both
# sides run them in float64 (family_cases.hf_keeps_float64). Qwen4-Exp's Gated DeltaNet rule
# computes in float32: 4.2e-6 at SP 3 with its n-gram embeddings' convolution drawn at random.
FLOAT32_ISLANDS = ("hy_v4", "deepseek_v4", "qwen4_exp", "qwen4_exp_text")


def numerics(model_type):
    """The context both sides of a family's comparison run in (FLOAT32_ISLANDS)."""
    from family_cases import hf_keeps_float64

    return hf_keeps_float64() if model_type in FLOAT32_ISLANDS else contextlib.nullcontext()


def run_family(model_type, groups, progress):
    """What one family does on this rank (see the module doc)."""
    with numerics(model_type):
        return _run_family(model_type, groups, progress)


def _run_family(model_type, groups, progress):
    from tiny_models import build_tiny_model

    from ulysses_kernels.hf import NotSequenceParallelError

    model, outcome = build_outcome(lambda: build_tiny_model(model_type, "ulysses"))
    if outcome is not None:
        return outcome
    results = {}
    for case, documents in DOCUMENTS.items():
        progress(f"{model_type} / {case}")
        model.zero_grad(set_to_none=True)
        try:
            results[case] = sp_step(model, documents, groups)
        except NotSequenceParallelError as error:
            return ("refused", str(error))
        except Exception as error:  # noqa: BLE001 - a finding, reported by the test
            return ("raised", _first_line(error) + " @ " + _where(error))
    return ("ran", results)


def _where(error):
    frame = traceback.extract_tb(error.__traceback__)[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno}"


def references(model_type, mine: bool = True):
    """Single-device references of both cases ("ran", {case: step}), or ("unbuilt", why)."""
    with numerics(model_type):
        return _references(model_type)


def _references(model_type):
    from family_cases import register_exact_eager
    from tiny_models import build_tiny_model

    name = register_exact_eager()
    model = build_tiny_model(model_type, name)
    out = {}
    for case, documents in DOCUMENTS.items():
        model.zero_grad(set_to_none=True)
        try:
            out[case] = reference_step(model, documents)
        except Exception as error:  # noqa: BLE001 - the family's own single-device forward failed
            return ("unbuilt", f"single-device forward: {_first_line(error)}")
    return ("ran", out)


def largest_error(got, want):
    """(the largest relative error over the loss and every parameter gradient, where). A
    gradient that is zero in exact arithmetic (a key bias: softmax ignores a shift shared
    by every key) is rounding noise on both sides: its error is measured against a floor
    of 1e-6 of the model's largest gradient."""
    loss, grads = got
    want_loss, want_grads = want
    errors = {"loss": float((loss.double() - want_loss.double()).abs() / want_loss.double().abs())}
    missing = sorted(set(want_grads) - set(grads))
    if missing:
        errors[f"no gradient for {missing[0]}"] = float("inf")
    floor = 1e-6 * max([float(g.double().norm()) for g in want_grads.values()] + [1e-30])
    for name, g in want_grads.items():
        if name in grads:
            diff = float((grads[name].double() - g.double()).norm())
            errors[name] = diff / max(float(g.double().norm()), floor)
    not_finite = [name for name, e in errors.items() if e != e or e == float("inf")]
    if not_finite:   # NaN compares false with everything: name it as the worst, never as exact
        return float("inf"), f"{not_finite[0]} (not finite)"
    worst = max(errors, key=errors.get)
    return errors[worst], worst


def compare(outcome, reference):
    """This rank's ("ran", {case: step}) against the reference -> ("ran", error, where), or
    ("unbuilt", why) when the single-device forward itself fails."""
    if reference[0] == "unbuilt":
        return reference
    worst, where = 0.0, ""
    for case in DOCUMENTS:
        err, name = largest_error(outcome[1][case], reference[1][case])
        if err > worst:
            worst, where = err, f"{case}, {name}"
    return ("ran", worst, where)


def sweep_worker(rank, world, model_types, progress_dir):
    """Every family on this rank: {model_type: outcome}, small: a step that ran is compared
    here, against the reference one rank computes and broadcasts (every other family on
    each rank, so both cores work)."""
    import torch.distributed as dist
    import transformers

    import ulysses_kernels as uk
    from ulysses_kernels import hf as ukhf

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.set_default_dtype(torch.float32)
    log = open(os.path.join(progress_dir, f"rank{rank}.log"), "a", buffering=1)

    def progress(what):
        log.write(f"{time.monotonic():.2f} {what}\n")

    groups = uk.init_sequence_parallel(world)
    ukhf.register(groups)
    out, ran = {}, 0
    for model_type in model_types:
        outcome = run_family(model_type, groups, progress)
        kinds = [None] * world
        dist.all_gather_object(kinds, outcome[0])   # every rank ran it: compare; else report as is
        if all(kind == "ran" for kind in kinds):
            owner = ran % world
            ran += 1
            progress(f"{model_type} / reference")
            shared = [references(model_type, mine=True) if rank == owner else None]
            dist.broadcast_object_list(shared, src=owner)
            outcome = compare(outcome, shared[0])
        out[model_type] = outcome
    progress("done")
    return out
