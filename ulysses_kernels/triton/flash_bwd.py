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
from ._common import PlanNote, Target
from ._common import block_d as padded_head_dim
from .features import bwd_warp_specialize_feature, requested
from .flash_bwd_dkdv import _launch_atomic, head_splits, launch_dkdv
from .flash_bwd_dq import launch_dq
from .flash_bwd_preprocess import launch_preprocess


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


def launch_bwd(do, q, k, v, out, lse, dq, dk, dv, docs, cu_seqlens, *, strides_of, batch, seqlen_q,
               seqlen_k, num_q_heads, num_kv_heads, head_dim, block_d, causal, softmax_scale,
               split, seq_splits, deterministic, head_dim_v=None, band=None, softcap=0.0, sinks=None,
               dsinks=None, counter=None, target=None, plan=None):
    """strides_of(t): t's (batch, seq, head, dim) strides as the kernels address it.
    head_dim_v: v's (default head_dim); band, softcap, counter, target, plan: see
    flash_fwd.launch_fwd (a plan also receives the backward's mode and head splits as
    PlanNotes); sinks (fp32 ``[Hq]``) and dsinks (fp32 ``[Hq]``, overwritten with the sinks'
    gradient) go together."""
    target = target or Target.of(q)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    delta = torch.empty((batch, num_q_heads, seqlen_q), dtype=torch.float32, device=q.device)
    common = dict(batch=batch, seqlen_q=seqlen_q, split=split, seq_splits=seq_splits)
    shape = dict(seqlen_k=seqlen_k, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                 head_dim=head_dim, block_d=block_d, causal=causal, softmax_scale=softmax_scale)
    variant = dict(head_dim_v=head_dim_v, band=band, softcap=softcap, counter=counter, target=target, plan=plan)
    if plan is None:
        # delta = rowsum(dO * O) runs over v's head dim.
        launch_preprocess(out, do, delta, so_strides=strides_of(out), sdo_strides=strides_of(do),
                          num_q_heads=num_q_heads, head_dim=head_dim_v, block_d=padded_head_dim(head_dim_v),
                          **common)
        if dsinks is not None:
            dsinks.copy_(sinks_gradient(sinks, lse, delta))
    base = tuple(strides_of(t) for t in (q, k, v, do))
    ws_switch = bwd_warp_specialize_feature(requested(), tensors=(q, k, v, do), strides=base, split=split,
                                            batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                                            varlen=docs is not None, target=target)
    ws = bool(ws_switch.on)
    if plan is not None:
        plan.append(_backward_mode(deterministic, ws_switch))
    if deterministic or ws:  # the two-kernel backward: dK/dV, then dQ (bitwise reproducible)
        rows = lse_rows(lse, delta) if ws else dict(lse=lse, delta=delta, lse_row_stride=None)
        launch_dkdv(q, k, v, do, dk, dv, rows["lse"], rows["delta"], docs, cu_seqlens,
                    strides=base + (strides_of(dk), strides_of(dv)), warp_specialize=ws,
                    lse_row_stride=rows["lse_row_stride"], **shape, **common, **variant)
        launch_dq(q, k, v, do, dq, rows["lse"], rows["delta"], docs, cu_seqlens,
                  strides=base + (strides_of(dq),), warp_specialize=ws, lse_row_stride=rows["lse_row_stride"],
                  **shape, **common, **variant)
        return
    # fp32 accumulators [B, H, S, block_d] by position (compile-time strides in the
    # kernel, see flash_bwd_dkdv); one elementwise pass puts them into q's/k's layout.
    dq_acc = torch.zeros((batch, num_q_heads, seqlen_q, block_d), dtype=torch.float32, device=q.device)
    splits, splits_why = _head_splits(batch, seqlen_k, num_q_heads, num_kv_heads,
                                      max(block_d, padded_head_dim(head_dim_v)), target)
    if plan is not None:
        plan.append(PlanNote("head splits", str(splits), splits_why))
    dk_out, dv_out = dk, dv
    if splits > 1:
        dk_out, dv_out = (torch.zeros((batch, num_kv_heads, seqlen_k, width), dtype=torch.float32, device=k.device)
                          for width in (block_d, padded_head_dim(head_dim_v)))
    # dk/dv strides: those of the outputs (the kernel ignores them for the accumulators).
    launch_dkdv(q, k, v, do, dk_out, dv_out, lse, delta, docs, cu_seqlens,
                strides=base + (strides_of(dk), strides_of(dv)), dq_acc=dq_acc, splits=splits, **shape, **common,
                **variant)
    if plan is not None:
        return
    copy_positions(dq, dq_acc, head_dim, batch, seq_splits, scale=softmax_scale)
    if splits > 1:
        copy_positions(dk, dk_out, head_dim, batch, seq_splits)
        copy_positions(dv, dv_out, head_dim_v, batch, seq_splits)


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


def lse_rows(lse, delta):
    """lse and delta ``[B, H, Sq]`` as the warp-specialized kernels read them: 16-byte
    aligned rows of a stride that is a multiple of 4 (TMA's rules), copied only when they
    are not; the kernels' descriptors stop at Sq, so the padding is never read."""
    sq = lse.shape[-1]
    stride = -(-sq // 4) * 4
    if stride == sq and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (lse, delta)):
        return dict(lse=lse, delta=delta, lse_row_stride=sq)
    padded = [torch.empty((*t.shape[:-1], stride), dtype=t.dtype, device=t.device) for t in (lse, delta)]
    for dst, src in zip(padded, (lse, delta)):
        dst[..., :sq].copy_(src)
    return dict(lse=padded[0], delta=padded[1], lse_row_stride=stride)


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
