"""The reference path only: torch ops + torch.distributed. It defines the semantics every
faster path is tested against, and runs anywhere (CPU with gloo included).

- `attention.py`: exact single-device attention (`reference_attention`).
- `sdpa.py`: torch SDPA for the calls it computes with the same semantics (the path's
  fast attention; `sdpa_problem` says what keeps the reference).
- `block_ops.py`: the ring's block computations in torch (`TorchBlockOps`).
- `path.py`: the path itself (`PATH`, distributed/dispatch.py's `Path`).
"""

from .attention import reference_attention
from .path import PATH

__all__ = ["reference_attention", "PATH"]
