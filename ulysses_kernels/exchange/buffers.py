"""The buffers of the sequence <-> head all-to-all and the exchanges over them, with
torch ops and torch.distributed (docs/architecture.md, "Layout rules"): the semantics of
the exchange. The reference and Triton paths exchange with them (`heads.py`), the Triton
path's kernels read and write these buffers in place, and the fused path's CUDA pack
kernels produce the same layouts.

Layout conventions:
- send buffer of seq->heads: `[P, B, S_local, Hc, D]`, chunk j goes to rank j, where Hc is
  the number of head channels one rank receives (for the q/k/v exchange
  `Hc = Hl_q + 2 * Hl_kv`, replicated KV heads included). Which heads go where is
  `ulysses_kernels.layout`'s placement.
- receive buffer: the concatenation over source ranks i of `[B, S_i, Hc, D]` blocks.
  Source-rank-major is sequence order, so for B == 1 it already is `[S, Hc, D]`.
- heads->seq is the exact inverse: every rank sends, for each destination j, its heads
  for j's sequence slice `[B, S_j, Hc, D]`; that send buffer has the same block layout
  as the receive buffer above, which is what lets attention write its output there.

"""

from typing import List, Optional, Sequence

import torch

from ..distributed.collectives import all_to_all
from ..layout import HeadPlacement, place_heads

# ------------------------------------------------------------- raw (non-autograd) exchanges

def exchange_seq_to_heads(send: torch.Tensor, seq_lens: List[int], rank: int, group) -> torch.Tensor:
    """send `[P, B, S_rank, Hc, D]` -> flat receive buffer of `[B, S_i, Hc, D]` blocks."""
    P, B, S_local, Hc, D = send.shape
    per_token = B * Hc * D
    return all_to_all(send, [S_local * per_token] * P, [n * per_token for n in seq_lens], group)


def recv_blocks_to_bshd(recv: torch.Tensor, seq_lens: List[int], batch: int, channels: int,
                        head_dim: int) -> torch.Tensor:
    """Flat receive buffer -> `[B, S, Hc, D]` (a view for B == 1, one copy otherwise)."""
    total = sum(seq_lens)
    if batch == 1:
        return recv.view(1, total, channels, head_dim)
    blocks = torch.split(recv, [batch * n * channels * head_dim for n in seq_lens])
    return torch.cat([b.view(batch, n, channels, head_dim) for b, n in zip(blocks, seq_lens)], dim=1)


def bshd_to_blocks(x: torch.Tensor, seq_lens: List[int]) -> torch.Tensor:
    """`[B, S, Hc, D]` -> flat block layout (the `[B, S_j, Hc, D]` block of every rank j in
    turn, each contiguous): the heads -> seq send buffer; inverse of `recv_blocks_to_bshd`."""
    if x.shape[0] == 1 or len(seq_lens) == 1:
        return x.reshape(-1)
    return torch.cat([c.reshape(-1) for c in torch.split(x, list(seq_lens), dim=1)])


def exchange_heads_to_seq(x: torch.Tensor, seq_lens: List[int], rank: int, group) -> torch.Tensor:
    """x `[B, S, Hc, D]` (this rank's heads, whole sequence) -> `[P, B, S_rank, Hc, D]`,
    where slot i holds source rank i's heads for this rank's sequence slice."""
    B, S, Hc, D = x.shape
    P = len(seq_lens)
    per_token = B * Hc * D
    send = bshd_to_blocks(x, seq_lens)
    recv = all_to_all(send, [n * per_token for n in seq_lens], [seq_lens[rank] * per_token] * P, group)
    return recv.view(P, B, seq_lens[rank], Hc, D)


# --------------------------------------------------------------------- packing helpers

