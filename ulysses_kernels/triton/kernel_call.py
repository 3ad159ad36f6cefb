"""One attention call as the launchers read it (docs/architecture.md, "Attention kernels"):
where it runs (Target), its shapes, mask and variant (KernelCall, built once per call by
ops), the forward's row statistics for the backward (RowStats), the mask and variant
arguments of a launch (kernel_band, variant_args), the padded head dim (block_d) and the
tests' visit counts (VisitCounter).

Variants (compile-time switches, off by default: without them a kernel builds the same
instructions as before, bench/sass_report.py; docs/architecture.md, "Attention variants"):

* ``WINDOW``: a band. With off = Sk - Sq, query i sees key j iff
  ``i + off - left <= j <= i + off + right`` (runtime ints ``window_left`` /
  ``window_right``, negative allowed; the host folds ``causal`` into the right side and
  clamps both, see :func:`kernel_band`). The loops visit only the blocks inside the band.
* ``SOFTCAP``: scores ``c * tanh(scale * q.k / c)`` (tanh from exp2: ``scores.capped_tanh``).
* ``SINKS`` (forward only): one logit per query head in the softmax denominator.
* ``HEAD_DIM_V`` / ``BLOCK_DV``: v, out, dO and dV have a head dim of their own.
* ``COUNT``: tests count the blocks each program visits (one atomic add per loop
  iteration into ``COUNTS``; :class:`VisitCounter`).
"""

from typing import Dict, NamedTuple, Optional, Tuple

import torch

from ..env import interpreting
from ..variants import fold_causal
from .scores import LOG2E, TWO_LOG2E


class Target(NamedTuple):
    """Where a launch runs, as its decisions see it: the device type ("cuda" or "cpu"),
    whether Triton interprets the kernels, and the GPU's SM count (0: unknown). A launch
    reads it from its tensors (``Target.of``); a plan (``ulysses_kernels.triton.plan``)
    may describe another machine's (meta tensors, a GPU's target)."""

    device_type: str
    interpreting: bool
    sm_count: int = 0

    @classmethod
    def of(cls, tensor) -> "Target":
        device = tensor.device
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
        return cls(device.type, interpreting(), sms)

    @property
    def gpu(self) -> bool:
        """Compiled kernels on a GPU (not the interpreter)."""
        return self.device_type == "cuda" and not self.interpreting


class KernelCall(NamedTuple):
    """One attention call as every launcher reads it, built once per call by ``ops._run_fwd``
    / ``_run_bwd``: the shapes as the kernels see them (one rank's heads, the SPLIT mode),
    the mask after ``kernel_band`` (causal, band, the documents' id per key and boundary
    table), the variant and where it runs."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    split: int                            # the SPLIT mode (split_mode)
    seq_splits: int
    causal: bool                          # kernel_band's
    band: Optional[Tuple[int, int]]       # kernel_band's (None: WINDOW off)
    softcap: float                        # c, or 0 for none
    softmax_scale: float
    docs: Optional[torch.Tensor]          # document id per key position (VARLEN), or None
    cu_seqlens: Optional[torch.Tensor]    # the boundary table the kernels index, or None
    target: Target

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def varlen(self) -> bool:
        return self.docs is not None

    def documents(self, dummy):
        """The (ids, table) pair a kernel takes: ``dummy`` for both without documents."""
        return (self.docs, self.cu_seqlens) if self.varlen else (dummy, dummy)


class RowStats(NamedTuple):
    """The per-row statistics the backward kernels read: the forward's LSE and delta =
    rowsum(dO * O), fp32 ``[B, Hq, Sq]``, rows ``row_stride`` apart (None: Sq, contiguous;
    the warp-specialized kernels take padded rows, ``flash_bwd.tma_row_stats``)."""

    lse: torch.Tensor
    delta: torch.Tensor
    row_stride: Optional[int] = None


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def block_d(head_dim: int) -> int:
    return max(16, next_pow2(head_dim))


def kernel_band(causal, window, seqlen_q, seqlen_k):
    """(causal, band) as the kernels take a mask: band None (WINDOW off) or (left, right)
    ints for the band rule (see blocks.in_band), causal folded into it (``variants.fold_causal``).

    A side that hides no key becomes unbounded (None): left >= Sk - 1, right >= Sq - 1.
    No band left, or only the causal edge (left unbounded, right 0): the causal or the
    plain kernels, unchanged. Otherwise sides are clamped to where they hide every key
    (left >= -Sq, right >= -Sk), so the kernels' int32 arithmetic cannot overflow.
    """
    left, right = fold_causal(window, causal)
    if causal:  # the causal edge as the band's right side (kept only if a window remains)
        right = 0 if right is None else int(right)
    if left is not None and left >= seqlen_k - 1:
        left = None
    if right is not None and right >= seqlen_q - 1:
        right = None
    if left is None and right is None:
        return False, None
    if left is None and right == 0:
        return True, None
    left = seqlen_k if left is None else max(int(left), -seqlen_q)
    right = seqlen_q if right is None else max(int(right), -seqlen_k)
    return False, (left, right)


class KernelVariant(NamedTuple):
    """A launch's variant arguments: ``softcap`` = (softcap_in, softcap_out) and ``window``
    = (left, right) runtime tuples, ``constexprs`` = {WINDOW, SOFTCAP}."""

    softcap: Tuple[float, float]
    window: Tuple[int, int]
    constexprs: Dict[str, bool]


def variant_args(band, softcap: float, softmax_scale: float) -> KernelVariant:
    """The variant arguments of a launch. band: kernel_band's (None: no window); softcap:
    c > 0, or 0 for none. ``softcap_in = 2 log2(e) scale / c`` feeds capped_tanh,
    ``softcap_out = c log2(e)`` turns tanh into a log2-unit score."""
    left, right = band if band is not None else (0, 0)
    cap_in = TWO_LOG2E * softmax_scale / softcap if softcap else 0.0
    return KernelVariant(softcap=(cap_in, softcap * LOG2E), window=(int(left), int(right)),
                         constexprs=dict(WINDOW=band is not None, SOFTCAP=bool(softcap)))


class VisitCounter:
    """Tests (COUNT): how many blocks each program of a kernel visits (see
    ``ops._count_visited_blocks``). ``slots`` must cover the largest grid of the call."""

    def __init__(self, device, slots: int):
        self.device, self.slots = device, int(slots)
        self.counts, self.configs, self.grids = {}, {}, {}

    def tensor(self, name: str) -> torch.Tensor:
        """A zeroed int32 counter for kernel ``name``: program p adds to slot p."""
        self.counts[name] = torch.zeros(self.slots, dtype=torch.int32, device=self.device)
        return self.counts[name]

    def ran(self, name: str, config, grid) -> None:
        """Kernel ``name`` ran ``config`` on ``grid``: program (x, y) counted in slot
        ``y * grid[0] + x``."""
        self.configs[name] = config
        self.grids[name] = grid
