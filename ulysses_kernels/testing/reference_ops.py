"""Pure-torch stand-ins of the CUDA pack/unpack ops (csrc/pack_kernels.cu), with the same
arguments: the kernels must match them bitwise (replicated heads are summed in fp32 in
replica order, like the kernel). Installed with `ulysses_kernels.fused.use_ops` they run
the whole fused pipeline on CPU (see `fused_stand_ins`)."""


class ReferenceOps:
    device_types = ("cpu", "cuda")

    @staticmethod
    def pack_into(srcs, send, offsets, counts, local_heads, replicas):
        P = send.shape[0]
        ch = 0
        for x, off, cnt, local, rep in zip(srcs, offsets, counts, local_heads, replicas):
            if cnt == 0:
                continue
            for j in range(P):
                start = (j // rep) * local + off  # the placement the caller passed (layout.py)
                send[j, :, :, ch:ch + cnt] = x[:, :, start:start + cnt]
            ch += cnt

    @staticmethod
    def unpack_into(recv, outs, offsets, counts, local_heads, replicas):
        P = recv.shape[0]
        ch = 0
        for x, off, cnt, local, rep in zip(outs, offsets, counts, local_heads, replicas):
            if cnt == 0:
                continue
            for g in range(P // rep):  # ranks [g * rep, (g + 1) * rep) hold the same heads
                first = g * local + off
                if rep == 1:
                    x[:, :, first:first + cnt] = recv[g, :, :, ch:ch + cnt]
                    continue
                acc = recv[g * rep, :, :, ch:ch + cnt].float()
                for r in range(1, rep):
                    acc = acc + recv[g * rep + r, :, :, ch:ch + cnt].float()
                x[:, :, first:first + cnt] = acc.to(x.dtype)
            ch += cnt
