"""What every attention program starts from: its prologue (which tile and heads it owns,
the tile's positions) and the compile-time bundles its loop phases read by name
(docs/architecture.md, "Attention kernels").

The forward, dQ and dK/dV kernels pass their loop phases (the ``*_inner`` functions) two
constexpr bundles, one definition each for the three kernels:

* ``SWITCHES`` (:class:`LoopSwitches`): the mask, layout, variant and feature switches;
  a kernel leaves the switches it does not have at their default (off);
* ``DIMS`` (:class:`LoopDims`): the tile and head dims and the dot's precision.

How they travel (the one construction that works on Triton 3.6, 3.8 and 3.9 and in the
interpreter): the kernel calls the NamedTuple on its constexpr parameters and binds the
result to an annotated name (``SWITCHES: tl.constexpr = LoopSwitches(CAUSAL=CAUSAL, ...)``),
which keeps a tuple of constexprs, and passes it to the phase's ``tl.constexpr`` parameter;
the phase reads its fields inline (``SWITCHES.CAUSAL``, ``DIMS.BLOCK_N``), each a
constexpr where it is used. The alternatives fail somewhere: a plain assignment
(``SWITCHES = LoopSwitches(...)``) turns every field into a tensor (a string field such as
PRECISION does not even convert); ``tl.constexpr(LoopSwitches(...))`` compiles, but the
interpreter's constexpr has no attribute access; and constexpr tuples are never launch
arguments (an unpacking bug of Triton's launcher).
"""

from typing import NamedTuple

import triton
import triton.language as tl


class LoopSwitches(NamedTuple):
    """The switches of a loop phase (the kernel's constexprs of the same names)."""

    CAUSAL: bool
    VARLEN: bool
    SPLIT: int
    WINDOW: bool
    SOFTCAP: bool
    COUNT: bool
    WARP_SPECIALIZE: bool
    KV_DESC: bool = False       # the forward's Hopper features
    FMA_SCALE: bool = False
    LAZY_RESCALE: bool = False
    DQ_ATOMIC: bool = False     # the dK/dV kernel's dQ modes
    DQ_REDUCE: bool = False


class LoopDims(NamedTuple):
    """The tile (BLOCK_M query rows x BLOCK_N keys), the head dims of q/k (HEAD_DIM,
    padded BLOCK_D) and of v (HEAD_DIM_V, BLOCK_DV), and the dots' inputs (FP32_DOT: the
    interpreter's fp32, PRECISION: tl.dot's input_precision)."""

    BLOCK_M: int
    BLOCK_N: int
    HEAD_DIM: int
    BLOCK_D: int
    HEAD_DIM_V: int
    BLOCK_DV: int
    FP32_DOT: bool
    PRECISION: str


# ------------------------------------------------------------------------ the prologue
# The query-tile programs (forward, dQ) start the same way: which tile and heads they own
# (query_tile_program), then that tile's positions and head-dim columns (program_tile).
# The dK/dV kernel keeps its own prologue: program_tile there moves one instruction of
# the sm_90 build of its TMA dQ reduce (Triton 3.9, bench/sass_report.py --compare).

@triton.jit
def query_tile_program(Sq, HQ, GROUP, BLOCK_M: tl.constexpr):
    """A query-tile program's ids (forward, dQ; grid (query tiles, B*HQ)): (its tile,
    its (batch, query head) index, b, h, its KV head hk, its visit-count slot). Tiles run
    heaviest first (the last, for causal): better tail balance."""
    num_m = tl.cdiv(Sq, BLOCK_M)
    pid_m = num_m - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // HQ
    h = pid_bh % HQ
    hk = h // GROUP
    return pid_m, pid_bh, b, h, hk, pid_bh * num_m + pid_m


@triton.jit
def program_tile(tile, S, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_DV: tl.constexpr):
    """Tile ``tile`` of BLOCK positions of a sequence of S, and the head dims' columns:
    (its first position, local offsets 0..BLOCK-1, positions, q/k columns, v columns,
    positions < S, q/k columns < HEAD_DIM, its last valid position)."""
    start = tile * BLOCK
    local = tl.arange(0, BLOCK)
    offs = start + local
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    ok = offs < S
    d_ok = offs_d < HEAD_DIM
    last = tl.minimum(start + BLOCK, S) - 1
    return start, local, offs, offs_d, offs_dv, ok, d_ok, last
