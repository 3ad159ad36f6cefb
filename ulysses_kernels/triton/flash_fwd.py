"""Flash-attention forward kernel (online softmax, exp2, fp32 accumulation).

One program computes a ``[BLOCK_M, Dv]`` tile of the output of one (batch, query head).
Keys are visited in two phases: blocks every valid row of the tile sees in full (no
mask), then the blocks that need a mask (causal diagonal, sequence end, document
boundaries). Causal masks are bottom-right aligned: query i sees key j iff
``j <= i + Sk - Sq``. Rows that see no key produce zeros and LSE = -inf.

Variants (compile-time switches, see kernel_call):

* ``WINDOW``: only the keys of the tile's band ``[m0 + off - left, m_last + off + right]``
  are visited, in three phases: a masked left edge, an unmasked middle where every valid
  row sees the whole block, a masked right edge (``blocks.query_tile_band_range``).
* ``SOFTCAP``: scores ``softcap * tanh(scale * q.k / softcap)`` before masks and softmax.
* ``SINKS``: the online softmax starts from the head's sink, a virtual key of logit
  ``sink`` and value 0 (``m = sink * log2e``, ``l = 1``), so the LSE includes it and a
  row that sees no key gives out 0 and LSE = sink.
* ``HEAD_DIM_V``: v and out have their own head dim (the accumulator is ``[BLOCK_M, Dv]``).
"""

import torch
import triton
import triton.language as tl

from .addressing import kv_descriptor, seq_offsets, tile_row
from .blocks import in_band, query_tile_band_range, query_tile_key_range, query_tile_visit_range
from .configs import CONFIGS
from .features import forward_features, requested
from .kernel_call import KernelCall, block_d, variant_args
from .launcher import TunedLauncher, seq_bucket
from .program import LoopDims, LoopSwitches, program_tile, query_tile_program
from .scores import LN2, LOG2E, capped_tanh, dot_precision, maybe_fp32

