"""The families sweep: every causal LM family transformers ships (its
`MODEL_FOR_CAUSAL_LM_MAPPING`), built tiny in float64 (tiny_models.py), one training step
at SP 2 through `register` / `attn_implementation="ulysses"` / `shard_batch` /
`causal_lm_loss` / `allreduce_gradients`, on one uneven document and on two packed
documents, against the same weights on one process (sweep.py).

Every family must be exact (loss and every parameter gradient) or refused with
`NotSequenceParallelError` on every rank; nothing silently wrong, nothing raised on some
ranks only, no other error, no hang. What each family does is pinned in
`sweep_outcomes.json`, per supported transformers minor version (a change shows up here; a
minor without an entry is one nobody has swept yet), and listed with the reasons in
docs/hf_families.md ("Model families: the sweep", the newest pinned version).
"""

import json
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="ulysses_kernels.hf needs Hugging Face transformers "
                                           "(pip install -e '.[hf]' in the checkout)")

from helpers import ROOT  # noqa: E402
from sweep import sweep_worker  # noqa: E402

from ulysses_kernels.launch import spawn  # noqa: E402

OUTCOMES = Path(__file__).parent.parent / "sweep_outcomes.json"
# float64 throughout, but some families compute parts in float32 whatever the weights'
# dtype (RMSNorm, routers): measured up to ~1e-7 there. A shard-local token mixer is off
# by 1e-5 .. 1 (the sweep: loss 1e-5 to 4e-2, gradients 20% to 100%).
TOLERANCE = 1e-6
# Measured on 2 cores: the two ranks run every family in about 60 s.
SWEEP_TIMEOUT = 420


def pinned_outcomes(version=None, path=OUTCOMES):
    """{case: outcome} pinned in `path` for transformers `version` (a minor such as "5.25";
    None: the installed one)."""
    import transformers

    by_version = json.loads(path.read_text())
    version = version or ".".join(transformers.__version__.split(".")[:2])
    assert version in by_version, (f"{path.name} pins no outcomes for transformers {version} (pinned: "
                                   f"{sorted(by_version)}): run its sweep on it and pin what it prints")
    return by_version[version]


def newest_pinned_version(path=OUTCOMES):
    return max(json.loads(path.read_text()), key=lambda v: tuple(int(part) for part in v.split(".")))


def sweep_families():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def classify(model_type, per_rank):
    """(outcome, detail) of one family from every rank's outcome (sweep.py)."""
    outcomes = [results[model_type] for results in per_rank]
    kinds = {o[0] for o in outcomes}
    if len(kinds) > 1:
        return "some ranks only", "; ".join(f"rank {r}: {o[0]} {str(o[1])[:200]}" for r, o in enumerate(outcomes))
    kind = kinds.pop()
    if kind in ("unbuilt", "refused", "raised"):
        messages = {o[1] for o in outcomes}
        if kind == "refused" and len(messages) > 1:
            return "some ranks only", " | ".join(sorted(messages))
        return kind, outcomes[0][1]
    rank, (_, worst, where) = max(enumerate(outcomes), key=lambda entry: entry[1][1])
    if worst < TOLERANCE:
        return "exact", f"largest error {worst:.1e}"
    return "wrong", f"{worst:.1e} at {where}, rank {rank}"


def run_sweep(model_types, progress_dir):
    start = time.monotonic()
    try:
        per_rank = spawn(sweep_worker, 2, args=(model_types, str(progress_dir)), timeout=SWEEP_TIMEOUT,
                         start_method="forkserver", preload=["torch", "transformers", "ulysses_kernels.hf"])
    except TimeoutError as error:
        logs = {p.name: p.read_text().splitlines()[-1:] for p in Path(progress_dir).glob("rank*.log")}
        raise AssertionError(f"the sweep hung or ran past {SWEEP_TIMEOUT} s; last step per rank: {logs}") from error
    return per_rank, time.monotonic() - start


@pytest.mark.slow
def test_every_family_is_exact_or_refused_on_every_rank(tmp_path):
    model_types = sweep_families()
    per_rank, seconds = run_sweep(model_types, tmp_path)
    report = {model_type: classify(model_type, per_rank) for model_type in model_types}
    counts = {}
    for outcome, _ in report.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    lines = [f"{m:28s} {o:16s} {d}" for m, (o, d) in sorted(report.items())]
    print(f"\nsweep of {len(model_types)} families in {seconds:.0f} s: {counts}\n" + "\n".join(lines))
    bad = {m: r for m, r in report.items() if r[0] not in ("exact", "refused", "unbuilt")}
    assert not bad, "families neither exact nor refused on every rank:\n" + "\n".join(
        f"{m}: {o}: {d}" for m, (o, d) in sorted(bad.items()))
    pinned = pinned_outcomes()
    changed = {m: (pinned.get(m), o) for m, (o, _) in report.items() if pinned.get(m) != o}
    assert not changed, f"outcomes differ from {OUTCOMES.name} (pinned, now): {changed}"


def test_the_pinned_outcomes_cover_this_transformers():
    """sweep_outcomes.json names every family of the installed transformers, and the
    families people train are among the exact ones, in every pinned version."""
    assert sorted(pinned_outcomes()) == sweep_families()
    for version, pinned in json.loads(OUTCOMES.read_text()).items():
        for family in ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "gpt_oss", "deepseek_v3",
                       "llama4_text"):
            assert pinned[family] == "exact", (version, family)
        assert set(pinned.values()) <= {"exact", "refused", "unbuilt"}, version


def test_docs_list_every_refused_and_unbuilt_family():
    """docs/hf_families.md's sweep table has a row for every family of the newest pinned transformers,
    with its pinned outcome."""
    pinned = pinned_outcomes(newest_pinned_version())
    text = (ROOT / "docs" / "hf_families.md").read_text()
    table = text[text.index("## Model families: the sweep"):]
    table = table[:table.index("\n## ", 1)] if "\n## " in table[1:] else table
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2 and cells[0] not in ("outcome", "---"):
            for family in cells[1].split(","):
                if family.strip():
                    rows[family.strip().strip("`")] = cells[0]
    assert {m: o for m, o in pinned.items() if rows.get(m) != o} == {}


def test_tiny_models_keep_every_layer_kind():
    """The layer selection keeps a hybrid hybrid: Qwen3-Next's tiny model has a linear-attention
    and a full-attention layer; Llama 4's a chunked and a full one (tiny_models.py)."""
    from tiny_models import tiny_config

    assert set(tiny_config("qwen3_next").layer_types) == {"linear_attention", "full_attention"}
    llama4 = tiny_config("llama4_text")
    assert set(llama4.layer_types) == {"chunked_attention", "full_attention"}
    assert llama4.attention_chunk_size < 23 and llama4.num_hidden_layers == len(llama4.layer_types)
    assert torch.get_default_dtype() == torch.float32
