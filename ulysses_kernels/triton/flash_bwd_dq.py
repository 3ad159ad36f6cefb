"""Flash-attention backward, dQ kernel.

One program owns a ``[BLOCK_M, D]`` tile of dQ for one (batch, query head) and walks the
keys it can see (same two phases as the forward: unmasked blocks, then masked ones):
``P = exp2(QK^T * scale*log2e - lse*log2e)``, ``dS = P * (dO V^T - delta)``,
``dQ += dS K``; finally ``dQ *= scale``. No atomics: deterministic.

Variants (as in the forward): ``WINDOW`` visits only the band's key blocks (masked left
edge, unmasked middle, masked right edge); ``SOFTCAP`` recomputes ``t = tanh(.)`` and
back-propagates through it (``dS_raw = dS * (1 - t^2)``); ``HEAD_DIM_V``: dO and v have
their own head dim (dQ keeps D). Sinks need nothing here: the LSE includes them.
"""

import torch
import triton
import triton.language as tl

from .addressing import kv_descriptor, seq_offsets, tile_row
from .blocks import in_band, query_tile_band_range, query_tile_key_range, query_tile_visit_range
from .configs import CONFIGS
from .kernel_call import KernelCall, RowStats, variant_args
from .kernel_call import block_d as padded_head_dim
from .launcher import TunedLauncher, seq_bucket
from .program import LoopDims, LoopSwitches, program_tile, query_tile_program
from .scores import LOG2E, capped_tanh, dot_precision, maybe_fp32

LOG2E_C = tl.constexpr(LOG2E)


@triton.jit
def _dq_inner(dq, rows, kv, tile, mask, score, counter, lo, hi,
              MASKED: tl.constexpr, SWITCHES: tl.constexpr, DIMS: tl.constexpr):
    """Keys ``[lo, hi)`` of one query tile, MASKED or not, into dq; rows: this tile's q,
    dO, LSE (log2 units) and delta; the other bundles as flash_fwd._fwd_inner's."""
    q, do, lse2, delta = rows
    K, V, k_desc, v_desc, k_head, v_head, k_strides, v_strides = kv
    sk_b, sk_s, sk_h, sk_d = k_strides
    sv_b, sv_s, sv_h, sv_d = v_strides
    b, Sk, B, P, offs_m, offs_d, offs_dv = tile
    doc_q, DOCS, causal_off, window_left, window_right = mask
    qk_scale, softcap_in, softcap_out = score
    COUNTS, count_slot = counter
    d_ok = offs_d < DIMS.HEAD_DIM
    dv_ok = offs_dv < DIMS.HEAD_DIM_V
    local_n = tl.arange(0, DIMS.BLOCK_N)
    for start_n in tl.range(lo, hi, DIMS.BLOCK_N, warp_specialize=SWITCHES.WARP_SPECIALIZE):
        if SWITCHES.COUNT:  # tests: one more block visited by this program
            tl.atomic_add(COUNTS + count_slot, 1)
        offs_n = start_n + local_n
        n_ok = offs_n < Sk
        if SWITCHES.WARP_SPECIALIZE:  # descriptor loads: zeros past Sk and past the head dims
            k_row = tile_row(start_n, b, Sk, B, P, SWITCHES.SPLIT)
            k = k_desc.load([k_row, 0])
            v = v_desc.load([k_row, 0])
        else:
            k_base, k_rows = seq_offsets(offs_n, start_n, local_n, b, Sk, B, P, sk_b, sk_s, SWITCHES.SPLIT)
            v_base, v_rows = seq_offsets(offs_n, start_n, local_n, b, Sk, B, P, sv_b, sv_s, SWITCHES.SPLIT)
            k_ptrs = K + (k_head + k_base) + (k_rows[:, None] + offs_d[None, :] * sk_d)
            v_ptrs = V + (v_head + v_base) + (v_rows[:, None] + offs_dv[None, :] * sv_d)
            if MASKED:
                k = tl.load(k_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
                v = tl.load(v_ptrs, mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
            else:  # whole key blocks: mask padded dims only
                if DIMS.HEAD_DIM == DIMS.BLOCK_D:
                    k = tl.load(k_ptrs)
                else:
                    k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
                if DIMS.HEAD_DIM_V == DIMS.BLOCK_DV:
                    v = tl.load(v_ptrs)
                else:
                    v = tl.load(v_ptrs, mask=dv_ok[None, :], other=0.0)
        k = maybe_fp32(k, DIMS.FP32_DOT)
        qk = tl.dot(q, tl.trans(k), input_precision=DIMS.PRECISION)
        if SWITCHES.SOFTCAP:
            t = capped_tanh(qk, softcap_in)
            p = tl.math.exp2(t * softcap_out - lse2[:, None])
        else:
            p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if MASKED:
            valid = n_ok[None, :]
            if SWITCHES.CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None] + causal_off)
            if SWITCHES.WINDOW:
                valid = valid & in_band(offs_n[None, :], offs_m[:, None], causal_off, window_left, window_right)
            if SWITCHES.VARLEN:
                doc_k = tl.load(DOCS + offs_n, mask=n_ok, other=-1)
                valid = valid & (doc_k[None, :] == doc_q[:, None])
            p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, tl.trans(maybe_fp32(v, DIMS.FP32_DOT)), input_precision=DIMS.PRECISION)
        ds = p * (dp - delta[:, None])
        if SWITCHES.SOFTCAP:
            ds = ds * (1.0 - t * t)  # d(softcap * tanh(x / softcap)) / dx
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DIMS.PRECISION)
    return dq


