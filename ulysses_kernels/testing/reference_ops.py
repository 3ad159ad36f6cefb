"""Pure-torch stand-ins of the CUDA pack/unpack ops (csrc/pack_kernels.cu), with the same
arguments: the kernels must match them bitwise (replicated heads are summed in fp32 in
replica order, like the kernel). Installed with `ulysses_kernels.fused.use_ops` they run
the whole fused pipeline on CPU (see `fused_stand_ins`). Like the kernels, they take the
placement (`local_heads`, `replicas`) as arguments and never decide one."""

from ..layout import HeadPlacement


class ReferenceOps:
    device_types = ("cpu", "cuda")

    @staticmethod
    def pack_into(srcs, send, offsets, counts, local_heads, replicas):
        P = send.shape[0]
        ch = 0
        for x, off, cnt, local, rep in zip(srcs, offsets, counts, local_heads, replicas):
            if cnt == 0:
                continue
            placement = HeadPlacement(x.shape[2], P, local, rep)
            for j in range(P):
                start = placement.source_head(j, off)
                send[j, :, :, ch:ch + cnt] = x[:, :, start:start + cnt]
            ch += cnt

    @staticmethod
    def unpack_into(recv, outs, offsets, counts, local_heads, replicas):
        P = recv.shape[0]
        ch = 0
        for x, off, cnt, local, rep in zip(outs, offsets, counts, local_heads, replicas):
            if cnt == 0:
                continue
            placement = HeadPlacement(x.shape[2], P, local, rep)
            for g in range(P // rep):  # ranks [g * rep, (g + 1) * rep) hold the same heads
                first = placement.source_head(g * rep, off)
                if rep == 1:
                    x[:, :, first:first + cnt] = recv[g, :, :, ch:ch + cnt]
                    continue
                acc = recv[g * rep, :, :, ch:ch + cnt].float()
                for r in range(1, rep):
                    acc = acc + recv[g * rep + r, :, :, ch:ch + cnt].float()
                x[:, :, first:first + cnt] = acc.to(x.dtype)
            ch += cnt
