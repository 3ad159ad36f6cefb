"""Which execution path runs a call, and what a path is (docs/architecture.md, "One call").

Paths: "reference" (torch ops + torch.distributed, always available), "triton" (Triton
attention kernels; on CPU tensors only under TRITON_INTERPRET=1), "fused" (CUDA
extension: pack kernels + NCCL engine + Triton attention). `backend=None` means
`ULYSSES_KERNELS_BACKEND` if set, else automatic: fused on CUDA in a process group, else
Triton on CUDA, else reference, each only when it can run the inputs.

Every path package exports one object, `PATH`, with the interface `Path` below; api.py
holds the three and asks each faster one "why can't you run these tensors here?"
(`Path.problem`), so this module decides without importing any path, and the paths never
import each other to ask.
"""

import warnings
from typing import Callable, Mapping, Optional, Protocol, Sequence, Tuple

import torch

from .. import env
from ..variants import PLAIN

BACKENDS = tuple(name for name in env.BACKEND.choices if name != "auto")   # the paths, by name


class Path(Protocol):
    """An execution path: what api.py, the ring schedule (ring/schedule.py) and the HF
    inference call on it. Inputs reach a path validated (distributed/validate.py); a path never
    validates across ranks or dispatches."""

    name: str
    block_ops: object  # the ring's block computations on this path (ring/schedule.py, `BlockOps`)

    def problem(self, device: torch.device, tensors: Sequence[torch.Tensor]) -> Optional[str]:
        """Why this path cannot run q/k/v `tensors` on `device` (None when it can; no tensors:
        whether it can run at all), phrased to follow "backend='<name>' "."""

    def ulysses_attention(self, q, k, v, *, group, rank: int, seq_lens, causal: bool, softmax_scale: float,
                          cu_seqlens, variant=PLAIN, sinks=None, engine=None) -> torch.Tensor:
        """Pure Ulysses attention (differentiable): q `[B, S_local, Hq, D]` -> `[B, S_local, Hq, Dv]`.
        `variant` (variants.py) and the global `[Hq]` `sinks` (each rank uses
        its heads' slice) are the attention variants. `engine`: the caller's fused engine
        (`fused.Engine`); the fused path runs on it, the others hold no engine and leave it."""

    def seq_to_heads(self, tensors, *, group, rank: int, seq_lens) -> Tuple[torch.Tensor, ...]:
        """Sequence shards `[B, S_local, H_t, D]` -> head shards `[B, S, Hl_t, D]`, one exchange
        (differentiable; KV heads replicated where there are fewer than ranks)."""

    def heads_to_seq(self, x, *, group, rank: int, seq_lens) -> torch.Tensor:
        """Head shard `[B, S, Hl, D]` -> sequence shard `[B, S_local, P * Hl, D]` (differentiable)."""

    def attention(self, q, k, v, *, causal: bool, softmax_scale: Optional[float], cu_seqlens=None,
                  deterministic: Optional[bool] = None, with_lse: bool = False, variant=PLAIN,
                  sinks=None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Single-device attention over `[B, S, H, D]` (bottom-right causal when Sq != Sk;
        packed documents with `cu_seqlens`; the `variant` and `[Hq]` `sinks`): (out, lse `[B, Hq, Sq]` when `with_lse`
        (float32; float64 for float64 inputs; forward only), else None). `deterministic`:
        a bitwise-reproducible backward (None: `ULYSSES_KERNELS_DETERMINISTIC`)."""

    def ring_shift(self, group, world: int, rank: int, device: torch.device) -> Optional[Callable]:
        """The transfers of a ring over `group` on this path (ring/schedule.py, `Shift`), or
        None for torch.distributed P2P."""


def requested_backend(backend: Optional[str]) -> str:
    """The backend asked for: the argument, else the environment, else "auto"."""
    if backend is None:
        return env.choice(env.BACKEND, env.BACKEND.choices, env.BACKEND.default)
    if backend not in BACKENDS + ("auto",):
        raise ValueError(f"backend={backend!r} is not a backend; choose one of {', '.join(BACKENDS)} "
                         "(or None / 'auto')")
    return backend


# The reasons already warned about in this process (one warning per reason).
_WARNED_REFERENCE_ON_CUDA = set()


def _warn_reference_on_cuda(problem: str) -> None:
    """Say once per reason that a CUDA call runs on the reference path: torch SDPA where it
    computes the call (reference/sdpa.py), else the reference attention, O(S^2) memory and
    several times slower than the kernels."""
    if problem in _WARNED_REFERENCE_ON_CUDA:
        return
    _WARNED_REFERENCE_ON_CUDA.add(problem)
    warnings.warn(f"ulysses_kernels: CUDA inputs run on the reference path (torch SDPA where it expresses the "
                  f"call, else the O(S^2) reference attention) because backend='triton' {problem}; "
                  "backend='reference' chooses it without this warning", stacklevel=3)


def resolve_backend(backend: Optional[str], device: torch.device, *, distributed: bool,
                    paths: Mapping[str, Path], tensors: Sequence = ()) -> str:
    """Pick the path for `tensors` on `device`; a forced path that cannot run raises
    RuntimeError. Automatic choice takes the fastest path whose problem is None, so e.g.
    float64 CUDA inputs use the reference path (with one warning per reason)."""
    name = requested_backend(backend)
    if name == "auto":
        if device.type != "cuda":
            return "reference"
        if distributed and paths["fused"].problem(device, tensors) is None:
            return "fused"
        problem = paths["triton"].problem(device, tensors)
        if problem is None:
            return "triton"
        _warn_reference_on_cuda(problem)
        return "reference"
    if name != "reference":
        problem = paths[name].problem(device, tensors)
        if problem:
            raise RuntimeError(f"backend={name!r} {problem}")
    return name
