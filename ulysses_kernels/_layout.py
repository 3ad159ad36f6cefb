"""Sequence and head bookkeeping shared by every execution path.

Everything here is pure arithmetic: how `torch.tensor_split` cuts a sequence over P
ranks, and which query / key-value heads each rank owns after the all-to-all. The
reference path, the Triton path and the CUDA extension must all agree with it.
"""

from dataclasses import dataclass
from typing import List


def split_lengths(total: int, parts: int) -> List[int]:
    """Lengths of `torch.tensor_split(x, parts)` along a dim of size `total`.

    The first `total % parts` chunks are one longer than the rest.
    """
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def split_starts(lengths: List[int]) -> List[int]:
    """Start offset of each chunk (exclusive prefix sum)."""
    starts, acc = [], 0
    for n in lengths:
        starts.append(acc)
        acc += n
    return starts


@dataclass(frozen=True)
class HeadPlan:
    """Which heads a rank of a P-way sequence-parallel group owns after seq->heads.

    Query heads are always split: rank r owns `[r * Hq/P, (r+1) * Hq/P)`.
    KV heads are split the same way when `Hkv % P == 0`; when `P % Hkv == 0` (fewer KV
    heads than ranks) each KV head is replicated to the `P / Hkv` consecutive ranks whose
    query heads use it, and the replicas' gradients are summed on the way back.
    """

    world: int
    num_q_heads: int
    num_kv_heads: int

    @property
    def kv_split(self) -> bool:
        return self.num_kv_heads % self.world == 0

    @property
    def local_q_heads(self) -> int:
        return self.num_q_heads // self.world

    @property
    def local_kv_heads(self) -> int:
        return self.num_kv_heads // self.world if self.kv_split else 1

    @property
    def kv_replicas(self) -> int:
        """How many ranks receive each KV head (1 when KV heads are split)."""
        return 1 if self.kv_split else self.world // self.num_kv_heads

    def q_head_start(self, rank: int) -> int:
        return rank * self.local_q_heads

    def kv_head_start(self, rank: int) -> int:
        if self.kv_split:
            return rank * self.local_kv_heads
        return rank // self.kv_replicas


def head_plan_error(world: int, num_q_heads: int, num_kv_heads: int):
    """Return a message if the head counts cannot be sharded over `world` ranks, else None."""
    if num_q_heads % num_kv_heads != 0:
        return (f"query heads ({num_q_heads}) must be a multiple of key/value heads "
                f"({num_kv_heads}) for grouped-query attention")
    if num_q_heads % world != 0:
        return (f"query heads ({num_q_heads}) must be divisible by the sequence-parallel "
                f"size ({world})")
    if num_kv_heads % world != 0 and world % num_kv_heads != 0:
        return (f"key/value heads ({num_kv_heads}) must either be divisible by the "
                f"sequence-parallel size ({world}) or divide it (GQA replication)")
    return None
