"""Flash-attention backward: delta preprocess, then either the 5-GEMM kernel (dK/dV with
dQ accumulated by fp32 atomics, the default) or, deterministic, the dK/dV kernel and the
separate dQ kernel (7 GEMMs, no atomics). See docs/architecture.md, "Attention kernels:
backward".

Host-side orchestration only; the kernels live in ``flash_bwd_preprocess.py``,
``flash_bwd_dkdv.py`` and ``flash_bwd_dq.py``. The variants (window band, softcap, a
value head dim of its own) are the kernels' compile-time switches; the sinks' gradient is
computed here from delta and the sink-inclusive LSE (`variants.sinks_gradient`, the one rule every path uses).
"""

import torch
import triton

from ..env import BWD_HEAD_SPLITS, DETERMINISTIC, flag, integer
from ..variants import sinks_gradient
from .features import bwd_warp_specialize_feature, requested
from .flash_bwd_dkdv import _launch_atomic, head_splits, launch_dkdv
from .flash_bwd_dq import launch_dq
from .flash_bwd_preprocess import launch_preprocess
from .kernel_call import KernelCall, RowStats
from .kernel_call import block_d as padded_head_dim
from .launcher import PlanNote


def deterministic_default() -> bool:
    """``ULYSSES_KERNELS_DETERMINISTIC=1`` makes every backward deterministic."""
    return flag(DETERMINISTIC, default=False)


def _head_splits(batch, seqlen_k, num_q_heads, num_kv_heads, block_d, target):
    """(splits, why): ULYSSES_KERNELS_BWD_HEAD_SPLITS (a divisor of the GQA group) or the
    grid rule (flash_bwd_dkdv.head_splits) on a GPU of known SM count."""
    group = num_q_heads // num_kv_heads
    forced = integer(BWD_HEAD_SPLITS, 0)
    if forced > 0:
        if group % forced:
            raise ValueError(f"ULYSSES_KERNELS_BWD_HEAD_SPLITS={forced} does not divide the GQA group {group}")
        return forced, f"{BWD_HEAD_SPLITS.name}={forced}"
    if target.device_type != "cuda" or target.sm_count <= 0:
        return 1, "no GPU SM count to fill"
    block_n = _launch_atomic.default(block_d)[1]
    key_blocks = triton.cdiv(seqlen_k, block_n)
    programs = key_blocks * batch * num_kv_heads
    splits = head_splits(key_blocks, batch, num_kv_heads, group, target.sm_count)
    if splits == 1 and programs >= 2 * target.sm_count:
        return 1, f"{programs} programs (key blocks x batch x KV heads) fill {target.sm_count} SMs twice already"
    return splits, (f"{programs} programs (key blocks x batch x KV heads) on {target.sm_count} SMs, GQA group "
                    f"{group}: the smallest divisor of the group reaching 2 programs per SM")


