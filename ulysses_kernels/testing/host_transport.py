"""A transport for the fused engine that goes through host memory (tests only)."""

import torch
import torch.distributed as dist


class HostTransport:
    """Test transport: the exchange goes through host memory over a gloo group.

    NCCL refuses two ranks on one GPU, so multi-rank tests on a single GPU run every
    CUDA part of the fused path (pack/unpack kernels, chunking, streams, the attention
    reading the receive buffers in place) and replace only the NCCL call by a gloo
    `all_to_all_single` of the same bytes. It synchronises the comm stream; it is for
    correctness tests, never for speed.
    """

    name = "host"

    def __init__(self, group, world: int, rank: int, device: torch.device):
        self.group, self.world, self.rank, self.device = group, world, rank, device

    def all_to_all(self, send, recv, send_counts, recv_counts):
        esize = send.element_size()
        s = send.reshape(-1)[:sum(send_counts)].view(torch.uint8).cpu()
        r = torch.empty(sum(recv_counts) * esize, dtype=torch.uint8)
        if self.group is None and not dist.is_initialized():
            r.copy_(s)
        else:
            dist.all_to_all_single(r, s, [n * esize for n in recv_counts], [n * esize for n in send_counts],
                                   group=self.group)
        recv.reshape(-1)[:sum(recv_counts)].view(torch.uint8).copy_(r)

    def check(self):
        pass

    def close(self):
        pass
