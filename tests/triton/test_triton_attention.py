"""Triton flash attention (forward + backward) against a float64 reference.

Runs on CPU in the Triton interpreter (TRITON_INTERPRET must be set before triton or the
kernel modules are imported: conftest.py sets it without CUDA). GPU cases (real sizes,
bf16) are marked `gpu`.
"""

import pytest
import torch
from helpers import from_a2a_buffer, make_qkv, param_id, reference_with_lse, rel_err, run_under_memcheck

from ulysses_kernels import env
from ulysses_kernels.reference import reference_attention

uk_triton = pytest.importorskip("ulysses_kernels.triton")

# On a GPU machine (bench/gpu_check.sh exports TRITON_INTERPRET=0) the CPU tests skip and
# the `gpu` tests run.
INTERP = env.interpreting()
DEVICE = "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERP,
                                reason="needs a CUDA GPU and TRITON_INTERPRET unset/0")
interp_only = pytest.mark.skipif(not INTERP, reason="CPU test: needs TRITON_INTERPRET=1")

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def check_lse(lse, ref_lse, tol=1e-4):
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse), ~finite), "LSE -inf pattern differs from reference"
    assert not torch.isnan(lse).any()
    if finite.any():
        assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() < tol


def run_autograd(q, k, v, do, causal, cu_seqlens=None, scale=None, deterministic=None):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = uk_triton.flash_attention(q, k, v, causal=causal, softmax_scale=scale, cu_seqlens=cu_seqlens,
                                    deterministic=deterministic)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def compare(q, k, v, do, causal, cu_seqlens=None, scale=None, tol=None):
    tol = tol if tol is not None else TOL[q.dtype]
    out, dq, dk, dv = run_autograd(q, k, v, do, causal, cu_seqlens, scale)
    _, lse = uk_triton.flash_attention_forward(q, k, v, causal=causal, softmax_scale=scale,
                                               cu_seqlens=cu_seqlens)
    r_out, r_lse, r_dq, r_dk, r_dv = reference_with_lse(q, k, v, do, causal, cu_seqlens, scale)
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv), ("lse", lse)):
        assert not torch.isnan(t).any(), f"NaN in {name}"
    assert out.dtype == q.dtype and out.shape == q.shape
    assert rel_err(out, r_out) < tol, f"out rel err {rel_err(out, r_out)}"
    check_lse(lse, r_lse, tol=max(1e-4, tol))
    for name, got, want in (("dq", dq, r_dq), ("dk", dk, r_dk), ("dv", dv, r_dv)):
        if want.norm() == 0:
            # Exactly zero in float64 (e.g. one visible key: dS = P * (dP - delta) = 0); the
            # kernel's fp32 dP and delta are sums in different orders, so zero up to rounding
            # of O(1) inputs: an absolute bound, far below any real contribution.
            assert got.abs().max() <= tol, f"{name} should be zero, got max |{name}| {got.abs().max():.3e}"
        else:
            assert rel_err(got, want) < tol, f"{name} rel err {rel_err(got, want)}"
    return out, lse, dq, dk, dv


# ----------------------------------------------------------------------------- CPU tests

@interp_only
@pytest.mark.parametrize("B,Sq,Sk,Hq,Hkv,D,causal", [
    (1, 1, 1, 2, 2, 16, False),       # length 1
    (1, 1, 1, 2, 1, 16, True),
    (2, 17, 17, 2, 2, 32, False),     # odd, not a block multiple
    (2, 17, 17, 2, 2, 32, True),
    (1, 100, 100, 4, 1, 16, True),    # MQA
    (1, 100, 100, 4, 4, 16, False),
    (2, 40, 40, 4, 2, 64, True),      # GQA 2
    (1, 45, 30, 4, 1, 16, False),     # Sq > Sk
    (1, 30, 45, 4, 2, 16, True),      # Sq < Sk, bottom-right causal
])
def test_fp32_against_reference(B, Sq, Sk, Hq, Hkv, D, causal):
    q, k, v, do = make_qkv(B, Sq, Hq, Hkv, D, Sk=Sk, dtype=torch.float32)
    compare(q, k, v, do, causal)


