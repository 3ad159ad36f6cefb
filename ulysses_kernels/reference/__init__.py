"""The reference path: torch ops + torch.distributed. It defines the semantics every
faster path is tested against, and runs anywhere (CPU with gloo included).

- `attention.py`: exact single-device attention (`reference_attention`).
- `exchange.py`: the sequence <-> head all-to-all exchanges (also used by the Triton path).
- `sequence.py`: differentiable sharding and gathering along the sequence.
- `ring.py`: ring attention over the ring group of the Ulysses x Ring hybrid.
- `ulysses.py`: `ulysses_attention` on this path.
"""

from .attention import reference_attention
from .ulysses import ulysses_attention

__all__ = ["reference_attention", "ulysses_attention"]
