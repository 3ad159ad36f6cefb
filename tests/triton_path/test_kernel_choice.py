"""The attention kernel chooser (ulysses_kernels/triton_path/select.py): eligibility rules,
the timed choice with fake timings and its caches, the ULYSSES_KERNELS_ATTENTION override,
the SDPA backend on CPU (math) against float64 attention, the Ulysses Triton path running
SDPA on its receive buffer over gloo, and the doctor lines."""

import json
import os
import warnings

import pytest
import torch
from helpers import SPAWN_TIMEOUT, make_qkv, reference_with_grads, rel_err, shard

import ulysses_kernels as uk
from ulysses_kernels import env
from ulysses_kernels.launch import spawn
from ulysses_kernels.triton_path import select as sel
from ulysses_kernels.variants import make_variant

ALL = ("triton", "sdpa_cudnn", "sdpa_flash", "flash")


@pytest.fixture(autouse=True)
def clean_state(tmp_path, monkeypatch):
    """Each test: its own cache folder, empty in-process caches, no override, fresh warnings."""
    monkeypatch.setenv(sel.CACHE_DIR_VAR, str(tmp_path))
    monkeypatch.delenv(sel.ENV_VAR, raising=False)
    sel.clear_memory_cache()
    sel._warned.clear()
    yield
    sel.clear_memory_cache()


def key(**changes):
    base = dict(device="NVIDIA H200", dtype="bfloat16", head_dim=128, causal=False, varlen=False, bucket=4096,
                grad=True)
    base.update(changes)
    return sel.Key(**base)


def cands(k, q_len=4000, k_len=4000, **kw):
    return sel.candidates(k, q_len=q_len, k_len=k_len, backends=ALL, **kw)


# ------------------------------------------------------------------- eligibility

def test_every_backend_eligible_for_a_plain_bf16_call():
    assert cands(key()) == ALL
    assert cands(key(causal=True)) == ALL  # Sq == Sk: top-left and bottom-right agree


@pytest.mark.parametrize("changes,kw", [
    (dict(), dict(need_lse=True)),  # the ring merge needs the LSE: SDPA has none
    (dict(varlen=True), dict()),  # packed documents: our kernel only
    (dict(), dict(split_layout=True)),  # batch > 1 in the all-to-all buffer
    (dict(dtype="float32"), dict()),
    (dict(dtype="float64"), dict()),
    (dict(head_dim=12), dict()),  # not a multiple of 8
    (dict(), dict(q_len=0)),  # no rows: nothing to choose
])
def test_only_triton(changes, kw):
    assert cands(key(**changes), **kw) == ("triton",)


def test_causal_with_unequal_lengths_excludes_sdpa():
    # bottom-right causal: SDPA's top-left mask differs; flash_attn >= 2.1 agrees when no
    # query row is left without keys (Sq <= Sk).
    assert cands(key(causal=True), q_len=100, k_len=300) == ("triton", "flash")
    assert cands(key(causal=True), q_len=300, k_len=100) == ("triton",)
    assert cands(key(causal=False), q_len=300, k_len=100) == ALL


def test_variants_keep_only_kernels_that_compute_them():
    """flash_attn has window_size and softcap (bottom-right, our meaning); SDPA has
    neither; sinks and a value head dim of its own are ours only (choose never offers
    another backend for them, whatever the override)."""
    windowed = key(causal=True, variant=make_variant((255, -1), causal=True))
    assert cands(windowed) == ("triton", "flash")
    assert cands(key(variant=make_variant(softcap=30.0))) == ("triton", "flash")
    assert "window_size=(255,-1)" in windowed.text() and "window" not in key().text()