@triton.jit(do_not_specialize=["sizes", "window", "TUNE_KEY", "HQ", "GROUP", "s_lse"])
def _flash_bwd_dq_kernel(
    Q, K, V, DO, DQ, row_stats, documents, COUNTS,
    q_strides, k_strides, v_strides, do_strides, dq_strides,
    sizes, scores, window, TUNE_KEY, HQ, GROUP, s_lse,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, SPLIT: tl.constexpr,
    FP32_DOT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False, COUNT: tl.constexpr = False,
    WARP_SPECIALIZE: tl.constexpr = False,
):
    # The launch's bundles (launch_dq): one stride tuple (batch, seq, head, dim) per tensor.
    LSE, DELTA = row_stats
    DOCS, CU = documents
    sq_b, sq_s, sq_h, sq_d = q_strides
    sk_b, sk_s, sk_h, sk_d = k_strides
    sv_b, sv_s, sv_h, sv_d = v_strides
    sdo_b, sdo_s, sdo_h, sdo_d = do_strides
    sdq_b, sdq_s, sdq_h, sdq_d = dq_strides
    Sq, Sk, B, P = sizes
    sm_scale, qk_scale, softcap_in, softcap_out = scores
    window_left, window_right = window
    pid_m, pid_bh, b, h, hk, count_slot = query_tile_program(Sq, HQ, GROUP, BLOCK_M)
    m0, local_m, offs_m, offs_d, offs_dv, m_ok, d_ok, m_last = program_tile(pid_m, Sq, BLOCK_M, HEAD_DIM, BLOCK_D,
                                                                            BLOCK_DV)
    causal_off = Sk - Sq
    tile_mask = m_ok[:, None] & d_ok[None, :]

    k_head = hk * sk_h
    v_head = hk * sv_h
    if WARP_SPECIALIZE:
        # Triton's warp-specialized loop (features.py): descriptor loads only, before it and
        # in it; 2-D views of this (batch, head)'s rows as in the forward, and 1-D views of
        # its LSE and delta row (rows s_lse apart: tma_row_stats in flash_bwd.py; 2-D views with a
        # [1, BLOCK_M] tile fail Triton's pass here). Rows past Sq read zeros.
        if SPLIT == 1:
            rows_q, rows_k, q_off, do_off, k_off, v_off = B * Sq, B * Sk, 0, 0, 0, 0
        else:
            rows_q, rows_k = Sq, Sk
            q_off, do_off, k_off, v_off = b * sq_b, b * sdo_b, b * sk_b, b * sv_b
        q_row = tile_row(m0, b, Sq, B, P, SPLIT)
        q = kv_descriptor(Q + (q_off + h * sq_h), rows_q, sq_s, HEAD_DIM, BLOCK_M, BLOCK_D).load([q_row, 0])
        do = kv_descriptor(DO + (do_off + h * sdo_h), rows_q, sdo_s, HEAD_DIM_V, BLOCK_M, BLOCK_DV).load([q_row, 0])
        lse_desc = tl.make_tensor_descriptor(LSE + pid_bh * s_lse, shape=[Sq], strides=[1], block_shape=[BLOCK_M])
        delta_desc = tl.make_tensor_descriptor(DELTA + pid_bh * s_lse, shape=[Sq], strides=[1], block_shape=[BLOCK_M])
        lse = lse_desc.load([m0])
        delta = delta_desc.load([m0])
        k_desc = kv_descriptor(K + (k_off + k_head), rows_k, sk_s, HEAD_DIM, BLOCK_N, BLOCK_D)
        v_desc = kv_descriptor(V + (v_off + v_head), rows_k, sv_s, HEAD_DIM_V, BLOCK_N, BLOCK_DV)
    else:
        q_base, q_rows = seq_offsets(offs_m, m0, local_m, b, Sq, B, P, sq_b, sq_s, SPLIT)
        do_base, do_rows = seq_offsets(offs_m, m0, local_m, b, Sq, B, P, sdo_b, sdo_s, SPLIT)
        q = tl.load(Q + (h * sq_h + q_base) + (q_rows[:, None] + offs_d[None, :] * sq_d), mask=tile_mask,
                    other=0.0)
        do = tl.load(DO + (h * sdo_h + do_base) + (do_rows[:, None] + offs_dv[None, :] * sdo_d),
                     mask=m_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :], other=0.0)
        k_desc = K  # unused
        v_desc = V
    q = maybe_fp32(q, FP32_DOT)
    do = maybe_fp32(do, FP32_DOT)
    if not WARP_SPECIALIZE:
        lse = tl.load(LSE + pid_bh * Sq + offs_m, mask=m_ok, other=float("inf"))
    # Rows that saw no key (lse = -inf) must get P = 0: use +inf there.
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E_C)
    if not WARP_SPECIALIZE:
        delta = tl.load(DELTA + pid_bh * Sq + offs_m, mask=m_ok, other=0.0)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    rows = (q, do, lse2, delta)
    kv = (K, V, k_desc, v_desc, k_head, v_head, k_strides, v_strides)
    tile = (b, Sk, B, P, offs_m, offs_d, offs_dv)
    score = (qk_scale, softcap_in, softcap_out)
    counter = (COUNTS, count_slot)
    SWITCHES: tl.constexpr = LoopSwitches(
        CAUSAL=CAUSAL, VARLEN=VARLEN, SPLIT=SPLIT, WINDOW=WINDOW, SOFTCAP=SOFTCAP, COUNT=COUNT,
        WARP_SPECIALIZE=WARP_SPECIALIZE)
    DIMS: tl.constexpr = LoopDims(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                                  HEAD_DIM_V=HEAD_DIM_V, BLOCK_DV=BLOCK_DV, FP32_DOT=FP32_DOT, PRECISION=PRECISION)
    if WARP_SPECIALIZE:  # one masked loop: the warp-specialized loop must be the only one
        doc_q, lo, hi = query_tile_visit_range(offs_m, m_ok, m0, m_last, Sk, causal_off, window_left, window_right,
                                               DOCS, CU, CAUSAL, VARLEN, WINDOW, SPLIT, BLOCK_N)
        mask = (doc_q, DOCS, causal_off, window_left, window_right)
        dq = _dq_inner(dq, rows, kv, tile, mask, score, counter, lo, hi, MASKED=True, SWITCHES=SWITCHES, DIMS=DIMS)
    elif WINDOW:
        doc_q, start, a, b_end, end = query_tile_band_range(offs_m, m_ok, m0, m_last, Sk, causal_off,
                                                            window_left, window_right, DOCS, CU,
                                                            VARLEN, SPLIT, BLOCK_N)
        mask = (doc_q, DOCS, causal_off, window_left, window_right)
        dq = _dq_inner(dq, rows, kv, tile, mask, score, counter, start, a,
                       MASKED=True, SWITCHES=SWITCHES, DIMS=DIMS)
        if a < b_end:  # its loads are unmasked: not even a pipelined first load when empty
            dq = _dq_inner(dq, rows, kv, tile, mask, score, counter, a, b_end,
                           MASKED=False, SWITCHES=SWITCHES, DIMS=DIMS)
        dq = _dq_inner(dq, rows, kv, tile, mask, score, counter, b_end, end,
                       MASKED=True, SWITCHES=SWITCHES, DIMS=DIMS)
    else:
        doc_q, lo, hi, unmasked_end = query_tile_key_range(offs_m, m_ok, m0, m_last, Sk, causal_off,
                                                           DOCS, CU, CAUSAL, VARLEN, BLOCK_N)
        mask = (doc_q, DOCS, causal_off, window_left, window_right)
        dq = _dq_inner(dq, rows, kv, tile, mask, score, counter, lo, unmasked_end,
                       MASKED=False, SWITCHES=SWITCHES, DIMS=DIMS)
        dq = _dq_inner(dq, rows, kv, tile, mask, score, counter, unmasked_end, hi,
                       MASKED=True, SWITCHES=SWITCHES, DIMS=DIMS)
    dq = dq * sm_scale
    dq_base, dq_rows = seq_offsets(offs_m, m0, local_m, b, Sq, B, P, sdq_b, sdq_s, SPLIT)
    tl.store(DQ + (h * sdq_h + dq_base) + (dq_rows[:, None] + offs_d[None, :] * sdq_d),
             dq.to(DQ.dtype.element_ty), mask=tile_mask)


