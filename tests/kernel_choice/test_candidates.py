"""Every candidate kernel that runs on CPU (torch SDPA's math backend, FlexAttention, our
Triton kernel in the interpreter) against float64 attention written out independently
(helpers.brute_force_attention), for every call class its capability table claims: the
tables say what each computes exactly, and this holds them to it. A table that claims a
class its runner gets wrong fails here (the last test shows one)."""

import dataclasses

import pytest
import torch
from helpers import brute_force_attention, brute_force_lse, make_qkv, needs_interpreter, randn, rel_err

from ulysses_kernels import kernel_choice
from ulysses_kernels.kernel_choice import candidates as cands
from ulysses_kernels.variants import make_variant

# Each case: a call class's features on CPU-sized shapes. Sq/Sk set the alignment.
CASES = {
    "full": dict(B=2, S=37, Hq=4, Hkv=4, D=16),
    "causal-square-gqa": dict(B=2, S=37, Hq=4, Hkv=2, D=16, causal=True),
    "causal-square-mqa": dict(B=1, S=45, Hq=6, Hkv=1, D=32, causal=True, scale=0.2),
    "causal-short-queries": dict(B=1, S=13, Sk=40, Hq=4, Hkv=2, D=16, causal=True),
    "causal-long-queries": dict(B=1, S=40, Sk=13, Hq=4, Hkv=2, D=16, causal=True),
    "full-unequal": dict(B=2, S=13, Sk=29, Hq=4, Hkv=1, D=16),
    "window": dict(B=1, S=41, Hq=4, Hkv=2, D=16, causal=True, window=(7, -1)),
    "window-both-sides": dict(B=1, S=33, Hq=2, Hkv=2, D=16, window=(5, 3)),
    "softcap": dict(B=1, S=31, Hq=4, Hkv=2, D=16, causal=True, softcap=3.0),
    "packed": dict(B=1, S=48, Hq=4, Hkv=2, D=16, causal=True, documents=(0, 9, 30, 48)),
    "packed-window": dict(B=1, S=48, Hq=4, Hkv=2, D=16, causal=True, documents=(0, 20, 48), window=(6, -1)),
    "value-dim": dict(B=1, S=29, Hq=4, Hkv=2, D=32, Dv=16, causal=True),
    "sinks": dict(B=1, S=27, Hq=4, Hkv=2, D=16, causal=True, sinks=True),
}
CPU_CANDIDATES = ("triton", "sdpa_cudnn", "sdpa_flash", "flex")
GPU = dict(device="NVIDIA H100 80GB HBM3", capability=(9, 0), dtype="bfloat16")  # the table's view of a GPU call


def _inputs(case, dtype=torch.float32):
    c = dict(case)
    q, k, v, do = make_qkv(c["B"], c["S"], c["Hq"], c["Hkv"], c["D"], dtype=dtype, seed=c["S"] + c["Hkv"],
                           Sk=c.get("Sk"))
    if c.get("Dv"):
        v = randn(c["B"], k.shape[1], c["Hkv"], c["Dv"], dtype=dtype, seed=7)
        do = randn(c["B"], c["S"], c["Hq"], c["Dv"], dtype=dtype, seed=8)
    cu = torch.tensor(c["documents"], dtype=torch.int32) if c.get("documents") else None
    sinks = randn(c["Hq"], seed=5) if c.get("sinks") else None
    return q, k, v, do, cu, sinks


def _call(case, q, k, v, cu, sinks):
    variant = make_variant(case.get("window", (-1, -1)), case.get("softcap", 0.0), causal=case.get("causal", False))
    call = kernel_choice.call_of(q, k, v, causal=case.get("causal", False), packed=cu is not None, variant=variant,
                                 sinks=sinks is not None, grad=True)
    return dataclasses.replace(call, **GPU), variant


def _claimed(name):
    table = kernel_choice.CANDIDATES[name].table()
    table = dataclasses.replace(table, devices=("cuda", "cpu"))  # the CPU runner stands for the GPU kernel's semantics
    return [case for case, spec in CASES.items()
            if kernel_choice.excluded(table, _call(spec, *_pick(_inputs(spec)))[0]) is None]


def _pick(inputs):
    q, k, v, _, cu, sinks = inputs
    return q, k, v, cu, sinks


