"""The forward kernel's Hopper features (ulysses_kernels/triton/features.py) against the float64
brute force of tests/helpers.py: tensor-descriptor loads of K/V (zero-filled past the
sequence and the head dim), the scale in one FFMA, lazy rescaling (scores that grow slowly,
fast and by huge jumps), the warp-specialized single loop; causal and not, GQA, batch 2,
Sq != Sk, padded head dims, the all-to-all buffer layouts, documents, and the attention
variants. Also which features a call keeps (the rules of features.forward_features) and the
errors of a bad feature list.

Runs on CPU in the Triton interpreter (fp32 inputs, errors ~1e-7, tolerance 1e-5): the
interpreter runs the descriptor loads and the single loop but not the producer/consumer
partitions, which tests/triton/test_triton_features_gpu.py runs on a GPU.
"""

import pytest
import torch
from helpers import brute_force_attention, brute_force_lse, from_a2a_buffer, randn, rel_err, to_a2a_buffer

from ulysses_kernels import env

uk_triton = pytest.importorskip("ulysses_kernels.triton")
from ulysses_kernels.triton import features, flash_fwd  # noqa: E402

pytestmark = pytest.mark.skipif(not env.interpreting(), reason="CPU test: needs TRITON_INTERPRET=1")

TOL = 1e-5
VARIABLE = env.HOPPER_FEATURES.name
ALL_OFF = {"KV_DESC": False, "FMA_SCALE": False, "LAZY_RESCALE": False, "WARP_SPECIALIZE": False}
# Feature lists and the constexprs a plain call (no softcap, no documents) runs with.
FEATURE_SETS = {
    "desc": dict(ALL_OFF, KV_DESC=True),
    "desc,fma_scale": dict(ALL_OFF, KV_DESC=True, FMA_SCALE=True),
    "desc,fma_scale,lazy_rescale": dict(ALL_OFF, KV_DESC=True, FMA_SCALE=True, LAZY_RESCALE=True),
    "hopper": dict(ALL_OFF, KV_DESC=True, FMA_SCALE=True, WARP_SPECIALIZE=True),
}
# The fast tier runs the two lists that hold every forward feature; the slow tier (CI runs
# both) adds their subsets.
SLOW = pytest.mark.slow
FEATURE_PARAMS = [pytest.param(name, marks=SLOW) if name in ("desc", "desc,fma_scale") else name
                  for name in FEATURE_SETS]


@pytest.fixture
def launched(monkeypatch):
    """The constexprs of each forward launch's features, in order."""
    seen = []
    real = flash_fwd.forward_features

    def spy(*args, **kwargs):
        switches = real(*args, **kwargs)
        seen.append(switches.constexprs())
        return switches

    monkeypatch.setattr(flash_fwd, "forward_features", spy)
    return seen


def forward(q, k, v, feature_list, monkeypatch, **options):
    """flash_attention_forward with ULYSSES_KERNELS_HOPPER_FEATURES = feature_list."""
    monkeypatch.setenv(VARIABLE, feature_list)
    options.setdefault("softmax_scale", None)
    return uk_triton.flash_attention_forward(q, k, v, **options)


def check_forward(out, lse, q, k, v, **options):
    """out and the LSE against the brute force (window_size: flash_attn's, as the kernels); the
    LSE within TOL relative to max(1, |LSE|) (the fp32 sum of a score of thousands)."""
    do = torch.zeros_like(out)
    want = brute_force_attention(q, k, v, do, **options)[0]
    want_lse = brute_force_lse(q, k, **options)
    err = rel_err(out, want)
    assert err < TOL, f"out error {err:.2e}"
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite), "LSE -inf pattern differs"
    lse_err = ((lse.double()[finite] - want_lse[finite]).abs() / want_lse[finite].abs().clamp(min=1.0)).max().item() \
        if finite.any() else 0.0
    assert lse_err < TOL, f"lse error {lse_err:.2e}"
    return err, lse_err


