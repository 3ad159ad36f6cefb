"""Flash-attention backward, dK/dV kernel, optionally accumulating dQ (the 5-GEMM backward).

One program owns a ``[BLOCK_N, D]`` tile of dK and dV for one (batch, KV head) and loops
over the query heads of its GQA group (``h = hk*G .. hk*G + G - 1``) and over the query
rows that can see the tile: ``P^T = exp2(K Q^T * scale*log2e - lse*log2e)``,
``dV += P^T dO``, ``dS^T = P^T * (V dO^T - delta)``, ``dK += dS^T Q``; finally
``dK *= scale``. The GQA reduction happens in registers.

Two modes (docs/architecture.md, "Attention kernels: backward"):

* ``DQ_ATOMIC=False`` (``deterministic=True``): dK/dV only, 4 GEMMs per step; dQ comes
  from the separate dQ kernel (3 more GEMMs, recomputing P and dP). No atomics.
* ``DQ_ATOMIC=True`` (default): the same step also forms ``dQ += dS K`` (the 5th GEMM)
  and adds it to an fp32 dQ accumulator with atomics: 5 GEMMs instead of 7, at the price
  of a summation order that varies from run to run. ``HEAD_SPLITS`` > 1 divides a KV
  head's query-head group over that many programs (more programs when the grid is small:
  one KV head per rank is the usual Ulysses case); their dK/dV partials are then added
  with atomics too (``KV_ATOMIC``, fp32 accumulators).

Query rows are visited in three phases: masked (causal diagonal / document start),
unmasked (rows that see the whole key tile), masked (document end / sequence end).

Variants (see kernel_call): ``WINDOW`` visits only the query rows of the key tile's band,
``[n0 - off - right, n_last - off + left]`` (:func:`blocks.key_tile_band_range`), in the same three
phases; ``SOFTCAP`` back-propagates through ``softcap * tanh(.)``
(``dS_raw = dS * (1 - t^2)``); ``HEAD_DIM_V``: v, dO and dV have their own head dim (the
head-split accumulators are ``[.., BLOCK_D]`` for dK and ``[.., BLOCK_DV]`` for dV). Sinks
need nothing here: the LSE includes them.
"""

import torch
import triton
import triton.language as tl

from .addressing import kv_descriptor, seq_offsets, tile_row
from .blocks import in_band, key_tile_band_range, key_tile_query_range
from .configs import CONFIGS
from .features import dq_reduce_feature, requested
from .kernel_call import KernelCall, RowStats, variant_args
from .kernel_call import block_d as padded_head_dim
from .launcher import TunedLauncher, seq_bucket
from .program import LoopDims, LoopSwitches
from .scores import LOG2E, capped_tanh, dot_precision, maybe_fp32

LOG2E_C = tl.constexpr(LOG2E)