def _errors(name, spec):
    """rel errors of out, dq, dk, dv (and dsinks) of candidate `name` against float64 (the
    output alone for a candidate without a backward on CPU: FlexAttention)."""
    q, k, v, do, cu, sinks = _inputs(spec)
    _, variant = _call(spec, q, k, v, cu, sinks)
    grad = kernel_choice.CANDIDATES[name].table().cpu_backward
    leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    sink_leaf = sinks.clone().requires_grad_(grad) if sinks is not None else None
    out = kernel_choice.run(name, *leaves, causal=spec.get("causal", False), softmax_scale=spec.get("scale"),
                            cu_seqlens=cu, variant=variant, sinks=sink_leaf)
    if not grad:
        want = brute_force_attention(q, k, v, do, causal=spec.get("causal", False), cu_seqlens=cu,
                                     window_size=spec.get("window", (-1, -1)), softcap=spec.get("softcap", 0.0),
                                     softmax_scale=spec.get("scale"))
        return {"out": rel_err(out, want[0])}
    out.backward(do)
    want = brute_force_attention(q, k, v, do, causal=spec.get("causal", False), cu_seqlens=cu,
                                 window_size=spec.get("window", (-1, -1)), softcap=spec.get("softcap", 0.0),
                                 sinks=sinks, softmax_scale=spec.get("scale"))
    got = [out] + [t.grad for t in leaves] + ([sink_leaf.grad] if sinks is not None else [])
    return {n: rel_err(g, w) for n, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want)}


def test_every_cpu_candidate_claims_the_plain_classes():
    """The tables are not empty claims: each CPU candidate covers at least the full and the
    square causal GQA classes, and our kernel covers every class."""
    for name in CPU_CANDIDATES:
        assert {"full", "causal-square-gqa", "causal-square-mqa"} <= set(_claimed(name)), name
    assert set(_claimed("triton")) == set(CASES)
    assert set(_claimed("flex")) == set(CASES) - {"value-dim", "sinks"}
    assert set(_claimed("sdpa_cudnn")) == {"full", "causal-square-gqa", "causal-square-mqa", "full-unequal"}


@pytest.mark.parametrize("name,case", [(n, c) for n in CPU_CANDIDATES for c in CASES if c in _claimed(n)])
def test_candidate_matches_float64_on_every_class_it_claims(name, case):
    if name == "triton":
        needs_interpreter()
    errors = _errors(name, CASES[case])
    assert max(errors.values()) < 2e-5, errors


def test_sdpa_reads_strided_views_of_the_receive_buffer():
    """q, k, v as channel slices of one `[1, S, Hq + 2 Hkv, D]` buffer (the Triton path's
    receive buffer at batch 1): read in place."""
    buf = randn(1, 40, 8, 16, seed=1)
    q, k, v = buf[:, :, :4], buf[:, :, 4:6], buf[:, :, 6:]
    want = brute_force_attention(q, k, v, torch.zeros(1, 40, 4, 16), causal=True)[0]
    for name in ("sdpa_flash", "flex"):
        assert rel_err(kernel_choice.run(name, q, k, v, causal=True), want) < 1e-5, name


@pytest.mark.parametrize("case", ["causal-square-gqa", "packed", "window", "softcap"])
def test_lse_functions_of_our_kernel_match_float64(case):
    """The ring's pair: forward with the LSE, backward from a given output and LSE."""
    needs_interpreter()
    spec = CASES[case]
    q, k, v, do, cu, _ = _inputs(spec)
    variant = make_variant(spec.get("window", (-1, -1)), spec.get("softcap", 0.0), causal=spec["causal"])
    ours = kernel_choice.CANDIDATES["triton"]
    options = dict(causal=spec["causal"], scale=None, cu_seqlens=cu, band=variant.window, softcap=variant.softcap)
    out, lse = ours.forward_lse(q, k, v, **options)
    want = brute_force_attention(q, k, v, do, causal=spec["causal"], cu_seqlens=cu,
                                 window_size=spec.get("window", (-1, -1)), softcap=spec.get("softcap", 0.0))
    want_lse = brute_force_lse(q, k, causal=spec["causal"], cu_seqlens=cu, window_size=spec.get("window", (-1, -1)),
                               softcap=spec.get("softcap", 0.0))
    assert rel_err(out, want[0]) < 2e-5 and rel_err(lse, want_lse) < 2e-5
    grads = ours.backward_lse(do, q, k, v, out, lse, **options)
    for name, got, ref in zip(("dq", "dk", "dv"), grads[:3], want[1:4]):
        assert rel_err(got, ref) < 2e-5, name