@pytest.mark.parametrize("feature_list", FEATURE_PARAMS)
@pytest.mark.parametrize("B,Sq,Sk,Hq,Hkv,D,causal", [
    (2, 70, 70, 4, 2, 32, False),   # batch 2, GQA, a partial last key block
    (2, 70, 70, 4, 2, 32, True),
    (1, 50, 83, 2, 1, 48, True),    # Sq < Sk (bottom-right causal), D padded to 64: zero-filled dims
    (1, 83, 50, 3, 1, 16, True),    # Sq > Sk: the first rows see no key; MQA
], ids=lambda x: str(x))
def test_features_match_the_reference(B, Sq, Sk, Hq, Hkv, D, causal, feature_list, monkeypatch, launched):
    q, k, v = (randn(B, s, h, D, seed=i + Sq) for i, (s, h) in enumerate([(Sq, Hq), (Sk, Hkv), (Sk, Hkv)]))
    out, lse = forward(q, k, v, feature_list, monkeypatch, causal=causal)
    assert launched[-1] == FEATURE_SETS[feature_list]
    check_forward(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("feature_list", FEATURE_PARAMS)
def test_features_with_the_attention_variants(feature_list, monkeypatch, launched):
    """A two-sided window (Sq < Sk: shifted), sinks and Dv != D; then softcap (fma_scale
    dropped)."""
    q, k, v = randn(2, 48, 4, 32, seed=1), randn(2, 64, 2, 32, seed=2), randn(2, 64, 2, 16, seed=3)
    sinks = randn(4, seed=4)
    out, lse = forward(q, k, v, feature_list, monkeypatch, causal=False, window_size=(9, 3), sinks=sinks)
    assert launched[-1] == FEATURE_SETS[feature_list]
    check_forward(out, lse, q, k, v, window_size=(9, 3), sinks=sinks)

    out, lse = forward(q * 3, k, v, feature_list, monkeypatch, causal=True, softcap=4.0, sinks=sinks)
    assert launched[-1] == dict(FEATURE_SETS[feature_list], FMA_SCALE=False)
    check_forward(out, lse, q * 3, k, v, causal=True, softcap=4.0, sinks=sinks)


@pytest.mark.parametrize("feature_list", ["desc,fma_scale,lazy_rescale", "hopper"])
def test_features_with_documents(feature_list, monkeypatch, launched):
    """Packed documents (an empty one, a one-token one): warp_specialize is dropped (its
    loop cannot hold the document loads), the rest runs."""
    cu = torch.tensor([0, 0, 13, 14, 40, 52], dtype=torch.int32)
    q, k, v = randn(1, 52, 4, 16, seed=5), randn(1, 52, 1, 16, seed=6), randn(1, 52, 1, 16, seed=7)
    out, lse = forward(q, k, v, feature_list, monkeypatch, causal=True, cu_seqlens=cu, window_size=(6, -1))
    assert launched[-1] == dict(FEATURE_SETS[feature_list], WARP_SPECIALIZE=False)
    check_forward(out, lse, q, k, v, causal=True, cu_seqlens=cu, window_size=(6, -1))


@pytest.mark.parametrize("B,S,P,split,kept", [(2, 64, 2, 1, True), pytest.param(2, 47, 3, 2, False, marks=SLOW)],
                         ids=["affine", "per-token"])
def test_features_on_the_all_to_all_buffer(B, S, P, split, kept, monkeypatch, launched):
    """3-D buffer views (q|k heads of one buffer): the affine layout (SPLIT 1) reads through
    descriptors over the buffer's B*S rows; the per-token layout keeps pointer loads."""
    from ulysses_kernels.triton.addressing import split_mode

    assert split_mode(True, B, P, (S, S)) == split
    Hq, Hkv, D = 4, 2, 32
    q, k, v = randn(B, S, Hq, D, seed=8), randn(B, S, Hkv, D, seed=9), randn(B, S, Hkv, D, seed=10)
    qk = to_a2a_buffer(torch.cat([q, k], dim=2), P)
    for feature_list in FEATURE_SETS:
        for causal in (False, True):
            out, lse = forward(qk[:, :Hq], qk[:, Hq:], to_a2a_buffer(v, P), feature_list, monkeypatch,
                               causal=causal, seq_splits=P, batch=B)
            assert launched[-1] == (FEATURE_SETS[feature_list] if kept else ALL_OFF)
            check_forward(from_a2a_buffer(out, B, P), lse, q, k, v, causal=causal)


@pytest.mark.parametrize("feature_list", ["desc,fma_scale,lazy_rescale", pytest.param("desc,fma_scale", marks=SLOW)])
@pytest.mark.parametrize("growth", [0.05, 0.3, 0.5, 6.0, 400.0], ids=lambda g: f"growth{g}")
def test_rescaling_as_the_maxima_grow(growth, feature_list, monkeypatch):
    """Scores that rise along the keys by `growth` (natural-log units) per key, about 23x
    that in log2 units per 16-key block: a row maximum that grows by less than 8 per block
    (0.05, 0.3: lazy_rescale keeps its maxima for the whole row), by a little more (0.5), by
    ~140 per block (6: unrescaled probabilities would overflow fp32, a threshold of 200
    fails here), and by huge jumps. Causal and not; the LSE checks the maxima bookkeeping."""
    S, D = 80, 16
    u = torch.nn.functional.normalize(randn(D, seed=11), dim=0)
    q = u * D ** 0.5 + 0.1 * randn(1, S, 2, D, seed=12)   # q.u ~ sqrt(D): score_j ~ growth * j
    k = (torch.arange(S, dtype=torch.float32).view(1, S, 1, 1) * growth * u + 0.1 * randn(1, S, 1, D, seed=13))
    v = randn(1, S, 1, D, seed=14)
    for causal in (False, True):
        out, lse = forward(q, k, v, feature_list, monkeypatch, causal=causal)
        check_forward(out, lse, q, k, v, causal=causal)


def test_no_features_is_the_measured_kernel(monkeypatch, launched):
    """Unset, empty, or features that do not apply: every switch off, bitwise the same
    output as the plain kernel."""
    q, k, v = randn(1, 40, 2, 16, seed=14), randn(1, 40, 1, 16, seed=15), randn(1, 40, 1, 16, seed=16)
    monkeypatch.delenv(VARIABLE, raising=False)
    plain, plain_lse = uk_triton.flash_attention_forward(q, k, v, causal=True, softmax_scale=None)
    assert launched[-1] == ALL_OFF
    out, lse = forward(q, k, v, "", monkeypatch, causal=True)
    assert launched[-1] == ALL_OFF and torch.equal(out, plain) and torch.equal(lse, plain_lse)
    # a negative scale: fma_scale's max over raw scores would be a min; dropped
    forward(q, k, v, "desc,fma_scale", monkeypatch, causal=True, softmax_scale=-0.5)
    assert launched[-1] == dict(ALL_OFF, KV_DESC=True)


def test_feature_list_errors(monkeypatch):
    assert features.parse("") == frozenset() and features.parse(None) == frozenset()
    assert features.parse("hopper") == {"desc", "fma_scale", "warp_specialize", "dq_reduce"}
    assert features.parse(" Desc , fma_scale,") == {"desc", "fma_scale"}
    assert features.parse(["desc", "lazy_rescale"]) == {"desc", "lazy_rescale"}
    with pytest.raises(ValueError, match="unknown kernel feature.*tma"):
        features.parse("desc,tma")
    with pytest.raises(ValueError, match="lazy_rescale and warp_specialize cannot be combined"):
        features.parse("hopper,lazy_rescale")
    q = randn(1, 8, 1, 16, seed=17)
    monkeypatch.setenv(VARIABLE, "fast")
    with pytest.raises(ValueError, match=f"{VARIABLE}: unknown kernel feature"):
        uk_triton.flash_attention_forward(q, q, q, causal=True, softmax_scale=None)


def test_descriptor_rules():
    """TMA's rules, checked on the host: unit dim stride, 16-byte aligned base and strides,
    rows of >= 16 bytes, SPLIT 0 or 1, int32 rows."""
    x = torch.randn(2, 10, 3, 16, dtype=torch.bfloat16)
    strides = x.stride()
    assert features.descriptor_ok(x, strides, rows=10, width=16, split=0, batch=2)
    assert features.descriptor_ok(x, strides, rows=20, width=16, split=1, batch=2)
    assert not features.descriptor_ok(x, strides, rows=10, width=16, split=2, batch=2)
    assert not features.descriptor_ok(x, (strides[0], strides[1], strides[2], 2), rows=10, width=16, split=0,
                                      batch=2)
    odd = torch.randn(2, 10, 3, 12, dtype=torch.bfloat16)  # 24-byte heads: unaligned head stride
    assert not features.descriptor_ok(odd, odd.stride(), rows=10, width=12, split=0, batch=2)
    shifted = torch.randn(2 * 10 * 3 * 16 + 1, dtype=torch.bfloat16)[1:].view(2, 10, 3, 16)
    assert not features.descriptor_ok(shifted, strides, rows=10, width=16, split=0, batch=2)
    narrow = torch.randn(1, 10, 1, 4, dtype=torch.bfloat16)  # 8-byte rows
    assert not features.descriptor_ok(narrow, narrow.stride(), rows=10, width=4, split=0, batch=1)
    assert not features.descriptor_ok(x, strides, rows=2**31, width=16, split=1, batch=2)


def test_dq_reduce_rules(monkeypatch):
    """dq_reduce: the atomic backward on a GPU only, 16-bit inputs, padded head dims up to
    128. On CPU (the interpreter has no descriptor reduce) it is dropped, and the backward
    runs and matches the reference as without it."""
    q = randn(1, 40, 2, 16, seed=18)
    acc = torch.zeros(1, 2, 40, 16)
    assert features.backward_switches("dq_reduce", q=q, dq_acc=acc) == {"DQ_REDUCE": False}
    assert features.backward_switches("hopper", q=q, dq_acc=None) == {"DQ_REDUCE": False}
    assert features.backward_switches("", q=q, dq_acc=acc) == {"DQ_REDUCE": False}
    monkeypatch.setenv(VARIABLE, "hopper")
    k, v, do = randn(1, 40, 1, 16, seed=19), randn(1, 40, 1, 16, seed=20), randn(1, 40, 2, 16, seed=21)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    uk_triton.flash_attention(*leaves, causal=True).backward(do)
    want = brute_force_attention(q, k, v, do, causal=True)
    for name, got, ref in zip(("dq", "dk", "dv"), (t.grad for t in leaves), want[1:4]):
        assert rel_err(got, ref) < TOL, name


def test_doctor_shows_the_features(monkeypatch, capsys):
    from ulysses_kernels import cli, extensions

    monkeypatch.setattr(extensions, "load_extension", lambda: (None, "skipped in this test"))
    monkeypatch.delenv(VARIABLE, raising=False)
    assert cli.doctor(None) == 0
    assert "Hopper features      none (the measured kernels)" in capsys.readouterr().out
    monkeypatch.setenv(VARIABLE, "desc,dq_reduce")
    cli.doctor(None)
    assert "desc, dq_reduce (opt-in, not yet GPU-verified)" in capsys.readouterr().out
    monkeypatch.setenv(VARIABLE, "desc,fast")
    cli.doctor(None)
    assert f"error: {VARIABLE}: unknown kernel feature(s) fast" in capsys.readouterr().out


# ------------------------------------------------------------------ the warp-specialized backward

@pytest.fixture
def dkdv_launches(monkeypatch):
    """warp_specialize of each dK/dV launch, in order."""
    from ulysses_kernels.triton import flash_bwd

    seen = []
    real = flash_bwd.launch_dkdv

    def spy(*args, **kwargs):
        seen.append(bool(kwargs.get("warp_specialize")))
        return real(*args, **kwargs)

    monkeypatch.setattr(flash_bwd, "launch_dkdv", spy)
    return seen


def check_backward(q, k, v, do, sinks=None, **options):
    """flash_attention's gradients (autograd; sinks learnable) against the brute force."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sink_leaf = sinks.clone().requires_grad_() if sinks is not None else None
    uk_triton.flash_attention(*leaves, sinks=sink_leaf, **options).backward(do)
    options.pop("deterministic", None)
    want = brute_force_attention(q, k, v, do, sinks=sinks, **options)
    got = [t.grad for t in leaves] + ([sink_leaf.grad] if sinks is not None else [])
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want[1:]):
        assert rel_err(g, w) < TOL, f"{name} error {rel_err(g, w):.2e}"


@pytest.mark.parametrize("B,Sq,Sk,Hq,Hkv,D,Dv,options", [
    (2, 70, 70, 4, 2, 32, 32, dict(causal=False)),   # Sq % 4 != 0: LSE rows copied to a stride of 72
    (2, 64, 64, 4, 2, 32, 32, dict(causal=True)),    # Sq % 4 == 0: read in place
    (1, 50, 83, 2, 1, 48, 48, dict(causal=True)),    # Sq < Sk, padded head dim, MQA
    (1, 83, 50, 4, 2, 16, 16, dict(causal=True)),    # Sq > Sk: rows that see nothing
    (2, 48, 64, 4, 2, 32, 16, dict(causal=False, window_size=(9, 3), softcap=4.0)),  # variants, Dv != D
], ids=lambda x: str(x).replace(" ", ""))
@pytest.mark.parametrize("deterministic", [False, pytest.param(True, marks=SLOW)], ids=["atomic", "deterministic"])
def test_warp_specialized_backward(B, Sq, Sk, Hq, Hkv, D, Dv, options, deterministic, monkeypatch, dkdv_launches):
    """bwd_warp_specialize: the one-loop dK/dV kernel with descriptor loads, then the dQ
    kernel, whatever `deterministic` says; gradients (sinks' too) against float64."""
    shapes = [(B, Sq, Hq, D), (B, Sk, Hkv, D), (B, Sk, Hkv, Dv), (B, Sq, Hq, Dv)]
    q, k, v, do = (randn(*s, seed=i + Sq + Dv) for i, s in enumerate(shapes))
    sinks = randn(Hq, seed=22) if options.get("softcap") else None
    monkeypatch.setenv(VARIABLE, "bwd_warp_specialize")
    check_backward(q, k, v, do, sinks=sinks, deterministic=deterministic, **options)
    assert dkdv_launches[-1] is True


@pytest.mark.parametrize("B,S,P,kept", [(2, 64, 2, True), (2, 47, 3, False)], ids=["affine", "per-token"])
def test_warp_specialized_backward_on_the_buffer(B, S, P, kept, monkeypatch, dkdv_launches):
    """The all-to-all buffer views: the affine layout reads q/dO through [H, B*S, D]
    descriptors; the per-token layout keeps the atomic backward."""
    Hq, Hkv, D = 4, 2, 32
    q, k, v, do = (randn(B, S, h, D, seed=i + 30) for i, h in enumerate((Hq, Hkv, Hkv, Hq)))
    out, lse = uk_triton.flash_attention_forward(q, k, v, causal=True, softmax_scale=None)
    want = brute_force_attention(q, k, v, do, causal=True)
    qk = to_a2a_buffer(torch.cat([q, k], dim=2), P)
    buffers = dict(seq_splits=P, batch=B)
    monkeypatch.setenv(VARIABLE, "bwd_warp_specialize")
    out_b, lse_b = uk_triton.flash_attention_forward(qk[:, :Hq], qk[:, Hq:], to_a2a_buffer(v, P), causal=True,
                                                     softmax_scale=None, **buffers)
    grads = uk_triton.flash_attention_backward(to_a2a_buffer(do, P), qk[:, :Hq], qk[:, Hq:], to_a2a_buffer(v, P),
                                               out_b, lse_b, causal=True, softmax_scale=None, **buffers)
    assert dkdv_launches[-1] is kept
    for name, g, w in zip(("dq", "dk", "dv"), grads, want[1:4]):
        assert rel_err(from_a2a_buffer(g, B, P), w) < TOL, name


def test_warp_specialized_backward_rules(monkeypatch, dkdv_launches):
    """Packed documents keep the atomic backward (their loads cannot enter the
    warp-specialized loop), and so does a head dim of 256 (its tiles spill); unrequested,
    nothing changes."""
    big = [randn(1, 8, 1, 256, seed=50)] * 4
    assert not features.bwd_warp_specialize("bwd_warp_specialize", tensors=big, strides=[big[0].stride()] * 4,
                                            split=0, batch=1, seqlen_q=8, seqlen_k=8, varlen=False)
    small = [randn(1, 8, 1, 128, seed=51)] * 4
    assert features.bwd_warp_specialize("bwd_warp_specialize", tensors=small, strides=[small[0].stride()] * 4,
                                        split=0, batch=1, seqlen_q=8, seqlen_k=8, varlen=False)
    cu = torch.tensor([0, 13, 14, 40], dtype=torch.int32)
    q, k, v, do = (randn(1, 40, h, 16, seed=i + 40) for i, h in enumerate((2, 1, 1, 2)))
    monkeypatch.setenv(VARIABLE, "bwd_warp_specialize")
    check_backward(q, k, v, do, causal=True, cu_seqlens=cu)
    assert dkdv_launches[-1] is False
    monkeypatch.setenv(VARIABLE, "hopper")
    check_backward(q, k, v, do, causal=True)
    assert dkdv_launches[-1] is False


def test_feature_configs_of_the_launchers():
    """A launch with WARP_SPECIALIZE takes its 4-warp candidates, by default and under
    autotuning's pruning; without it, the measured defaults, unchanged."""
    from ulysses_kernels.triton import flash_bwd_dkdv, flash_bwd_dq
    from ulysses_kernels.triton.configs import CONFIGS

    for launch, table in ((flash_fwd._launch, CONFIGS["fwd"].warp_specialize),
                          (flash_bwd_dkdv._launch, CONFIGS["dkdv"].warp_specialize),
                          (flash_bwd_dq._launch, CONFIGS["dq"].warp_specialize)):
        for block_d in (64, 128):
            assert launch.default(block_d, False, {"WARP_SPECIALIZE": True}) == table[block_d][0]
            assert launch.default(block_d, False, {"WARP_SPECIALIZE": False}) == launch.default(block_d)
            assert launch.default(block_d) == launch.configs[block_d][0]
        configs = launch._all_configs()  # what autotuning is given: every table's candidates
        kept = launch._prune(configs, {}, BLOCK_D=128, BLOCK_DV=128, WARP_SPECIALIZE=True, VARLEN=False, SPLIT=0)
        assert {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept} == set(table[128])
        plain = launch._prune(configs, {}, BLOCK_D=128, BLOCK_DV=128, WARP_SPECIALIZE=False, VARLEN=False, SPLIT=0)
        assert {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in plain} == \
            set(launch.configs[128])


def test_one_config_table_and_a_scoped_forced_config():
    """Every launcher reads its tables from configs.CONFIGS (no table of its own), and a
    benchmark's forced config holds inside its block only."""
    from ulysses_kernels.triton import flash_bwd_dkdv, flash_bwd_dq
    from ulysses_kernels.triton.configs import CONFIGS

    launchers = {"fwd": flash_fwd._launch, "dkdv": flash_bwd_dkdv._launch, "dkdv_atomic": flash_bwd_dkdv._launch_atomic,
                 "dq": flash_bwd_dq._launch}
    for name, launch in launchers.items():
        assert launch.config_set is CONFIGS[name]
        assert not hasattr(launch, "override")
    for module in (flash_fwd, flash_bwd_dkdv, flash_bwd_dq):
        assert not [n for n in vars(module) if n.endswith("_CONFIGS") or n == "_INTERPRET_BLOCKS"], module
    launch = flash_fwd._launch
    options = dict(fp32_dot=False, fp32_inputs=False, autotune=False)
    assert launch.choose(128, {}, **options)[0] == CONFIGS["fwd"].plain[128][0]
    with launch.forced((64, 32, 4, 2)):
        assert launch.choose(128, {}, **options) == ((64, 32, 4, 2), "forced by a benchmark (TunedLauncher.forced)")
        assert launch.choose(128, {}, **dict(options, fp32_dot=True))[0] == (32, 16, 4, 1)  # the interpreter's
    assert launch.choose(128, {}, **options)[0] == CONFIGS["fwd"].plain[128][0]
    try:
        with launch.forced((64, 32, 4, 2)):
            raise RuntimeError("a failed build")
    except RuntimeError:
        pass
    assert launch.choose(128, {}, **options)[0] == CONFIGS["fwd"].plain[128][0]


def test_scratch_allocator_is_set_once_and_a_callers_is_kept():
    """Device-side descriptors need Triton's launch allocator: set when none is, never
    over one the caller set (no GPU needed: setting is bookkeeping)."""
    from triton.runtime import _allocation

    saved = _allocation._allocator.get()
    try:
        _allocation._allocator.set(_allocation.NullAllocator())
        features.ensure_allocator(torch.device("cpu"))  # the interpreter needs none
        assert isinstance(_allocation._allocator.get(), _allocation.NullAllocator)
        features.ensure_allocator(torch.device("cuda"))
        ours = _allocation._allocator.get()
        assert isinstance(ours, features._ScratchAllocator)

        def mine(size, alignment, stream):
            return None

        _allocation._allocator.set(mine)
        features.ensure_allocator(torch.device("cuda"))
        assert _allocation._allocator.get() is mine
    finally:
        _allocation._allocator.set(saved)