@triton.jit
def _dkdv_inner(dk, dv, keys, queries, group, tile, mask, score, dq_out, counter, lo, hi,
                MASKED: tl.constexpr, SWITCHES: tl.constexpr, DIMS: tl.constexpr):
    """Query rows [lo, hi) of query heads ``hk*GROUP + g_lo ..`` (g_cnt of them), as ONE
    flat loop.

    A loop over the heads around the row loop would nest three software-pipelined loops
    in a runtime loop: Triton 3.6 then spills hundreds of bytes of registers (sm_90
    build, D = 128), and each head would drain and refill the pipeline. Flat, the
    iteration ``it`` covers head ``it // nblk`` and row block ``it % nblk``.
    """
    k, v = keys  # this program's key tile and its values
    Q, DO, LSE, DELTA, q_strides, do_strides, descs = queries
    sq_b, sq_s, sq_h, sq_d = q_strides
    sdo_b, sdo_s, sdo_h, sdo_d = do_strides
    hk, g_lo, g_cnt, GROUP, HQ = group  # KV head, this program's query heads of its group
    b, Sq, B, P, offs_n, offs_d, offs_dv = tile
    doc_k, DOCS, causal_off, window_left, window_right = mask
    qk_scale, softcap_in, softcap_out = score
    DQ_ACC, dq_desc = dq_out
    COUNTS, count_slot = counter
    d_ok = offs_d < DIMS.HEAD_DIM
    dv_ok = offs_dv < DIMS.HEAD_DIM_V
    local_m = tl.arange(0, DIMS.BLOCK_M)
    nblk = tl.cdiv(tl.maximum(hi - lo, 0), DIMS.BLOCK_M)
    # Every address the body forms must lie inside the tensors for ANY `it`, the empty
    # loop's included: the software pipeliner may issue a first iteration's loads ahead of
    # the trip-count test. With `it // nblk` and an empty phase (nblk = 0, the non-causal
    # first phase) the head index was a division by zero, the rows were valid, so the
    # load was real: an illegal address on an H200 (Triton 3.6, 8 warps, 2 stages; see
    # docs/architecture.md, "First GPU run"). Hence a divisor >= 1, the head clamped to
    # the group and the per-row reads (LSE, delta, documents) clamped to the sequence.
    per_head = tl.maximum(nblk, 1)
    for it in tl.range(0, nblk * g_cnt, warp_specialize=SWITCHES.WARP_SPECIALIZE):
        if SWITCHES.COUNT:  # tests: one more block visited by this program
            tl.atomic_add(COUNTS + count_slot, 1)
        g = tl.minimum(it // per_head, g_cnt - 1)
        h = (hk * GROUP + g_lo + g).to(tl.int64)
        lse_base = (b * HQ + h) * Sq
        start_m = lo + (it - g * per_head) * DIMS.BLOCK_M
        offs_m = start_m + local_m
        m_ok = offs_m < Sq
        addr_m = tl.minimum(offs_m, Sq - 1)
        if SWITCHES.WARP_SPECIALIZE:
            # Descriptor loads only (see the kernel): q and dO tiles of head h, and the LSE
            # and delta rows of (b, h) from the host's padded copies (padding: LSE +inf and
            # delta 0, so padded rows give P = 0 like the pointer loads' `other`).
            q_desc, do_desc, lse_desc, delta_desc = descs
            row = tile_row(start_m, b, Sq, B, P, SWITCHES.SPLIT)
            q = tl.reshape(q_desc.load([h.to(tl.int32), row, 0]), [DIMS.BLOCK_M, DIMS.BLOCK_D])
            do = tl.reshape(do_desc.load([h.to(tl.int32), row, 0]), [DIMS.BLOCK_M, DIMS.BLOCK_DV])
            lse = tl.reshape(lse_desc.load([(b * HQ + h).to(tl.int32), start_m]), [DIMS.BLOCK_M])
            delta = tl.reshape(delta_desc.load([(b * HQ + h).to(tl.int32), start_m]), [DIMS.BLOCK_M])
            q = maybe_fp32(q, DIMS.FP32_DOT)
            lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E_C)
            do = maybe_fp32(do, DIMS.FP32_DOT)
        else:
            tile_mask = m_ok[:, None] & d_ok[None, :]
            q_base, q_rows = seq_offsets(addr_m, start_m, local_m, b, Sq, B, P, sq_b, sq_s, SWITCHES.SPLIT)
            do_base, do_rows = seq_offsets(addr_m, start_m, local_m, b, Sq, B, P, sdo_b, sdo_s, SWITCHES.SPLIT)
            q = tl.load(Q + (h * sq_h + q_base) + (q_rows[:, None] + offs_d[None, :] * sq_d),
                        mask=tile_mask, other=0.0)
            q = maybe_fp32(q, DIMS.FP32_DOT)
            lse = tl.load(LSE + lse_base + addr_m, mask=m_ok, other=float("inf"))
            lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E_C)
            delta = tl.load(DELTA + lse_base + addr_m, mask=m_ok, other=0.0)
            do = tl.load(DO + (h * sdo_h + do_base) + (do_rows[:, None] + offs_dv[None, :] * sdo_d),
                         mask=m_ok[:, None] & dv_ok[None, :], other=0.0)
            do = maybe_fp32(do, DIMS.FP32_DOT)
        qkT = tl.dot(k, tl.trans(q), input_precision=DIMS.PRECISION)
        if SWITCHES.SOFTCAP:
            tT = capped_tanh(qkT, softcap_in)
            pT = tl.math.exp2(tT * softcap_out - lse2[None, :])
        else:
            pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])
        if MASKED:
            valid = m_ok[None, :]
            if SWITCHES.CAUSAL:
                valid = valid & (offs_n[:, None] <= offs_m[None, :] + causal_off)
            if SWITCHES.WINDOW:
                valid = valid & in_band(offs_n[:, None], offs_m[None, :], causal_off, window_left, window_right)
            if SWITCHES.VARLEN:
                doc_q = tl.load(DOCS + addr_m, mask=m_ok, other=-2)
                valid = valid & (doc_k[:, None] == doc_q[None, :])
            pT = tl.where(valid, pT, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DIMS.PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=DIMS.PRECISION)
        dsT = pT * (dpT - delta[None, :])
        if SWITCHES.SOFTCAP:
            dsT = dsT * (1.0 - tT * tT)  # d(softcap * tanh(x / softcap)) / dx
        dsT = dsT.to(q.dtype)
        dk = tl.dot(dsT, q, dk, input_precision=DIMS.PRECISION)
        if SWITCHES.DQ_ATOMIC:
            # dQ rows of this block += dS K (unscaled; the host scales the fp32 sum). The
            # accumulator is [B, HQ, Sq, BLOCK_D] by position, whatever q's layout: with
            # compile-time strides the atomics' addresses are one base register plus
            # immediates (runtime strides cost a 64-bit address per element: spills).
            dq = tl.dot(tl.trans(dsT), k, input_precision=DIMS.PRECISION)
            if SWITCHES.DQ_REDUCE:
                # One TMA reduce-add of the tile (staged in shared memory) instead of
                # BLOCK_M x BLOCK_D atomics issued by the compute warps; rows past Sq fall
                # outside the descriptor's [B*HQ, Sq, BLOCK_D] bounds and are dropped.
                dq_desc.atomic_add([(b * HQ + h).to(tl.int32), start_m, 0],
                                   tl.reshape(dq, [1, DIMS.BLOCK_M, DIMS.BLOCK_D]))
            else:
                dq_ptrs = DQ_ACC + ((b * HQ + h) * Sq + start_m) * DIMS.BLOCK_D + (local_m[:, None] * DIMS.BLOCK_D
                                                                             + offs_d[None, :])
                tl.atomic_add(dq_ptrs, dq, mask=m_ok[:, None], sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["sizes", "window", "TUNE_KEY", "heads", "GROUP", "HEAD_SPLITS", "s_lse"])
