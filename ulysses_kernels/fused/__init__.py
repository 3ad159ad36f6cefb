"""The fused path: CUDA pack/unpack kernels (csrc/) + an NCCL engine on its own stream +
Triton attention reading the receive buffers in place, chunked so that exchanges overlap
attention (docs/architecture.md, "Fused path").

- `plan.py`: which heads each chunk moves (pure arithmetic).
- `ops.py`: the CUDA ops as the path calls them (placements from layout.py), their fakes.
- `transport.py`: NCCL communicator; `symm_transport.py`: symmetric-memory windows (not yet
  run on a GPU, `ULYSSES_KERNELS_TRANSPORT=symm`); `engine.py`: transport + comm stream + buffers per group.
- `exchange.py`: the seq <-> heads exchange on the engine (streams and events: `ulysses_kernels/streams.py`).
- `pipeline.py`: the chunked forward/backward pipelines; `attention.py`: `ulysses_attention`
  on this path; `layer.py`: the self-attention block whose projection GEMMs run inside the
  pipeline; `ring.py`: the Ulysses x Ring transfers on the ring group's engine.
- `path.py`: the path itself (`PATH`).

Declared interface (what the rest of the package and `ulysses_kernels.testing` use):
everything imported below.
"""

from .attention import Setup, prepare, problem, ulysses_attention
from .engine import Engine, choose_transport, close, get_engine, use_transport
from .layer import self_attention
from .ops import is_supported, use_ops
from .path import PATH
from .plan import Chunk, plan_chunks, resolve_num_chunks, valid_num_chunks
from .symm_transport import SymmTransport
from .transport import NcclTransport

__all__ = [
    "PATH", "ulysses_attention", "self_attention", "prepare", "Setup", "problem",
    "Engine", "get_engine", "close", "use_transport", "choose_transport", "NcclTransport", "SymmTransport", "is_supported", "use_ops",
    "Chunk", "plan_chunks", "valid_num_chunks", "resolve_num_chunks",
]
