"""What every attention program starts from: the compile-time bundles its loop phases read
by name (docs/architecture.md, "Attention kernels").

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
