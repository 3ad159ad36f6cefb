"""The ring's block computations in plain torch (docs/architecture.md, "Ulysses x Ring"):
the reference path's `BlockOps` (ring/schedule.py), and the semantics the Triton block
ops are tested against."""

import torch

from ..ring.merge import accumulate_dtype, merge_partial
from ..ring.plan import Block
from .attention import attention_mask, softcapped


class TorchBlockOps:
    """Block attention in plain torch (float64 for float64 inputs, else float32); memory
    O(rows x keys) per block: the reference, not for long sequences."""

    merge = staticmethod(merge_partial)

    @staticmethod
    def _scores(q, k, block: Block, scale, softcap):
        """(masked scores, the softcap's derivative or None, compute dtype, GQA group)."""
        compute = accumulate_dtype(q.dtype)
        group = q.shape[2] // k.shape[2]
        qc = q.to(compute).permute(0, 2, 1, 3)                                # [B, H, n, D]
        kc = k.to(compute).permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
        scores = softcapped(torch.matmul(qc, kc.transpose(-1, -2)) * scale, softcap)
        slope = 1 - (scores / softcap) ** 2 if softcap else None             # d(c tanh(s/c))/ds
        mask = _block_mask(block, q.shape[1], k.shape[1], q.device)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return scores, slope, compute, group

    @staticmethod
    def forward(q, k, v, block: Block, scale: float, softcap: float = 0.0):
        scores, _, compute, group = TorchBlockOps._scores(q, k, block, scale, softcap)
        lse = torch.logsumexp(scores, dim=-1)                                 # [B, H, n]
        p = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
        vc = v.to(compute).permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
        return torch.matmul(p, vc).permute(0, 2, 1, 3), lse

    @staticmethod
    def backward(do, q, k, v, out, lse, block: Block, scale: float, softcap: float = 0.0):
        """Gradients of this block's share of the final attention, from the final output
        and LSE (so P is the final softmax restricted to the block)."""
        scores, slope, compute, group = TorchBlockOps._scores(q, k, block, scale, softcap)
        lse = lse.to(compute)
        p = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
        p = torch.where(torch.isinf(lse).unsqueeze(-1), torch.zeros_like(p), p)
        doc = do.to(compute).permute(0, 2, 1, 3)
        vc = v.to(compute).permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
        qc = q.to(compute).permute(0, 2, 1, 3)
        kc = k.to(compute).permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
        delta = (doc * out.to(compute).permute(0, 2, 1, 3)).sum(-1, keepdim=True)
        ds = p * (torch.matmul(doc, vc.transpose(-1, -2)) - delta)
        if slope is not None:
            ds = ds * slope
        dq = torch.matmul(ds, kc) * scale
        dk = torch.matmul(ds.transpose(-1, -2), qc) * scale                   # [B, H, nk, D]
        dv = torch.matmul(p.transpose(-1, -2), doc)                           # [B, H, nk, Dv]
        B, H, nk, _ = dk.shape
        fold = lambda t: t.view(B, H // group, group, nk, t.shape[-1]).sum(2).permute(0, 2, 1, 3)  # noqa: E731
        return dq.permute(0, 2, 1, 3), fold(dk), fold(dv)


def _block_mask(block: Block, rows: int, keys: int, device):
    """Boolean [rows, keys] mask of a block: causal and documents inside a diagonal block,
    and the part of the window that cuts it (its `band`); None: dense."""
    causal = block.diagonal and block.causal
    doc_q = doc_k = None
    if block.diagonal and block.documents is not None:
        bounds = torch.tensor(block.documents[1:], device=device)
        doc_q = torch.searchsorted(bounds, torch.arange(rows, device=device), right=True)
        doc_k = torch.searchsorted(bounds, torch.arange(keys, device=device), right=True)
    return attention_mask(rows, keys, 0, rows, causal, doc_q, doc_k, device, block.band)
