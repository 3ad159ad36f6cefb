"""Path selection (ulysses_kernels/distributed/dispatch.py): `resolve_backend` (a pure function of
the request, the device and each faster path's problem) and `api.resolve_path`, which
asks the paths themselves."""

import warnings

import pytest
import torch
from helpers import make_qkv

import ulysses_kernels as uk
from ulysses_kernels import env, fused, triton_path
from ulysses_kernels.api import PATHS, resolve_path
from ulysses_kernels.distributed import dispatch

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
ENV_VAR = env.BACKEND.name


class _FakePath:
    """A path whose problem is fixed; `calls` records which paths were asked."""

    def __init__(self, name, answer, calls):
        self.name, self.answer, self.calls = name, answer, calls

    def problem(self, device, tensors):
        if self.calls is not None:
            self.calls.append(self.name)
        return self.answer


def _problems(triton=None, fused=None, calls=None):
    """A paths mapping whose problems are fixed."""
    return {"triton": _FakePath("triton", triton, calls), "fused": _FakePath("fused", fused, calls)}


# ---------------------------------------------------------------- the pure rules

def test_auto_prefers_fused_then_triton_then_reference(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    pick = dispatch.resolve_backend
    assert pick(None, CUDA, distributed=True, paths=_problems()) == "fused"
    assert pick("auto", CUDA, distributed=True, paths=_problems()) == "fused"
    assert pick(None, CUDA, distributed=False, paths=_problems()) == "triton"  # fused means an exchange
    assert pick(None, CUDA, distributed=True, paths=_problems(fused="no")) == "triton"
    with pytest.warns(UserWarning, match="reference path"):
        assert pick(None, CUDA, distributed=True, paths=_problems(triton="no", fused="no")) == "reference"
        assert pick(None, CUDA, distributed=False, paths=_problems(triton="no")) == "reference"


def test_a_cuda_call_on_the_reference_path_warns_once_per_reason(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(dispatch, "_WARNED_REFERENCE_ON_CUDA", set())
    pick = dispatch.resolve_backend
    with pytest.warns(UserWarning) as record:
        for _ in range(3):
            pick(None, CUDA, distributed=False, paths=_problems(triton="cannot run float64 inputs"))
        pick(None, CUDA, distributed=True, paths=_problems(triton="has no kernel for head dim 512", fused="no"))
    messages = [str(w.message) for w in record]
    assert len(messages) == 2, messages
    assert "backend='triton' cannot run float64 inputs" in messages[0]
    assert "head dim 512" in messages[1] and "backend='reference' chooses it without this warning" in messages[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pick("reference", CUDA, distributed=False, paths=_problems(triton="no")) == "reference"
        assert pick(None, CPU, distributed=False, paths=_problems(triton="no")) == "reference"


def test_auto_on_cpu_is_reference_without_asking(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    calls = []
    for distributed in (False, True):
        assert dispatch.resolve_backend(None, CPU, distributed=distributed, paths=_problems(calls=calls)) == \
            "reference"
    assert calls == []


def test_forced_paths(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    calls = []
    problems = _problems(triton="cannot run these inputs: test", fused="needs CUDA tensors, got cpu", calls=calls)
    assert dispatch.resolve_backend("reference", CUDA, distributed=True, paths=problems) == "reference"
    assert calls == []  # the reference path runs anything: nobody is asked
    with pytest.raises(RuntimeError, match="^backend='triton' cannot run these inputs: test$"):
        dispatch.resolve_backend("triton", CUDA, distributed=False, paths=problems)
    with pytest.raises(RuntimeError, match="^backend='fused' needs CUDA tensors, got cpu$"):
        dispatch.resolve_backend("fused", CPU, distributed=True, paths=problems)
    assert dispatch.resolve_backend("fused", CPU, distributed=False, paths=_problems()) == "fused"
    assert dispatch.resolve_backend("triton", CPU, distributed=True, paths=_problems()) == "triton"


def test_env_var_and_bad_names(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "triton")
    assert dispatch.requested_backend(None) == "triton"
    assert dispatch.requested_backend("reference") == "reference"  # the argument beats the environment
    assert dispatch.resolve_backend(None, CUDA, distributed=True, paths=_problems()) == "triton"
    monkeypatch.setenv(ENV_VAR, "  ")
    assert dispatch.requested_backend(None) == "auto"
    monkeypatch.setenv(ENV_VAR, "nonsense")
    with pytest.raises(ValueError, match="ULYSSES_KERNELS_BACKEND='nonsense' is not one of auto, reference, triton"):
        dispatch.requested_backend(None)
    monkeypatch.setenv(ENV_VAR, "Triton")   # read like every choice variable (env.choice): any case
    assert dispatch.requested_backend(None) == "triton"
    monkeypatch.delenv(ENV_VAR)
    with pytest.raises(ValueError, match="backend='cuda' is not a backend; choose one of reference, triton, fused"):
        dispatch.requested_backend("cuda")


# ------------------------------------------------- api.resolve_path: the paths asked

def test_backend_selection_rules(monkeypatch):
    assert resolve_path(None, CPU, distributed=True) == "reference"
    monkeypatch.setenv(ENV_VAR, "reference")
    assert resolve_path(None, CPU, distributed=True) == "reference"
    monkeypatch.setenv(ENV_VAR, "nonsense")
    with pytest.raises(ValueError, match="ULYSSES_KERNELS_BACKEND='nonsense' is not one of auto, reference"):
        resolve_path(None, CPU, distributed=True)
    monkeypatch.delenv(ENV_VAR)
    with pytest.raises(ValueError, match="backend='cuda' is not a backend"):
        resolve_path("cuda", CPU, distributed=True)
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        resolve_path("fused", CPU, distributed=True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        resolve_path("triton", CPU, distributed=False)


def test_every_path_implements_the_interface():
    """api's paths: each answers the `Path` protocol's calls (distributed/dispatch.py)."""
    methods = [n for n in vars(dispatch.Path) if not n.startswith("_") and callable(vars(dispatch.Path)[n])]
    assert set(methods) == {"problem", "ulysses_attention", "seq_to_heads", "heads_to_seq", "attention",
                            "ring_shift"}
    assert set(dispatch.Path.__annotations__) == {"name", "block_ops"}
    for name, path in PATHS.items():
        assert path.name == name
        for attr in methods:
            assert callable(getattr(path, attr)), (name, attr)
        for op in ("forward", "backward", "merge"):
            assert callable(getattr(path.block_ops, op)), (name, op)
    # the fused path borrows the Triton path's attention and ring blocks (its declared interface)
    assert PATHS["fused"].block_ops is PATHS["triton"].block_ops


@pytest.mark.parametrize("causal,documents", [(False, None), (True, None), (True, [0, 5, 16, 32])])
def test_path_attention_with_lse_matches_float64(causal, documents):
    """Path.attention(with_lse=True) (what HF ring inference merges): the reference and the
    Triton path's (out, lse) against the float64 reference, GQA, packed documents."""
    if triton_path.PATH.problem(CPU, ()) is not None:
        pytest.skip("the Triton path cannot run on CPU here (interpreter off or Triton missing)")
    from helpers import rel_err

    q, k, v, _ = make_qkv(1, 32, 4, 2, 16, dtype=torch.float64, seed=3)
    cu = torch.tensor(documents, dtype=torch.int32) if documents else None
    want_out, want_lse = PATHS["reference"].attention(q, k, v, causal=causal, softmax_scale=0.25, cu_seqlens=cu,
                                                      with_lse=True)
    q32, k32, v32 = (t.float() for t in (q, k, v))
    for name in ("reference", "triton"):
        out, lse = PATHS[name].attention(q32, k32, v32, causal=causal, softmax_scale=0.25, cu_seqlens=cu, with_lse=True)
        assert out.shape == want_out.shape and lse.shape == want_lse.shape, (name, lse.shape)
        assert rel_err(out, want_out) < 1e-5 and rel_err(lse, want_lse) < 1e-5, name
    out, lse = PATHS["triton"].attention(q32, k32, v32, causal=causal, softmax_scale=0.25, cu_seqlens=cu)
    assert lse is None and rel_err(out, want_out) < 1e-5


def test_triton_path_reports_inputs_it_cannot_run():
    if triton_path.PATH.problem(CPU, ()) is not None:
        pytest.skip("the Triton path cannot run on CPU here (interpreter off or Triton missing)")
    q, k, v, _ = make_qkv(1, 4, 2, 2, 8, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="backend='triton' cannot run these inputs: .*multiple of 16"):
        resolve_path("triton", CPU, distributed=False, tensors=(q, k, v))
    q, k, v, _ = make_qkv(1, 4, 2, 2, 16)
    with pytest.raises(RuntimeError, match="float16/bfloat16/float32 inputs of one dtype, got float64"):
        resolve_path("triton", CPU, distributed=False, tensors=(q, k, v))
    # automatic choice on CPU never asks: float64 CPU inputs simply take the reference path
    assert resolve_path(None, CPU, distributed=False, tensors=(q, k, v)) == "reference"


def test_auto_never_picks_fused_for_cpu():
    assert resolve_path(None, CPU, distributed=True) == "reference"
    assert resolve_path(None, CPU, distributed=False) == "reference"


def test_forced_fused_on_cpu_raises_clear_error():
    q, k, v, _ = make_qkv(1, 4, 2, 2, 8, dtype=torch.float32)
    with pytest.raises((ValueError, RuntimeError), match="fused.*CUDA|CUDA.*fused"):
        uk.ulysses_attention(q, k, v, backend="fused")


def test_forced_fused_on_cpu_is_a_clear_error_single_process():
    q, k, v, _ = make_qkv(1, 8, 2, 2, 8, seed=6)
    with pytest.raises(ValueError, match="backend='fused' needs CUDA tensors"):
        uk.ulysses_attention(q, k, v, backend="fused")


def test_forced_fused_without_extension_message(monkeypatch):
    """A missing build reads as a reason, not a crash (no stand-ins installed)."""
    from ulysses_kernels.fused import attention as fused_attention
    from ulysses_kernels.fused import ops as fused_ops

    missing = lambda: (None, "not built: test")  # noqa: E731
    monkeypatch.setattr(fused_ops, "load_extension", missing)
    monkeypatch.setattr(fused_attention, "load_extension", missing)
    # An earlier test (the doctor's) may have found the real extension: forget that answer.
    monkeypatch.setattr(fused_ops, "_extension_supported", False)
    assert not fused.is_supported()
    why = fused.problem(CUDA, ())
    assert "CUDA extension" in why and "unavailable (not built: test)" in why, why
    with pytest.raises(RuntimeError, match=r"^backend='fused' .*CUDA extension.*\(not built: test\)$"):
        resolve_path("fused", CUDA, distributed=True)
    assert resolve_path(None, CUDA, distributed=True) != "fused"
