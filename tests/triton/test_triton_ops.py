"""torch.library registration of the Triton attention: opcheck, fake tensors, torch.compile.

CPU only, Triton interpreter (TRITON_INTERPRET must be set before triton or the kernel
modules are imported: conftest.py sets it without CUDA).
"""


import pytest
import torch
from helpers import make_qkv, rel_err

from ulysses_kernels import env
from ulysses_kernels.reference import reference_attention

uk_triton = pytest.importorskip("ulysses_kernels.triton")

pytestmark = pytest.mark.skipif(not env.interpreting(), reason="CPU test: needs TRITON_INTERPRET=1")

OPS = torch.ops.ulysses_kernels


def qkv(B=1, S=9, Hq=2, Hkv=1, D=16, dtype=torch.float32, seed=0):
    return make_qkv(B, S, Hq, Hkv, D, dtype=dtype, seed=seed)[:3]


OP_NAMES = ("triton_flash_fwd", "triton_flash_bwd", "triton_flash_fwd_out", "triton_flash_bwd_out")


def test_ops_registered():
    for name in OP_NAMES:
        assert hasattr(OPS, name), name


def test_no_written_argument_has_a_default():
    """Before torch 2.14 a custom op's ADInplaceOrView kernel indexed the arguments it writes by
    position in a list from which the dispatcher had dropped trailing defaults: a written
    argument with a default raised IndexError on every call (the second GPU run, torch 2.11)."""
    for name in OP_NAMES:
        for arg in getattr(OPS, name).default._schema.arguments:
            written = arg.alias_info is not None and arg.alias_info.is_write
            assert not (written and arg.has_default_value()), f"{name}: written argument {arg.name} has a default"


def test_backward_through_the_written_ops_on_every_supported_torch():
    """The regression of the second GPU run, as a user meets it: a backward through the ops
    that write their results (`triton_flash_bwd_out`, which the fused path and the Triton
    path's Ulysses backward call). On torch 2.11 at 04418eb, the commit before the fix, it
    raises IndexError in torch/_library/custom_ops.py (CI's torch 2.11 leg runs this file;
    docs/build.md, "Supported torch releases"). Written ops, not the autograd op
    `triton_flash_bwd`, so the caller's buffers are the ones written."""
    from helpers import brute_force_attention

    from ulysses_kernels.triton.ops import flash_attention_backward, flash_attention_forward

    q, k, v, do = make_qkv(1, 9, 2, 1, 16, dtype=torch.float32, seed=3)
    out = torch.empty_like(q)
    _, lse = flash_attention_forward(q, k, v, causal=True, softmax_scale=0.25, out=out)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    flash_attention_backward(do, q, k, v, out, lse, causal=True, softmax_scale=0.25, dq=dq, dk=dk, dv=dv)
    ref = brute_force_attention(q, k, v, do, causal=True, softmax_scale=0.25)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref):
        assert rel_err(got, want) < 1e-5, name


# test_aot_dispatch_dynamic traces with symbolic shapes and runs the real kernels; it works
# in the interpreter, it is only slow, so keep the inputs tiny.
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor",
                 "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("causal", [False, True])
def test_opcheck_fwd(causal):
    q, k, v = qkv()
    q.requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    torch.library.opcheck(OPS.triton_flash_fwd.default, (q, k, v, causal, 0.25, None),
                          test_utils=OPCHECK_TESTS)


def test_opcheck_fwd_varlen():
    q, k, v = qkv(S=10)
    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    torch.library.opcheck(OPS.triton_flash_fwd.default, (q, k, v, True, 0.25, cu),
                          test_utils=OPCHECK_TESTS)


def test_opcheck_bwd():
    q, k, v = qkv()
    out, lse = OPS.triton_flash_fwd(q, k, v, True, 0.25, None)
    do = torch.randn_like(out)
    torch.library.opcheck(OPS.triton_flash_bwd.default, (do, q, k, v, out, lse, True, 0.25, None),
                          test_utils=OPCHECK_TESTS)


