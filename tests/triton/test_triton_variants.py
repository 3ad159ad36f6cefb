"""The Triton kernels' attention variants against a float64 reference written here: window
bands (negative sides too), logit softcapping, attention sinks, a value head dim Dv != D,
and all of them together; forward, both backward modes (atomic dQ with and without head
splits, deterministic), plain tensors and the all-to-all buffer layouts. Also: the loops
visit only the key/query blocks inside a band (the COUNT switch), the argument checks and
the host's band rule.

Runs on CPU in the Triton interpreter (conftest.py sets TRITON_INTERPRET=1 without CUDA):
fp32 inputs, errors ~1e-7, tolerance 1e-5.
"""

import math

import pytest
import torch
from helpers import from_a2a_buffer, rel_err, to_a2a_buffer

import ulysses_kernels as uk
from ulysses_kernels import env

uk_triton = pytest.importorskip("ulysses_kernels.triton")
from ulysses_kernels.triton import flash_bwd_dkdv, flash_bwd_dq, flash_fwd, ops  # noqa: E402
from ulysses_kernels.triton.kernel_call import kernel_band  # noqa: E402

pytestmark = pytest.mark.skipif(not env.interpreting(), reason="CPU test: needs TRITON_INTERPRET=1")

TOL = 1e-5
HEAD_SPLITS = "ULYSSES_KERNELS_BWD_HEAD_SPLITS"


# ------------------------------------------------------------------ the reference

def visible_mask(sq, sk, *, causal=False, window=(None, None), cu_seqlens=None):
    """``[Sq, Sk]`` bool: key j visible to query i, the rule spelled out (off = Sk - Sq)."""
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    off = sk - sq
    left, right = window
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        visible &= j <= i + off
    if left is not None:
        visible &= j >= i + off - left
    if right is not None:
        visible &= j <= i + off + right
    if cu_seqlens is not None:
        doc = torch.searchsorted(cu_seqlens.long()[1:], torch.arange(sk), right=True)
        visible &= doc[:, None] == doc[None, :]
    return visible


def reference(q, k, v, do, *, causal=False, window=(None, None), softcap=0.0, sinks=None, cu_seqlens=None):
    """Float64 (out, lse, dq, dk, dv, dsinks or None): the whole score matrix, softcap, the
    mask of visible_mask, the sinks as one more logit column (its value row is 0), a
    softmax over each row, autograd for the gradients. A row with no finite logit gives
    out 0 and LSE -inf."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    sink = sinks.detach().double().requires_grad_() if sinks is not None else None
    qd, kd, vd = leaves
    B, Sq, Hq, D = qd.shape
    Sk, group = kd.shape[1], Hq // kd.shape[2]
    scores = torch.einsum("bqhd,bkhd->bhqk", qd, kd.repeat_interleave(group, 2)) / math.sqrt(D)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    visible = visible_mask(Sq, Sk, causal=causal, window=window, cu_seqlens=cu_seqlens)
    logits = scores.masked_fill(~visible, float("-inf"))
    if sink is not None:
        logits = torch.cat([logits, sink.view(1, Hq, 1, 1).expand(B, Hq, Sq, 1)], dim=-1)
    seen = torch.isfinite(logits).any(-1, keepdim=True)
    lse = torch.logsumexp(logits.detach(), dim=-1)
    p = torch.softmax(logits.masked_fill(~seen, 0.0), dim=-1) * seen
    out = torch.einsum("bhqk,bkhd->bqhd", p[..., :Sk], vd.repeat_interleave(group, 2))
    out.backward(do.double())
    return out.detach(), lse, *(t.grad for t in leaves), (sink.grad if sink is not None else None)


# ------------------------------------------------------------------ inputs and checks

def inputs(B, Sq, Sk, Hq, Hkv, D, Dv, seed, scale=1.0):
    """q, k, v, do (fp32, standard normal; q scaled by `scale`)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, Sq, Hq, D), (B, Sk, Hkv, D), (B, Sk, Hkv, Dv), (B, Sq, Hq, Dv)]
    q, k, v, do = (torch.randn(*s, generator=g) for s in shapes)
    return q * scale, k, v, do


def sink_logits(Hq, seed):
    return torch.randn(Hq, generator=torch.Generator().manual_seed(seed + 1000))


