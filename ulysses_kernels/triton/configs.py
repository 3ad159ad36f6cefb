"""THE launch configurations of the attention kernels: one table, ``CONFIGS``, kernel name
-> ``ConfigSet``. A config is ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``; per padded
head dim (16, 32, 64, 128, 256; a missing one takes 128's) a list of candidates whose first
is the default. ``_common.TunedLauncher.choose`` is the one rule that picks among a set's
tables for a launch (docs/architecture.md, "Attention kernels"); ``ulysses-kernels doctor
--explain`` prints what it picked and why. The tile comments cite ``bench/sass_report.py``
builds (sm_90, the Triton versions named).
"""

from typing import Dict, List, NamedTuple, Tuple

Config = Tuple[int, int, int, int]  # BLOCK_M, BLOCK_N, num_warps, num_stages


class ConfigSet(NamedTuple):
    """One kernel's tables. plain: the candidates of every launch not covered below;
    interpret_blocks: the interpreter's (BLOCK_M, BLOCK_N) (small, for fast tests); fp32:
    the one config of fp32 inputs on a GPU (tiles twice the bytes, tf32x3 dots); masked:
    replaces plain's default and joins its candidates for the VARLEN / per-token SPLIT=2 /
    WINDOW launches (their index arithmetic costs registers); warp_specialize: the only
    candidates of a WARP_SPECIALIZE launch."""

    plain: Dict[int, List[Config]]
    interpret_blocks: Tuple[int, int]
    fp32: Dict[int, Config]
    masked: Dict[int, List[Config]] = {}
    warp_specialize: Dict[int, List[Config]] = {}


# ---------------------------------------------------------------------------- forward
# Q is the shared-memory A operand of the QK^T wgmma: with BLOCK_N = 64 its re-reads put
# QK^T at the shared-memory bandwidth limit, BLOCK_N = 128 leaves headroom (FlashAttention-3
# and the Triton tutorial use 128x128 with 2 warpgroups for D = 128 on Hopper). D = 128
# default: 2 stages, which builds without spills for the plain layout and the buffer with
# affine tiles alike (3 stages spill 40 B there: Triton 3.8); 3 stages stay a candidate.
# masked: VARLEN / per-token SPLIT=2 (more index registers): 128x128x3 stages spills there;
# the all-to-all buffer with affine tiles (SPLIT=1) uses the plain configs.
# warp_specialize (features.py): Triton splits a 4-warp program into producer and consumer
# partitions (8 warps build no warp-specialized code, Triton 3.6 to 3.9).
FORWARD = ConfigSet(
    plain={
        16: [(128, 64, 4, 4), (64, 64, 4, 4)],
        32: [(128, 64, 4, 4), (64, 64, 4, 4)],
        64: [(128, 64, 4, 4), (128, 128, 8, 3), (128, 64, 8, 3)],
        128: [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3)],
        256: [(64, 64, 8, 2), (128, 32, 8, 2)],
    },
    interpret_blocks=(32, 16),
    fp32={16: (64, 32, 4, 2), 32: (64, 32, 4, 2), 64: (64, 32, 4, 2), 128: (64, 32, 4, 2), 256: (64, 32, 4, 1)},
    masked={
        128: [(128, 64, 8, 3), (128, 128, 8, 2)],
    },
    warp_specialize={
        16: [(128, 64, 4, 2)],
        32: [(128, 64, 4, 2)],
        64: [(128, 128, 4, 2), (128, 64, 4, 3)],
        128: [(128, 128, 4, 2), (128, 64, 4, 2)],
        256: [(64, 64, 4, 2)],
    },
)