LN2_C = tl.constexpr(LN2)
LOG2E_C = tl.constexpr(LOG2E)
# LAZY_RESCALE: the rows' maxima are moved only when one grows by more than this (log2
# units: probabilities up to 2**8 before the final division).
RESCALE_THRESHOLD = tl.constexpr(8.0)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, kv, tile, mask, score, counter, lo, hi,
               MASKED: tl.constexpr, SWITCHES: tl.constexpr, DIMS: tl.constexpr):
    """Keys ``[lo, hi)`` of one query tile, MASKED or not; the bundles are built by the
    kernel (``_flash_fwd_kernel``): kv (k/v pointers, descriptors, head offsets, strides),
    tile (batch, key count, layout, the tile's offsets), mask (documents, causal offset,
    band), score (scale, softcap), counter (tests); SWITCHES and DIMS: the constexpr bundles
    (program.LoopSwitches, program.LoopDims), read by name."""
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
        if SWITCHES.KV_DESC:
            # TMA: the descriptor's bounds zero-fill keys past Sk and dims past the head dim.
            kt = k_desc.load([tile_row(start_n, b, Sk, B, P, SWITCHES.SPLIT), 0]).T
        else:
            k_base, k_rows = seq_offsets(offs_n, start_n, local_n, b, Sk, B, P, sk_b, sk_s, SWITCHES.SPLIT)
            v_base, v_rows = seq_offsets(offs_n, start_n, local_n, b, Sk, B, P, sv_b, sv_s, SWITCHES.SPLIT)
            # Scalar base + tile offsets (loop invariant for SPLIT 0/1): see addressing.
            kt_ptrs = K + (k_head + k_base) + (k_rows[None, :] + offs_d[:, None] * sk_d)
            v_ptrs = V + (v_head + v_base) + (v_rows[:, None] + offs_dv[None, :] * sv_d)
            if MASKED:
                kt = tl.load(kt_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            elif DIMS.HEAD_DIM == DIMS.BLOCK_D:  # whole blocks of keys and no padded dims: no mask at all
                kt = tl.load(kt_ptrs)
            else:
                kt = tl.load(kt_ptrs, mask=d_ok[:, None], other=0.0)
        qk = tl.dot(maybe_fp32(q, DIMS.FP32_DOT), maybe_fp32(kt, DIMS.FP32_DOT), input_precision=DIMS.PRECISION)
        if SWITCHES.SOFTCAP:
            qk = capped_tanh(qk, softcap_in) * softcap_out  # softcap * tanh(.), in log2 units
        elif not SWITCHES.FMA_SCALE:
            qk = qk * qk_scale
        if MASKED:
            valid = n_ok[None, :]
            if SWITCHES.CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None] + causal_off)
            if SWITCHES.WINDOW:
                valid = valid & in_band(offs_n[None, :], offs_m[:, None], causal_off, window_left, window_right)
            if SWITCHES.VARLEN:
                doc_k = tl.load(DOCS + offs_n, mask=n_ok, other=-1)
                valid = valid & (doc_k[None, :] == doc_q[:, None])
            qk = tl.where(valid, qk, float("-inf"))
        # The row maxima m are in log2 units. FMA_SCALE: the max of the raw scores times
        # the (positive) scale is the max of the scaled scores, and each score costs one
        # FFMA (qk * scale - m) instead of a multiply and a subtract.
        if SWITCHES.FMA_SCALE and not SWITCHES.SOFTCAP:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1))
        if SWITCHES.LAZY_RESCALE:
            # Keep the old maxima while no row's grows by more than RESCALE_THRESHOLD (then
            # p <= 2**8: fp32 sums and 16-bit p stay exact to rounding); out = acc / l and
            # the LSE use the same m, so the result is the same softmax.
            grow = tl.max((m_new > m_i + RESCALE_THRESHOLD).to(tl.int32), 0)
            if grow > 0:
                m_keep = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.math.exp2(m_i - m_keep)
                l_i = l_i * alpha
                acc = acc * alpha[:, None]
                m_i = m_new
            # A row that has seen no key yet keeps m = -inf: shift by 0 instead (no NaN).
            m_shift = tl.where(m_i == float("-inf"), 0.0, m_i)
        elif MASKED:
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_shift = m_new
        if SWITCHES.FMA_SCALE and not SWITCHES.SOFTCAP:
            p = tl.math.exp2(qk * qk_scale - m_shift[:, None])
        else:
            p = tl.math.exp2(qk - m_shift[:, None])
        if SWITCHES.LAZY_RESCALE:
            l_i = l_i + tl.sum(p, 1)
        else:
            alpha = tl.math.exp2(m_i - m_shift)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
        if SWITCHES.KV_DESC:
            v = v_desc.load([tile_row(start_n, b, Sk, B, P, SWITCHES.SPLIT), 0])
        elif MASKED:
            v = tl.load(v_ptrs, mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
        elif DIMS.HEAD_DIM_V == DIMS.BLOCK_DV:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=dv_ok[None, :], other=0.0)
        if DIMS.FP32_DOT:
            acc = tl.dot(p, v.to(tl.float32), acc, input_precision=DIMS.PRECISION)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DIMS.PRECISION)
        if not SWITCHES.LAZY_RESCALE:
            m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["sizes", "window", "TUNE_KEY", "HQ", "GROUP"])
