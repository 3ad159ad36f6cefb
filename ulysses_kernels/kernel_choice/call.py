"""The class of an attention call (docs/architecture.md, "The kernel choice"): every fact a
kernel's capability table is checked against and the timed choice is keyed by. Two calls
of one class run on the same kernel, on every rank of a group.

A call class never holds a rank's own facts (its rank, its slice of the sequence): every
rank of a Ulysses group sees the same heads-sharded shape, so every rank derives the same
class, and the agreement on the choice (choice.py) is one collective on the first call.
"""

import functools
from dataclasses import dataclass
from typing import Tuple

import torch

from ..variants import PLAIN, Band, Variant

# How the causal diagonal sits when the lengths differ (bottom-right alignment: query i sees
# key j iff j <= i + Sk - Sq). "square": Sq == Sk, where top-left and bottom-right agree;
# "short_queries": Sq < Sk (a chunk of queries over a longer cache); "long_queries": Sq > Sk,
# where the first rows see no key at all.
ALIGNMENTS = ("square", "short_queries", "long_queries")


def alignment_of(q_len: int, k_len: int) -> str:
    return "square" if q_len == k_len else ("short_queries" if q_len < k_len else "long_queries")


def bucket(length: int) -> int:
    """The power of two at or above `length` (at least 16): calls in one bucket share a choice."""
    return max(16, 1 << max(0, int(length) - 1).bit_length())


@dataclass(frozen=True)
class Call:
    """One class of attention calls."""

    device: str                        # the GPU's name, or "cpu"
    capability: Tuple[int, int]        # the GPU's compute capability, (0, 0) on CPU
    dtype: str                         # "bfloat16", ...
    head_dim: int                      # q's and k's
    value_dim: int                     # v's (MLA has its own)
    q_heads: int
    kv_heads: int
    causal: bool
    alignment: str                     # ALIGNMENTS
    bucket: int                        # the power of two at or above max(Sq, Sk)
    batch: int = 1
    window: Band = (None, None)        # variants.py's band; sides may be negative in a ring's blocks
    softcap: float = 0.0
    sinks: bool = False
    packed: bool = False               # packed documents (cu_seqlens)
    lse: bool = False                  # the ring: the forward returns the LSE, the backward takes a merged out and LSE
    rows_layout: bool = False          # the all-to-all buffer's block rows (batch > 1 across ranks): no [B, S, H, D] view
    deterministic: bool = False        # a bitwise-reproducible backward is asked for
    grad: bool = False                 # the call will be differentiated
    empty: bool = False                # Sq or Sk is 0

    @property
    def windowed(self) -> bool:
        return self.window != (None, None)

    @property
    def variant(self) -> Variant:
        return Variant(window=self.window, softcap=self.softcap)

    def text(self) -> str:
        """A stable one-line name: the cache key's first part and doctor's label."""
        parts = [self.device, f"sm{self.capability[0]}{self.capability[1]}", self.dtype,
                 f"d{self.head_dim}" + (f"v{self.value_dim}" if self.value_dim != self.head_dim else ""),
                 f"h{self.q_heads}/{self.kv_heads}", f"B{self.batch}", f"S{self.bucket}",
                 ("causal-" if self.causal else "full-") + self.alignment]
        if self.windowed:
            parts.append("window{}:{}".format(*("none" if s is None else s for s in self.window)))
        for flag, name in ((self.softcap, f"softcap{self.softcap:g}"), (self.sinks, "sinks"),
                           (self.packed, "packed"), (self.lse, "lse"), (self.rows_layout, "rows"),
                           (self.deterministic, "deterministic"), (self.empty, "empty")):
            if flag:
                parts.append(name)
        parts.append("fwd+bwd" if self.grad else "fwd")
        return "|".join(parts)


@functools.lru_cache(maxsize=None)
def device_facts(device: torch.device) -> Tuple[str, Tuple[int, int]]:
    """(name, compute capability) of `device`; ("cpu", (0, 0)) off CUDA."""
    if device.type != "cuda":
        return device.type, (0, 0)
    return torch.cuda.get_device_name(device), tuple(torch.cuda.get_device_capability(device))


def call_for(device: torch.device, dtype, *, batch: int, q_len: int, k_len: int, q_heads: int, kv_heads: int,
             head_dim: int, value_dim: int, causal: bool, variant: Variant = PLAIN, **flags) -> Call:
    """THE construction of a class from a call's shape (what `call_of` reads from tensors, the
    fused path from its chunk plan, the ring from its spec, doctor from a described call);
    `flags`: sinks, packed, lse, rows_layout, deterministic, grad."""
    name, capability = device_facts(torch.device(device))
    return Call(device=name, capability=capability, dtype=str(dtype).replace("torch.", ""), head_dim=int(head_dim),
                value_dim=int(value_dim), q_heads=int(q_heads), kv_heads=int(kv_heads), causal=bool(causal),
                alignment=alignment_of(q_len, k_len), bucket=bucket(max(q_len, k_len)), batch=int(batch),
                window=variant.window, softcap=float(variant.softcap), empty=min(q_len, k_len) < 1,
                **{key: bool(value) for key, value in flags.items()})


def call_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, packed: bool = False,
            variant: Variant = PLAIN, sinks: bool = False, lse: bool = False, rows_layout: bool = False,
            deterministic: bool = False, grad: bool = False, batch: int = None) -> Call:
    """The class of attention of q `[B, Sq, Hq, D]` over k `[B, Sk, Hkv, D]`, v `[B, Sk, Hkv, Dv]`
    (`rows_layout`: the buffer's 3-D rows `[B*S, H, D]`, with `batch` rows of the batch)."""
    if rows_layout:
        batch = int(batch)
        q_len, k_len = q.shape[0] // batch, k.shape[0] // batch
        heads = (q.shape[1], k.shape[1])
    else:
        batch, q_len, k_len = q.shape[0], q.shape[1], k.shape[1]
        heads = (q.shape[2], k.shape[2])
    return call_for(q.device, q.dtype, batch=batch, q_len=q_len, k_len=k_len, q_heads=heads[0], kv_heads=heads[1],
                    head_dim=q.shape[-1], value_dim=v.shape[-1], causal=causal, variant=variant, sinks=sinks,
                    packed=packed, lse=lse, rows_layout=rows_layout, deterministic=deterministic, grad=grad)
