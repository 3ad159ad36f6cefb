"""The ring's block computations (docs/architecture.md, "Ulysses x Ring"): the Triton and
fused paths' `BlockOps` (ring/schedule.py) on the kernel the kernel choice picks for the
ring call among the candidates that return the LSE and run a backward from a merged output
and LSE (ulysses_kernels/kernel_choice/); the merge is our fp32 merge kernel."""

import torch

from .. import env, kernel_choice
from ..extensions import require_triton_kernels

_documents = {}  # (local boundaries, device) -> int32 tensor: one host->device copy per block shape


def _documents_on(block, device):
    if block.documents is None:
        return None
    key = (block.documents, str(device))
    docs = _documents.get(key)
    if docs is None:
        if len(_documents) > 1024:
            _documents.clear()
        docs = torch.tensor(block.documents, dtype=torch.int32, device=device)
        _documents[key] = docs
    return docs


class BlockOpsOn:
    """`BlockOps` on one candidate: forward / backward of one block (diagonal blocks causal
    and/or with their documents, bands shifted by the block plan) and the merge."""

    def __init__(self, kernel: str):
        self.kernel = kernel

    def _options(self, block, device):
        return dict(causal=block.diagonal and block.causal, cu_seqlens=_documents_on(block, device), band=block.band)

    def forward(self, q, k, v, block, scale, softcap=0.0):
        return kernel_choice.CANDIDATES[self.kernel].forward_lse(q, k, v, scale=scale, softcap=softcap,
                                                                 **self._options(block, q.device))

    def backward(self, do, q, k, v, out, lse, block, scale, softcap=0.0):
        return kernel_choice.CANDIDATES[self.kernel].backward_lse(do, q, k, v, out, lse, scale=scale, softcap=softcap,
                                                                  **self._options(block, q.device))

    @staticmethod
    def merge(acc, acc_lse, out, lse):
        require_triton_kernels().merge_attention(acc, acc_lse, out, lse)

    def for_call(self, q, k, v, *, spec, groups) -> "BlockOpsOn":
        """The block ops of one ring call on head-sharded portions q `[B, L, Hq, D]`, k, v: the
        kernel the choice makes for the ring's class (the whole ring's length, so every rank
        has the same class), agreed over `groups` (the SP group and the ring group)."""
        # The ring's class holds only the ring's facts (a rank's portion may be empty, or straddle
        # another bucket): its length is the whole ring's, so every rank derives the same one.
        call = kernel_choice.call_for(q.device, q.dtype, batch=q.shape[0], q_len=spec.total, k_len=spec.total,
                                      q_heads=q.shape[2], kv_heads=k.shape[2], head_dim=q.shape[-1],
                                      value_dim=v.shape[-1], causal=spec.causal, variant=spec.variant,
                                      packed=spec.documents is not None, lse=True,
                                      deterministic=env.flag(env.DETERMINISTIC),
                                      grad=torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))
        choice = kernel_choice.choose(call, groups=groups, device=q.device).choice
        return self if choice == self.kernel else BlockOpsOn(choice)


TritonBlockOps = BlockOpsOn("triton")