def launch_bwd(do, q, k, v, out, lse, grads, call: KernelCall, *, strides_of, deterministic, sinks=None,
               dsinks=None, counter=None, plan=None):
    """The backward of ``call`` (``kernel_call.KernelCall``): grads = (dq, dk, dv), written in
    place; strides_of(t): t's (batch, seq, head, dim) strides as the kernels address it;
    counter, plan: see flash_fwd.launch_fwd (a plan also receives the backward's mode and
    head splits as PlanNotes); sinks (fp32 ``[Hq]``) and dsinks (fp32 ``[Hq]``, overwritten
    with the sinks' gradient) go together."""
    c = call
    dq, dk, dv = grads
    bd, bdv = padded_head_dim(c.head_dim), padded_head_dim(c.head_dim_v)
    delta = torch.empty((c.batch, c.num_q_heads, c.seqlen_q), dtype=torch.float32, device=q.device)
    if plan is None:
        # delta = rowsum(dO * O) runs over v's head dim.
        launch_preprocess(out, do, delta, so_strides=strides_of(out), sdo_strides=strides_of(do),
                          num_q_heads=c.num_q_heads, head_dim=c.head_dim_v, block_d=bdv, batch=c.batch,
                          seqlen_q=c.seqlen_q, split=c.split, seq_splits=c.seq_splits)
        if dsinks is not None:
            dsinks.copy_(sinks_gradient(sinks, lse, delta))
    base = tuple(strides_of(t) for t in (q, k, v, do))
    ws_switch = bwd_warp_specialize_feature(requested(), tensors=(q, k, v, do), strides=base, split=c.split,
                                            batch=c.batch, seqlen_q=c.seqlen_q, seqlen_k=c.seqlen_k,
                                            varlen=c.varlen, target=c.target)
    ws = bool(ws_switch.on)
    launched = dict(counter=counter, plan=plan)
    if plan is not None:
        plan.append(_backward_mode(deterministic, ws_switch))
    if deterministic or ws:  # the two-kernel backward: dK/dV, then dQ (bitwise reproducible)
        rows = tma_row_stats(lse, delta) if ws else RowStats(lse, delta)
        launch_dkdv(q, k, v, do, dk, dv, rows, c, strides=base + (strides_of(dk), strides_of(dv)),
                    warp_specialize=ws, **launched)
        launch_dq(q, k, v, do, dq, rows, c, strides=base + (strides_of(dq),), warp_specialize=ws, **launched)
        return
    # fp32 accumulators [B, H, S, block_d] by position (compile-time strides in the
    # kernel, see flash_bwd_dkdv); one elementwise pass puts them into q's/k's layout.
    dq_acc = torch.zeros((c.batch, c.num_q_heads, c.seqlen_q, bd), dtype=torch.float32, device=q.device)
    splits, splits_why = _head_splits(c.batch, c.seqlen_k, c.num_q_heads, c.num_kv_heads, max(bd, bdv), c.target)
    if plan is not None:
        plan.append(PlanNote("head splits", str(splits), splits_why))
    dk_out, dv_out = dk, dv
    if splits > 1:
        dk_out, dv_out = (torch.zeros((c.batch, c.num_kv_heads, c.seqlen_k, width), dtype=torch.float32,
                                      device=k.device) for width in (bd, bdv))
    # dk/dv strides: those of the outputs (the kernel ignores them for the accumulators).
    launch_dkdv(q, k, v, do, dk_out, dv_out, RowStats(lse, delta), c,
                strides=base + (strides_of(dk), strides_of(dv)), dq_acc=dq_acc, splits=splits, **launched)
    if plan is not None:
        return
    copy_positions(dq, dq_acc, c.head_dim, c.batch, c.seq_splits, scale=c.softmax_scale)
    if splits > 1:
        copy_positions(dk, dk_out, c.head_dim, c.batch, c.seq_splits)
        copy_positions(dv, dv_out, c.head_dim_v, c.batch, c.seq_splits)


def _backward_mode(deterministic: bool, ws_switch) -> PlanNote:
    """The backward's mode as a plan states it (the rule is launch_bwd's)."""
    if ws_switch.on:
        return PlanNote("mode", "warp-specialized two kernels: dK/dV, then dQ (7 GEMMs, no atomics)",
                        "bwd_warp_specialize requested and applicable (it runs the two-kernel backward whatever "
                        "deterministic says)")
    dropped = "; ".join(f"{n} dropped: {why}" for n, why in ws_switch.dropped.items())
    if deterministic:
        return PlanNote("mode", "two kernels: dK/dV, then dQ (7 GEMMs, no atomics: bitwise reproducible)",
                        "deterministic=True (the call's argument or ULYSSES_KERNELS_DETERMINISTIC=1)"
                        + (f"; {dropped}" if dropped else ""))
    return PlanNote("mode", "atomic: one dK/dV kernel that adds dQ with fp32 atomics (5 GEMMs)",
                    "the default (deterministic=False; the summation order of dQ varies run to run)"
                    + (f"; {dropped}" if dropped else ""))


def tma_row_stats(lse, delta) -> RowStats:
    """lse and delta ``[B, H, Sq]`` as the warp-specialized kernels read them: 16-byte
    aligned rows of a stride that is a multiple of 4 (TMA's rules), copied only when they
    are not; the kernels' descriptors stop at Sq, so the padding is never read."""
    sq = lse.shape[-1]
    stride = -(-sq // 4) * 4
    if stride == sq and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (lse, delta)):
        return RowStats(lse, delta, sq)
    padded = [torch.empty((*t.shape[:-1], stride), dtype=t.dtype, device=t.device) for t in (lse, delta)]
    for dst, src in zip(padded, (lse, delta)):
        dst[..., :sq].copy_(src)
    return RowStats(padded[0], padded[1], stride)


def copy_positions(dst, acc, head_dim, batch, seq_splits, scale=None):
    """dst (4-D ``[B, S, H, D]``, or a 3-D all-to-all buffer view ``[B*S, H, D]`` of
    seq_splits blocks) = acc ``[B, H, S, >= D]`` (by position) times ``scale`` (if given),
    cast to dst's dtype: one elementwise pass (the product in fp32, then rounded once)."""
    src = acc[..., :head_dim].transpose(1, 2)  # [B, S, H, D]

    def put(out, part):
        if scale is None:
            out.copy_(part)
        else:
            torch.mul(part, scale, out=out)

    if dst.dim() == 4:
        put(dst, src)
        return
    row = 0
    for part in torch.tensor_split(src, seq_splits, dim=1):  # block i: rows [B, S_i] in order
        n = part.shape[0] * part.shape[1]
        put(dst[row:row + n].view(part.shape), part)
        row += n