@interp_only
def test_causal_sq_greater_than_sk_fully_masked_rows():
    B, Sq, Sk, Hq, Hkv, D = 1, 50, 20, 4, 2, 16
    q, k, v, do = make_qkv(B, Sq, Hq, Hkv, D, Sk=Sk, dtype=torch.float32, seed=1)
    out, lse, dq, dk, dv = compare(q, k, v, do, causal=True)
    dead = Sq - Sk  # rows i < Sq - Sk see no key
    assert torch.all(out[:, :dead] == 0)
    assert torch.all(torch.isneginf(lse[:, :, :dead]))
    assert torch.all(dq[:, :dead] == 0)
    assert torch.isfinite(lse[:, :, dead:]).all()


@interp_only
def test_custom_scale():
    q, k, v, do = make_qkv(1, 23, 2, 1, 32, dtype=torch.float32, seed=2)
    compare(q, k, v, do, causal=True, scale=0.3)


@interp_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=param_id)
@pytest.mark.parametrize("causal", [False, True])
def test_half_precision(dtype, causal):
    q, k, v, do = make_qkv(2, 33, 4, 2, 64, dtype=dtype, seed=3)
    compare(q, k, v, do, causal)


@interp_only
def test_head_dim_128_bf16():
    q, k, v, do = make_qkv(1, 40, 2, 1, 128, dtype=torch.bfloat16, seed=4)
    compare(q, k, v, do, causal=True)


@interp_only
def test_head_dim_48_padded():
    # D not a power of two: padded to 64 with masks.
    q, k, v, do = make_qkv(1, 20, 2, 2, 48, dtype=torch.float32, seed=5)
    compare(q, k, v, do, causal=False)


@interp_only
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 1)])
def test_varlen_documents(causal, Hq, Hkv):
    # empty documents (repeated bounds) and a length-1 document
    cu = torch.tensor([0, 0, 10, 11, 11, 40, 64], dtype=torch.int32, device=DEVICE)
    q, k, v, do = make_qkv(1, 64, Hq, Hkv, 16, dtype=torch.float32, seed=6)
    compare(q, k, v, do, causal, cu_seqlens=cu)


@interp_only
def test_varlen_single_token_documents_bf16():
    cu = torch.tensor([0, 1, 2, 3, 20, 21, 37], dtype=torch.int32, device=DEVICE)
    q, k, v, do = make_qkv(1, 37, 2, 1, 32, dtype=torch.bfloat16, seed=7)
    compare(q, k, v, do, True, cu_seqlens=cu)


@interp_only
@pytest.mark.parametrize("causal", [False, True])
def test_strided_views(causal):
    """q/k/v as views into one packed [B, S, Hq+2Hkv, D] buffer and a [B, H, S, D] transpose."""
    B, S, Hq, Hkv, D = 2, 21, 4, 2, 32
    g = torch.Generator().manual_seed(8)
    buf = torch.randn(B, S, Hq + 2 * Hkv, D, generator=g).to(DEVICE)
    q, k, v = buf[:, :, :Hq], buf[:, :, Hq:Hq + Hkv], buf[:, :, Hq + Hkv:]
    assert not q.is_contiguous()
    do = torch.randn(B, Hq, S, D, generator=g).to(DEVICE).transpose(1, 2)  # strided dO
    compare(q, k, v, do, causal)


def pack_buffer(tensors, P):
    """[P blocks of [B, S_i, sum(H), D]] flattened to [B*S, sum(H), D]; also head slices."""
    B, S = tensors[0].shape[:2]
    heads = [t.shape[2] for t in tensors]
    blocks = [torch.cat(chunks, dim=2).reshape(-1) for chunks in
              zip(*[torch.tensor_split(t, P, dim=1) for t in tensors])]
    buf = torch.cat(blocks).view(B * S, sum(heads), tensors[0].shape[3])
    views, h0 = [], 0
    for h in heads:
        views.append(buf[:, h0:h0 + h])
        h0 += h
    return buf, views


