"""Backward preprocess: ``delta = rowsum(dO * O)`` in fp32, stored ``[B, Hq, Sq]``.

O and dO have v's head dim (Dv, the HEAD_DIM the host passes here). delta also gives the
sinks' gradient (``variants.sinks_gradient``).
"""

import triton
import triton.language as tl

from ..env import interpreting
from .addressing import seq_offsets


@triton.jit(do_not_specialize=["Sq", "B", "P", "HQ"])
def _flash_bwd_preprocess_kernel(
    O, DO, DELTA,
    so_b, so_s, so_h, so_d,
    sdo_b, sdo_s, sdo_h, sdo_d,
    Sq, B, P, HQ,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // HQ
    h = pid_bh % HQ
    m0 = pid_m * BLOCK_M
    local_m = tl.arange(0, BLOCK_M)
    offs_m = m0 + local_m
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < Sq
    mask = m_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    o_base, o_rows = seq_offsets(offs_m, m0, local_m, b, Sq, B, P, so_b, so_s, SPLIT)
    do_base, do_rows = seq_offsets(offs_m, m0, local_m, b, Sq, B, P, sdo_b, sdo_s, SPLIT)
    o = tl.load(O + (h * so_h + o_base) + (o_rows[:, None] + offs_d[None, :] * so_d), mask=mask, other=0.0)
    do = tl.load(DO + (h * sdo_h + do_base) + (do_rows[:, None] + offs_d[None, :] * sdo_d), mask=mask,
                 other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + pid_bh * Sq + offs_m, delta, mask=m_ok)


def launch_preprocess(out, do, delta, *, so_strides, sdo_strides, batch, seqlen_q, num_q_heads,
                      head_dim, block_d, split, seq_splits):
    # fp32 copies of the O and dO tiles live in registers: 64 rows for D = 256 (no spills).
    bm = 32 if interpreting() else (128 if block_d <= 128 else 64)
    grid = (triton.cdiv(seqlen_q, bm), batch * num_q_heads)
    _flash_bwd_preprocess_kernel[grid](
        out, do, delta, *so_strides, *sdo_strides, seqlen_q, batch, seq_splits, num_q_heads,
        HEAD_DIM=head_dim, BLOCK_D=block_d, SPLIT=int(split), BLOCK_M=bm,
        num_warps=4 if block_d <= 64 else 8)