def variant_qkv(seed=3):
    """Dv != D (32 / 16), GQA, and the sink logits."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(1, 11, 2, 32, generator=g), torch.randn(1, 13, 1, 32, generator=g), \
        torch.randn(1, 13, 1, 16, generator=g)
    return q, k, v, torch.randn(2, generator=g)


def test_opcheck_variants():
    """A shifted window band, softcap, sinks (differentiable) and Dv != D through every op."""
    q, k, v, sinks = variant_qkv()
    for t in (q, k, v, sinks):
        t.requires_grad_()
    variant = (-2, 5, 3.0, sinks)
    torch.library.opcheck(OPS.triton_flash_fwd.default, (q, k, v, True, 0.25, None, False, *variant),
                          test_utils=OPCHECK_TESTS)
    out, lse = OPS.triton_flash_fwd(q, k, v, True, 0.25, None, False, *variant)
    do = torch.randn_like(out)
    torch.library.opcheck(OPS.triton_flash_bwd.default,
                          (do, q.detach(), k.detach(), v.detach(), out.detach(), lse, True, 0.25, None, True,
                           -2, 5, 3.0, sinks.detach()), test_utils=OPCHECK_TESTS)
    B, Sq = 1, 11
    q3, k3, v3 = (t.detach().reshape(B * t.shape[1], t.shape[2], t.shape[3]) for t in (q, k, v))
    k3, v3 = k3[:Sq], v3[:Sq]  # the buffer views take Sq == Sk rows per batch
    out3, lse3 = torch.empty(B * Sq, 2, 16), torch.empty(B, 2, Sq)
    torch.library.opcheck(OPS.triton_flash_fwd_out.default,
                          (q3, k3, v3, out3, lse3, False, 0.25, None, 1, B, 4, None, 3.0, sinks.detach()),
                          test_utils=OPCHECK_TESTS)
    OPS.triton_flash_fwd_out(q3, k3, v3, out3, lse3, False, 0.25, None, 1, B, 4, None, 3.0, sinks.detach())
    grads = (torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(v3))
    torch.library.opcheck(OPS.triton_flash_bwd_out.default,
                          (torch.randn_like(out3), q3, k3, v3, out3, lse3, *grads, torch.empty(2), False, 0.25, None, 1,
                           B, False, 4, None, 3.0, sinks.detach()), test_utils=OPCHECK_TESTS)


def test_opcheck_inplace_ops():
    B, S, Hq, Hkv, D, P = 2, 7, 2, 1, 16, 2
    q, k, v = (t.reshape(B * S, -1, D) for t in qkv(B=B, S=S, Hq=Hq, Hkv=Hkv, D=D))
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, S)
    torch.library.opcheck(OPS.triton_flash_fwd_out.default,
                          (q, k, v, out, lse, False, 0.25, None, P, B), test_utils=OPCHECK_TESTS)
    OPS.triton_flash_fwd_out(q, k, v, out, lse, False, 0.25, None, P, B)
    do = torch.randn_like(out)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    torch.library.opcheck(OPS.triton_flash_bwd_out.default,
                          (do, q, k, v, out, lse, dq, dk, dv, None, False, 0.25, None, P, B),
                          test_utils=OPCHECK_TESTS)


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 33, 8, 64, dtype=torch.bfloat16)
        k = torch.empty(2, 40, 2, 64, dtype=torch.bfloat16)
        v = torch.empty(2, 40, 2, 64, dtype=torch.bfloat16)
        out, lse = OPS.triton_flash_fwd(q, k, v, True, 0.125, None)
        assert out.shape == (2, 33, 8, 64) and out.dtype == torch.bfloat16
        assert lse.shape == (2, 8, 33) and lse.dtype == torch.float32
        dq, dk, dv, dsinks = OPS.triton_flash_bwd(out, q, k, v, out, lse, True, 0.125, None)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        assert dq.dtype == dk.dtype == dv.dtype == torch.bfloat16
        assert dsinks.shape == (0,)  # no sinks: an empty gradient
        # the variants: out and dv have v's head dim, dsinks is [Hq] fp32
        v_small = torch.empty(2, 40, 2, 32, dtype=torch.bfloat16)
        sinks = torch.empty(8, dtype=torch.bfloat16)
        out, lse = OPS.triton_flash_fwd(q, k, v_small, True, 0.125, None, False, 16, None, 30.0, sinks)
        assert out.shape == (2, 33, 8, 32) and lse.shape == (2, 8, 33)
        dq, dk, dv, dsinks = OPS.triton_flash_bwd(out, q, k, v_small, out, lse, True, 0.125, None, False, 16,
                                                  None, 30.0, sinks)
        assert dv.shape == v_small.shape and dsinks.shape == (8,) and dsinks.dtype == torch.float32
        # the public wrapper too (views of a packed buffer as input)
        buf = torch.empty(1, 17, 12, 32, dtype=torch.float16)
        o = uk_triton.flash_attention(buf[:, :, :8], buf[:, :, 8:10], buf[:, :, 10:], causal=True)
        assert o.shape == (1, 17, 8, 32) and o.dtype == torch.float16


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    q, k, v = qkv(B=1, S=19, Hq=4, Hkv=2, D=32, seed=1)
    cu = torch.tensor([0, 7, 7, 19], dtype=torch.int32)

    def fn(q, k, v):
        return uk_triton.flash_attention(q, k, v, causal=True, cu_seqlens=cu) * 2.0

    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = compiled(*leaves)
    out.sum().backward()
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*ref_leaves, causal=True, cu_seqlens=cu)[0] * 2.0
    ref.sum().backward()
    assert rel_err(out, ref) < 1e-5
    for got, want in zip(leaves, ref_leaves):
        assert rel_err(got.grad, want.grad) < 1e-5


def test_torch_compile_fullgraph_variants():
    """A window, softcap, sinks (with their gradient) and Dv != D under torch.compile."""
    torch._dynamo.reset()
    q, k, v, sinks = variant_qkv(seed=4)

    def fn(q, k, v, sinks):
        return uk_triton.flash_attention(q, k, v, causal=True, window_size=(4, -1), softcap=2.0, sinks=sinks) * 2.0

    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = compiled(*leaves)
    out.sum().backward()
    eager = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    fn(*eager).sum().backward()
    assert out.shape == (1, 11, 2, 16)
    torch.testing.assert_close(out, fn(*eager), rtol=0, atol=0)
    for got, want in zip(leaves, eager):
        assert got.grad is not None and got.grad.abs().sum() > 0
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)


def test_torch_compile_fullgraph_lowlevel_inplace():
    torch._dynamo.reset()
    B, S, Hq, Hkv, D, P = 2, 11, 2, 1, 16, 2
    q, k, v = (t.reshape(B * S, -1, D) for t in qkv(B=B, S=S, Hq=Hq, Hkv=Hkv, D=D, seed=2))

    def fn(q, k, v, out):
        o, lse = uk_triton.flash_attention_forward(q, k, v, causal=True, softmax_scale=None,
                                                   out=out, seq_splits=P, batch=B)
        return lse

    out_c = torch.zeros_like(q)
    out_e = torch.zeros_like(q)
    lse_c = torch.compile(fn, backend="eager", fullgraph=True)(q, k, v, out_c)
    lse_e = fn(q, k, v, out_e)
    assert torch.equal(out_c, out_e) and torch.equal(lse_c, lse_e)
    assert out_c.abs().sum() > 0


# The sm_90 builds (wgmma, spills, inner-loop SASS) are checked by tests/bench/test_sass_report.py.