def run_buffer_case(B, S, Hq, Hkv, D, P, causal, dtype=torch.float32, cu=None, seed=9, device=None,
                    tol=None, deterministic=None):
    device = device or DEVICE
    q, k, v, do = make_qkv(B, S, Hq, Hkv, D, dtype=dtype, seed=seed, device=device)
    _, (qb, kb, vb) = pack_buffer([q, k, v], P)
    # the reverse send buffer: out heads next to some other payload
    send = torch.full((B * S, Hq + 3, D), 7.0, dtype=dtype, device=device)
    out_view = send[:, 1:1 + Hq]
    _, (dob,) = pack_buffer([do], P)
    out, lse = uk_triton.flash_attention_forward(qb, kb, vb, causal=causal, softmax_scale=None,
                                                 cu_seqlens=cu, out=out_view, seq_splits=P, batch=B)
    assert out.data_ptr() == out_view.data_ptr()
    assert torch.all(send[:, 0] == 7.0) and torch.all(send[:, 1 + Hq:] == 7.0)
    grad_buf = torch.full((B * S, Hq + 2 * Hkv, D), 5.0, dtype=dtype, device=device)
    dqb, dkb, dvb = grad_buf[:, :Hq], grad_buf[:, Hq:Hq + Hkv], grad_buf[:, Hq + Hkv:]
    dq, dk, dv = uk_triton.flash_attention_backward(dob, qb, kb, vb, out, lse, causal=causal,
                                                    softmax_scale=None, cu_seqlens=cu, dq=dqb,
                                                    dk=dkb, dv=dvb, seq_splits=P, batch=B,
                                                    deterministic=deterministic)
    assert dq.data_ptr() == dqb.data_ptr() and dk.data_ptr() == dkb.data_ptr()
    assert dv.data_ptr() == dvb.data_ptr()
    r_out, r_lse, r_dq, r_dk, r_dv = reference_with_lse(q, k, v, do, causal, cu)
    tol = tol if tol is not None else TOL[dtype]
    assert rel_err(from_a2a_buffer(out, B, P), r_out) < tol
    check_lse(lse, r_lse, max(1e-4, tol))
    assert rel_err(from_a2a_buffer(dq, B, P), r_dq) < tol
    assert rel_err(from_a2a_buffer(dk, B, P), r_dk) < tol
    assert rel_err(from_a2a_buffer(dv, B, P), r_dv) < tol


@interp_only
@pytest.mark.parametrize("P", [1, 2, 4])
@pytest.mark.parametrize("B", [1, 2])
def test_receive_buffer_layout(P, B):
    # S = 23: uneven over 2 and 4 (tensor_split lengths 12/11 and 6/6/6/5)
    run_buffer_case(B, 23, 4, 2, 16, P, causal=(P != 2))


@interp_only
def test_receive_buffer_layout_short_sequence():
    # S < P: some blocks are empty
    run_buffer_case(2, 3, 2, 1, 16, 4, causal=True)


@interp_only
def test_receive_buffer_layout_mqa_noncausal_bf16():
    run_buffer_case(2, 30, 4, 1, 32, 4, causal=False, dtype=torch.bfloat16)


@interp_only
def test_receive_buffer_layout_varlen():
    cu = torch.tensor([0, 5, 5, 6, 19, 29], dtype=torch.int32, device=DEVICE)
    run_buffer_case(1, 29, 2, 1, 16, 4, causal=True, cu=cu)


@interp_only
def test_buffer_read_in_place_without_copies(monkeypatch):
    """The kernel reads q/k/v from the receive buffer itself (no copy) and writes out in place."""
    from torch.utils._python_dispatch import TorchDispatchMode

    B, S, Hq, Hkv, D, P = 2, 19, 2, 1, 16, 2
    q, k, v, _ = make_qkv(B, S, Hq, Hkv, D, dtype=torch.float32, seed=10)
    recv, (qb, kb, vb) = pack_buffer([q, k, v], P)
    out_buf = torch.empty(B * S, Hq, D, device=DEVICE)
    ptr = out_buf.data_ptr()
    big = (B * S * Hkv * D)

    class NoCopies(TorchDispatchMode):
        seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = str(func.overloadpacket)
            if name in ("aten::clone", "aten::contiguous", "aten::_to_copy", "aten::copy_",
                        "aten::index", "aten::cat"):
                for a in list(args) + list(kwargs.values()):
                    if isinstance(a, torch.Tensor) and a.numel() >= big and a.is_floating_point():
                        self.seen.append(name)
            return func(*args, **kwargs)

    # Check the launcher (everything before the kernel launch) makes no copy of q/k/v.
    from ulysses_kernels.triton import ops as tops
    launched = {}
    real_launch = tops.launch_fwd

    def spy(qq, kk, vv, oo, *a, **kw):
        launched["q"], launched["k"], launched["v"], launched["out"] = (
            qq.data_ptr(), kk.data_ptr(), vv.data_ptr(), oo.data_ptr())
        return real_launch(qq, kk, vv, oo, *a, **kw)

    monkeypatch.setattr(tops, "launch_fwd", spy)
    with NoCopies():
        out, _ = uk_triton.flash_attention_forward(qb, kb, vb, causal=True, softmax_scale=None,
                                                   out=out_buf, seq_splits=P, batch=B)
    assert NoCopies.seen == [], f"copies of the buffers were made: {NoCopies.seen}"
    assert launched == {"q": qb.data_ptr(), "k": kb.data_ptr(), "v": vb.data_ptr(), "out": ptr}
    assert qb.data_ptr() == recv.data_ptr()  # q is the start of the receive buffer
    assert out.data_ptr() == ptr
    r_out = reference_attention(q.double(), k.double(), v.double(), causal=True)[0]
    assert rel_err(from_a2a_buffer(out_buf, B, P), r_out) < 1e-5


