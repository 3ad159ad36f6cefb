"""The ring's block computations on the Triton kernels (docs/architecture.md, "Ulysses x
Ring"): the Triton and fused paths' `BlockOps` (ring/schedule.py)."""

import torch

from ..extensions import require_triton_kernels


class TritonBlockOps:
    """The ring's block computations (ring/schedule.py, `BlockOps`) on the Triton kernels: flash
    forward/backward of one block (diagonal blocks causal and/or with their documents),
    and the fp32 merge kernel."""

    _documents = {}  # (local boundaries, device) -> int32 tensor: one host->device copy per block shape

    @staticmethod
    def _options(block, device):
        docs = None
        if block.documents is not None:
            key = (block.documents, str(device))
            docs = TritonBlockOps._documents.get(key)
            if docs is None:
                if len(TritonBlockOps._documents) > 1024:
                    TritonBlockOps._documents.clear()
                docs = torch.tensor(block.documents, dtype=torch.int32, device=device)
                TritonBlockOps._documents[key] = docs
        return dict(causal=block.diagonal and block.causal, cu_seqlens=docs, _band=block.band)

    @staticmethod
    def forward(q, k, v, block, scale, softcap=0.0):
        return require_triton_kernels().flash_attention_forward(q, k, v, softmax_scale=scale, softcap=softcap,
                                                                **TritonBlockOps._options(block, q.device))

    @staticmethod
    def backward(do, q, k, v, out, lse, block, scale, softcap=0.0):
        return require_triton_kernels().flash_attention_backward(do, q, k, v, out, lse, softmax_scale=scale,
                                                                 softcap=softcap,
                                                                 **TritonBlockOps._options(block, q.device))

    @staticmethod
    def merge(acc, acc_lse, out, lse):
        require_triton_kernels().merge_attention(acc, acc_lse, out, lse)
