"""Hugging Face transformers integration (ulysses_kernels.hf) on CPU with gloo.

Sequence-parallel runs (SP = 2 and 4) of tiny random Llama / Qwen2 / Qwen3 GQA models must
equal a single-process eager run of the same model and batch: logits, loss and every
parameter gradient (float32, relative error < 1e-5).
"""

import pytest
import torch

pytest.importorskip("transformers", reason="ulysses_kernels.hf needs Hugging Face transformers "
                                           "(pip install 'ulysses-kernels[hf]')")

import _hf_cases  # noqa: E402
from _helpers import rel_err  # noqa: E402
from ulysses_kernels import hf as ukhf  # noqa: E402
from ulysses_kernels.launch import spawn  # noqa: E402

TIMEOUT = 240  # seconds per spawn
TOL = 1e-5


def _grad_errors(got, ref, tol=TOL):
    # Gradients are compared relative to their own norm, with a floor at 1e-6 of the
    # largest gradient norm (a parameter whose true gradient is ~0 would otherwise
    # compare float noise with float noise).
    floor = 1e-6 * max(g.norm().item() for g in ref.values())
    bad = []
    assert set(got) == set(ref), (sorted(set(got) ^ set(ref)))
    for name, r in ref.items():
        g = got[name]
        err = (g.double() - r.double()).norm().item() / max(r.double().norm().item(), floor)
        if not err < tol:
            bad.append(f"{name}: rel err {err:.2e}")
    return bad


SP_CASES = [
    # length not divisible by 2 or 4, two packed documents
    dict(kind="llama", S=37, doc_lens=[10, 27], batch_seed=1),
    # a single document, batch of 2
    dict(kind="qwen2", S=30, B=2, batch_seed=2),
    # three packed documents, tiled MLP + tiled loss + activation checkpointing
    dict(kind="qwen3", S=33, doc_lens=[5, 17, 11], batch_seed=3, tiled=True, checkpointing=True),
    # no helper kwargs: the attention gathers the position ids itself
    dict(kind="llama", S=26, doc_lens=[13, 1, 12], batch_seed=4, fallback_positions=True),
]

DP_SEQS = [dict(seed=11, S=29, doc_lens=[12, 17]), dict(seed=12, S=29)]
DP_MODES = ["fsdp_world_tiled", "fsdp_sp", "ddp", "manual"]
DP_STEPS = 3

# One spawn per world size (process start-up dominates on CPU); the tests share it.
_JOBS = {
    2: [("sp", (SP_CASES,)), ("errors", ()),
        ("example", (["--sp", "2", "--seq-len", "97", "--steps", "3", "--tiled", "--checkpointing",
                      "--parallel", "fsdp"],))],
    4: [("sp", (SP_CASES,)), ("dp_sp", (2, DP_MODES, DP_STEPS, DP_SEQS))],
}
_RESULTS = {}


def _run(world):
    if world not in _RESULTS:
        try:
            _RESULTS[world] = spawn(_hf_cases.run_jobs, world, args=(_JOBS[world],), timeout=TIMEOUT)
        except Exception as exc:  # report the same failure in every test that needs it
            _RESULTS[world] = exc
    if isinstance(_RESULTS[world], Exception):
        raise _RESULTS[world]
    return _RESULTS[world]


@pytest.mark.parametrize("world", [2, 4])
def test_sp_matches_single_process(world):
    per_rank = [r["sp"] for r in _run(world)]
    failures = []
    for i, case in enumerate(SP_CASES):
        logits, loss, grads = _hf_cases.reference(case)
        for r in range(world):
            err = rel_err(per_rank[r][i]["loss"], loss)
            if not err < TOL:
                failures.append(f"case {i} rank {r} loss {per_rank[r][i]['loss']} vs {loss}: {err:.2e}")
        if "logits" in per_rank[0][i]:
            got = torch.cat([per_rank[r][i]["logits"] for r in range(world)], dim=1)
            err = rel_err(got, logits)
            if not err < TOL:
                failures.append(f"case {i} logits rel err {err:.2e}")
        for r in range(world):  # after the SP all-reduce every rank holds the full gradient
            failures += [f"case {i} rank {r} {m}" for m in _grad_errors(per_rank[r][i]["grads"], grads)]
    assert not failures, "\n".join(failures)


def test_unsupported_masks_raise_on_every_rank():
    per_rank = [r["errors"] for r in _run(2)]
    for r, rep in enumerate(per_rank):
        msg = rep["padding_one_rank"] or ""
        assert "padding" in msg or "another rank" in msg, (r, msg)
        assert rep["all_ones_ok"]
        assert rep["custom_4d"] and "mask" in rep["custom_4d"], rep["custom_4d"]
        assert rep["sliding"] and "sliding-window" in rep["sliding"], rep["sliding"]
        assert rep["dropout"] and "dropout" in rep["dropout"], rep["dropout"]
    ref_logits, _, _ = _hf_cases.reference(dict(kind="llama", S=21, batch_seed=1))
    got = torch.cat([rep["after"] for rep in per_rank], dim=1)
    assert rel_err(got, ref_logits) < TOL


