"""Shared test helpers: inputs, float64 references, error measures, rotary tables and the
skip helpers. Every test module imports these from here (tests/ is on sys.path, see
conftest.py); worker functions that spawned ranks run live in the test module that uses
them (they are pickled by module name).
"""

from pathlib import Path

import pytest
import torch

from ulysses_kernels import env, extensions, fused, reference_attention, split_lengths

# The repository (tests/ is one level below it; test modules in tests/<folder>/ use this).
ROOT = Path(__file__).resolve().parent.parent

# Seconds a spawned process group may run (`ulysses_kernels.launch.spawn(..., timeout=)`):
# a hang fails the test instead of blocking CI.
SPAWN_TIMEOUT = 180
# Spawns that run the Triton interpreter or load transformers on every rank.
SLOW_SPAWN_TIMEOUT = 240


# ------------------------------------------------------------------------- inputs

def randn(*shape, dtype=torch.float32, seed=0, device="cpu") -> torch.Tensor:
    """Standard normal values drawn in float32 on the CPU (the same values on every device
    and, float32 being exact in float64, for float64 too), cast to `dtype`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)


def make_qkv(B, S, Hq, Hkv, D, *, dtype=torch.float64, seed=0, Sk=None, device="cpu"):
    """q `[B, S, Hq, D]`, k/v `[B, Sk, Hkv, D]` (Sk defaults to S) and an output gradient
    `do` like q, drawn in this order from one generator in float32 (so the float32 and the
    float64 version of a case hold the same values), then cast to `dtype`."""
    Sk = S if Sk is None else Sk
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, S, Hq, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D), (B, S, Hq, D)]
    return tuple(torch.randn(*s, generator=g, dtype=torch.float32).to(device=device, dtype=dtype) for s in shapes)


def param_id(value):
    """Readable pytest ids for dtypes and case tuples ("bfloat16", "2-301-8-2-64-True-bfloat16-2"),
    so `-k float32` selects the float32 cases (bench/gpu_check.sh splits the GPU steps so)."""
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, tuple):
        return "-".join(param_id(v) for v in value)
    return str(value)


def free_port() -> int:
    """A TCP port nobody listens on now (for a launcher's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_script(cmd, *, timeout: float, **env_extra) -> str:
    """Run a launcher command (torchrun, accelerate launch) from the repository root, one
    thread per process, outside any process group of this one; its stdout and stderr
    together. A non-zero exit fails with the output's tail."""
    import os
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1", **env_extra)
    env.pop("RANK", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


class SpawnedRuns:
    """Each world's jobs spawned once per test module, every test reading the same results,
    or re-raising the same failure. jobs(world): (the function the spawned ranks run, its
    args)."""

    def __init__(self, jobs, timeout: float):
        self.jobs, self.timeout, self.results = jobs, timeout, {}

    def __call__(self, world: int):
        from ulysses_kernels.launch import spawn

        if world not in self.results:
            fn, args = self.jobs(world)
            try:
                self.results[world] = spawn(fn, world, args=args, timeout=self.timeout)
            except Exception as exc:  # report the same failure in every test that needs it
                self.results[world] = exc
        if isinstance(self.results[world], Exception):
            raise self.results[world]
        return self.results[world]


def shard(t: torch.Tensor, world: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's `torch.tensor_split` slice along the sequence (a contiguous copy)."""
    return torch.tensor_split(t, world, dim=dim)[rank].clone()


def seq_lens(total: int, world: int):
    """Every rank's local length: the lengths of `torch.tensor_split`."""
    return split_lengths(total, world)


def rope_tables(B, S, D, device="cpu"):
    """Rotary (cos, sin) `[B, S, D]` at global positions 0..S-1 (Llama convention)."""
    freqs = 1.0 / (10000.0 ** (torch.arange(D // 2, dtype=torch.float32, device=device) / (D // 2)))
    angles = torch.arange(S, dtype=torch.float32, device=device)[:, None] * freqs[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().expand(B, S, D), emb.sin().expand(B, S, D)


# --------------------------------------------------------------------- references

def reference_with_grads(q, k, v, do, causal, cu_seqlens=None, softmax_scale=None):
    """Float64 (out, dq, dk, dv) of full single-process attention."""
    out, _, dq, dk, dv = reference_with_lse(q, k, v, do, causal, cu_seqlens, softmax_scale)
    return out, dq, dk, dv


def reference_with_lse(q, k, v, do, causal, cu_seqlens=None, softmax_scale=None):
    """Float64 (out, lse, dq, dk, dv) of full single-process attention."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    out, lse = reference_attention(q, k, v, causal=causal, cu_seqlens=cu_seqlens, softmax_scale=softmax_scale)
    out.backward(do.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def brute_force_attention(q, k, v, do, *, causal=False, cu_seqlens=None, window_size=(-1, -1), softcap=0.0,
                          sinks=None, softmax_scale=None):
    """Float64 (out, dq, dk, dv, dsinks or None) of attention with the variants, written
    out independently of the package: the whole score matrix, one boolean mask from the
    rule (bottom-right aligned band, causal, same document), the sinks as one more logit
    column whose value is 0, autograd for the gradients."""
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    s = sinks.detach().double().requires_grad_(True) if sinks is not None else None
    qd, kd, vd = leaves
    Sk, group = kd.shape[1], qd.shape[2] // kd.shape[2]
    scores, seen = _brute_force_logits(qd, kd, s, causal=causal, cu_seqlens=cu_seqlens, window_size=window_size,
                                       softcap=softcap, softmax_scale=softmax_scale)
    p = torch.softmax(scores.masked_fill(~seen, 0.0), dim=-1) * seen  # a row that sees nothing outputs zeros
    out = torch.einsum("bhqk,bkhd->bqhd", p[..., :Sk], vd.repeat_interleave(group, 2))
    out.backward(do.double())
    return (out.detach(), *(t.grad for t in leaves), s.grad if s is not None else None)


def brute_force_lse(q, k, *, causal=False, cu_seqlens=None, window_size=(-1, -1), softcap=0.0, sinks=None,
                    softmax_scale=None):
    """Float64 ``[B, Hq, Sq]`` log-sum-exp of brute_force_attention's logits (the sinks
    included): -inf for a row that sees no key and has no sink."""
    scores, seen = _brute_force_logits(q.detach().double(), k.detach().double(),
                                       sinks.detach().double() if sinks is not None else None, causal=causal,
                                       cu_seqlens=cu_seqlens, window_size=window_size, softcap=softcap,
                                       softmax_scale=softmax_scale)
    return torch.logsumexp(scores, dim=-1).masked_fill(~seen[..., 0], float("-inf"))


def _brute_force_logits(qd, kd, s, *, causal, cu_seqlens, window_size, softcap, softmax_scale):
    """([B, Hq, Sq, Sk (+1 with sinks)] logits, -inf where not visible; [B|1, Hq|1, Sq, 1]
    whether a row has any finite logit)."""
    B, Sq, Hq, D = qd.shape
    Sk, group = kd.shape[1], Hq // kd.shape[2]
    scale = softmax_scale if softmax_scale is not None else D ** -0.5
    scores = torch.einsum("bqhd,bkhd->bhqk", qd, kd.repeat_interleave(group, 2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(Sq)[:, None] + (Sk - Sq)
    j = torch.arange(Sk)[None, :]
    visible = torch.ones(Sq, Sk, dtype=torch.bool)
    if causal:
        visible &= j <= i
    if window_size[0] >= 0:
        visible &= j >= i - window_size[0]
    if window_size[1] >= 0:
        visible &= j <= i + window_size[1]
    if cu_seqlens is not None:
        doc = torch.searchsorted(cu_seqlens.long()[1:], torch.arange(Sk), right=True)
        visible &= doc[:, None] == doc[None, :]
    scores = scores.masked_fill(~visible, float("-inf"))
    seen = visible.any(-1, keepdim=True) | (s is not None)
    if s is not None:
        scores = torch.cat([scores, s.view(1, Hq, 1, 1).expand(B, Hq, Sq, 1)], dim=-1)
    return scores, seen


def to_a2a_buffer(t: torch.Tensor, P: int) -> torch.Tensor:
    """`[B, S, H, D]` -> the all-to-all buffer `[B*S, H, D]` of P blocks (block i: the
    `[B, S_i]` rows of its `torch.tensor_split` positions), written out independently of
    the package's exchange code."""
    return torch.cat([part.reshape(-1, *t.shape[2:]) for part in torch.tensor_split(t, P, dim=1)])


def from_a2a_buffer(x: torch.Tensor, B: int, P: int) -> torch.Tensor:
    """Inverse of `to_a2a_buffer`: `[B*S, H, D]` in P-block order -> `[B, S, H, D]`."""
    S = x.shape[0] // B
    parts, row = [], 0
    for n in split_lengths(S, P):
        parts.append(x[row:row + B * n].reshape(B, n, *x.shape[1:]))
        row += B * n
    return torch.cat(parts, dim=1)


def check_rank_against_reference(full, out, leaves, *, rank, world, causal, tol):
    """A spawned rank's `ulysses_attention` output and q/k/v gradients (`leaves`, its
    shards) against the float32 reference path on the whole tensors `full` = (q, k, v, dO):
    this rank's `tensor_split` slice of each."""
    qr, kr, vr = (t.detach().float().requires_grad_(True) for t in full[:3])
    ref, _ = reference_attention(qr, kr, vr, causal=causal)
    ref.backward(full[3].float())
    for name, a, b in (("out", out, ref), ("dq", leaves[0].grad, qr.grad), ("dk", leaves[1].grad, kr.grad),
                       ("dv", leaves[2].grad, vr.grad)):
        b = torch.tensor_split(b, world, dim=1)[rank]
        torch.testing.assert_close(a.float(), b, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")


def raised(call, errors) -> "str | None":
    """What `call()` raised of the exception types `errors`, as "Type: message" (None: it
    returned): refusal tests compare it across ranks."""
    try:
        call()
    except errors as error:
        return f"{type(error).__name__}: {error}"
    return None


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (the absolute error when ref is zero)."""
    out, ref = out.detach().double(), ref.detach().double().to(out.device)
    denom = ref.norm().item()
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)


def layout_part(t: torch.Tensor, ranges) -> torch.Tensor:
    """The tokens (dim 1) of `t` at `ranges` ((global start, length), in order): one rank's
    part of a sequence layout (hf/families/halo/halo.py's SequenceLayout)."""
    return torch.cat([t[:, :0]] + [t[:, s:s + n] for s, n in ranges], dim=1)


def chunk_layout(total: int):
    """A generation chunk of `total` tokens split along the sequence over the default
    group (hf/families/halo/halo.py's contiguous layout): (the layout, this rank's ranges)."""
    from ulysses_kernels.distributed.groups import resolve_group
    from ulysses_kernels.hf.families.halo.halo import contiguous_layout
    from ulysses_kernels.layout import split_lengths

    group = resolve_group(None)
    layout = contiguous_layout(group, split_lengths(total, group[1]))
    return layout, layout.ranges[layout.mine]


def sharded_chunk_error(out, want_whole, ranges, state, want_state) -> float:
    """A sharded generation chunk's largest error: this rank's output against the whole
    result at its ranges (none on a rank without tokens), and the state every rank keeps."""
    local = rel_err(out, layout_part(want_whole, ranges)) if out.shape[1] else 0.0
    return max(local, rel_err(state, want_state))


# ----------------------------------------------------------------------- skipping

def needs_extension(fused_ops: bool = False):
    """Skip unless the CUDA extension `ulysses_kernels._C` is built (and, with
    `fused_ops`, has every op of the fused path); returns the module."""
    module, reason = extensions.load_extension()
    if module is None:
        pytest.skip(f"ulysses_kernels._C is not built ({reason}); build with "
                    "`pip install --no-build-isolation -e .`")
    if fused_ops and fused.problem(torch.device("cuda"), ()) is not None:
        pytest.skip(f"the CUDA extension lacks the fused path: {fused.problem(torch.device('cuda'), ())}")
    return module


def needs_interpreter():
    """Skip unless Triton kernels can run on CPU tensors: TRITON_INTERPRET=1 (conftest.py
    sets it without CUDA) and the kernels import."""
    if not env.interpreting():
        pytest.skip("the Triton interpreter is off (conftest.py sets TRITON_INTERPRET=1 without CUDA)")
    module, reason = extensions.triton_kernels()
    if module is None or not hasattr(module, "flash_attention_forward"):
        pytest.skip(f"Triton kernels unavailable: {reason}")
    return module


def run_under_memcheck(script: str, timeout: float = 55.0) -> None:
    """Run the Python `script` under compute-sanitizer's memcheck (skips without it) with
    the caching allocator off, so every tensor ends where its allocation does, and the
    default Triton configs; fails on any memcheck error or when the script does not print
    "memcheck script done"."""
    import os
    import shutil
    import subprocess
    import sys

    import pytest

    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        pytest.skip("compute-sanitizer is not on PATH")
    run_env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1", ULYSSES_KERNELS_TRITON_AUTOTUNE="0",
                   TRITON_INTERPRET="0")
    proc = subprocess.run([sanitizer, "--tool", "memcheck", "--error-exitcode", "9", "--print-limit", "5",
                           sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                          env=run_env)
    assert proc.returncode == 0 and "memcheck script done" in proc.stdout, (proc.stdout + proc.stderr)[-3000:]