def pack_for_heads(tensors: Sequence[torch.Tensor], placements: Sequence[HeadPlacement], world: int) -> torch.Tensor:
    """Write tensors `[B, S_local, H_t, D_t]` into one send buffer: destination j receives
    the heads `placements[t]` gives it, in tensor order. With one head dim D the buffer is
    `[P, B, S_local, Hc, D]`; with several (a token mixer's x, B, C and dt) each head is
    flattened into the channels, `[P, B, S_local, W, 1]` with `W = sum(local_t * D_t)`."""
    B, S_local = tensors[0].shape[:2]
    dims = [t.shape[3] for t in tensors]
    if len(set(dims)) > 1:
        return _pack_flat(tensors, placements, world).unsqueeze(-1)
    D = dims[0]
    channels = sum(p.local for p in placements)
    send = tensors[0].new_empty(world, B, S_local, channels, D)
    for j in range(world):
        c = 0
        for t, p in zip(tensors, placements):
            start = p.source_head(j)
            send[j, :, :, c:c + p.local] = t[:, :, start:start + p.local]
            c += p.local
    return send


def _pack_flat(tensors, placements, world) -> torch.Tensor:
    B, S_local = tensors[0].shape[:2]
    width = sum(p.local * t.shape[3] for t, p in zip(tensors, placements))
    send = tensors[0].new_empty(world, B, S_local, width)
    for j in range(world):
        c = 0
        for t, p in zip(tensors, placements):
            start, w = p.source_head(j), p.local * t.shape[3]
            send[j, :, :, c:c + w] = t[:, :, start:start + p.local].reshape(B, S_local, w)
            c += w
    return send


def split_head_channels(full: torch.Tensor, placements: Sequence[HeadPlacement],
                        head_dims: Sequence[int]) -> List[torch.Tensor]:
    """Views `[..., local_t, D_t]` of each tensor's channels in a buffer `[..., Hc, D]` (one
    head dim) or `[..., W, 1]` (flattened heads, several head dims)."""
    outs, c = [], 0
    flat = len(set(head_dims)) > 1
    for p, d in zip(placements, head_dims):
        if flat:
            part = full[..., c:c + p.local * d, 0]
            outs.append(part.view(*part.shape[:-1], p.local, d))
            c += p.local * d
        else:
            outs.append(full[..., c:c + p.local, :])
            c += p.local
    return outs


def join_head_channels(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Inverse of `split_head_channels` for tensors `[B, S, local_t, D_t]`: one `[B, S, Hc, D]`
    (one head dim) or `[B, S, W, 1]` (several)."""
    if len({t.shape[3] for t in tensors}) > 1:
        return torch.cat([t.reshape(*t.shape[:2], -1) for t in tensors], dim=2).unsqueeze(-1)
    return torch.cat(list(tensors), dim=2) if len(tensors) > 1 else tensors[0]


def unpack_from_heads(recv: torch.Tensor, placements: Sequence[HeadPlacement],
                      head_dims: Optional[Sequence[int]] = None) -> List[torch.Tensor]:
    """Inverse of `pack_for_heads` for gradients: `[P, B, S_local, Hc, D]` (or `[P, B,
    S_local, W, 1]` with `head_dims`) -> tensors `[B, S_local, H_t, D_t]`, summing the
    replicas of replicated heads."""
    P, B, S_local = recv.shape[:3]
    head_dims = list(head_dims) if head_dims is not None else [recv.shape[4]] * len(placements)
    out = []
    for p, part in zip(placements, split_head_channels(recv, placements, head_dims)):  # [P, B, S, local, D]
        D = part.shape[-1]
        if p.replicas > 1:  # ranks [g * replicas, (g + 1) * replicas) hold the same heads: sum them
            part = part.reshape(P // p.replicas, p.replicas, B, S_local, p.local, D).sum(dim=1)
        out.append(part.permute(1, 2, 0, 3, 4).reshape(B, S_local, p.heads, D).contiguous())
    return out


def placements_for(num_heads: Sequence[int], world: int) -> List[HeadPlacement]:
    return [place_heads(h, world) for h in num_heads]
