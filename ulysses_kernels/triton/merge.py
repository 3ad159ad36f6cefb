"""Merge of attention partials by their log-sum-exp, in fp32 (ring attention).

Two attentions of the same queries over disjoint key sets, ``(acc, lse_acc)`` and
``(out, lse)``, combine to the attention over the union::

    lse_new = log(exp(lse_acc) + exp(lse))
    acc_new = acc * exp(lse_acc - lse_new) + out * exp(lse - lse_new)

One program merges a ``[BLOCK_M, D]`` tile of one (batch, head) in registers: the block
output is read once in its dtype (bf16/fp16/fp32: the attention kernel rounds each
block's output once, as in ring-flash-attn), the accumulator is fp32 and updated in
place, so the running result is never rounded to 16 bits between ring steps. Rows with
``-inf`` on both sides (no key seen yet) stay ``0`` / ``-inf``.
"""

import torch
import triton
import triton.language as tl

from ..env import interpreting


@triton.jit(do_not_specialize=["n_rows", "HQ"])
def _merge_kernel(
    ACC, ACC_LSE, OUT, LSE,
    sa_b, sa_s, sa_h, sa_d,
    sal_b, sal_h, sal_s,
    so_b, so_s, so_h, so_d,
    sl_b, sl_h, sl_s,
    n_rows, HQ,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid_bh = tl.program_id(0).to(tl.int64)  # batch x heads on axis 0 (no 65535 limit)
    pid_m = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    acc_lse_ptr = ACC_LSE + b * sal_b + h * sal_h + rows * sal_s
    lse_a = tl.load(acc_lse_ptr, mask=row_ok, other=float("-inf"))
    lse_b = tl.load(LSE + b * sl_b + h * sl_h + rows * sl_s, mask=row_ok, other=float("-inf")).to(tl.float32)
    top = tl.maximum(lse_a, lse_b)
    top = tl.where(top == float("-inf"), 0.0, top)
    w_a = tl.exp(lse_a - top)
    w_b = tl.exp(lse_b - top)
    total = w_a + w_b
    seen = total > 0.0
    inv = tl.where(seen, 1.0 / tl.where(seen, total, 1.0), 0.0)
    acc_ptr = ACC + b * sa_b + h * sa_h + rows[:, None] * sa_s + dims[None, :] * sa_d
    out_ptr = OUT + b * so_b + h * so_h + rows[:, None] * so_s + dims[None, :] * so_d
    acc = tl.load(acc_ptr, mask=mask, other=0.0)
    out = tl.load(out_ptr, mask=mask, other=0.0).to(tl.float32)
    merged = (acc * (w_a * inv)[:, None]) + (out * (w_b * inv)[:, None])
    tl.store(acc_ptr, merged, mask=mask)
    tl.store(acc_lse_ptr, tl.where(seen, top + tl.log(tl.where(seen, total, 1.0)), float("-inf")), mask=row_ok)


def merge_attention(acc: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge the partial ``(out [B, n, H, D], lse [B, H, n])`` into ``(acc, acc_lse)`` in place.

    acc: fp32 ``[B, n, H, D]``, acc_lse: fp32 ``[B, H, n]`` (any strides, e.g. row slices of
    the whole accumulator); out: any float dtype; lse: fp32 (natural log, -inf = no key).
    """
    B, n, H, D = acc.shape
    if acc.dtype != torch.float32 or acc_lse.dtype != torch.float32:
        raise ValueError(f"merge_attention: the accumulators must be float32, got {acc.dtype} / {acc_lse.dtype}")
    if tuple(out.shape) != (B, n, H, D) or tuple(acc_lse.shape) != (B, H, n) or tuple(lse.shape) != (B, H, n):
        raise ValueError(f"merge_attention: shapes disagree: acc {tuple(acc.shape)}, acc_lse {tuple(acc_lse.shape)}, "
                         f"out {tuple(out.shape)}, lse {tuple(lse.shape)}")
    if B * n * H == 0:
        return
    block_d = max(16, triton.next_power_of_2(D))
    block_m = 32 if interpreting() else 64
    grid = (B * H, triton.cdiv(n, block_m))
    _merge_kernel[grid](acc, acc_lse, out, lse, *acc.stride(), *acc_lse.stride(), *out.stride(), *lse.stride(),
                        n, H, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=block_m, num_warps=4)