@interp_only
def test_backward_deterministic():
    q, k, v, do = make_qkv(1, 37, 4, 1, 32, dtype=torch.bfloat16, seed=11)
    first = run_autograd(q, k, v, do, causal=True, deterministic=True)
    second = run_autograd(q, k, v, do, causal=True, deterministic=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@interp_only
@pytest.mark.parametrize("B,S,Hq,Hkv,D,causal,docs", [
    (2, 45, 4, 2, 32, True, None),     # GQA, causal, batch 2
    (1, 40, 6, 1, 16, False, None),    # MQA, non-causal (empty first phase)
    (1, 33, 4, 2, 16, True, [0, 7, 7, 20, 33]),  # documents
])
def test_atomic_backward_matches_deterministic(B, S, Hq, Hkv, D, causal, docs):
    """The default 5-GEMM backward (dQ by fp32 atomics) agrees with the deterministic
    7-GEMM one to 1e-5 in float32, and both with the float64 reference."""
    q, k, v, do = make_qkv(B, S, Hq, Hkv, D, dtype=torch.float32, seed=S)
    cu = torch.tensor(docs, dtype=torch.int32) if docs else None
    atomic = run_autograd(q, k, v, do, causal, cu, deterministic=False)
    determ = run_autograd(q, k, v, do, causal, cu, deterministic=True)
    torch.testing.assert_close(atomic[0], determ[0], rtol=0, atol=0)  # same forward
    for a, d in zip(atomic[1:], determ[1:]):
        assert rel_err(a, d) < 1e-5
    r_out, _, r_dq, r_dk, r_dv = reference_with_lse(q, k, v, do, causal, cu)
    for got, want in zip(atomic[1:], (r_dq, r_dk, r_dv)):
        assert rel_err(got, want) < 1e-5


@interp_only
def test_deterministic_environment_variable(monkeypatch):
    """ULYSSES_KERNELS_DETERMINISTIC=1 selects the two-kernel backward: no fp32 dQ
    accumulator is allocated (the atomic mode's only extra buffer)."""
    from ulysses_kernels.triton import flash_bwd

    calls = []
    real = flash_bwd.launch_dkdv

    def spy(*args, **kwargs):
        calls.append(kwargs.get("dq_acc") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(flash_bwd, "launch_dkdv", spy)
    q, k, v, do = make_qkv(1, 20, 2, 1, 16, dtype=torch.float32, seed=3)
    run_autograd(q, k, v, do, causal=True)
    monkeypatch.setenv("ULYSSES_KERNELS_DETERMINISTIC", "1")
    run_autograd(q, k, v, do, causal=True)
    run_autograd(q, k, v, do, causal=True, deterministic=False)  # the argument wins
    assert calls == [True, False, True]


@interp_only
def test_atomic_backward_head_splits(monkeypatch):
    """A KV head's query-head group divided over several programs (small grids): the
    dK/dV partial sums meet in fp32 accumulators; same gradients as the reference
    (plain tensors with 2 splits of the group of 4, the all-to-all buffer with 4)."""
    monkeypatch.setenv("ULYSSES_KERNELS_BWD_HEAD_SPLITS", "2")
    q, k, v, do = make_qkv(2, 29, 8, 2, 16, dtype=torch.float32, seed=2)
    compare(q, k, v, do, causal=True)
    monkeypatch.setenv("ULYSSES_KERNELS_BWD_HEAD_SPLITS", "4")
    run_buffer_case(2, 29, 8, 2, 16, 2, causal=False)
    monkeypatch.setenv("ULYSSES_KERNELS_BWD_HEAD_SPLITS", "3")
    with pytest.raises(ValueError, match="does not divide"):
        run_autograd(q, k, v, do, causal=True)


def test_head_splits_rule():
    from ulysses_kernels.triton.flash_bwd_dkdv import head_splits

    # One KV head, S = 8k in 128-key blocks, 132 SMs: 64 programs -> split the group of 4 in 4.
    assert head_splits(64, 1, 1, 4, 132) == 4
    assert head_splits(100, 1, 1, 4, 132) == 4   # 200 < 264: two is not enough
    assert head_splits(140, 1, 1, 4, 132) == 2   # 280 >= 264
    assert head_splits(64, 1, 1, 6, 132) == 6
    assert head_splits(64, 1, 1, 1, 132) == 1    # MHA: nothing to split
    assert head_splits(300, 1, 1, 8, 132) == 1   # large grid already
    assert head_splits(64, 1, 1, 8, 0) == 1      # SM count unknown


def test_split_mode_rule(monkeypatch):
    from ulysses_kernels.triton.addressing import affine_align, split_mode

    a = affine_align()
    assert split_mode(False, 4, 1, (100, 100)) == 0      # plain tensors
    assert split_mode(True, 1, 8, (8 * a + 3, 8 * a)) == 0  # batch 1: rows are positions
    assert split_mode(True, 4, 1, (77, 77)) == 0          # one block: [B, S] rows
    assert split_mode(True, 2, 4, (4 * a, 8 * a)) == 1    # every block a tile multiple
    assert split_mode(True, 2, 4, (4 * a, 4 * a + 4)) == 2  # uneven: per token


@interp_only
@pytest.mark.parametrize("P,B,S,causal,deterministic", [(2, 2, 64, True, False), (2, 3, 64, False, True)])
def test_receive_buffer_affine_tiles(P, B, S, causal, deterministic):
    """Blocks of S/P tokens, a multiple of every tile: the affine-tile addressing
    (SPLIT=1), batch > 1, forward and both backward modes."""
    from ulysses_kernels.triton.addressing import affine_align, split_mode

    assert split_mode(True, B, P, (S, S)) == 1 and S % (P * affine_align()) == 0
    run_buffer_case(B, S, 4, 2, 16, P, causal=causal, deterministic=deterministic, seed=P + S)


@interp_only
def test_sequence_stride_beyond_int32_tile_offsets_is_refused(monkeypatch):
    """Tile offsets are int32 (up to 256 rows x the sequence stride): a larger stride gets
    a clear error before any kernel runs, forward and backward. (The limit is lowered here:
    a real 2**23-element stride would need a 400 MB tensor.)"""
    from ulysses_kernels.triton import ops as tops

    monkeypatch.setattr(tops, "MAX_ROW_STRIDE", 40)
    q, k, v, do = make_qkv(1, 4, 2, 2, 16, dtype=torch.float32, seed=1)  # sequence stride 32: allowed
    wide = torch.zeros(1, 4, 3, 16)[:, :, :2]                             # sequence stride 48
    with pytest.raises(ValueError, match="sequence stride of 48"):
        uk_triton.flash_attention_forward(wide.copy_(q), k, v, causal=False, softmax_scale=None)
    out, lse = uk_triton.flash_attention_forward(q, k, v, causal=False, softmax_scale=None)
    with pytest.raises(ValueError, match="sequence stride of 48"):
        uk_triton.flash_attention_backward(wide.copy_(do), q, k, v, out, lse, causal=False, softmax_scale=None)


@interp_only
def test_input_errors():
    q, k, v, _ = make_qkv(1, 8, 2, 2, 16, dtype=torch.float32)
    with pytest.raises(ValueError):
        uk_triton.flash_attention(q[..., :8], k[..., :8], v[..., :8])  # D = 8
    with pytest.raises(ValueError):
        uk_triton.flash_attention(q, k[:, :, :1].expand(1, 8, 3, 16), v[:, :, :1].expand(1, 8, 3, 16))
    with pytest.raises(ValueError):
        uk_triton.flash_attention_forward(q, k, v, causal=False, softmax_scale=None, seq_splits=2)


# ----------------------------------------------------------------------------- GPU tests

@gpu
@needs_cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Hq,Hkv", [(8, 8), (8, 2)])
def test_gpu_real_size_bf16(causal, Hq, Hkv):
    torch.manual_seed(0)
    B, S, D = 1, 4096, 128
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16)
    do = torch.randn_like(q)
    out, dq, dk, dv = run_autograd(q, k, v, do, causal)
    r_out, r_lse, r_dq, r_dk, r_dv = reference_with_lse(q, k, v, do, causal)
    _, lse = uk_triton.flash_attention_forward(q, k, v, causal=causal, softmax_scale=None)
    assert rel_err(out, r_out) < 1e-2
    check_lse(lse, r_lse, 1e-2)
    assert rel_err(dq, r_dq) < 2e-2 and rel_err(dk, r_dk) < 2e-2 and rel_err(dv, r_dv) < 2e-2
    # Same-run comparison with PyTorch SDPA (MHA only; SDPA needs [B, H, S, D]).
    if Hq == Hkv:
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
        assert rel_err(out, sdpa) < 1e-2


@gpu
@needs_cuda
def test_gpu_varlen_and_buffer_layout():
    cu = torch.tensor([0, 1000, 1001, 1001, 3000, 4093], dtype=torch.int32, device="cuda")
    q, k, v, do = make_qkv(1, 4093, 8, 2, 128, dtype=torch.bfloat16, seed=1, device="cuda")
    compare(q, k, v, do, True, cu_seqlens=cu, tol=2e-2)
    run_buffer_case(2, 4093, 8, 2, 128, 4, causal=True, dtype=torch.bfloat16, device="cuda", tol=2e-2)
    # blocks of 1024 tokens: the affine-tile addressing (SPLIT=1), both backward modes
    for deterministic in (False, True):
        run_buffer_case(2, 4096, 8, 2, 128, 4, causal=True, dtype=torch.bfloat16, device="cuda", tol=2e-2,
                        deterministic=deterministic)


# Forward and backward of the kernels' mask variants on small, ragged shapes, run by
# test_gpu_memcheck in a process of its own under compute-sanitizer.
_MEMCHECK_SCRIPT = """
import torch
from ulysses_kernels import triton as kernels
torch.manual_seed(0)
cases = ((False, (4, 2), 1000, False), (True, (4, 4), 777, False), (True, (8, 1), 1000, True),
         (False, (4, 1), 300, None))
for causal, (hq, hkv), s, det in cases:  # det None: the atomic mode with split head groups
    q = torch.randn(2, s, hq, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, s, hkv, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, s, hkv, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = kernels.flash_attention(q, k, v, causal=causal, deterministic=bool(det))
    out.backward(torch.randn(2, s, hq, 128, device="cuda", dtype=torch.bfloat16))
torch.cuda.synchronize()
print("memcheck script done")
"""


@gpu
@needs_cuda
def test_gpu_memcheck():
    """No kernel forms an address outside its tensors, masked lanes and the software
    pipeliner's early loads included (the first GPU run: the dK/dV kernel's empty
    non-causal phase divided by zero into an illegal address). compute-sanitizer with
    the caching allocator off, so every tensor ends where its allocation does."""
    run_under_memcheck(_MEMCHECK_SCRIPT)


@gpu
@needs_cuda
def test_gpu_deterministic_and_head_dims():
    for D in (64, 128, 256):
        q, k, v, do = make_qkv(2, 1500, 8, 2, D, dtype=torch.bfloat16, seed=D, device="cuda")
        compare(q, k, v, do, True, tol=2e-2)
    q, k, v, do = make_qkv(1, 4096, 8, 1, 128, dtype=torch.bfloat16, seed=2, device="cuda")
    a = run_autograd(q, k, v, do, causal=True, deterministic=True)
    b = run_autograd(q, k, v, do, causal=True, deterministic=True)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    c = run_autograd(q, k, v, do, causal=True, deterministic=False)  # the atomic default
    for x, y in zip(a[1:], c[1:]):
        assert rel_err(x, y) < 1e-2


@gpu
@needs_cuda
def test_gpu_float32_inputs():
    """fp32 on the GPU runs tf32x3 dots with small tiles (the bf16 tiles do not fit in
    shared memory at 4 bytes per element); about fp32 accuracy."""
    for D, causal in ((128, True), (64, False)):
        q, k, v, do = make_qkv(1, 300, 4, 2, D, dtype=torch.float32, seed=D, device="cuda")
        compare(q, k, v, do, causal, tol=1e-3)
