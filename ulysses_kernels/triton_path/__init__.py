"""The Triton path: the torch exchange around the Triton attention kernels
(`ulysses_kernels.triton`, built from ulysses_kernels/triton/).

- `ulysses.py`: its Ulysses attention (the kernels read the all-to-all buffers in place);
- `block_ops.py`: the ring's block computations on the kernel the kernel choice picks;
- `path.py`: the path itself (`PATH`, distributed/dispatch.py's `Path`).

Declared interface: everything imported below. The fused path borrows the attention
(`PATH.attention`), the ring's block ops and the kernels' input rule
from here (docs/architecture.md, "Import layers").
"""

from .block_ops import TritonBlockOps
from .path import PATH, kernels_problem

__all__ = ["PATH", "TritonBlockOps", "kernels_problem"]
