"""Shared pieces of the Triton flash-attention kernels.

Addressing. Every tensor is passed with a base pointer and its (batch, seq, head, dim)
strides. Two sequence layouts exist, chosen by the constexpr ``SPLIT``:

* ``SPLIT=False``: the ordinary strided layout, element (b, s, h, d) at
  ``base + b*stride_b + s*stride_s + h*stride_h + d*stride_d``.
* ``SPLIT=True``: the all-to-all buffer layout. The buffer holds P blocks, block i a
  contiguous ``[B, S_i, H, D]`` array with ``S_i`` the ``torch.tensor_split`` lengths of
  S over P, blocks adjacent in memory. Token (b, s) with s in block i lives at row
  ``B*seq_start[i] + b*S_i + (s - seq_start[i])`` and the element at
  ``base + row*stride_s + h*stride_h + d*stride_d`` (``stride_b`` unused). With P == 1
  this is the plain ``[B*S, H, D]`` row order.

All offsets are int64 (sequences of millions of tokens times large row strides).
"""

import math
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def interpreting() -> bool:
    """True when kernels run in the Triton interpreter (read at call time)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


# Read once at import: decides whether kernels are wrapped in @triton.autotune.
INTERPRET_AT_IMPORT = interpreting()


def autotune_enabled() -> bool:
    """Autotuning runs only on a GPU (never in the interpreter) unless disabled by env."""
    if INTERPRET_AT_IMPORT:
        return False
    return os.environ.get("ULYSSES_KERNELS_TRITON_AUTOTUNE", "1").strip().lower() not in ("0", "false", "no", "off")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def block_d(head_dim: int) -> int:
    return max(16, next_pow2(head_dim))


def seq_bucket(n: int) -> int:
    """Autotune key: log2 bucket of a sequence length (retune per power of two only)."""
    return max(0, int(math.ceil(math.log2(max(1, n)))))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs (tests) use exact fp32 products; 16-bit inputs ignore this."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def row_offsets(s, b, S, B, P, stride_b, stride_s, SPLIT: tl.constexpr):
    """int64 element offsets of tokens ``s`` (a tensor of positions) of batch ``b``.

    SPLIT: the P-block all-to-all buffer layout (see module docstring); else strided.
    """
    s64 = s.to(tl.int64)
    b64 = b.to(tl.int64)
    if SPLIT:
        q = S // P
        rem = S - q * P
        big = rem * (q + 1)
        # Block index of each token: the first `rem` blocks hold q+1 tokens, the rest q.
        blk = tl.where(s64 < big, s64 // (q + 1), rem + (s64 - big) // tl.maximum(q, 1))
        start = blk * q + tl.minimum(blk, rem)
        length = q + (blk < rem).to(tl.int64)
        row = start * B + b64 * length + (s64 - start)
        return row * stride_s
    else:
        return b64 * stride_b + s64 * stride_s


@triton.jit
def maybe_fp32(x, FP32_DOT: tl.constexpr):
    """The interpreter's tl.dot is wrong on bf16: compute in fp32 there (only there)."""
    if FP32_DOT:
        return x.to(tl.float32)
    else:
        return x


# Autotune key shared by all attention kernels: retune per head dim, mask kind, layout,
# GQA group and power-of-two sequence bucket.
TUNE_KEYS = ["TUNE_KEY", "HEAD_DIM", "BLOCK_D", "CAUSAL", "VARLEN", "SPLIT", "GROUP", "HQ"]


class TunedLauncher:
    """Launch policy of one kernel with per-head-dim candidate configs.

    ``configs`` maps the padded head dim to ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``
    candidates, the first being the default. On a GPU with autotuning enabled the kernel
    is autotuned over the candidates of its head dim; otherwise the default runs; in the
    interpreter the small ``interpret_blocks`` (BLOCK_M, BLOCK_N) keep tests fast.
    """

    def __init__(self, kernel, configs, interpret_blocks):
        self.kernel = kernel
        self.configs = configs
        self.interpret_blocks = interpret_blocks
        self.tuned = None
        if autotune_enabled():
            self.tuned = triton.autotune(configs=self._all_configs(), key=TUNE_KEYS,
                                         prune_configs_by={"early_config_prune": self._prune})(kernel)

    def _all_configs(self):
        seen, out = set(), []
        for candidates in self.configs.values():
            for cfg in candidates:
                if cfg not in seen:
                    seen.add(cfg)
                    bm, bn, w, s = cfg
                    out.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s))
        return out

    def _prune(self, configs, named_args, **kwargs):
        bd = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
        allowed = self.configs.get(bd, self.configs[128])
        keep = [c for c in configs
                if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in allowed]
        return keep or configs[:1]

    def default(self, block_d: int):
        return self.configs.get(block_d, self.configs[128])[0]

    def __call__(self, grid, args, meta, block_d: int, fp32_dot: bool):
        """grid(BLOCK_M, BLOCK_N) -> launch grid."""
        if self.tuned is not None and not fp32_dot:
            self.tuned[lambda META: grid(META["BLOCK_M"], META["BLOCK_N"])](*args, **meta)
            return
        if fp32_dot:
            (bm, bn), w, s = self.interpret_blocks, 4, 1
        else:
            bm, bn, w, s = self.default(block_d)
        self.kernel[grid(bm, bn)](*args, **meta, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