def _flash_fwd_kernel(
    Q, K, V, O, LSE, documents, SINK, COUNTS,
    q_strides, k_strides, v_strides, o_strides,
    sizes, scores, window, TUNE_KEY, HQ, GROUP,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, SPLIT: tl.constexpr,
    FP32_DOT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False, SINKS: tl.constexpr = False,
    COUNT: tl.constexpr = False,
    KV_DESC: tl.constexpr = False, FMA_SCALE: tl.constexpr = False, LAZY_RESCALE: tl.constexpr = False,
    WARP_SPECIALIZE: tl.constexpr = False,
):
    # The launch's bundles (launch_fwd): one stride tuple (batch, seq, head, dim) per tensor.
    DOCS, CU = documents
    sq_b, sq_s, sq_h, sq_d = q_strides
    sk_b, sk_s, sk_h, sk_d = k_strides
    sv_b, sv_s, sv_h, sv_d = v_strides
    so_b, so_s, so_h, so_d = o_strides
    Sq, Sk, B, P = sizes
    qk_scale, softcap_in, softcap_out = scores
    window_left, window_right = window
    pid_m, pid_bh, b, h, hk, count_slot = query_tile_program(Sq, HQ, GROUP, BLOCK_M)
    m0, local_m, offs_m, offs_d, offs_dv, m_ok, d_ok, m_last = program_tile(pid_m, Sq, BLOCK_M, HEAD_DIM, BLOCK_D,
                                                                            BLOCK_DV)
    causal_off = Sk - Sq
    tile_ok = m_ok[:, None] & d_ok[None, :]
    out_ok = m_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :]

    if WARP_SPECIALIZE:
        # Triton's warp-specialized loop needs q from a descriptor too (a pointer load
        # before it fails its pass, Triton 3.6 to 3.9).
        if SPLIT == 1:
            q_desc = kv_descriptor(Q + h * sq_h, B * Sq, sq_s, HEAD_DIM, BLOCK_M, BLOCK_D)
        else:
            q_desc = kv_descriptor(Q + (b * sq_b + h * sq_h), Sq, sq_s, HEAD_DIM, BLOCK_M, BLOCK_D)
        q = q_desc.load([tile_row(m0, b, Sq, B, P, SPLIT), 0])
    else:
        q_base, q_rows = seq_offsets(offs_m, m0, local_m, b, Sq, B, P, sq_b, sq_s, SPLIT)
        q = tl.load(Q + (h * sq_h + q_base) + (q_rows[:, None] + offs_d[None, :] * sq_d),
                    mask=tile_ok, other=0.0)

    k_head = hk * sk_h
    v_head = hk * sv_h
    if KV_DESC:
        # One 2-D view [rows, head dim] of this (batch, KV head)'s keys and values: batch b's
        # Sk rows (SPLIT 0), or the buffer's B*Sk rows, whose tiles tile_row finds (SPLIT 1).
        if SPLIT == 1:
            k_desc = kv_descriptor(K + k_head, B * Sk, sk_s, HEAD_DIM, BLOCK_N, BLOCK_D)
            v_desc = kv_descriptor(V + v_head, B * Sk, sv_s, HEAD_DIM_V, BLOCK_N, BLOCK_DV)
        else:
            k_desc = kv_descriptor(K + (b * sk_b + k_head), Sk, sk_s, HEAD_DIM, BLOCK_N, BLOCK_D)
            v_desc = kv_descriptor(V + (b * sv_b + v_head), Sk, sv_s, HEAD_DIM_V, BLOCK_N, BLOCK_DV)
    else:
        k_desc = K  # unused
        v_desc = V
    if SINKS:
        # The sink: a virtual key of logit sink and value 0, seen first by every row.
        m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(SINK + h) * LOG2E_C
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    kv = (K, V, k_desc, v_desc, k_head, v_head, k_strides, v_strides)
    # The constexprs the loop needs travel as two NamedTuples of constexprs built here and
    # read by name (program.py says why this construction: it works on every Triton).
    SWITCHES: tl.constexpr = LoopSwitches(
        CAUSAL=CAUSAL, VARLEN=VARLEN, SPLIT=SPLIT, WINDOW=WINDOW, SOFTCAP=SOFTCAP, COUNT=COUNT,
        WARP_SPECIALIZE=WARP_SPECIALIZE, KV_DESC=KV_DESC, FMA_SCALE=FMA_SCALE, LAZY_RESCALE=LAZY_RESCALE)
    DIMS: tl.constexpr = LoopDims(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                                  HEAD_DIM_V=HEAD_DIM_V, BLOCK_DV=BLOCK_DV, FP32_DOT=FP32_DOT, PRECISION=PRECISION)
    score = (qk_scale, softcap_in, softcap_out)
    counter = (COUNTS, count_slot)
    tile = (b, Sk, B, P, offs_m, offs_d, offs_dv)
    if WARP_SPECIALIZE:
        # One masked loop over every key the tile visits: the warp-specialized loop must be
        # the kernel's only loop (a second one fails Triton's pass).
        doc_q, lo, hi = query_tile_visit_range(offs_m, m_ok, m0, m_last, Sk, causal_off, window_left, window_right,
                                               DOCS, CU, CAUSAL, VARLEN, WINDOW, SPLIT, BLOCK_N)
        mask = (doc_q, DOCS, causal_off, window_left, window_right)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, kv, tile, mask, score, counter, lo, hi,
                                   MASKED=True, SWITCHES=SWITCHES, DIMS=DIMS)
    elif WINDOW:
        doc_q, start, a, b_end, end = query_tile_band_range(offs_m, m_ok, m0, m_last, Sk, causal_off,
                                                            window_left, window_right, DOCS, CU,
                                                            VARLEN, SPLIT, BLOCK_N)
        mask = (doc_q, DOCS, causal_off, window_left, window_right)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, kv, tile, mask, score, counter, start, a,
                                   MASKED=True, SWITCHES=SWITCHES, DIMS=DIMS)
        if a < b_end:  # its loads are unmasked: not even a pipelined first load when empty
            acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, kv, tile, mask, score, counter, a, b_end,
                                       MASKED=False, SWITCHES=SWITCHES, DIMS=DIMS)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, kv, tile, mask, score, counter, b_end, end,
                                   MASKED=True, SWITCHES=SWITCHES, DIMS=DIMS)
    else:
        doc_q, lo, hi, unmasked_end = query_tile_key_range(offs_m, m_ok, m0, m_last, Sk, causal_off,
                                                           DOCS, CU, CAUSAL, VARLEN, BLOCK_N)
        mask = (doc_q, DOCS, causal_off, window_left, window_right)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, kv, tile, mask, score, counter, lo, unmasked_end,
                                   MASKED=False, SWITCHES=SWITCHES, DIMS=DIMS)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, kv, tile, mask, score, counter, unmasked_end, hi,
                                   MASKED=True, SWITCHES=SWITCHES, DIMS=DIMS)

    # l = 0: no key seen (and no sink, or a sink of -inf): out 0, LSE -inf.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2_C)
    o_base, o_rows = seq_offsets(offs_m, m0, local_m, b, Sq, B, P, so_b, so_s, SPLIT)
    tl.store(O + (h * so_h + o_base) + (o_rows[:, None] + offs_dv[None, :] * so_d),
             out.to(O.dtype.element_ty), mask=out_ok)
    tl.store(LSE + pid_bh * Sq + offs_m, lse, mask=m_ok)