def test_windows_with_more_queries_than_keys_are_ours_and_flexs():
    """A window over Sq > Sk (non-causal): FlashAttention 2 bounds the unbounded side at Sk,
    which hides keys the reference shows; only candidates whose tables claim that alignment
    compute it."""
    call = kernel_choice.Call(**GPU, head_dim=64, value_dim=64, q_heads=4, kv_heads=4, causal=False,
                              alignment="long_queries", bucket=16, window=(1, None))
    claimed = [n for n, c in kernel_choice.CANDIDATES.items() if kernel_choice.excluded(c.table(), call) is None]
    assert claimed == ["triton", "flex"]
    packed_batch = dataclasses.replace(call, alignment="square", window=(None, None), packed=True, batch=2)
    claimed = [n for n, c in kernel_choice.CANDIDATES.items() if kernel_choice.excluded(c.table(), packed_batch) is None]
    assert claimed == ["triton"]


def test_flash_window_convention():
    """FlashAttention's and torch varlen's window_size from a band: -1 unbounded, causal
    bounds the right side at 0."""
    assert cands._flash_window((None, None), causal=True) == (-1, 0)
    assert cands._flash_window((7, None), causal=True) == (7, 0)
    assert cands._flash_window((5, 3), causal=False) == (5, 3)
    assert cands._flash_window((None, None), causal=False) == (-1, -1)


class FakeFlash:
    """A FlashAttention module that records its calls and answers with q (or (q, lse))."""

    def __init__(self, pair):
        self.calls, self.pair = [], pair

    def _answer(self, q):
        return (q, None) if self.pair else q

    def flash_attn_func(self, *args, **kwargs):
        self.calls.append(("dense", args, kwargs))
        return self._answer(args[0])

    def flash_attn_varlen_func(self, *args, **kwargs):
        self.calls.append(("varlen", args, kwargs))
        return self._answer(args[0])


@pytest.mark.parametrize("name,module,pair", [("flash2", "flash_attn", False), ("fa3", "flash_attn_interface", True),
                                              ("fa4", "flash_attn.cute", True)])
def test_flash_runners_pass_the_libraries_conventions(name, module, pair, monkeypatch):
    """The arguments each FlashAttention runner hands its library: FA2/FA3 windows with -1
    unbounded and varlen's lengths positional, FA4 by keyword only with None unbounded (its
    varlen's fourth positional parameter is qv, and a -1 side is a literal offset); an (out,
    lse) pair is unpacked; packed documents as `[S, H, D]` rows and back."""
    fake = FakeFlash(pair)
    monkeypatch.setattr(cands, "_import", lambda mod, attr=None: (fake, "test") if mod == module else (None, "no"))
    q, k, v, _ = make_qkv(1, 24, 4, 2, 16, dtype=torch.float32, seed=1)
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    window = make_variant((7, -1), 2.0, causal=True)
    out = kernel_choice.run(name, q, k, v, causal=True, softmax_scale=0.3, variant=window)
    assert torch.equal(out, q)
    packed = kernel_choice.run(name, q, k, v, causal=True, cu_seqlens=cu)
    assert torch.equal(packed, q)
    (kind, args, kwargs), (vkind, vargs, vkwargs) = fake.calls
    assert kind == "dense" and vkind == "varlen" and kwargs["softmax_scale"] == 0.3 and kwargs["causal"] is True
    assert kwargs["softcap"] == 2.0
    if name == "fa4":
        assert kwargs["window_size"] == (7, 0) and len(args) == 3 and len(vargs) == 3
        assert vkwargs["cu_seqlens_q"] is cu and vkwargs["max_seqlen_q"] == 24 and vargs[0].shape == (24, 4, 16)
    else:
        assert kwargs["window_size"] == (7, 0)
        assert vargs[3] is cu and vargs[4] is cu and vargs[5:7] == (24, 24) and vargs[0].shape == (24, 4, 16)
    unbounded = make_variant((-1, 5), 0.0, causal=False)
    kernel_choice.run(name, q, k, v, causal=False, variant=unbounded)
    assert fake.calls[-1][2]["window_size"] == ((None, 5) if name == "fa4" else (-1, 5))


def test_a_table_that_claims_too_much_fails_the_check(monkeypatch):
    """SDPA's is_causal is top-left: a table claiming bottom-right alignment for it would be
    wrong, and the float64 comparison says so (the check above can fail)."""
    errors = _errors("sdpa_flash", CASES["causal-short-queries"])
    assert errors["out"] > 1e-2
    errors = _errors("sdpa_flash", CASES["window"])  # SDPA has no window: it would silently ignore it
    assert errors["out"] > 1e-2