_launch = TunedLauncher(_flash_bwd_dq_kernel, CONFIGS["dq"])


def launch_dq(q, k, v, do, dq, rows: RowStats, call: KernelCall, *, strides, counter=None, warp_specialize=False,
              plan=None):
    """The dQ kernel of ``call`` (``kernel_call.KernelCall``). rows: the forward's LSE and delta
    (``kernel_call.RowStats``); strides: (q, k, v, do, dq) stride 4-tuples; counter, plan: see
    flash_fwd.launch_fwd; warp_specialize: see flash_bwd_dkdv.launch_dkdv. Returns the
    config it ran (None when autotuned)."""
    c = call
    bd, bdv = padded_head_dim(c.head_dim), padded_head_dim(c.head_dim_v)
    fp32_dot = c.target.interpreting
    variant = variant_args(c.band, c.softcap, c.softmax_scale)
    counts = counter.tensor("dq") if counter is not None else None
    args = (q, k, v, do, dq, (rows.lse, rows.delta), c.documents(rows.lse),
            counts if counts is not None else rows.lse, *(tuple(t) for t in strides),
            (c.seqlen_q, c.seqlen_k, c.batch, c.seq_splits), (c.softmax_scale, c.softmax_scale * LOG2E, *variant.softcap),
            variant.window, seq_bucket(max(c.seqlen_q, c.seqlen_k)), c.num_q_heads, c.group,
            rows.row_stride or c.seqlen_q)
    meta = dict(HEAD_DIM=c.head_dim, BLOCK_D=bd, HEAD_DIM_V=c.head_dim_v, BLOCK_DV=bdv,
                CAUSAL=bool(c.causal), VARLEN=c.varlen, SPLIT=int(c.split),
                FP32_DOT=fp32_dot, PRECISION=dot_precision(q.dtype, max(bd, bdv)),
                **variant.constexprs, COUNT=counts is not None, WARP_SPECIALIZE=bool(warp_specialize))

    def grid(bm, bn):
        return (triton.cdiv(c.seqlen_q, bm), c.batch * c.num_q_heads)

    config = _launch(grid, args, meta, max(bd, bdv), fp32_dot, q.dtype == torch.float32, plan=plan)
    if counter is not None and plan is None:
        counter.ran("dq", config, grid(*config[:2]))
    return config
