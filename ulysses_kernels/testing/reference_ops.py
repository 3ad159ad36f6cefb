"""Pure-torch stand-ins of the CUDA pack/unpack ops (csrc/pack_kernels.cu), with the same
arguments: the kernels must match them bitwise (replicated heads are summed in fp32 in
replica order, like the kernel). Installed with `ulysses_kernels.fused.use_ops` they run
the whole fused pipeline on CPU (see `fused_stand_ins`). Like the kernels, they take the
placement (`local_heads`, `replicas`) as arguments and never decide one. The pack's rotary
embedding (q and k of the fused self-attention layer) is computed in fp32 and rounded once,
as in the kernel (which may contract to FMAs: equal up to the last bit)."""

import torch

from ..layout import HeadPlacement


def _jobs(tensors, world, offsets, counts, local_heads, replicas):
    """(tensor, its placement, first local head, heads, first channel) of every tensor with
    heads in this chunk, channels consecutive in tensor order: the jobs of the kernels."""
    ch = 0
    for x, off, cnt, local, rep in zip(tensors, offsets, counts, local_heads, replicas):
        if cnt:
            yield x, HeadPlacement(x.shape[2], world, local, rep), off, cnt, ch
            ch += cnt


def _rotated(x, cos, sin):
    """x `[B, S, H, D]` with the rotary embedding of cos/sin `[B, S, D]` (rotary.py's
    convention), computed in fp32 and rounded once to x's dtype, as the rotary pack kernel."""
    h = x.shape[-1] // 2
    xf, c, s = x.float(), cos.float().unsqueeze(2), sin.float().unsqueeze(2)
    rot = torch.cat([-xf[..., h:], xf[..., :h]], dim=-1)
    return (xf * c + rot * s).to(x.dtype)


class ReferenceOps:
    device_types = ("cpu", "cuda")

    @staticmethod
    def pack_into(srcs, send, offsets, counts, local_heads, replicas, cos=None, sin=None, rotary=()):
        P = send.shape[0]
        if any(rotary):  # the kernel's rotary pack: fp32 math, one rounding
            srcs = [_rotated(x, cos, sin) if flag else x for x, flag in zip(srcs, rotary)]
        for x, placement, off, cnt, ch in _jobs(srcs, P, offsets, counts, local_heads, replicas):
            for j in range(P):
                start = placement.source_head(j, off)
                send[j, :, :, ch:ch + cnt] = x[:, :, start:start + cnt]

    @staticmethod
    def unpack_into(recv, outs, offsets, counts, local_heads, replicas):
        P = recv.shape[0]
        for x, placement, off, cnt, ch in _jobs(outs, P, offsets, counts, local_heads, replicas):
            rep = placement.replicas
            for g in range(P // rep):  # ranks [g * rep, (g + 1) * rep) hold the same heads
                first = placement.source_head(g * rep, off)
                if rep == 1:
                    x[:, :, first:first + cnt] = recv[g, :, :, ch:ch + cnt]
                    continue
                acc = recv[g * rep, :, :, ch:ch + cnt].float()
                for r in range(1, rep):
                    acc = acc + recv[g * rep + r, :, :, ch:ch + cnt].float()
                x[:, :, first:first + cnt] = acc.to(x.dtype)
