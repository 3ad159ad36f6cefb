"""ulysses-kernels: Ulysses sequence parallelism for PyTorch.

Each rank of a sequence-parallel group holds a contiguous slice of the sequence; one
all-to-all trades it for a head shard of the whole sequence, attention runs exactly, and
a second all-to-all trades it back. Beyond the head count, the Ulysses x Ring hybrid
runs ring attention over a second group (`init_sequence_parallel(sp, ring_size=R)`).
docs/architecture.md walks one call through the package; this module only re-exports
the public API, after one process-wide setting: NCCL_LAUNCH_ORDER_IMPLICIT=1 unless the
environment names a value (nccl_order.py: the fused engine's NCCL communicator beside torch's).
"""

from .nccl_order import order_nccl_launches

order_nccl_launches()

from .api import (  # noqa: E402 - after the NCCL setting, which must precede any NCCL launch
    flash_attention,
    gather_sequence,
    heads_to_seq,
    qkv_seq_to_heads,
    seq_to_heads,
    shard_sequence,
    ulysses_attention,
    ulysses_head_parallel,
)
from .distributed.groups import ParallelGroups, groups_from_mesh, init_sequence_parallel
from .global_batch import CostModel, GlobalBatchPlan, naive_plan, plan_global_batch
from .layout import HeadPlan, choose_ring_size, split_lengths
from .modules import UlyssesAttention, UlyssesSelfAttention
from .monitor import StepMonitor, StepRecord
from .reference import reference_attention
from .ring.layout import sp_lengths

__version__ = "0.1.0"

__all__ = [
    "ulysses_attention", "UlyssesAttention", "UlyssesSelfAttention", "flash_attention", "reference_attention",
    "seq_to_heads", "heads_to_seq", "qkv_seq_to_heads", "ulysses_head_parallel", "shard_sequence", "gather_sequence",
    "init_sequence_parallel", "groups_from_mesh", "ParallelGroups", "split_lengths", "HeadPlan", "choose_ring_size", "sp_lengths",
    "StepMonitor", "StepRecord", "plan_global_batch", "naive_plan", "GlobalBatchPlan", "CostModel",
]