def test_sinks_and_value_head_dims_choose_our_kernel(monkeypatch):
    q, k = qk()
    monkeypatch.setenv(sel.ENV_VAR, "sdpa")
    assert sel.choose(q, k, causal=True) == "sdpa_cudnn"
    assert sel.choose(q, k, causal=True, sinks=True) == "triton"
    assert sel.choose(q, k, causal=True, value_dim=q.shape[-1] // 2) == "triton"
    assert sel.choose(q, k, causal=True, variant=make_variant((8, -1), causal=True)) == "triton"  # SDPA: no window


def test_head_dim_limits_and_availability():
    assert cands(key(head_dim=256)) == ("triton", "sdpa_flash", "flash")  # cuDNN: up to 128
    assert cands(key(head_dim=72)) == ALL
    assert sel.candidates(key(), q_len=8, k_len=8, backends=("triton", "sdpa_cudnn")) == ("triton", "sdpa_cudnn")
    assert "flash" not in sel.available("cpu")  # flash_attn needs CUDA


def test_bucket_and_key_text():
    assert [sel.bucket(n) for n in (1, 16, 17, 4096, 4097)] == [16, 16, 32, 4096, 8192]
    q = torch.zeros(1, 300, 4, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 500, 2, 64, dtype=torch.bfloat16)
    assert sel.key_for(q, k, causal=True, grad=True).text() == "cpu|bfloat16|d64|causal|dense|S512|fwd+bwd"


# -------------------------------------------------------- timed choice, caches

class FakeTimer:
    """Fake timings in ms per backend; counts the calls and can fail a backend."""

    def __init__(self, ms, fail=()):
        self.ms, self.fail, self.calls = ms, fail, []

    def __call__(self, name, fn):
        self.calls.append(name)
        fn()
        if name in self.fail:
            raise RuntimeError("No available kernel. Aborting execution.")
        return self.ms[name]


def test_pick_times_once_and_caches_in_process_and_on_disk(monkeypatch):
    timer = FakeTimer({"triton": 3.0, "sdpa_cudnn": 1.5, "sdpa_flash": 2.0})
    monkeypatch.setattr(sel, "timer", timer)
    built = []
    names = ("triton", "sdpa_cudnn", "sdpa_flash")
    assert sel.pick(key(), names, lambda n: built.append(n) or (lambda: None)) == "sdpa_cudnn"
    assert timer.calls == list(names) and built == list(names)
    assert sel.pick(key(), names, lambda n: None) == "sdpa_cudnn" and len(timer.calls) == 3  # in process
    sel.clear_memory_cache()  # a new process: the disk file answers
    assert sel.pick(key(), names, lambda n: None) == "sdpa_cudnn" and len(timer.calls) == 3
    entries = json.load(open(sel.cache_path()))["choices"]
    (entry,) = entries.values()
    assert entry == {"choice": "sdpa_cudnn", "ms": {"triton": 3.0, "sdpa_cudnn": 1.5, "sdpa_flash": 2.0}}
    # Another key (forward only) is timed on its own; the file keeps both.
    assert sel.pick(key(grad=False), names, lambda n: (lambda: None)) == "sdpa_cudnn"
    assert len(timer.calls) == 6 and len(sel.read_cache()) == 2
    assert not [f for f in os.listdir(os.path.dirname(sel.cache_path())) if f.endswith(".tmp")]


def test_corrupt_cache_is_ignored_and_rewritten(monkeypatch):
    os.makedirs(os.path.dirname(sel.cache_path()), exist_ok=True)
    with open(sel.cache_path(), "w") as f:
        f.write('{"choices": {"x": ')  # half a file
    timer = FakeTimer({"triton": 1.0, "flash": 2.0})
    monkeypatch.setattr(sel, "timer", timer)
    assert sel.read_cache() == {}
    assert sel.pick(key(), ("triton", "flash"), lambda n: (lambda: None)) == "triton"
    assert list(sel.read_cache().values()) == [{"choice": "triton", "ms": {"triton": 1.0, "flash": 2.0}}]


def test_failing_candidate_is_skipped_with_a_warning(monkeypatch):
    monkeypatch.setattr(sel, "timer", FakeTimer({"triton": 5.0, "sdpa_cudnn": 1.0, "sdpa_flash": 2.0},
                                                fail=("sdpa_cudnn",)))
    with pytest.warns(RuntimeWarning, match="sdpa_cudnn.*failed while timed"):
        assert sel.pick(key(), ("triton", "sdpa_cudnn", "sdpa_flash"), lambda n: (lambda: None)) == "sdpa_flash"


def test_no_timing_without_permission_or_choice(monkeypatch):
    timer = FakeTimer({})
    monkeypatch.setattr(sel, "timer", timer)
    assert sel.pick(key(), ("triton", "sdpa_flash"), lambda n: None, can_time=False) == "triton"
    assert sel.pick(key(), ("sdpa_flash",), lambda n: None) == "sdpa_flash"
    assert timer.calls == []


# ------------------------------------------------------------------ the override

def qk(dtype=torch.bfloat16, sq=32, sk=32, d=16):
    return torch.randn(1, sq, 4, d).to(dtype), torch.randn(1, sk, 2, d).to(dtype)


def test_override_values(monkeypatch):
    q, k = qk()
    assert sel.requested() == "auto"
    assert sel.choose(q, k, causal=True) == "triton"  # auto on CPU: no timing, our kernel
    for value, expected in (("triton", "triton"), ("sdpa", "sdpa_cudnn"), (" SDPA ", "sdpa_cudnn"), ("", "triton")):
        monkeypatch.setenv(sel.ENV_VAR, value)
        assert sel.choose(q, k, causal=True) == expected


def test_invalid_override_raises(monkeypatch):
    monkeypatch.setenv(sel.ENV_VAR, "cudnn")
    with pytest.raises(ValueError, match="ULYSSES_KERNELS_ATTENTION='cudnn' is not one of auto, triton, sdpa, flash"):
        sel.choose(*qk(), causal=False)


@pytest.mark.parametrize("value,dtype,kw", [
    ("sdpa", torch.float32, {}),  # fp32: ours only
    ("sdpa", torch.bfloat16, dict(need_lse=True)),
    ("sdpa", torch.bfloat16, dict(varlen=True)),
    ("flash", torch.bfloat16, {}),  # flash_attn never runs on CPU
])
def test_ineligible_override_falls_back_with_one_warning(monkeypatch, value, dtype, kw):
    monkeypatch.setenv(sel.ENV_VAR, value)
    q, k = qk(dtype)
    with pytest.warns(RuntimeWarning, match=f"{sel.ENV_VAR}={value} cannot run"):
        assert sel.choose(q, k, causal=False, **kw) == "triton"
    with warnings.catch_warnings():  # once: the second call is silent
        warnings.simplefilter("error")
        assert sel.choose(q, k, causal=False, **kw) == "triton"


def test_sdpa_override_causal_unequal_lengths_falls_back(monkeypatch):
    monkeypatch.setenv(sel.ENV_VAR, "sdpa")
    q, k = qk(sq=16, sk=32)
    with pytest.warns(RuntimeWarning):
        assert sel.choose(q, k, causal=True) == "triton"
    assert sel.choose(q, k, causal=False) == "sdpa_cudnn"


# ------------------------------------------------- SDPA on CPU against float64

def sdpa_case(B, S, Hq, Hkv, D, causal, dtype, scale, seed, name="sdpa_cudnn"):
    q, k, v, do = make_qkv(B, S, Hq, Hkv, D, dtype=dtype, seed=seed)
    ref = reference_with_grads(q, k, v, do, causal, softmax_scale=scale)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out = sel.run(name, q, k, v, causal=causal, softmax_scale=scale)
    out.backward(do)
    assert out.dtype == dtype and out.shape == (B, S, Hq, D)
    return [rel_err(got, r) for got, r in zip((out, q.grad, k.grad, v.grad), ref)]


@pytest.mark.parametrize("name", ["sdpa_cudnn", "sdpa_flash"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("B,S,Hq,Hkv,D,causal,scale", [
    (2, 37, 4, 4, 16, False, None),  # MHA, batch > 1
    (2, 37, 4, 2, 16, True, None),  # GQA, causal
    (1, 45, 6, 1, 32, True, 0.2),  # MQA, causal, custom scale
])
def test_sdpa_backend_matches_float64_reference(name, dtype, tol, B, S, Hq, Hkv, D, causal, scale):
    errors = sdpa_case(B, S, Hq, Hkv, D, causal, dtype, scale, seed=S + Hkv, name=name)
    assert max(errors) < tol, f"out, dq, dk, dv rel errors {errors}"


def test_sdpa_reads_strided_views():
    """The receive buffer case: q, k, v are channel slices of one `[1, S, Hq+2Hkv, D]` buffer."""
    buf = torch.randn(1, 40, 8, 16, dtype=torch.float32)
    q, k, v = buf[:, :, :4], buf[:, :, 4:6], buf[:, :, 6:]
    ref = uk.reference_attention(q.double(), k.double(), v.double(), causal=True)[0]
    assert rel_err(sel.run("sdpa_flash", q, k, v, causal=True), ref) < 1e-5


def test_flash_attention_goes_through_the_chooser(monkeypatch):
    """api.flash_attention on the Triton path asks the chooser; forced sdpa runs SDPA."""
    import ulysses_kernels.api as api

    monkeypatch.setattr(api, "resolve_path", lambda *a, **kw: "triton")  # the interpreter may be off
    monkeypatch.setenv(sel.ENV_VAR, "sdpa")
    q, k, v, _ = make_qkv(1, 33, 4, 2, 16, dtype=torch.bfloat16, seed=3)
    out = uk.flash_attention(q, k, v, causal=True)
    assert torch.equal(out, sel.run("sdpa_cudnn", q, k, v, causal=True))
    ref = uk.reference_attention(q.double(), k.double(), v.double(), causal=True)[0]
    assert rel_err(out, ref) < 2e-2


def test_deterministic_backward_keeps_our_kernel(monkeypatch):
    """A reproducible backward is asked for (`deterministic=True`, or the environment's
    default): only our kernel promises it, so the chooser keeps it for differentiated calls,
    and flash_attention hands `deterministic` to it."""
    q, k, _, _ = make_qkv(1, 40, 4, 2, 16, dtype=torch.bfloat16, seed=4)
    key = sel.key_for(q, k, causal=True, grad=True)
    assert sel.candidates(key, q_len=40, k_len=40, deterministic=True, backends=ALL) == ("triton",)
    assert "sdpa_cudnn" in sel.candidates(key, q_len=40, k_len=40, deterministic=False, backends=ALL)
    forward_only = sel.key_for(q, k, causal=True, grad=False)  # no backward: determinism is moot
    assert "sdpa_cudnn" in sel.candidates(forward_only, q_len=40, k_len=40, deterministic=True, backends=ALL)
    monkeypatch.setenv(sel.ENV_VAR, "sdpa")
    sel._warned.clear()
    qg = q.clone().requires_grad_(True)
    with pytest.warns(RuntimeWarning, match="using the Triton kernel"):
        assert sel.choose(qg, k, causal=True, grad=True, deterministic=True) == "triton"
    monkeypatch.setenv(env.DETERMINISTIC.name, "1")  # the default of `deterministic`
    sel._warned.clear()
    with pytest.warns(RuntimeWarning, match="using the Triton kernel"):
        assert sel.choose(qg, k, causal=True, grad=True) == "triton"
    assert sel.choose(q, k, causal=True, grad=False) == "sdpa_cudnn"  # the forward alone may be SDPA's
    import ulysses_kernels.api as api

    seen = []
    monkeypatch.setattr(api, "resolve_path", lambda *a, **kw: "triton")
    monkeypatch.setattr(sel, "run", lambda name, *a, **kw: seen.append((name, kw["deterministic"])) or a[0])
    uk.flash_attention(qg, k, k, causal=True, deterministic=True)
    uk.flash_attention(qg, k, k, causal=True, deterministic=False)
    assert seen == [("triton", True), ("sdpa_cudnn", False)]


# ------------------------------------------ Ulysses Triton path running SDPA (gloo)

def sdpa_ulysses_worker(rank, world, cases):
    """ulysses_attention(backend="triton") fwd+bwd with ULYSSES_KERNELS_ATTENTION=sdpa; also
    reports which kernels the chooser picked on this rank."""
    os.environ[sel.ENV_VAR] = "sdpa"
    picked = []
    choose = sel.choose
    sel.choose = lambda *a, **kw: picked.append(choose(*a, **kw)) or picked[-1]
    results = []
    for case in cases:
        q, k, v, do = make_qkv(1, case["S"], case["Hq"], case["Hkv"], 16, dtype=torch.bfloat16, seed=case["seed"])
        ql, kl, vl = (shard(t, world, rank).requires_grad_(True) for t in (q, k, v))
        out = uk.ulysses_attention(ql, kl, vl, causal=case["causal"], backend="triton")
        out.backward(shard(do, world, rank))
        results.append({"out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad})
    return {"results": results, "picked": picked}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_ulysses_triton_path_with_sdpa_kernel(world):
    """Batch 1: the receive buffer rows are a strided [1, S, H, D] tensor that SDPA reads in
    place; the backward replays SDPA's autograd graph. GQA split and replicated KV heads."""
    Hq = 2 * world
    cases = [dict(S=37, Hq=Hq, Hkv=world, causal=True, seed=1), dict(S=29, Hq=Hq, Hkv=1, causal=False, seed=2),
             dict(S=41, Hq=Hq, Hkv=1, causal=True, seed=3)]
    per_rank = spawn(sdpa_ulysses_worker, world, args=(cases,), timeout=SPAWN_TIMEOUT)
    assert all(r["picked"] == ["sdpa_cudnn"] * len(cases) for r in per_rank)
    for i, case in enumerate(cases):
        q, k, v, do = make_qkv(1, case["S"], case["Hq"], case["Hkv"], 16, dtype=torch.bfloat16, seed=case["seed"])
        ref = reference_with_grads(q, k, v, do, case["causal"])
        for name, r in zip(("out", "dq", "dk", "dv"), ref):
            got = torch.cat([per_rank[p]["results"][i][name] for p in range(world)], dim=1)
            assert got.dtype == torch.bfloat16
            assert rel_err(got, r) < 2e-2, f"case {case} {name}"


# ------------------------------------------------------------------------ doctor

def test_doctor_prints_the_chooser(monkeypatch, capsys):
    from ulysses_kernels import cli, extensions

    monkeypatch.setattr(sel, "timer", FakeTimer({"triton": 2.0, "sdpa_flash": 1.0}))
    sel.pick(key(), ("triton", "sdpa_flash"), lambda n: (lambda: None))
    monkeypatch.setattr(extensions, "load_extension", lambda: (None, "skipped in this test"))
    monkeypatch.setenv(sel.ENV_VAR, "flash")
    assert cli.doctor(None) == 0
    out = capsys.readouterr().out
    assert f"{sel.ENV_VAR}=flash" in out
    assert "sdpa_cudnn, sdpa_flash" in out and sel.cache_path() in out and "(1 choices)" in out
    assert "NVIDIA H200|bfloat16|d128|full|dense|S4096|fwd+bwd|triton,sdpa_flash" in out
    assert "sdpa_flash (sdpa_flash 1 ms, triton 2 ms)" in out
    monkeypatch.setenv(sel.ENV_VAR, "fastest")
    cli.doctor(None)
    assert "INVALID" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_auto_choice_times_caches_and_matches_reference(causal):
    """On the device: `auto` times the eligible backends once (real CUDA timing), writes the
    choice to the disk cache, and the chosen kernel's output and gradients match float64."""
    q, k, v, do = make_qkv(1, 2048, 8, 2, 128, dtype=torch.bfloat16, seed=5, device="cuda")
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    name = sel.choose(q, k, causal=causal, grad=True)
    assert name in sel.candidates(sel.key_for(q, k, causal=causal, grad=True), q_len=2048, k_len=2048)
    entries = sel.read_cache()
    assert len(entries) == 1 and next(iter(entries.values()))["choice"] == name
    assert all(ms > 0 for ms in next(iter(entries.values()))["ms"].values())
    out = sel.attention(q, k, v, causal=causal)
    out.backward(do)
    ref_out, *ref_grads = reference_with_grads(q, k, v, do, causal)
    assert rel_err(out, ref_out) < 2e-2
    for got, want in zip((q.grad, k.grad, v.grad), ref_grads):
        assert rel_err(got, want) < 2e-2