def _flash_bwd_dkdv_kernel(
    Q, K, V, DO, grads, row_stats, documents, COUNTS,
    q_strides, k_strides, v_strides, do_strides, dk_strides, dv_strides,
    sizes, scores, window, TUNE_KEY, heads, GROUP, HEAD_SPLITS, s_lse,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, SPLIT: tl.constexpr,
    DQ_ATOMIC: tl.constexpr, KV_ATOMIC: tl.constexpr,
    FP32_DOT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False, COUNT: tl.constexpr = False,
    DQ_REDUCE: tl.constexpr = False, WARP_SPECIALIZE: tl.constexpr = False,
):
    # The launch's bundles (launch_dkdv): one stride tuple (batch, seq, head, dim) per tensor.
    DK, DV, DQ_ACC = grads  # dK, dV (fp32 accumulators under KV_ATOMIC), fp32 dQ (DQ_ATOMIC)
    LSE, DELTA = row_stats
    DOCS, CU = documents
    sq_b, sq_s, sq_h, sq_d = q_strides
    sk_b, sk_s, sk_h, sk_d = k_strides
    sv_b, sv_s, sv_h, sv_d = v_strides
    sdo_b, sdo_s, sdo_h, sdo_d = do_strides
    sdk_b, sdk_s, sdk_h, sdk_d = dk_strides
    sdv_b, sdv_s, sdv_h, sdv_d = dv_strides
    Sq, Sk, B, P = sizes
    sm_scale, qk_scale, softcap_in, softcap_out = scores
    window_left, window_right = window
    HQ, HKV = heads
    pid_n = tl.program_id(0)
    pid = tl.program_id(1).to(tl.int64)
    part = pid % HEAD_SPLITS
    pid_bh = pid // HEAD_SPLITS
    b = pid_bh // HKV
    hk = pid_bh % HKV
    g_cnt = GROUP // HEAD_SPLITS  # the host makes HEAD_SPLITS divide GROUP
    g_lo = part * g_cnt
    n0 = pid_n * BLOCK_N
    local_n = tl.arange(0, BLOCK_N)
    offs_n = n0 + local_n
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    n_ok = offs_n < Sk
    d_ok = offs_d < HEAD_DIM
    n_last = tl.minimum(n0 + BLOCK_N, Sk) - 1
    causal_off = Sk - Sq
    kv_mask = n_ok[:, None] & d_ok[None, :]
    v_mask = n_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :]
    count_slot = pid * tl.num_programs(0) + pid_n

    if WARP_SPECIALIZE:
        # Triton's warp-specialized loop (features.py) takes descriptor loads only, before
        # it and in it, and must be the kernel's only loop: k and v, then every query row
        # of the key tile in one masked loop. Views: q and dO as [HQ, rows, D] (batch b's
        # Sq rows, or the buffer's B*Sq rows), LSE and delta as [B*HQ, s_lse].
        if SPLIT == 1:
            kv_off = 0
            qdo_off = 0
            rows_k = B * Sk
            rows_q = B * Sq
        else:
            kv_off = b * sk_b
            qdo_off = b * sq_b
            rows_k = Sk
            rows_q = Sq
        k_row = tile_row(n0, b, Sk, B, P, SPLIT)
        k = kv_descriptor(K + (kv_off + hk * sk_h), rows_k, sk_s, HEAD_DIM, BLOCK_N, BLOCK_D).load([k_row, 0])
        v_off = kv_off if SPLIT == 1 else b * sv_b
        v = kv_descriptor(V + (v_off + hk * sv_h), rows_k, sv_s, HEAD_DIM_V, BLOCK_N, BLOCK_DV).load([k_row, 0])
        do_off = qdo_off if SPLIT == 1 else b * sdo_b
        descs = (tl.make_tensor_descriptor(Q + qdo_off, shape=[HQ, rows_q, HEAD_DIM], strides=[sq_h, sq_s, 1],
                                           block_shape=[1, BLOCK_M, BLOCK_D]),
                 tl.make_tensor_descriptor(DO + do_off, shape=[HQ, rows_q, HEAD_DIM_V], strides=[sdo_h, sdo_s, 1],
                                           block_shape=[1, BLOCK_M, BLOCK_DV]),
                 tl.make_tensor_descriptor(LSE, shape=[B * HQ, Sq], strides=[s_lse, 1], block_shape=[1, BLOCK_M]),
                 tl.make_tensor_descriptor(DELTA, shape=[B * HQ, Sq], strides=[s_lse, 1], block_shape=[1, BLOCK_M]))
    else:
        k_base, k_rows = seq_offsets(offs_n, n0, local_n, b, Sk, B, P, sk_b, sk_s, SPLIT)
        v_base, v_rows = seq_offsets(offs_n, n0, local_n, b, Sk, B, P, sv_b, sv_s, SPLIT)
        k = tl.load(K + (hk * sk_h + k_base) + (k_rows[:, None] + offs_d[None, :] * sk_d), mask=kv_mask,
                    other=0.0)
        v = tl.load(V + (hk * sv_h + v_base) + (v_rows[:, None] + offs_dv[None, :] * sv_d), mask=v_mask,
                    other=0.0)
        descs = (Q, DO, LSE, DELTA)  # unused
    k = maybe_fp32(k, FP32_DOT)
    v = maybe_fp32(v, FP32_DOT)

    if WINDOW:
        doc_k, lo, a_end, b_end, hi = key_tile_band_range(offs_n, n_ok, n0, n_last, Sq, causal_off,
                                                       window_left, window_right, DOCS, CU,
                                                       VARLEN, SPLIT, BLOCK_M)
    else:
        doc_k, lo, a_end, b_end, hi = key_tile_query_range(offs_n, n_ok, n0, n_last, Sq, causal_off, DOCS, CU,
                                                  CAUSAL, VARLEN, BLOCK_M)

    if DQ_REDUCE:
        # The dQ accumulator [B*HQ, Sq, BLOCK_D] (by position) as a TMA descriptor.
        dq_desc = tl.make_tensor_descriptor(DQ_ACC, shape=[B * HQ, Sq, BLOCK_D], strides=[Sq * BLOCK_D, BLOCK_D, 1],
                                            block_shape=[1, BLOCK_M, BLOCK_D])
    else:
        dq_desc = DQ_ACC  # unused
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    keys = (k, v)
    queries = (Q, DO, LSE, DELTA, q_strides, do_strides, descs)
    group = (hk, g_lo, g_cnt, GROUP, HQ)
    tile = (b, Sq, B, P, offs_n, offs_d, offs_dv)
    mask = (doc_k, DOCS, causal_off, window_left, window_right)
    score = (qk_scale, softcap_in, softcap_out)
    dq_out = (DQ_ACC, dq_desc)
    counter = (COUNTS, count_slot)
    SWITCHES: tl.constexpr = LoopSwitches(
        CAUSAL=CAUSAL, VARLEN=VARLEN, SPLIT=SPLIT, WINDOW=WINDOW, SOFTCAP=SOFTCAP, COUNT=COUNT,
        WARP_SPECIALIZE=WARP_SPECIALIZE, DQ_ATOMIC=DQ_ATOMIC, DQ_REDUCE=DQ_REDUCE)
    DIMS: tl.constexpr = LoopDims(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                                  HEAD_DIM_V=HEAD_DIM_V, BLOCK_DV=BLOCK_DV, FP32_DOT=FP32_DOT, PRECISION=PRECISION)
    if WARP_SPECIALIZE:
        # One masked loop over every row (see above), from a multiple of BLOCK_M: the LSE and
        # delta tiles' offsets must be 16-byte aligned (the rows added before lo see no key
        # of this tile, so the mask drops them).
        dk, dv = _dkdv_inner(dk, dv, keys, queries, group, tile, mask, score, dq_out, counter,
                             lo // BLOCK_M * BLOCK_M, hi, MASKED=True, SWITCHES=SWITCHES, DIMS=DIMS)
    else:  # three phases, each over the query heads of this program (see _dkdv_inner)
        dk, dv = _dkdv_inner(dk, dv, keys, queries, group, tile, mask, score, dq_out, counter, lo, a_end,
                             MASKED=True, SWITCHES=SWITCHES, DIMS=DIMS)
        dk, dv = _dkdv_inner(dk, dv, keys, queries, group, tile, mask, score, dq_out, counter, a_end, b_end,
                             MASKED=False, SWITCHES=SWITCHES, DIMS=DIMS)
        dk, dv = _dkdv_inner(dk, dv, keys, queries, group, tile, mask, score, dq_out, counter, b_end, hi,
                             MASKED=True, SWITCHES=SWITCHES, DIMS=DIMS)
    dk = dk * sm_scale
    if KV_ATOMIC:
        # Partial sums of a split query-head group, into fp32 accumulators laid out
        # [B, HKV, Sk, BLOCK_D] (dK) and [B, HKV, Sk, BLOCK_DV] (dV) by position
        # (compile-time strides, as for dQ).
        row = (b * HKV + hk) * Sk + n0
        tl.atomic_add(DK + row * BLOCK_D + (local_n[:, None] * BLOCK_D + offs_d[None, :]), dk,
                      mask=n_ok[:, None], sem="relaxed")
        tl.atomic_add(DV + row * BLOCK_DV + (local_n[:, None] * BLOCK_DV + offs_dv[None, :]), dv,
                      mask=n_ok[:, None], sem="relaxed")
    else:
        dk_base, dk_rows = seq_offsets(offs_n, n0, local_n, b, Sk, B, P, sdk_b, sdk_s, SPLIT)
        dv_base, dv_rows = seq_offsets(offs_n, n0, local_n, b, Sk, B, P, sdv_b, sdv_s, SPLIT)
        tl.store(DK + (hk * sdk_h + dk_base) + (dk_rows[:, None] + offs_d[None, :] * sdk_d),
                 dk.to(DK.dtype.element_ty), mask=kv_mask)
        tl.store(DV + (hk * sdv_h + dv_base) + (dv_rows[:, None] + offs_dv[None, :] * sdv_d),
                 dv.to(DV.dtype.element_ty), mask=v_mask)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per padded head dim; first = default.
_launch = TunedLauncher(_flash_bwd_dkdv_kernel, CONFIGS["dkdv"])
# Autotuning runs the kernel once per candidate: the accumulators restart from zero.
_launch_atomic = TunedLauncher(_flash_bwd_dkdv_kernel, CONFIGS["dkdv_atomic"], reset_to_zero=["grads"])


def head_splits(key_blocks: int, batch: int, num_kv_heads: int, group: int, sm_count: int) -> int:
    """How many programs share one KV head's query-head group in the atomic backward.

    One program per (key block, batch, KV head) leaves SMs idle when that grid is small
    (one KV head per rank at S = 8k: 64 programs on 132 SMs, each G times longer). The
    smallest divisor of the group that reaches two programs per SM; 1 when it is large
    enough already or the SM count is unknown (0).
    """
    programs = key_blocks * batch * num_kv_heads
    if sm_count <= 0 or programs >= 2 * sm_count:
        return 1
    for d in range(2, group + 1):
        if group % d == 0 and programs * d >= 2 * sm_count:
            return d
    return group


def launch_dkdv(q, k, v, do, dk, dv, rows: RowStats, call: KernelCall, *, strides, dq_acc=None, splits=1,
                counter=None, features=None, warp_specialize=False, plan=None):
    """The dK/dV kernel of ``call`` (``kernel_call.KernelCall``). rows: the forward's LSE and
    delta (``kernel_call.RowStats``); strides: (q, k, v, do, dk, dv) stride 4-tuples.

    dq_acc: atomic mode, a zero-filled fp32 ``[B, Hq, Sq, block_d]`` accumulator (by
    position) that receives the unscaled dS K. splits > 1 (atomic mode only): dk/dv are
    zero-filled fp32 ``[B, Hkv, Sk, block_d]`` / ``[B, Hkv, Sk, block_dv]`` accumulators for
    the partial sums. counter, features, plan: see flash_fwd.launch_fwd. warp_specialize
    (dK/dV only, features.bwd_warp_specialize's rule holds): the warp-specialized kernel,
    reading lse and delta as rows of ``rows.row_stride`` (a multiple of 4: 16-byte TMA
    strides). Returns the config it ran (None when autotuned)."""
    c = call
    fp32_dot = c.target.interpreting
    atomic = dq_acc is not None
    bd, bdv = padded_head_dim(c.head_dim), padded_head_dim(c.head_dim_v)
    if splits > 1 and (not atomic or dk.dtype != torch.float32 or c.group % splits):
        raise ValueError("launch_dkdv: head splits need atomic mode, fp32 dk/dv and a divisor of the group")
    if warp_specialize and (atomic or splits > 1):
        raise ValueError("launch_dkdv: the warp-specialized kernel computes dK/dV only (no dQ atomics, no splits)")
    variant = variant_args(c.band, c.softcap, c.softmax_scale)
    dq_reduce = dq_reduce_feature(requested() if features is None else features, q=q, dq_acc=dq_acc, target=c.target)
    counts = counter.tensor("dkdv") if counter is not None else None
    args = (q, k, v, do, (dk, dv, dq_acc if atomic else rows.lse), (rows.lse, rows.delta), c.documents(rows.lse),
            counts if counts is not None else rows.lse, *(tuple(t) for t in strides),
            (c.seqlen_q, c.seqlen_k, c.batch, c.seq_splits), (c.softmax_scale, c.softmax_scale * LOG2E, *variant.softcap),
            variant.window, seq_bucket(max(c.seqlen_q, c.seqlen_k)), (c.num_q_heads, c.num_kv_heads),
            c.group, splits, rows.row_stride or c.seqlen_q)
    meta = dict(HEAD_DIM=c.head_dim, BLOCK_D=bd, HEAD_DIM_V=c.head_dim_v, BLOCK_DV=bdv,
                CAUSAL=bool(c.causal), VARLEN=c.varlen, SPLIT=int(c.split),
                DQ_ATOMIC=atomic, KV_ATOMIC=splits > 1,
                FP32_DOT=fp32_dot, PRECISION=dot_precision(q.dtype, max(bd, bdv)),
                **variant.constexprs, COUNT=counts is not None,
                **dq_reduce.constexprs(),
                WARP_SPECIALIZE=bool(warp_specialize))
    launcher = _launch_atomic if atomic else _launch

    def grid(bm, bn):
        return (triton.cdiv(c.seqlen_k, bn), c.batch * c.num_kv_heads * splits)

    config = launcher(grid, args, meta, max(bd, bdv), fp32_dot, q.dtype == torch.float32, plan=plan,
                      switches=(dq_reduce,))
    if counter is not None and plan is None:
        counter.ran("dkdv", config, grid(*config[:2]))
    return config
