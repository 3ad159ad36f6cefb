"""Sequence <-> head all-to-all exchanges (reference path: torch ops + torch.distributed).

Layout conventions (DESIGN.md, "Data flow"):
- send buffer of seq->heads: `[P, B, S_local, Hc, D]`, chunk j goes to rank j, where Hc is
  the number of head channels one rank receives (for the fused q/k/v exchange
  `Hc = Hl_q + 2 * Hl_kv`, replicated KV heads included).
- receive buffer: the concatenation over source ranks i of `[B, S_i, Hc, D]` blocks.
  Source-rank-major is sequence order, so for B == 1 it already is `[S, Hc, D]`.
- heads->seq is the exact inverse: every rank sends, for each destination j, its heads
  for j's sequence slice `[B, S_j, Hc, D]`; that send buffer has the same block layout
  as the receive buffer above, which is what lets attention write its output there.

All functions are differentiable; the backward of an exchange is the inverse exchange
(summing the gradients of replicated KV heads).
"""

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ._layout import split_lengths


# --------------------------------------------------------------------------- groups

def resolve_group(group):
    """(group, world, rank) for `group` (None = the default group), or (None, 1, 0) when
    torch.distributed is not initialised and no group was given: a single process."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return None, 1, 0
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("a process group was passed but torch.distributed is not initialized")
    if group is None:
        group = dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"rank {dist.get_rank()} is not a member of the given process group")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"rank {dist.get_rank()} is not a member of the given process group")
    return group, dist.get_world_size(group), rank


def _all_to_all(send: torch.Tensor, send_splits: List[int], recv_splits: List[int], group) -> torch.Tensor:
    """Flat all_to_all_single with element split sizes; returns the flat receive buffer."""
    send = send.reshape(-1)
    recv = send.new_empty(sum(recv_splits))
    if group is None:  # single process: the exchange is the identity
        recv.copy_(send)
        return recv
    dist.all_to_all_single(recv, send, output_split_sizes=recv_splits,
                           input_split_sizes=send_splits, group=group)
    return recv


# ------------------------------------------------------------- raw (non-autograd) exchanges

def exchange_seq_to_heads(send: torch.Tensor, seq_lens: List[int], rank: int, group) -> torch.Tensor:
    """send `[P, B, S_rank, Hc, D]` -> flat receive buffer of `[B, S_i, Hc, D]` blocks."""
    P, B, S_local, Hc, D = send.shape
    per_token = B * Hc * D
    return _all_to_all(send, [S_local * per_token] * P, [n * per_token for n in seq_lens], group)


def recv_blocks_to_bshd(recv: torch.Tensor, seq_lens: List[int], batch: int, channels: int,
                        head_dim: int) -> torch.Tensor:
    """Flat receive buffer -> `[B, S, Hc, D]` (a view for B == 1, one copy otherwise)."""
    total = sum(seq_lens)
    if batch == 1:
        return recv.view(1, total, channels, head_dim)
    blocks = torch.split(recv, [batch * n * channels * head_dim for n in seq_lens])
    return torch.cat([b.view(batch, n, channels, head_dim) for b, n in zip(blocks, seq_lens)], dim=1)


def exchange_heads_to_seq(x: torch.Tensor, seq_lens: List[int], rank: int, group) -> torch.Tensor:
    """x `[B, S, Hc, D]` (this rank's heads, whole sequence) -> `[P, B, S_rank, Hc, D]`,
    where slot i holds source rank i's heads for this rank's sequence slice."""
    B, S, Hc, D = x.shape
    P = len(seq_lens)
    per_token = B * Hc * D
    # Send blocks in destination order, each [B, S_j, Hc, D] contiguous.
    send = torch.cat([c.reshape(-1) for c in torch.split(x, seq_lens, dim=1)]) if P > 1 else x.reshape(-1)
    recv = _all_to_all(send, [n * per_token for n in seq_lens], [seq_lens[rank] * per_token] * P, group)
    return recv.view(P, B, seq_lens[rank], Hc, D)


# --------------------------------------------------------------------- packing helpers

def _pack_for_heads(tensors: Sequence[torch.Tensor], plans: Sequence[Tuple[int, int, int]], world: int) -> torch.Tensor:
    """Write tensors `[B, S_local, H_t, D]` into one send buffer `[P, B, S_local, Hc, D]`.

    plans[t] = (local heads, split? 1/0, replicas): destination j receives heads
    `[j*local, (j+1)*local)` when split, else head `j // replicas`.
    """
    B, S_local, _, D = tensors[0].shape
    channels = sum(p[0] for p in plans)
    send = tensors[0].new_empty(world, B, S_local, channels, D)
    for j in range(world):
        c = 0
        for t, (local, split, replicas) in zip(tensors, plans):
            start = j * local if split else j // replicas
            send[j, :, :, c:c + local] = t[:, :, start:start + local]
            c += local
    return send


def _unpack_from_heads(recv: torch.Tensor, plans: Sequence[Tuple[int, int, int]], num_heads: Sequence[int]) -> List[torch.Tensor]:
    """Inverse of `_pack_for_heads` for gradients: `[P, B, S_local, Hc, D]` -> tensors
    `[B, S_local, H_t, D]`, summing the replicas of replicated heads."""
    P, B, S_local, _, D = recv.shape
    out, c = [], 0
    for (local, split, replicas), heads in zip(plans, num_heads):
        part = recv[:, :, :, c:c + local]  # [P, B, S, local, D]
        c += local
        if split:
            t = part.permute(1, 2, 0, 3, 4).reshape(B, S_local, P * local, D)
        else:  # local == 1; ranks [h*replicas, (h+1)*replicas) hold head h
            t = part.reshape(heads, replicas, B, S_local, D).sum(dim=1).permute(1, 2, 0, 3)
        out.append(t.contiguous())
    return out


def _tensor_plan(heads: int, world: int) -> Tuple[int, int, int]:
    if heads % world == 0:
        return (heads // world, 1, 1)
    return (1, 0, world // heads)


def _plans_for(num_heads: Sequence[int], world: int):
    return [_tensor_plan(h, world) for h in num_heads]


# ------------------------------------------------------------------- autograd functions

class _SeqToHeads(torch.autograd.Function):
    """Tensors `[B, S_local, H_t, D]` -> `[B, S, Hl_t, D]` in one exchange."""

    @staticmethod
    def forward(ctx, group, rank, seq_lens, *tensors):
        world = len(seq_lens)
        num_heads = [t.shape[2] for t in tensors]
        plans = _plans_for(num_heads, world)
        B, _, _, D = tensors[0].shape
        send = _pack_for_heads(tensors, plans, world)
        recv = exchange_seq_to_heads(send, seq_lens, rank, group)
        channels = send.shape[3]
        full = recv_blocks_to_bshd(recv, seq_lens, B, channels, D)
        ctx.group, ctx.rank, ctx.seq_lens, ctx.plans, ctx.num_heads = group, rank, seq_lens, plans, num_heads
        outs, c = [], 0
        for local, _, _ in plans:
            outs.append(full[:, :, c:c + local])
            c += local
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        B, S, _, D = next(g for g in grads if g is not None).shape
        grads = [g if g is not None else torch.zeros(B, S, p[0], D, dtype=_dtype_of(grads), device=_device_of(grads))
                 for g, p in zip(grads, ctx.plans)]
        packed = torch.cat(grads, dim=2) if len(grads) > 1 else grads[0]
        recv = exchange_heads_to_seq(packed, ctx.seq_lens, ctx.rank, ctx.group)
        return (None, None, None) + tuple(_unpack_from_heads(recv, ctx.plans, ctx.num_heads))


class _HeadsToSeq(torch.autograd.Function):
    """`[B, S, Hl, D]` -> `[B, S_local, P*Hl, D]`."""

    @staticmethod
    def forward(ctx, group, rank, seq_lens, x):
        ctx.group, ctx.rank, ctx.seq_lens = group, rank, seq_lens
        recv = exchange_heads_to_seq(x, seq_lens, rank, group)
        P, B, S_local, Hl, D = recv.shape
        return recv.permute(1, 2, 0, 3, 4).reshape(B, S_local, P * Hl, D)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        world = len(ctx.seq_lens)
        plans = _plans_for([grad.shape[2]], world)
        send = _pack_for_heads([grad], plans, world)
        recv = exchange_seq_to_heads(send, ctx.seq_lens, ctx.rank, ctx.group)
        B, _, _, D = grad.shape
        return None, None, None, recv_blocks_to_bshd(recv, ctx.seq_lens, B, plans[0][0], D)


def _dtype_of(grads):
    return next(g for g in grads if g is not None).dtype


def _device_of(grads):
    return next(g for g in grads if g is not None).device


# ------------------------------------------------------------------------ public API

def _lengths(group, world, rank, x, seq_lens, kind, names, tensors, **options):
    """Every rank's local length: checked exchange by default, trusted `seq_lens` otherwise."""
    from ._checks import exchange_and_check, lengths_error

    if seq_lens is None:
        if group is None:  # single process: nothing to exchange
            from ._checks import build_descriptor, check_table
            err = check_table(kind, [build_descriptor(kind, tensors, **options)], names)
            if err:
                raise ValueError(f"{kind}: {err}")
            return [x.shape[1]]
        return exchange_and_check(kind, group, names, tensors, **options)
    seq_lens = [int(n) for n in seq_lens]
    if len(seq_lens) != world:
        raise ValueError(f"{kind}: seq_lens has {len(seq_lens)} entries but the group has {world} ranks")
    if seq_lens[rank] != x.shape[1]:
        raise ValueError(f"{kind}: seq_lens[{rank}] = {seq_lens[rank]} but this rank's local length is {x.shape[1]}")
    err = lengths_error(seq_lens)
    if err:
        raise ValueError(f"{kind}: {err}")
    return seq_lens


def seq_to_heads(x: torch.Tensor, group=None, *, seq_lens: Optional[Sequence[int]] = None) -> torch.Tensor:
    """`[B, S_local, H, D]` sequence shard -> `[B, S, H/P, D]` head shard (differentiable)."""
    group, world, rank = resolve_group(group)
    lens = _lengths(group, world, rank, x, seq_lens, "seq_to_heads", ["x"], [x])
    if x.shape[2] % world:  # checked by the exchange too; the seq_lens path needs it here
        raise ValueError(f"seq_to_heads: heads ({x.shape[2]}) must be divisible by the "
                         f"sequence-parallel size ({world})")
    return _SeqToHeads.apply(group, rank, lens, x)[0]


def heads_to_seq(x: torch.Tensor, group=None, *, seq_lens: Optional[Sequence[int]] = None) -> torch.Tensor:
    """`[B, S, H/P, D]` head shard -> `[B, S_local, H, D]` sequence shard (differentiable).

    Rank r receives `torch.tensor_split`'s r-th slice of the sequence. By default one small
    collective first checks that every rank holds the same batch, sequence length, heads,
    head dim and dtype (a clear ValueError on every rank instead of a hang); passing
    `seq_lens` (every rank's output length, summing to S) skips it.
    """
    group, world, rank = resolve_group(group)
    if seq_lens is None:
        if group is None:
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                raise ValueError(f"heads_to_seq: x must be a 4-D tensor [batch, seq, heads_local, head_dim], "
                                 f"got {tuple(getattr(x, 'shape', ()))}")
        else:
            from ._checks import exchange_and_check
            exchange_and_check("heads_to_seq", group, ["x"], [x])
        lens = split_lengths(x.shape[1], world)
    else:
        lens = [int(n) for n in seq_lens]
        if len(lens) != world or sum(lens) != x.shape[1] or min(lens) < 0:
            raise ValueError(f"heads_to_seq: seq_lens {lens} must have one entry per rank ({world}) "
                             f"summing to the sequence length {x.shape[1]}")
    return _HeadsToSeq.apply(group, rank, lens, x)


def qkv_seq_to_heads(q, k, v, group=None, *, seq_lens: Optional[Sequence[int]] = None):
    """q `[B, S_local, Hq, D]`, k/v `[B, S_local, Hkv, D]` -> head shards over the whole
    sequence, moved by one collective. KV heads are split when `Hkv % P == 0`, else
    replicated to the `P / Hkv` ranks that need them (gradients summed back)."""
    group, world, rank = resolve_group(group)
    lens = _lengths(group, world, rank, q, seq_lens, "qkv_seq_to_heads", ["q", "k", "v"], [q, k, v])
    if seq_lens is not None:
        from ._layout import head_plan_error
        err = head_plan_error(world, q.shape[2], k.shape[2])
        if err:
            raise ValueError(f"qkv_seq_to_heads: {err}")
    return _SeqToHeads.apply(group, rank, lens, q, k, v)


def qkv_seq_to_heads_checked(q, k, v, group, world, rank, lens):
    """Exchange after the caller has already validated (used by ulysses_attention)."""
    return _SeqToHeads.apply(group, rank, lens, q, k, v)


def heads_to_seq_with_lengths(x, group, rank, lens):
    return _HeadsToSeq.apply(group, rank, lens, x)


# ------------------------------------------------------------ sharding along the sequence

class _ShardSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, world, rank, dim, x):
        ctx.group, ctx.world, ctx.rank, ctx.dim = group, world, rank, dim
        ctx.lengths = split_lengths(x.shape[dim], world)
        return torch.tensor_split(x, world, dim=dim)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return None, None, None, None, _all_gather_seq(grad.contiguous(), ctx.lengths, ctx.dim, ctx.group)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, world, rank, dim, lengths, x):
        ctx.group, ctx.rank, ctx.dim, ctx.lengths = group, rank, dim, lengths
        return _all_gather_seq(x.contiguous(), lengths, dim, group)

    @staticmethod
    def backward(ctx, grad):
        # Every rank consumed the gathered tensor: the gradient of a shard is the sum over
        # ranks of their gradients for that slice (a reduce-scatter, done as an all-to-all
        # because gloo has no reduce_scatter).
        chunks = [c.contiguous() for c in torch.split(grad, ctx.lengths, dim=ctx.dim)]
        mine = chunks[ctx.rank]
        if ctx.group is None:
            return None, None, None, None, None, mine
        send = torch.cat([c.reshape(-1) for c in chunks])
        recv = _all_to_all(send, [c.numel() for c in chunks], [mine.numel()] * len(chunks), ctx.group)
        return None, None, None, None, None, recv.view(len(chunks), *mine.shape).sum(0)