_launch = TunedLauncher(_flash_fwd_kernel, CONFIGS["fwd"])


def launch_fwd(q, k, v, out, lse, call: KernelCall, *, strides, sinks=None, counter=None, features=None,
               plan=None):
    """Launch the forward kernel of ``call`` (``kernel_call.KernelCall``). strides: the (batch,
    seq, head, dim) element strides of q, k, v and out; sinks: fp32 contiguous ``[Hq]`` or
    None, counter: a ``kernel_call.VisitCounter`` (tests), features: the Hopper features to try
    (names, see features.py; None: ``ULYSSES_KERNELS_HOPPER_FEATURES``), plan: a list that
    receives the launch's ``launcher.LaunchPlan`` instead of a launch. Returns the config it
    ran (None when autotuned)."""
    sq_strides, sk_strides, sv_strides, so_strides = (tuple(t) for t in strides)
    c = call
    bd, bdv = block_d(c.head_dim), block_d(c.head_dim_v)
    fp32_dot = c.target.interpreting
    dummy = lse
    variant = variant_args(c.band, c.softcap, c.softmax_scale)
    counts = counter.tensor("fwd") if counter is not None else None
    args = (q, k, v, out, lse, c.documents(dummy), sinks if sinks is not None else dummy,
            counts if counts is not None else dummy, sq_strides, sk_strides, sv_strides, so_strides,
            (c.seqlen_q, c.seqlen_k, c.batch, c.seq_splits), (c.softmax_scale * LOG2E, *variant.softcap),
            variant.window, seq_bucket(max(c.seqlen_q, c.seqlen_k)), c.num_q_heads, c.group)
    switches = forward_features(requested() if features is None else features, q=q, k=k, v=v,
                                sq_strides=sq_strides, sk_strides=sk_strides, sv_strides=sv_strides,
                                split=c.split, batch=c.batch, seqlen_q=c.seqlen_q, seqlen_k=c.seqlen_k,
                                head_dim=c.head_dim, head_dim_v=c.head_dim_v, varlen=c.varlen,
                                softmax_scale=c.softmax_scale, softcap=c.softcap, target=c.target)
    meta = dict(HEAD_DIM=c.head_dim, BLOCK_D=bd, HEAD_DIM_V=c.head_dim_v, BLOCK_DV=bdv,
                CAUSAL=bool(c.causal), VARLEN=c.varlen, SPLIT=int(c.split),
                FP32_DOT=fp32_dot, PRECISION=dot_precision(q.dtype, max(bd, bdv)),
                **variant.constexprs, SINKS=sinks is not None, COUNT=counts is not None,
                **switches.constexprs())

    def grid(bm, bn):
        return (triton.cdiv(c.seqlen_q, bm), c.batch * c.num_q_heads)

    config = _launch(grid, args, meta, max(bd, bdv), fp32_dot, q.dtype == torch.float32, plan=plan,
                     switches=(switches,))
    if counter is not None and plan is None:
        counter.ran("fwd", config, grid(*config[:2]))
    return config