def check_lse(lse, ref_lse):
    """Same -inf pattern; finite values within TOL; returns the largest difference."""
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse), ~finite), "LSE -inf pattern differs from the reference"
    assert not torch.isnan(lse).any()
    err = (lse.double()[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    assert err < TOL, f"lse max abs err {err:.2e}"
    return err


def check_errors(got, want, names, tols=None):
    """rel_err of each pair below its tolerance (TOL unless `tols` names one). An all-zero
    reference (one visible key per row: dS = P * (dP - delta) = 0) bounds the largest
    |value| instead: the kernel's fp32 dP and delta are sums in different orders."""
    errors = {}
    for name, g, w in zip(names, got, want):
        assert not torch.isnan(g).any(), f"NaN in {name}"
        errors[name] = rel_err(g, w) if w.norm() > 0 else g.abs().max().item()
        assert errors[name] < (tols or {}).get(name, TOL), f"{name} error {errors[name]:.2e}"
    return errors


def window_argument(band):
    """A test band as the kernels' Python API takes it: flash_attn's public ``window_size``
    (-1 unbounded) when it is one, else (a negative side: the ring's shifted bands) the
    package's private ``_band``."""
    if all(side is None or side >= 0 for side in band):
        return dict(window_size=tuple(-1 if side is None else side for side in band))
    return dict(_band=band)


def run_case(q, k, v, do, *, deterministic, causal=False, window=(None, None), softcap=0.0, sinks=None,
             cu_seqlens=None, dsinks_tol=TOL):
    """flash_attention (autograd, sinks differentiable) and flash_attention_forward's LSE
    against the reference; returns (errors, the kernel's out, lse, dq). dsinks_tol: the
    sinks' gradient comes back in their dtype."""
    variants = dict(causal=causal, window=window, softcap=softcap, cu_seqlens=cu_seqlens)
    arguments = dict(variants, **window_argument(variants.pop("window")))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sink_leaf = sinks.clone().requires_grad_() if sinks is not None else None
    out = uk_triton.flash_attention(*leaves, deterministic=deterministic, sinks=sink_leaf, **arguments)
    out.backward(do)
    _, lse = uk_triton.flash_attention_forward(q, k, v, softmax_scale=None, sinks=sinks, **arguments)
    r_out, r_lse, r_dq, r_dk, r_dv, r_dsinks = reference(q, k, v, do, sinks=sinks, window=window, **variants)
    assert out.shape == (*q.shape[:-1], v.shape[-1]) and out.dtype == q.dtype
    got, want, names = [out, *(t.grad for t in leaves)], [r_out, r_dq, r_dk, r_dv], ["out", "dq", "dk", "dv"]
    if sinks is not None:
        assert sink_leaf.grad.dtype == sinks.dtype
        got, want, names = got + [sink_leaf.grad], want + [r_dsinks], names + ["dsinks"]
    errors = check_errors(got, want, names, dict(dsinks=dsinks_tol))
    errors["lse"] = check_lse(lse, r_lse)
    print(f"errors {variants} sinks={sinks is not None} deterministic={deterministic}: "
          + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
    return errors, out.detach(), lse, leaves[0].grad


# The second backward mode and head splits run in the slow tier (CI runs both tiers):
# the fast loop keeps one mode of every variant.
BOTH_MODES = pytest.mark.parametrize("deterministic", [False, pytest.param(True, marks=pytest.mark.slow)],
                                     ids=["atomic", "deterministic"])
ALL_MODES = ["atomic", pytest.param("head_splits", marks=pytest.mark.slow),
             pytest.param("deterministic", marks=pytest.mark.slow)]


# ------------------------------------------------------------------ window bands

@BOTH_MODES
@pytest.mark.parametrize("B,Sq,Sk,Hq,Hkv,causal,window", [
    (1, 70, 70, 2, 1, True, (20, None)),      # sliding window, causal (GQA 2)
    (2, 40, 40, 4, 1, True, (7, 3)),          # causal folds the right side to 0 (MQA), batch 2
    (1, 70, 70, 2, 2, False, (13, 9)),        # two-sided
    (1, 64, 64, 2, 1, False, (0, 0)),         # the diagonal only
    (1, 50, 80, 2, 2, False, (-10, 30)),      # shifted band (ring off-diagonal), Sq < Sk
    (1, 80, 50, 4, 2, False, (20, -5)),       # shifted the other way, Sq > Sk: some rows see nothing
    (1, 61, 61, 2, 1, True, (None, -4)),      # causal with a negative right side: j <= i - 4
    (1, 40, 40, 2, 1, False, (-3, 1)),        # an empty band: every row sees nothing
    (1, 45, 45, 2, 1, False, (100, 2)),       # left side beyond the sequence: unbounded
], ids=lambda x: str(x).replace(" ", ""))
def test_window(B, Sq, Sk, Hq, Hkv, causal, window, deterministic):
    q, k, v, do = inputs(B, Sq, Sk, Hq, Hkv, 16, 16, seed=Sq + Sk)
    _, out, lse, dq = run_case(q, k, v, do, deterministic=deterministic, causal=causal, window=window)
    blind = ~visible_mask(Sq, Sk, causal=causal, window=window).any(-1)  # rows that see no key
    assert torch.all(out[:, blind] == 0) and torch.all(dq[:, blind] == 0)
    assert torch.all(torch.isneginf(lse[:, :, blind]))


@BOTH_MODES
@pytest.mark.parametrize("causal,window", [(True, (5, None)), (False, (6, 2)), (False, (-2, 4))])
def test_window_with_documents(causal, window, deterministic):
    # an empty document, a one-token one, documents shorter and longer than the band
    cu = torch.tensor([0, 0, 10, 11, 11, 40, 64], dtype=torch.int32)
    q, k, v, do = inputs(1, 64, 64, 4, 2, 16, 16, seed=6)
    run_case(q, k, v, do, deterministic=deterministic, causal=causal, window=window, cu_seqlens=cu)


def test_unbounded_windows_run_the_plain_kernels():
    """(-1, -1) is plain attention, (-1, 0) is causal: the same kernels, bitwise; the
    private band form gives the same."""
    q, k, v, _ = inputs(1, 40, 40, 2, 1, 16, 16, seed=3)
    causal_out = uk_triton.flash_attention(q, k, v, causal=True)
    assert torch.equal(uk_triton.flash_attention(q, k, v, causal=True, window_size=(-1, -1)), causal_out)
    assert torch.equal(uk_triton.flash_attention(q, k, v, window_size=(-1, 0)), causal_out)
    assert torch.equal(uk_triton.flash_attention(q, k, v, causal=True, window_size=(-1, 7)), causal_out)
    assert torch.equal(uk_triton.flash_attention(q, k, v, _band=(None, 0)), causal_out)
    assert torch.equal(uk_triton.flash_attention(q, k, v, window_size=(39, 39)), uk_triton.flash_attention(q, k, v))


def test_kernel_band_rule():
    """The host's band: causal folded into the right side, sides that hide no key
    unbounded, the rest clamped to where they hide every key."""
    assert kernel_band(False, (None, None), 10, 10) == (False, None)
    assert kernel_band(True, (None, None), 10, 10) == (True, None)
    assert kernel_band(False, (None, 0), 10, 10) == (True, None)        # = causal
    assert kernel_band(True, (None, 5), 10, 10) == (True, None)         # causal bounds it at 0
    assert kernel_band(True, (3, None), 10, 10) == (False, (3, 0))
    assert kernel_band(True, (3, -2), 10, 10) == (False, (3, -2))
    assert kernel_band(False, (9, 9), 10, 10) == (False, None)          # hides nothing
    assert kernel_band(False, (8, None), 10, 10) == (False, (8, 10))    # left 8 hides key 0 from query 9
    assert kernel_band(False, (-50, 3), 10, 20) == (False, (-10, 3))    # hides all: clamped
    assert kernel_band(False, (2, -10**9), 10, 20) == (False, (2, -20))
    assert kernel_band(True, (4, None), 1, 10) == (False, (4, 1))       # one query: causal hides nothing


# ------------------------------------------------------------------ softcap, sinks, Dv

@BOTH_MODES
@pytest.mark.parametrize("causal,scale", [(False, 1.0), (True, 4.0)], ids=["plain", "saturating"])
def test_softcap(causal, scale, deterministic):
    # scale 4: scores of tens, tanh near +-1 (the capped regime)
    q, k, v, do = inputs(1, 45, 45, 4, 2, 32, 32, seed=7, scale=scale)
    run_case(q, k, v, do, deterministic=deterministic, causal=causal, softcap=5.0)


@BOTH_MODES
@pytest.mark.parametrize("causal", [False, True])
def test_sinks(causal, deterministic):
    # Sq > Sk, causal: the first 20 rows see no key, so out 0 and LSE = the sink there.
    q, k, v, do = inputs(1, 50, 30, 4, 2, 16, 16, seed=8)
    sinks = sink_logits(4, 8)
    _, out, lse, _ = run_case(q, k, v, do, deterministic=deterministic, causal=causal, sinks=sinks)
    if causal:
        assert torch.all(out[:, :20] == 0)
        torch.testing.assert_close(lse[0, :, :20], sinks.view(4, 1).expand(4, 20), rtol=0, atol=1e-6)


def test_sinks_of_other_dtypes_and_minus_infinity():
    """Sinks are read as fp32 whatever their dtype (their gradient has theirs); a sink of
    -inf is no sink."""
    q, k, v, do = inputs(1, 33, 33, 2, 1, 16, 16, seed=9)
    run_case(q, k, v, do, deterministic=False, causal=True, sinks=sink_logits(2, 9).double())
    run_case(q, k, v, do, deterministic=False, causal=True, sinks=sink_logits(2, 9).to(torch.bfloat16),
             dsinks_tol=1e-2)  # the gradient rounded to bf16
    plain_out, plain_lse = uk_triton.flash_attention_forward(q, k, v, causal=True, softmax_scale=None)
    out, lse = uk_triton.flash_attention_forward(q, k, v, causal=True, softmax_scale=None,
                                                 sinks=torch.full((2,), float("-inf")))
    assert torch.equal(out, plain_out) and torch.equal(lse, plain_lse)


def test_no_keys_with_sinks():
    """Sk = 0: out 0 and LSE = the sink for every row; every gradient is 0."""
    q, k, v, do = inputs(1, 5, 0, 2, 1, 16, 32, seed=10)
    sinks = sink_logits(2, 10).requires_grad_()
    out, lse = uk_triton.flash_attention_forward(q, k, v, causal=False, softmax_scale=None, sinks=sinks)
    assert out.shape == (1, 5, 2, 32) and torch.all(out == 0)
    assert torch.equal(lse, sinks.detach().view(1, 2, 1).expand(1, 2, 5))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    uk_triton.flash_attention(*leaves, sinks=sinks).backward(do)
    assert torch.all(leaves[0].grad == 0) and torch.all(sinks.grad == 0)


@BOTH_MODES
@pytest.mark.parametrize("D,Dv,causal", [(32, 16, True), (16, 32, False), (16, 48, True)])
def test_value_head_dim(D, Dv, causal, deterministic):
    q, k, v, do = inputs(2, 37, 37, 2, 1, D, Dv, seed=D + Dv)
    run_case(q, k, v, do, deterministic=deterministic, causal=causal)


COMBINED = dict(B=2, Sq=48, Sk=64, Hq=4, Hkv=2, D=32, Dv=16)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_all_variants_combined(mode, monkeypatch):
    """A shifted two-sided band, softcap, sinks, Dv != D, GQA and Sq != Sk at once, in
    each backward mode (head splits: the dK/dV partial sums in fp32 accumulators of D and
    Dv columns). The deterministic mode is bitwise reproducible."""
    if mode == "head_splits":
        monkeypatch.setenv(HEAD_SPLITS, "2")
    c = COMBINED
    q, k, v, do = inputs(c["B"], c["Sq"], c["Sk"], c["Hq"], c["Hkv"], c["D"], c["Dv"], seed=11, scale=2.0)
    options = dict(causal=True, window=(9, -3), softcap=3.0, sinks=sink_logits(c["Hq"], 11))  # a shifted band
    deterministic = mode == "deterministic"
    _, _, _, dq = run_case(q, k, v, do, deterministic=deterministic, **options)
    if deterministic:
        _, _, _, again = run_case(q, k, v, do, deterministic=True, **options)
        assert torch.equal(dq, again)


def test_all_variants_with_documents():
    cu = torch.tensor([0, 13, 14, 40, 52], dtype=torch.int32)
    q, k, v, do = inputs(1, 52, 52, 4, 1, 16, 32, seed=12, scale=2.0)
    run_case(q, k, v, do, deterministic=False, causal=True, window=(6, None), softcap=2.0,
             sinks=sink_logits(4, 12), cu_seqlens=cu)


# ------------------------------------------------------------------ all-to-all buffers

@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("B,S,P,split", [(2, 47, 3, 2), (2, 64, 2, 1)], ids=["per-token", "affine"])
def test_buffer_layouts(B, S, P, split, mode, monkeypatch):
    """flash_attention_forward/backward on 3-D buffer views (q|k heads of one buffer, out
    and dq|dk|dv written into larger send buffers), with a band, softcap, sinks and
    Dv != D; dsinks is overwritten."""
    from ulysses_kernels.triton.addressing import split_mode

    assert split_mode(True, B, P, (S, S)) == split
    if mode == "head_splits":
        monkeypatch.setenv(HEAD_SPLITS, "2")
    deterministic = mode == "deterministic"
    Hq, Hkv, D, Dv = 4, 2, 32, 16
    q, k, v, do = inputs(B, S, S, Hq, Hkv, D, Dv, seed=S + P, scale=2.0)
    sinks = sink_logits(Hq, S)
    options = dict(causal=False, softcap=4.0, sinks=sinks)
    band = (11, -2)  # shifted: the private band form
    qk = to_a2a_buffer(torch.cat([q, k], dim=2), P)
    qb, kb, vb, dob = qk[:, :Hq], qk[:, Hq:], to_a2a_buffer(v, P), to_a2a_buffer(do, P)
    send = torch.full((B * S, Hq + 3, Dv), 7.0)
    out, lse = uk_triton.flash_attention_forward(qb, kb, vb, softmax_scale=None, out=send[:, 1:1 + Hq],
                                                 seq_splits=P, batch=B, _band=band, **options)
    assert torch.all(send[:, 0] == 7.0) and torch.all(send[:, 1 + Hq:] == 7.0)
    grads = torch.full((B * S, Hq + Hkv, D), 5.0)
    dv_buf = torch.full((B * S, Hkv + 1, Dv), 5.0)
    dsinks = torch.full((Hq,), float("nan"))
    dq, dk, dv = uk_triton.flash_attention_backward(dob, qb, kb, vb, out, lse, softmax_scale=None, dq=grads[:, :Hq],
                                                    dk=grads[:, Hq:], dv=dv_buf[:, 1:], seq_splits=P, batch=B,
                                                    deterministic=deterministic, dsinks=dsinks, _band=band,
                                                    **options)
    assert torch.all(dv_buf[:, 0] == 5.0)
    r_out, r_lse, r_dq, r_dk, r_dv, r_dsinks = reference(q, k, v, do, window=band, **options)
    got = [from_a2a_buffer(t, B, P) for t in (out, dq, dk, dv)] + [dsinks]
    errors = check_errors(got, [r_out, r_dq, r_dk, r_dv, r_dsinks], ["out", "dq", "dk", "dv", "dsinks"])
    errors["lse"] = check_lse(lse, r_lse)
    print(f"errors buffer SPLIT={split} {mode}: "
          + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))


# ------------------------------------------------------------------ argument checks

def test_variant_argument_errors():
    q, k, v, do = inputs(1, 8, 8, 2, 1, 16, 16, seed=1)
    bad = [
        (dict(window_size=(3,)), "window_size must be a pair"),
        (dict(window_size=(1.5, -1)), "window_size left side must be an int"),
        (dict(window_size=(-1, True)), "window_size right side must be an int"),
        (dict(window_size=(-2, 0)), r"window_size left side must be >= 0 or -1"),
        (dict(window_size=(None, 0)), "window_size left side must be an int"),  # None is the private band's
        (dict(window_size=(4, 0), _band=(4, 0)), "window_size or the package's _band, not both"),
        (dict(_band=(1.5, None)), "band left side must be an int or None"),
        (dict(_band=(1, 2, 3)), "a band must be a pair"),
        (dict(softcap=-1.0), "softcap must be"),
        (dict(softcap=float("inf")), "softcap must be"),
        (dict(sinks=torch.zeros(3)), r"sinks must have shape \[2\]"),
        (dict(sinks=torch.zeros(2, dtype=torch.int32)), "floating-point"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            uk_triton.flash_attention(q, k, v, **kwargs)
    out, lse = uk_triton.flash_attention_forward(q, k, v, causal=False, softmax_scale=None)
    with pytest.raises(ValueError, match="dsinks .* needs sinks"):
        uk_triton.flash_attention_backward(do, q, k, v, out, lse, causal=False, softmax_scale=None,
                                           dsinks=torch.zeros(2))
    with pytest.raises(ValueError, match="dsinks must be"):
        uk_triton.flash_attention_backward(do, q, k, v, out, lse, causal=False, softmax_scale=None,
                                           sinks=torch.zeros(2), dsinks=torch.zeros(2, dtype=torch.float64))
    # v may differ from k in its head dim only, and that dim must be supported too.
    with pytest.raises(ValueError, match="k and v differ"):
        uk_triton.flash_attention(q, k, v[:, :7])
    with pytest.raises(ValueError, match="head dim of v"):
        uk_triton.flash_attention(q, k, torch.zeros(1, 8, 1, 24))
    assert uk_triton.inputs_problem(q, k, torch.zeros(1, 8, 1, 48)) is None


# ------------------------------------------------------------------ visited blocks

def visits(window, S, tiles, monkeypatch=None, deterministic=True):
    """Blocks each program visits (ops._count_visited_blocks) at S, causal, one head, D 16;
    tiles: (query tile, key block) of the forward and dQ kernels, the dK/dV kernel the
    transpose, or None for the interpreter's defaults."""
    if tiles is not None:
        for launcher, blocks in ((flash_fwd._launch, tiles), (flash_bwd_dq._launch, tiles),
                                 (flash_bwd_dkdv._launch, tiles[::-1])):
            monkeypatch.setattr(launcher, "interpret_blocks", blocks)
    q, k, v = inputs(1, S, S, 1, 1, 16, 16, seed=S)[:3]
    return ops._count_visited_blocks(q, k, v, causal=True, band=window, deterministic=deterministic)


def full_causal_visits(S, tile, block):
    """Blocks a causal kernel without a band visits: query tile t sees keys [0, t_last]
    (and key tile t the rows [t_first, S): the same sum when tiles divide S)."""
    return sum(-(-min((t + 1) * tile, S) // block) for t in range(-(-S // tile)))


def check_visits(counts, S, width, fewer):
    """Every tile visits at most the blocks of its band's span (tile + width - 1
    positions), at most ceil(width / block) + 2 (tiles up to twice the block), and in
    total `fewer` times fewer than without the band."""
    for name, (count, (bm, bn, _, _)) in counts.items():
        tile, block = (bm, bn) if name != "dkdv" else (bn, bm)
        assert count.shape == (1, -(-S // tile))
        span_blocks = -(-(tile + width - 1) // block)
        assert count.max().item() <= span_blocks, name
        if tile <= 2 * block:
            assert count.max().item() <= -(-width // block) + 2, name
        full = full_causal_visits(S, tile, block)
        assert count.sum().item() * fewer < full, (name, count.sum().item(), full)
        print(f"{name}: tile {tile}, block {block}: at most {count.max().item()} blocks per tile "
              f"(band span {span_blocks}), {count.sum().item()} in all vs {full} causal")


@BOTH_MODES
def test_window_visits_only_the_band_blocks(deterministic):
    """S = 512, window (63, 0): the interpreter's default tiles; the atomic backward's
    dK/dV kernel (with dQ) visits the same query blocks."""
    counts = visits((63, 0), 512, None, deterministic=deterministic)
    assert set(counts) == ({"fwd", "dkdv", "dq"} if deterministic else {"fwd", "dkdv"})
    check_visits(counts, 512, 64, fewer=2)


@pytest.mark.slow  # about 13 s on 2 cores (the interpreter runs every block)
def test_window_visits_only_the_band_blocks_long_sequence(monkeypatch):
    """S = 4096, window (255, 0): 64-row tiles over 32-position blocks, where the bound
    ceil(W / block) + 2 = 10 is met exactly (the band's 319 positions span 10 blocks)."""
    counts = visits((255, 0), 4096, (64, 32), monkeypatch)
    check_visits(counts, 4096, 256, fewer=6)
    for count, _ in counts.values():
        assert count.max().item() == 10


def test_one_public_window_convention():
    """ulysses_kernels.triton takes flash_attn's window_size like uk.flash_attention (no
    other public window argument), and both compute the same attention."""
    import inspect

    for fn in (uk_triton.flash_attention, uk_triton.flash_attention_forward, uk_triton.flash_attention_backward):
        params = inspect.signature(fn).parameters
        assert params["window_size"].default == (-1, -1) and "window" not in params
    q, k, v, _ = inputs(1, 40, 40, 4, 2, 16, 16, seed=5)
    for causal, window_size in [(True, (6, -1)), (False, (5, 3)), (True, (3, 9))]:
        got = uk_triton.flash_attention(q, k, v, causal=causal, window_size=window_size)
        want = uk.flash_attention(q.double(), k.double(), v.double(), causal=causal, window_size=window_size,
                                  backend="reference")
        assert rel_err(got, want) < TOL