def _all_gather_seq(x, lengths, dim, group):
    if group is None:
        return x
    longest = max(lengths)
    pad = list(x.shape)
    pad[dim] = longest - x.shape[dim]
    padded = torch.cat([x, x.new_zeros(pad)], dim=dim) if pad[dim] else x
    parts = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, lengths)], dim=dim)


def shard_sequence(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """This rank's `torch.tensor_split(x, P, dim)[rank]` of a tensor every rank holds.

    Differentiable: the backward all-gathers, so each rank gets the full gradient.
    """
    group, world, rank = resolve_group(group)
    dim = dim % x.dim()
    return _ShardSequence.apply(group, world, rank, dim, x)


def gather_sequence(x: torch.Tensor, group=None, dim: int = 1,
                    seq_lens: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Concatenate every rank's shard along `dim` (inverse of `shard_sequence`).

    Local lengths follow `torch.tensor_split`; pass `seq_lens` to skip the small length
    exchange. Differentiable: the backward sums the gradients all ranks computed for each
    shard (so compute a loss on one rank, or on each rank's own shard, not P copies of it).
    """
    group, world, rank = resolve_group(group)
    dim = dim % x.dim()
    if seq_lens is None:
        if group is None:
            seq_lens = [x.shape[dim]]
        else:
            mine = torch.tensor([x.shape[dim]], dtype=torch.int64, device=_coll_device(group))
            got = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(got, mine, group=group)
            seq_lens = [int(g.item()) for g in got]
    seq_lens = [int(n) for n in seq_lens]
    if len(seq_lens) != world or seq_lens[rank] != x.shape[dim]:
        raise ValueError(f"gather_sequence: seq_lens {seq_lens} do not match the group size {world} "
                         f"or this rank's length {x.shape[dim]}")
    return _GatherSequence.apply(group, world, rank, dim, seq_lens, x)


def _coll_device(group):
    from ._checks import collective_device
    return collective_device(group)