def test_dp_x_sp_fsdp_ddp_match_and_train():
    """World 4 = DP 2 x SP 2: FSDP2 sharded over the whole world (with tiling), FSDP2 HSDP
    (sharded inside SP groups), DDP and manual all-reduces all give the first-step gradients
    of the single-process mean over the two DP batches, and the loss decreases."""
    per_rank = [r["dp_sp"] for r in _run(4)]
    # reference: mean over the DP groups of the single-process gradients of each batch
    refs = [_hf_cases.reference(dict(kind="llama", S=s["S"], doc_lens=s.get("doc_lens"), batch_seed=s["seed"]))
            for s in DP_SEQS]
    ref_loss = sum(r[1] for r in refs) / len(refs)
    ref_grads = {n: sum(r[2][n] for r in refs) / len(refs) for n in refs[0][2]}
    failures = []
    for mode in DP_MODES:
        for r in range(4):
            res = per_rank[r][mode]
            if not abs(res["losses"][0] - ref_loss.item()) < 1e-5 * abs(ref_loss.item()):
                failures.append(f"{mode} rank {r}: first loss {res['losses'][0]} vs {ref_loss.item()}")
            failures += [f"{mode} rank {r} {m}" for m in _grad_errors(res["grads"], ref_grads)]
            if not all(b < a for a, b in zip(res["losses"], res["losses"][1:])):
                failures.append(f"{mode} rank {r}: loss did not decrease: {res['losses']}")
    assert not failures, "\n".join(failures)


def test_example_train_hf_runs():
    losses = [r["example"] for r in _run(2)]
    assert losses[0] == losses[1] and len(losses[0]) == 3
    assert all(torch.isfinite(torch.tensor(losses[0]))) and losses[0][-1] < losses[0][0], losses[0]


# ------------------------------------------------------------- single-process units

def test_shard_batch_shifts_before_sharding():
    ids = torch.arange(11).unsqueeze(0) + 100
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2]])
    b = ukhf.shard_batch(ids, None, position_ids=pos)
    assert b.labels.tolist() == [[*range(101, 111), -100]]
    assert b.cu_seqlens.tolist() == [0, 3, 8, 11]
    m = ukhf.shard_batch(ids, None, position_ids=pos, mask_document_ends=True)
    assert m.labels[0, 2] == -100 and m.labels[0, 7] == -100 and m.labels[0, 3] == 104


def test_cu_seqlens_from_position_ids():
    assert ukhf.cu_seqlens_from_position_ids(torch.arange(7)[None]) is None
    assert ukhf.cu_seqlens_from_position_ids(torch.tensor([[5, 6, 0, 1, 0]])).tolist() == [0, 2, 4, 5]
    with pytest.raises(ValueError, match="batch size 1"):
        ukhf.cu_seqlens_from_position_ids(torch.tensor([[0, 1, 0], [0, 1, 2]]))


def _mlp():
    cfg = _hf_cases.make_config("llama")
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    return LlamaMLP(cfg)


@pytest.mark.parametrize("tile", [1, 4, 7, 64])
def test_tiled_mlp_matches_plain(tile):
    mlp = _mlp()
    x = torch.randn(2, 23, 64, requires_grad=True)
    gy = torch.randn(2, 23, 64)
    y = mlp(x)
    y.backward(gy)
    ref = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    yt = ukhf.tiled_mlp(mlp, x, tile)
    yt.backward(gy)
    assert rel_err(yt, y) < 1e-6
    got = [x.grad] + [p.grad for p in mlp.parameters()]
    for a, b in zip(got, ref):
        assert rel_err(a, b) < 1e-6


@pytest.mark.parametrize("tile", [1, 5, 64])
def test_tiled_cross_entropy_matches_plain(tile):
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 97, bias=False)
    h = torch.randn(2, 19, 64, requires_grad=True)
    labels = torch.randint(0, 97, (2, 19))
    labels[0, :4] = -100
    logits = head(h).float()
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 97), labels.reshape(-1), reduction="sum")
    ref.backward()
    rh, rw = h.grad.clone(), head.weight.grad.clone()
    h.grad = None
    head.weight.grad = None
    got = ukhf.tiled_cross_entropy_sum(h, head, labels, tile_tokens=tile)
    (got * 0.5).backward()
    assert rel_err(got, ref) < 1e-6
    assert rel_err(h.grad, rh * 0.5) < 1e-6
    assert rel_err(head.weight.grad, rw * 0.5) < 1e-6


def test_patched_model_single_process_with_checkpointing():
    ukhf.register(None)
    ref = _hf_cases.make_model("llama", "eager")
    model = _hf_cases.make_model("llama", "ulysses")
    ukhf.patch_model(model, mlp_tile_tokens=3, loss_tile_tokens=4)
    _hf_cases.enable_checkpointing(model)
    ids, pos = _hf_cases.make_batch(7, 19, [9, 10])
    loss_ref = ref(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss
    loss_ref.backward()
    loss = ukhf.causal_lm_loss(model, ukhf.shard_batch(ids, None, position_ids=pos))
    loss.backward()
    assert rel_err(loss, loss_ref) < TOL
    got = {n: p.grad for n, p in model.named_parameters()}
    want = {n: p.grad for n, p in ref.named_parameters()}
    assert not _grad_errors(got, want)
    ukhf.unpatch_model(model)
    assert not hasattr(model.model.layers[0].mlp, "_ulysses_orig_forward")
