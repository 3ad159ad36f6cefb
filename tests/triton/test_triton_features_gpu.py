"""The Hopper kernel features (ulysses_kernels/triton/features.py) on a GPU (marked `gpu`;
bench/gpu_check.sh's second-call step `hopper_tests`), against the float64 brute force of
tests/helpers.py computed on the CPU and against the measured kernels of the same run:
TMA descriptor loads, the scale in one FFMA, lazy rescaling, the warp-specialized forward
and dK/dV kernels (4-warp tiles, producer/consumer partitions) and the dQ reduce-add
through a descriptor, which the interpreter cannot run; bf16 (and fp16 once), D = 64/128/256, causal and not, GQA,
uneven lengths, the all-to-all buffer's affine layout and the attention variants.

A feature list must keep every feature it names for these calls (the spies below), and its
errors must stay within TOL and within 1.5x (plus 1e-3) of the measured kernels' errors on
the same inputs.
"""

import pytest
import torch
from helpers import brute_force_attention, from_a2a_buffer, param_id, randn, rel_err, run_under_memcheck, to_a2a_buffer

from ulysses_kernels import env

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or env.interpreting(),
                                 reason="needs a CUDA GPU and TRITON_INTERPRET unset/0")]

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
VARIABLE = env.HOPPER_FEATURES.name
# feature list -> the switches it must turn on in these calls. Four lists cover every
# feature (the step's time goes to compiling each list's kernels for each case).
FEATURE_LISTS = {
    "desc,fma_scale": {"KV_DESC", "FMA_SCALE"},
    "desc,fma_scale,lazy_rescale": {"KV_DESC", "FMA_SCALE", "LAZY_RESCALE"},
    "hopper": {"KV_DESC", "FMA_SCALE", "WARP_SPECIALIZE", "DQ_REDUCE"},
    "desc,fma_scale,warp_specialize,bwd_warp_specialize": {"KV_DESC", "FMA_SCALE", "WARP_SPECIALIZE",
                                                           "BWD_WARP_SPECIALIZE"},
}
_REFERENCE = {}  # case name -> the float64 brute force (computed once per case)
# (name, B, S, Hq, Hkv, D, options)
CASES = [
    ("causal-d128", 1, 2048, 8, 2, 128, dict(causal=True)),
    ("noncausal-uneven-d64", 2, 1000, 4, 4, 64, dict(causal=False)),
    ("causal-d256-mqa", 1, 1024, 4, 1, 256, dict(causal=True)),
    ("variants-d128", 2, 768, 8, 2, 128, dict(causal=False, window_size=(200, 30), sinks=True)),
]


@pytest.fixture
def switches(monkeypatch):
    """The switches each forward and dK/dV launch turned on, accumulated over the test
    (BWD_WARP_SPECIALIZE: the backward took the warp-specialized dK/dV kernel)."""
    from ulysses_kernels.triton import flash_bwd, flash_bwd_dkdv, flash_fwd

    seen = set()
    for module, name in ((flash_fwd, "forward_features"), (flash_bwd_dkdv, "dq_reduce_feature")):
        real = getattr(module, name)

        def spy(*args, _real=real, **kwargs):
            switches = _real(*args, **kwargs)
            seen.update(k for k, v in switches.constexprs().items() if v)
            return switches

        monkeypatch.setattr(module, name, spy)
    real_ws = flash_bwd.bwd_warp_specialize_feature

    def spy_ws(*args, **kwargs):
        switches = real_ws(*args, **kwargs)
        if switches.on:
            seen.add("BWD_WARP_SPECIALIZE")
        return switches

    monkeypatch.setattr(flash_bwd, "bwd_warp_specialize_feature", spy_ws)
    return seen


def run(q, k, v, do, sinks, feature_list, monkeypatch, **options):
    """out, dq, dk, dv (and dsinks) of flash_attention with the feature list, on the GPU."""
    from ulysses_kernels.triton import flash_attention

    monkeypatch.setenv(VARIABLE, feature_list)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sink_leaf = sinks.detach().clone().requires_grad_() if sinks is not None else None
    out = flash_attention(*leaves, sinks=sink_leaf, deterministic=False, **options)
    out.backward(do)
    return [out] + [t.grad for t in leaves] + ([sink_leaf.grad] if sinks is not None else [])


# bf16 for every case; fp16 (its own kernels) for the first case only.
DTYPE_CASES = [(torch.bfloat16, case) for case in CASES] + [(torch.float16, CASES[0])]


