"""SymmTransport (ulysses_kernels/fused/symm_transport.py) and the transport choice.

On CPU: the window-size rule, the growth rule and the read order (pure functions),
`ULYSSES_KERNELS_TRANSPORT` (auto -> NCCL, symm on CPU -> a clear error at engine
creation, `use_transport` wins), growth refused during capture, and doctor's line.

Marked `gpu` (bench/gpu_check.sh step `symm_tests`): P = 2 and 4 processes on ONE GPU,
each rank on cuda:0 over a gloo default group, `TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`
(torch's CUDA symmetric-memory backend otherwise refuses ranks on one device), with
`fused.use_transport(None, SymmTransport)`: the raw all_to_all bitwise against gloo's
`all_to_all_single` of the same bytes (host copies) for uneven counts of both Ulysses
shapes, repeated calls reusing the window, a growth; then `ulysses_attention(backend="fused")`
at P = 2 forward and backward against the reference. Every spawn has a timeout. Run:
    TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 ULYSSES_KERNELS_TRITON_AUTOTUNE=0 \\
        pytest -m gpu tests/fused/test_symm_transport.py
"""

import os

import pytest
import torch
import torch.distributed as dist
from helpers import check_rank_against_reference, needs_extension, randn, seq_lens

import ulysses_kernels as uk
from ulysses_kernels import cli, env, fused, streams
from ulysses_kernels.fused import engine as fused_engine
from ulysses_kernels.fused import symm_transport as st
from ulysses_kernels.fused.symm_transport import SymmTransport
from ulysses_kernels.launch import spawn
from ulysses_kernels.testing import HostTransport

CPU = torch.device("cpu")


# ------------------------------------------------------------------- the rules (CPU)

def test_slot_is_the_largest_count_of_either_ulysses_shape():
    # seq -> heads: rank r sends c_r to every rank, so recv_counts lists every rank's count
    lens = [5, 3, 4]
    for r in range(3):
        assert st.slot_elements([lens[r]] * 3, lens, 3) == 5
    # heads -> seq (the reverse): rank r receives c_r from every rank, send_counts lists them all
    for r in range(3):
        assert st.slot_elements(lens, [lens[r]] * 3, 3) == 5
    assert st.window_bytes_needed([3, 3], [5, 3], 2, element_size=2) == 5 * 2 * 2  # max(recv) * world elements
    assert st.slot_elements([0, 0], [0, 0], 2) == 0


def test_counts_that_break_the_rule_raise():
    with pytest.raises(ValueError, match="neither uniform"):
        st.slot_elements([0, 4], [4, 0], 2)  # a ring step: one destination, one source
    with pytest.raises(ValueError, match="one send and one receive count per rank"):
        st.slot_elements([1, 1], [1, 1, 1], 3)
    with pytest.raises(ValueError, match="negative"):
        st.slot_elements([-1, -1], [2, 2], 2)


def test_growth_is_geometric_and_grow_only():
    assert st.grown_window_bytes(0, 10) == st.MIN_WINDOW_BYTES
    big = 3 * st.MIN_WINDOW_BYTES
    assert st.grown_window_bytes(st.MIN_WINDOW_BYTES, big) == big
    assert st.grown_window_bytes(big, big + 1) == 2 * big
    assert st.grown_window_bytes(big, 5) == big  # never shrinks


def test_read_order_starts_after_this_rank():
    assert st.read_order(0, 4) == [1, 2, 3, 0]
    assert st.read_order(2, 4) == [3, 0, 1, 2]
    assert sorted(st.read_order(1, 3)) == [0, 1, 2]
    assert st.offsets([2, 0, 3]) == [0, 2, 2]


