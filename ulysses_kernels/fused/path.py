"""The fused path itself (`PATH`, distributed/dispatch.py's `Path`): its Ulysses attention is the
chunked pipeline (attention.py), its exchange the engine's (exchange.py), its ring
transfers the ring engine's (ring.py). Its single-device attention and the ring's block
computations are the Triton path's (the same kernels; `ulysses_kernels.triton_path`,
this path's declared interface to it)."""

from .. import triton_path
from . import exchange
from .attention import problem, ulysses_attention
from .ring import ring_shift


class FusedPath:
    name = "fused"
    block_ops = triton_path.TritonBlockOps
    problem = staticmethod(problem)
    ulysses_attention = staticmethod(ulysses_attention)
    seq_to_heads = staticmethod(exchange.seq_to_heads)
    heads_to_seq = staticmethod(exchange.heads_to_seq)
    attention = staticmethod(triton_path.PATH.attention)
    ring_shift = staticmethod(ring_shift)


PATH = FusedPath()
