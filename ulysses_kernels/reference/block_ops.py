"""The ring's block computations in plain torch (docs/architecture.md, "Ulysses x Ring"):
the reference path's `BlockOps` (ring/schedule.py), and the semantics the Triton block
ops are tested against."""

import torch

from ..ring.merge import accumulate_dtype, merge_partial
from ..ring.plan import Block


class TorchBlockOps:
    """Block attention in plain torch (float64 for float64 inputs, else float32); memory
    O(rows x keys) per block: the reference, not for long sequences."""

    merge = staticmethod(merge_partial)

    @staticmethod
    def _scores(q, k, block: Block, scale):
        compute = accumulate_dtype(q.dtype)
        group = q.shape[2] // k.shape[2]
        qc = q.to(compute).permute(0, 2, 1, 3)                                # [B, H, n, D]
        kc = k.to(compute).permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
        scores = torch.matmul(qc, kc.transpose(-1, -2)) * scale
        mask = _block_mask(block, q.shape[1], k.shape[1], q.device)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return scores, compute, group

    @staticmethod
    def forward(q, k, v, block: Block, scale: float):
        scores, compute, group = TorchBlockOps._scores(q, k, block, scale)
        lse = torch.logsumexp(scores, dim=-1)                                 # [B, H, n]
        p = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
        vc = v.to(compute).permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
        return torch.matmul(p, vc).permute(0, 2, 1, 3), lse

    @staticmethod
    def backward(do, q, k, v, out, lse, block: Block, scale: float):
        """Gradients of this block's share of the final attention, from the final output
        and LSE (so P is the final softmax restricted to the block)."""
        scores, compute, group = TorchBlockOps._scores(q, k, block, scale)
        lse = lse.to(compute)
        p = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
        p = torch.where(torch.isinf(lse).unsqueeze(-1), torch.zeros_like(p), p)
        doc = do.to(compute).permute(0, 2, 1, 3)
        vc = v.to(compute).permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
        qc = q.to(compute).permute(0, 2, 1, 3)
        kc = k.to(compute).permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
        delta = (doc * out.to(compute).permute(0, 2, 1, 3)).sum(-1, keepdim=True)
        ds = p * (torch.matmul(doc, vc.transpose(-1, -2)) - delta)
        dq = torch.matmul(ds, kc) * scale
        dk = torch.matmul(ds.transpose(-1, -2), qc) * scale                   # [B, H, nk, D]
        dv = torch.matmul(p.transpose(-1, -2), doc)
        B, H, nk, D = dk.shape
        fold = lambda t: t.view(B, H // group, group, nk, D).sum(2).permute(0, 2, 1, 3)  # noqa: E731
        return dq.permute(0, 2, 1, 3), fold(dk), fold(dv)


def _block_mask(block: Block, rows: int, keys: int, device):
    """Boolean [rows, keys] mask inside a diagonal block (None: dense)."""
    if not block.diagonal:
        return None
    mask = None
    if block.causal:
        i = torch.arange(rows, device=device)[:, None]
        mask = torch.arange(keys, device=device)[None, :] <= i + (keys - rows)
    if block.documents is not None:
        bounds = torch.tensor(block.documents[1:], device=device)
        doc_q = torch.searchsorted(bounds, torch.arange(rows, device=device), right=True)
        doc_k = torch.searchsorted(bounds, torch.arange(keys, device=device), right=True)
        same = doc_q[:, None] == doc_k[None, :]
        mask = same if mask is None else mask & same
    return mask