@pytest.mark.parametrize("feature_list", list(FEATURE_LISTS))
@pytest.mark.parametrize("dtype,case", DTYPE_CASES, ids=lambda x: param_id(x) if isinstance(x, torch.dtype) else x[0])
def test_features_on_the_gpu_match_float64(case, feature_list, dtype, monkeypatch, switches):
    name, B, S, Hq, Hkv, D, options = case
    options = dict(options)
    shapes = [(B, S, Hq, D), (B, S, Hkv, D), (B, S, Hkv, D), (B, S, Hq, D)]
    q, k, v, do = (randn(*s, seed=i + S + D) for i, s in enumerate(shapes))
    sinks = randn(Hq, seed=5) if options.pop("sinks", False) else None
    if name not in _REFERENCE:
        _REFERENCE[name] = brute_force_attention(q, k, v, do, sinks=sinks, **options)
    want = _REFERENCE[name]
    device = torch.device("cuda")
    q, k, v, do = (t.to(device, dtype) for t in (q, k, v, do))
    sinks = sinks.to(device) if sinks is not None else None
    measured = run(q, k, v, do, sinks, "", monkeypatch, **options)
    assert not switches, f"the measured kernels ran with {switches}"
    got = run(q, k, v, do, sinks, feature_list, monkeypatch, **options)
    expected = FEATURE_LISTS[feature_list]
    if D > 128:  # the backward features' rule: not at D = 256 (their tiles spill there)
        expected = expected - {"DQ_REDUCE", "BWD_WARP_SPECIALIZE"}
    assert expected <= switches, f"{feature_list}: only {sorted(switches)} ran"
    for name, g, m, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, measured, want):
        assert not torch.isnan(g).any(), name
        err, base = rel_err(g.float().cpu(), w), rel_err(m.float().cpu(), w)
        print(f"{feature_list} {name}: {err:.2e} (measured kernels {base:.2e})")
        assert err < TOL[dtype], (name, err)
        assert err <= 1.5 * base + 1e-3, (name, err, base)


@pytest.mark.parametrize("feature_list", ["desc,fma_scale", "hopper"])
def test_features_on_the_affine_buffer_layout(feature_list, monkeypatch, switches):
    """The all-to-all buffer with blocks of a multiple of 128 tokens (SPLIT 1): the
    descriptors span the buffer's B*S rows and the tiles find their batch's block."""
    from ulysses_kernels.triton import flash_attention_forward
    from ulysses_kernels.triton.addressing import split_mode

    B, S, P, Hq, Hkv, D = 2, 512, 2, 8, 2, 128
    assert split_mode(True, B, P, (S, S)) == 1
    q, k, v = randn(B, S, Hq, D, seed=1), randn(B, S, Hkv, D, seed=2), randn(B, S, Hkv, D, seed=3)
    want = brute_force_attention(q, k, v, torch.zeros_like(q), causal=True)[0]
    qk = to_a2a_buffer(torch.cat([q, k], dim=2), P).cuda().bfloat16()
    vb = to_a2a_buffer(v, P).cuda().bfloat16()
    monkeypatch.setenv(VARIABLE, feature_list)
    out, _ = flash_attention_forward(qk[:, :Hq], qk[:, Hq:], vb, causal=True, softmax_scale=None,
                                     seq_splits=P, batch=B)
    assert "KV_DESC" in switches
    err = rel_err(from_a2a_buffer(out.float().cpu(), B, P), want)
    print(f"{feature_list} affine buffer: out {err:.2e}")
    assert err < TOL[torch.bfloat16]


_MEMCHECK_SCRIPT = """
import os
import torch
from ulysses_kernels import triton as kernels
torch.manual_seed(0)
for features in ("hopper", "desc,fma_scale,lazy_rescale,bwd_warp_specialize"):
    os.environ["ULYSSES_KERNELS_HOPPER_FEATURES"] = features
    for causal, (hq, hkv), s in ((False, (4, 2), 777), (True, (4, 1), 300)):
        q = torch.randn(2, s, hq, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(2, s, hkv, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(2, s, hkv, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out = kernels.flash_attention(q, k, v, causal=causal)
        out.backward(torch.randn(2, s, hq, 128, device="cuda", dtype=torch.bfloat16))
torch.cuda.synchronize()
print("memcheck script done")
"""


def test_features_under_memcheck():
    """Every feature (the two lists hold them all) under compute-sanitizer's memcheck, with
    uneven lengths (partial tiles, LSE rows copied to a 16-byte stride): device-side
    descriptors, TMA loads past the bounds and the reduce-add touch no memory outside the
    tensors (helpers.run_under_memcheck)."""
    run_under_memcheck(_MEMCHECK_SCRIPT)
