"""Flash-attention backward, dK/dV kernel.

One program owns a ``[BLOCK_N, D]`` tile of dK and dV for one (batch, KV head) and loops
over every query head of its GQA group (``h = hk*G .. hk*G + G - 1``) and over the query
rows that can see the tile: ``P^T = exp2(K Q^T * scale*log2e - lse*log2e)``,
``dV += P^T dO``, ``dS^T = P^T * (V dO^T - delta)``, ``dK += dS^T Q``; finally
``dK *= scale``. The GQA reduction happens in registers: no atomics, deterministic.

Query rows are visited in three phases: masked (causal diagonal / document start),
unmasked (rows that see the whole key tile), masked (document end / sequence end).
"""

import torch
import triton
import triton.language as tl

from ._common import (
    LOG2E,
    TunedLauncher,
    dot_precision,
    interpreting,
    maybe_fp32,
    rows_to_offsets,
    seq_bucket,
    token_rows,
)

LOG2E_C = tl.constexpr(LOG2E)


@triton.jit
def _dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, hk, GROUP, HQ, sq_h, sdo_h,
                sq_b, sq_s, sq_d, sdo_b, sdo_s, sdo_d,
                b, Sq, B, P, lo, hi, offs_n, offs_d, doc_k, DOCS, qk_scale, causal_off,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
                SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                FP32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Query rows [lo, hi) of every query head of the GQA group, as ONE flat loop.

    A loop over the heads around the row loop would nest three software-pipelined loops
    in a runtime loop: Triton 3.6 then spills hundreds of bytes of registers (sm_90
    build, D = 128), and each head would drain and refill the pipeline. Flat, the
    iteration ``it`` covers head ``it // nblk`` and row block ``it % nblk``.
    """
    d_ok = offs_d < HEAD_DIM
    nblk = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_M)
    # Every address the body forms must lie inside the tensors for ANY `it`, the empty
    # loop's included: the software pipeliner may issue a first iteration's loads ahead of
    # the trip-count test. With `it // nblk` and an empty phase (nblk = 0, the non-causal
    # first phase) the head index was a division by zero, the rows were valid, so the
    # load was real: an illegal address on an H200 (Triton 3.6, 8 warps, 2 stages; see
    # docs/architecture.md, "First GPU run"). Hence a divisor >= 1, the head clamped to
    # the group and the address rows clamped to the sequence (masked lanes read row Sq-1).
    per_head = tl.maximum(nblk, 1)
    for it in range(0, nblk * GROUP):
        g = tl.minimum(it // per_head, GROUP - 1)
        h = (hk * GROUP + g).to(tl.int64)
        q_head = h * sq_h
        do_head = h * sdo_h
        lse_base = (b * HQ + h) * Sq
        start_m = lo + (it - g * per_head) * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < Sq
        addr_m = tl.minimum(offs_m, Sq - 1)
        tile_mask = m_ok[:, None] & d_ok[None, :]
        rows = token_rows(addr_m, b, Sq, B, P, SPLIT)  # shared by Q and dO
        q_rows = rows_to_offsets(rows, b, sq_b, sq_s, SPLIT)
        do_rows = rows_to_offsets(rows, b, sdo_b, sdo_s, SPLIT)
        q = tl.load(Q + q_head + q_rows[:, None] + offs_d[None, :] * sq_d, mask=tile_mask, other=0.0)
        q = maybe_fp32(q, FP32_DOT)
        lse = tl.load(LSE + lse_base + addr_m, mask=m_ok, other=float("inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E_C)
        qkT = tl.dot(k, tl.trans(q), input_precision=PRECISION)
        pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])
        if MASKED:
            valid = m_ok[None, :]
            if CAUSAL:
                valid = valid & (offs_n[:, None] <= offs_m[None, :] + causal_off)
            if VARLEN:
                doc_q = tl.load(DOCS + addr_m, mask=m_ok, other=-2)
                valid = valid & (doc_k[:, None] == doc_q[None, :])
            pT = tl.where(valid, pT, 0.0)
        do = tl.load(DO + do_head + do_rows[:, None] + offs_d[None, :] * sdo_d, mask=tile_mask, other=0.0)
        do = maybe_fp32(do, FP32_DOT)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PRECISION)
        delta = tl.load(DELTA + lse_base + addr_m, mask=m_ok, other=0.0)
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["Sq", "Sk", "B", "P", "TUNE_KEY", "HQ", "HKV", "GROUP"])
def _flash_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, DOCS, CU,
    sq_b, sq_s, sq_h, sq_d,
    sk_b, sk_s, sk_h, sk_d,
    sv_b, sv_s, sv_h, sv_d,
    sdo_b, sdo_s, sdo_h, sdo_d,
    sdk_b, sdk_s, sdk_h, sdk_d,
    sdv_b, sdv_s, sdv_h, sdv_d,
    Sq, Sk, B, P, sm_scale, qk_scale, TUNE_KEY, HQ, HKV, GROUP,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, SPLIT: tl.constexpr,
    FP32_DOT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // HKV
    hk = pid_bh % HKV
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < Sk
    d_ok = offs_d < HEAD_DIM
    n_last = tl.minimum(n0 + BLOCK_N, Sk) - 1
    causal_off = Sk - Sq
    kv_mask = n_ok[:, None] & d_ok[None, :]

    n_rows = token_rows(offs_n, b, Sk, B, P, SPLIT)  # shared by K, V, dK and dV
    k_rows = rows_to_offsets(n_rows, b, sk_b, sk_s, SPLIT)
    v_rows = rows_to_offsets(n_rows, b, sv_b, sv_s, SPLIT)
    k = tl.load(K + hk * sk_h + k_rows[:, None] + offs_d[None, :] * sk_d, mask=kv_mask, other=0.0)
    v = tl.load(V + hk * sv_h + v_rows[:, None] + offs_d[None, :] * sv_d, mask=kv_mask, other=0.0)
    k = maybe_fp32(k, FP32_DOT)
    v = maybe_fp32(v, FP32_DOT)

    # Query rows [lo, hi) that may see a key of the tile; [full_lo, full_hi) see all of it.
    if VARLEN:
        doc_k = tl.load(DOCS + offs_n, mask=n_ok, other=-1)
        first_doc = tl.load(DOCS + n0)
        last_doc = tl.load(DOCS + n_last)
        lo = tl.load(CU + first_doc)
        hi = tl.load(CU + last_doc + 1)
        if CAUSAL:
            lo = tl.maximum(lo, n0)
            full_lo = tl.minimum(tl.maximum(n_last, lo), hi)
        else:
            full_lo = lo
        full_hi = tl.where(first_doc == last_doc, hi, full_lo)
    else:
        doc_k = offs_n  # unused
        lo = 0
        hi = Sq
        if CAUSAL:
            lo = tl.minimum(tl.maximum(n0 - causal_off, 0), Sq)
            full_lo = tl.minimum(tl.maximum(n_last - causal_off, lo), Sq)
        else:
            full_lo = lo
        # Rows past Sq are neutral (q = dO = 0, P = 0): the last block needs no mask.
        full_hi = Sq + BLOCK_M - 1
    a_end = lo + tl.cdiv(full_lo - lo, BLOCK_M) * BLOCK_M
    a_end = tl.minimum(a_end, hi)
    b_end = a_end + tl.maximum(full_hi - a_end, 0) // BLOCK_M * BLOCK_M

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # Three phases, each over all query heads of the group (see _dkdv_inner).
    dk, dv = _dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, hk, GROUP, HQ, sq_h, sdo_h,
                         sq_b, sq_s, sq_d, sdo_b, sdo_s, sdo_d,
                         b, Sq, B, P, lo, a_end, offs_n, offs_d, doc_k, DOCS, qk_scale, causal_off,
                         True, CAUSAL, VARLEN, SPLIT, BLOCK_M, HEAD_DIM, FP32_DOT, PRECISION)
    dk, dv = _dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, hk, GROUP, HQ, sq_h, sdo_h,
                         sq_b, sq_s, sq_d, sdo_b, sdo_s, sdo_d,
                         b, Sq, B, P, a_end, b_end, offs_n, offs_d, doc_k, DOCS, qk_scale, causal_off,
                         False, CAUSAL, VARLEN, SPLIT, BLOCK_M, HEAD_DIM, FP32_DOT, PRECISION)
    dk, dv = _dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, hk, GROUP, HQ, sq_h, sdo_h,
                         sq_b, sq_s, sq_d, sdo_b, sdo_s, sdo_d,
                         b, Sq, B, P, b_end, hi, offs_n, offs_d, doc_k, DOCS, qk_scale, causal_off,
                         True, CAUSAL, VARLEN, SPLIT, BLOCK_M, HEAD_DIM, FP32_DOT, PRECISION)
    dk = dk * sm_scale
    dk_rows = rows_to_offsets(n_rows, b, sdk_b, sdk_s, SPLIT)
    dv_rows = rows_to_offsets(n_rows, b, sdv_b, sdv_s, SPLIT)
    tl.store(DK + hk * sdk_h + dk_rows[:, None] + offs_d[None, :] * sdk_d,
             dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + hk * sdv_h + dv_rows[:, None] + offs_d[None, :] * sdv_d,
             dv.to(DV.dtype.element_ty), mask=kv_mask)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per padded head dim; first = default.
# The dK/dV accumulators (2 x BLOCK_N x D fp32) dominate the registers: with D = 128 and
# 8 warps they take 128 per thread, so BLOCK_M stays at 32 (BLOCK_M = 64 spills) and
# BLOCK_N at 128, the Triton tutorial's Hopper tiles (BLOCK_M1=32 / BLOCK_N1=128; its
# 4 warps would need 256 registers per thread for the accumulators alone, hence 8 here).
# Measured with sm_90 builds (cuobjdump -res-usage): (32, 128, 8, 2) has no spills in the
# plain layout under Triton 3.6 and 3.8; 3 stages spill under 3.8 (kept as a candidate for
# autotuning only). The VARLEN+SPLIT variant spills a few registers (<= 40 bytes) either way.
# D = 256: 8 warps only (4 warps give mma.sync instead of wgmma, and spill).
_DKDV_CONFIGS = {
    16: [(32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3)],
    32: [(32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3)],
    64: [(32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3)],
    128: [(32, 128, 8, 2), (32, 128, 8, 3), (32, 64, 8, 2)],
    256: [(16, 64, 8, 2)],
}
_INTERPRET_BLOCKS = (16, 32)


_DKDV_FP32_CONFIGS = {16: (16, 64, 4, 2), 32: (16, 64, 4, 2), 64: (16, 64, 4, 2), 128: (16, 64, 4, 2),
                      256: (16, 64, 4, 1)}


_launch = TunedLauncher(_flash_bwd_dkdv_kernel, _DKDV_CONFIGS, _INTERPRET_BLOCKS,
                        fp32_configs=_DKDV_FP32_CONFIGS)


def launch_dkdv(q, k, v, do, dk, dv, lse, delta, docs, cu_seqlens, *, strides, batch, seqlen_q,
                seqlen_k, num_q_heads, num_kv_heads, head_dim, block_d, causal, softmax_scale,
                split, seq_splits):
    """strides: (q, k, v, do, dk, dv) stride 4-tuples."""
    fp32_dot = interpreting()
    varlen = docs is not None
    args = (q, k, v, do, dk, dv, lse, delta, docs if varlen else lse, cu_seqlens if varlen else lse,
            *strides[0], *strides[1], *strides[2], *strides[3], *strides[4], *strides[5],
            seqlen_q, seqlen_k, batch, seq_splits, softmax_scale, softmax_scale * LOG2E,
            seq_bucket(max(seqlen_q, seqlen_k)), num_q_heads, num_kv_heads,
            num_q_heads // num_kv_heads)
    meta = dict(HEAD_DIM=head_dim, BLOCK_D=block_d,
                CAUSAL=bool(causal), VARLEN=varlen, SPLIT=bool(split),
                FP32_DOT=fp32_dot, PRECISION=dot_precision(q.dtype, block_d))
    _launch(lambda bm, bn: (triton.cdiv(seqlen_k, bn), batch * num_kv_heads), args, meta, block_d, fp32_dot,
            q.dtype == torch.float32)
