"""Flash-attention backward: delta preprocess, dK/dV kernel (GQA loop), dQ kernel.

Host-side orchestration only; the kernels live in ``flash_bwd_preprocess.py``,
``flash_bwd_dkdv.py`` and ``flash_bwd_dq.py``.
"""

import torch

from .flash_bwd_dkdv import launch_dkdv
from .flash_bwd_dq import launch_dq
from .flash_bwd_preprocess import launch_preprocess


def launch_bwd(do, q, k, v, out, lse, dq, dk, dv, docs, cu_seqlens, *, strides, batch, seqlen_q,
               seqlen_k, num_q_heads, num_kv_heads, head_dim, block_d, causal, softmax_scale,
               split, seq_splits):
    """strides: dict name -> (batch, seq, head, dim) strides for q k v out do dq dk dv."""
    delta = torch.empty((batch, num_q_heads, seqlen_q), dtype=torch.float32, device=q.device)
    common = dict(batch=batch, seqlen_q=seqlen_q, split=split, seq_splits=seq_splits)
    launch_preprocess(out, do, delta, so_strides=strides["out"], sdo_strides=strides["do"],
                      num_q_heads=num_q_heads, head_dim=head_dim, block_d=block_d, **common)
    launch_dkdv(q, k, v, do, dk, dv, lse, delta, docs, cu_seqlens,
                strides=(strides["q"], strides["k"], strides["v"], strides["do"], strides["dk"],
                         strides["dv"]),
                seqlen_k=seqlen_k, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim, block_d=block_d, causal=causal, softmax_scale=softmax_scale,
                **common)
    launch_dq(q, k, v, do, dq, lse, delta, docs, cu_seqlens,
              strides=(strides["q"], strides["k"], strides["v"], strides["do"], strides["dq"]),
              seqlen_k=seqlen_k, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
              head_dim=head_dim, block_d=block_d, causal=causal, softmax_scale=softmax_scale,
              **common)