# ------------------------------------------------------------- dK/dV, two-kernel backward
# The dK/dV accumulators (2 x BLOCK_N x D fp32) dominate the registers: with D = 128 and 8
# warps they take 128 per thread at BLOCK_N = 128 (the Triton tutorial's Hopper tile,
# BLOCK_M1=32 / BLOCK_N1=128), which spills 8-16 B in every layout with Triton 3.8; the
# D = 128 default is 32x64 (205 registers, no spills), 32x128 stays an autotuning candidate.
# D = 256: 8 warps only (4 warps give mma.sync instead of wgmma, and spill).
# warp_specialize (features.py, dK/dV only): 4-warp programs that Triton splits into
# producer and consumer partitions; 64-row query tiles (every wgmma N >= 64) build there
# without spills at D = 64 and for non-causal D = 128, with 16 B causal (Triton 3.8; 32 B
# under 3.6).
DKDV = ConfigSet(
    plain={
        16: [(32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3)],
        32: [(32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3)],
        64: [(32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3)],
        128: [(32, 64, 8, 2), (32, 128, 8, 2), (32, 128, 8, 3)],
        256: [(16, 64, 8, 2)],
    },
    interpret_blocks=(16, 32),
    fp32={16: (16, 64, 4, 2), 32: (16, 64, 4, 2), 64: (16, 64, 4, 2), 128: (16, 64, 4, 2), 256: (16, 64, 4, 1)},
    warp_specialize={
        16: [(64, 128, 4, 2)],
        32: [(64, 128, 4, 2)],
        64: [(64, 128, 4, 2), (64, 128, 4, 3)],
        128: [(64, 128, 4, 2), (64, 128, 4, 3), (64, 64, 4, 2)],
        256: [(64, 64, 4, 2)],
    },
)

# ------------------------------------------------------ dK/dV + atomic dQ (the default)
# BLOCK_M >= 64 would keep every wgmma at N >= 64 (K Q^T and V dO^T have N = BLOCK_M) and
# give the 5th GEMM (dS^T)^T K a warpgroup's M = 64, but no such D = 128 tile builds
# without spills under Triton 3.8 (64x64x8w 104 B, 64x128x8w 168 B, 4 warps 344+ B; a
# query-major loop order spilled more). K and V as wgmma A operands sit in registers,
# duplicated per warpgroup when two split N. So the default stays 32x128 (no spills, 236
# registers), whose dQ GEMM (M = 32) runs on mma.sync; the BLOCK_M = 64 tiles remain
# autotuning candidates, timed against it on the GPU.
DKDV_ATOMIC = ConfigSet(
    plain={
        16: [(32, 128, 8, 2), (64, 64, 8, 2), (64, 128, 8, 2)],
        32: [(32, 128, 8, 2), (64, 64, 8, 2), (64, 128, 8, 2)],
        64: [(32, 128, 8, 2), (64, 64, 8, 2), (64, 128, 8, 2)],
        128: [(32, 128, 8, 2), (64, 64, 8, 2), (64, 128, 8, 2)],
        256: [(16, 64, 8, 2), (64, 32, 8, 2)],
    },
    interpret_blocks=(16, 32),
    fp32=DKDV.fp32,
)

# ----------------------------------------------------------------------------------- dQ
# Q and dO are shared-memory A operands of QK^T and dO V^T: BLOCK_N = 32 makes those two
# wgmmas shared-memory-bandwidth bound (about 2/3 of peak), BLOCK_N = 64 does not, and
# 128x64 with 8 warps builds for sm_90 without spills (Triton 3.6 / 3.8, VARLEN+SPLIT too).
# D = 256: BLOCK_M must be >= 64 with 8 warps, or Triton falls back to mma.sync (no wgmma).
# warp_specialize (features.py "bwd_warp_specialize"): as the forward's.
DQ = ConfigSet(
    plain={
        16: [(128, 32, 4, 4), (64, 64, 4, 3)],
        32: [(128, 32, 4, 4), (64, 64, 4, 3)],
        64: [(128, 32, 4, 4), (128, 64, 8, 3)],
        128: [(128, 64, 8, 3), (128, 32, 8, 3), (128, 64, 8, 2)],
        256: [(64, 32, 8, 2), (64, 32, 8, 3)],
    },
    interpret_blocks=(32, 16),
    fp32={16: (64, 32, 4, 2), 32: (64, 32, 4, 2), 64: (64, 32, 4, 2), 128: (64, 32, 4, 2), 256: (64, 16, 4, 1)},
    warp_specialize={
        16: [(128, 64, 4, 2)],
        32: [(128, 64, 4, 2)],
        64: [(128, 64, 4, 2), (128, 128, 4, 2)],
        128: [(128, 64, 4, 2), (128, 128, 4, 2), (64, 64, 4, 2)],
        256: [(64, 64, 4, 2)],
    },
)

CONFIGS: Dict[str, ConfigSet] = {"fwd": FORWARD, "dkdv": DKDV, "dkdv_atomic": DKDV_ATOMIC, "dq": DQ}
