"""The fused path: CUDA pack/unpack kernels (csrc/) + an NCCL engine on its own stream +
Triton attention reading the receive buffers in place, chunked so that exchanges overlap
attention (docs/architecture.md, "Fused path").

- `plan.py`: which heads each chunk moves (pure arithmetic).
- `ops.py`: the CUDA ops as the path calls them (placements from layout.py), their fakes.
- `transport.py`: NCCL communicator; `engine.py`: transport + comm stream + buffers per group.
- `streams.py`: stream/event helpers; `pipeline.py`: the forward/backward pipelines.
- `attention.py`: `ulysses_attention` on this path; `layer.py`: the self-attention block
  whose projection GEMMs run inside the pipeline.

Declared interface (what the rest of the package and `ulysses_kernels.testing` use):
everything imported below.
"""

from .attention import Setup, prepare, problem, ulysses_attention, unsupported_reason
from .engine import Engine, close, get_engine, use_transport
from .layer import self_attention
from .ops import is_supported, use_ops
from .plan import ENV_CHUNKS, Chunk, plan_chunks, resolve_num_chunks, valid_num_chunks
from .transport import ENV_BLOCKING, ENV_CHECK, ENV_TIMEOUT, NcclTransport

__all__ = [
    "ulysses_attention", "self_attention", "prepare", "Setup", "problem", "unsupported_reason",
    "Engine", "get_engine", "close", "use_transport", "NcclTransport", "is_supported", "use_ops",
    "Chunk", "plan_chunks", "valid_num_chunks", "resolve_num_chunks",
    "ENV_CHUNKS", "ENV_TIMEOUT", "ENV_CHECK", "ENV_BLOCKING",
]