def test_growth_during_capture_raises(monkeypatch):
    transport = SymmTransport.__new__(SymmTransport)  # no window yet, no device needed
    transport.window, transport.handle, transport.retired, transport._views = None, None, [], {}
    monkeypatch.setattr(streams, "is_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="during CUDA graph capture"):
        transport._ensure_window(100)


# ------------------------------------------------------------ the choice (CPU)

@pytest.fixture
def fresh_engines(monkeypatch):
    monkeypatch.setattr(fused_engine, "_transport_for", {})
    monkeypatch.setattr(fused_engine, "_engines", {})
    yield
    fused_engine._engines.clear()


def test_auto_and_nccl_mean_nccl(monkeypatch):
    monkeypatch.delenv(env.TRANSPORT.name, raising=False)
    factory, why = fused.choose_transport(torch.device("cuda"))
    assert factory is fused.NcclTransport and "auto will choose symmetric memory" in why
    monkeypatch.setenv(env.TRANSPORT.name, "NCCL")
    assert fused.choose_transport(torch.device("cuda"))[0] is fused.NcclTransport
    monkeypatch.setenv(env.TRANSPORT.name, "shm")
    with pytest.raises(ValueError, match="ULYSSES_KERNELS_TRANSPORT='shm' is not one of auto, symm, nccl"):
        fused.choose_transport(CPU)


def test_symm_on_cpu_fails_at_engine_creation(monkeypatch, fresh_engines):
    monkeypatch.setenv(env.TRANSPORT.name, "symm")
    factory, why = fused.choose_transport(CPU)
    assert factory is None and "needs a CUDA device, got cpu" in why
    with pytest.raises(RuntimeError, match="ULYSSES_KERNELS_TRANSPORT=symm, but the symmetric-memory transport "
                                           "needs a CUDA device"):
        fused.get_engine(None, 1, 0, CPU)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        SymmTransport(None, 1, 0, CPU)
    fused.use_transport(None, HostTransport)  # an explicit transport wins over the variable
    assert fused.get_engine(None, 1, 0, CPU).transport.name == "host"


def test_doctor_shows_the_transport(monkeypatch):
    monkeypatch.delenv(env.TRANSPORT.name, raising=False)
    assert cli.transport_line(torch.device("cuda")).startswith("nccl (auto, which means NCCL for now")
    monkeypatch.setenv(env.TRANSPORT.name, "symm")
    assert cli.transport_line(CPU).startswith("unavailable: ULYSSES_KERNELS_TRANSPORT=symm")
    monkeypatch.setenv(env.TRANSPORT.name, "bogus")
    assert cli.transport_line(CPU).startswith("error: ULYSSES_KERNELS_TRANSPORT='bogus'")


# --------------------------------------------- P ranks on one GPU (symmetric memory)

def _on_one_gpu():
    """Per rank: every rank on cuda:0, torch's CUDA backend allowing overlapping devices."""
    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    torch.cuda.set_device(0)
    fused.use_transport(None, SymmTransport)


def _gloo_all_to_all(send, send_counts, recv_counts):
    """The same exchange through host memory: what the symmetric-memory one must equal."""
    esize = send.element_size()
    s = send.reshape(-1)[:sum(send_counts)].view(torch.uint8).cpu()
    r = torch.empty(sum(recv_counts) * esize, dtype=torch.uint8)
    dist.all_to_all_single(r, s, [n * esize for n in recv_counts], [n * esize for n in send_counts])
    return r


def _exchange_and_compare(transport, rank, world, lens, width, reverse, dtype, seed):
    mine = lens[rank] * width
    send_counts, recv_counts = [mine] * world, [n * width for n in lens]  # seq -> heads
    if reverse:  # heads -> seq
        send_counts, recv_counts = recv_counts, send_counts
    send = randn(sum(send_counts) + 3, dtype=dtype, seed=seed + rank, device="cuda")  # + 3: trailing slack
    recv = torch.full((sum(recv_counts) + 5,), -7.0, dtype=dtype, device="cuda")
    transport.all_to_all(send, recv, send_counts, recv_counts)
    want = _gloo_all_to_all(send, send_counts, recv_counts)
    got = recv[:sum(recv_counts)].view(torch.uint8).cpu()
    assert torch.equal(got, want), (rank, lens, reverse, dtype)
    assert torch.equal(recv[sum(recv_counts):].cpu(), torch.full((5,), -7.0, dtype=dtype))  # nothing past the end


def raw_exchange_worker(rank, world):
    _on_one_gpu()
    transport = fused.get_engine(None, world, rank, torch.device("cuda", 0)).transport
    assert transport.name == "symm"
    lens = [7 + 3 * i for i in range(world)]  # uneven
    for reverse in (False, True):
        for dtype in (torch.bfloat16, torch.float32):
            _exchange_and_compare(transport, rank, world, lens, 16, reverse, dtype, seed=10)
    window = transport.window.data_ptr()
    for call in range(3):  # repeated calls reuse the window (and the barriers keep them apart)
        _exchange_and_compare(transport, rank, world, lens, 16, call % 2 == 1, torch.bfloat16, seed=20 + call)
    assert transport.window.data_ptr() == window and not transport.retired
    big = [n * 4096 for n in lens]  # past 1 MiB: every rank grows at the same call
    _exchange_and_compare(transport, rank, world, big, 16, False, torch.float32, seed=30)
    assert transport.window.data_ptr() != window and len(transport.retired) == 1
    _exchange_and_compare(transport, rank, world, lens, 16, True, torch.bfloat16, seed=40)  # small again
    torch.cuda.synchronize()
    fused.close()


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_symm_all_to_all_matches_gloo(world):
    spawn(raw_exchange_worker, world, timeout=60)


def attention_worker(rank, world):
    """ulysses_attention(backend="fused") over SymmTransport vs the reference path."""
    _on_one_gpu()
    B, S, Hq, Hkv, D = 2, 301, 8, 2, 64
    os.environ[env.NUM_CHUNKS.name] = "2"
    full = [randn(B, S, h, D, dtype=torch.bfloat16, seed=99 + i, device="cuda")
            for i, h in enumerate((Hq, Hkv, Hkv, Hq))]
    mine = [torch.tensor_split(t, world, dim=1)[rank].contiguous() for t in full]
    ql, kl, vl = (t.clone().requires_grad_(True) for t in mine[:3])
    out = uk.ulysses_attention(ql, kl, vl, causal=True, seq_lens=seq_lens(S, world), backend="fused")
    assert type(out.grad_fn).__name__ == "_FusedUlyssesAttentionBackward"
    assert fused.get_engine(None, world, rank, ql.device).transport.name == "symm"
    out.backward(mine[3])
    check_rank_against_reference(full, out, (ql, kl, vl), rank=rank, world=world, causal=True, tol=3e-2)
    torch.cuda.synchronize()
    fused.close()


@pytest.mark.gpu
def test_symm_fused_attention_two_ranks():
    needs_extension(fused_ops=True)
    spawn(attention_worker, 2, timeout=60)
