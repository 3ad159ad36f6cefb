"""How the attention kernels address their tensors (docs/architecture.md, "Attention kernels:
addressing"). Every tensor is passed with a base pointer and its (batch, seq, head, dim)
strides. The constexpr ``SPLIT`` selects how a token's sequence offset is formed:

* ``SPLIT=0`` (strided): element (b, s, h, d) at
  ``base + b*stride_b + s*stride_s + h*stride_h + d*stride_d``. Also used for the
  all-to-all buffer when it degenerates to this (batch 1, or a single block).
* ``SPLIT=2`` (all-to-all buffer, per token): the buffer holds P blocks, block i a
  contiguous ``[B, S_i, H, D]`` array with ``S_i`` the ``torch.tensor_split`` lengths of
  S over P, blocks adjacent in memory. Token (b, s) with s in block i lives at row
  ``B*seq_start[i] + b*S_i + (s - seq_start[i])`` and the element at
  ``base + row*stride_s + h*stride_h + d*stride_d`` (``stride_b`` unused).
* ``SPLIT=1`` (all-to-all buffer, affine tiles): the same layout when every block holds
  ``L = S/P`` tokens and L is a multiple of every tile height (the host checks
  ``L % affine_align() == 0``). A tile then never straddles two blocks, so its rows are
  ``row(s0) + i``: one scalar base per tile, computed once, instead of two int32
  divisions per token per iteration.

For SPLIT 0 and 1 a tile's offsets are ``tile_base(s0) + i*stride_s``: the second term
does not depend on the loop variable, so the compiler keeps it out of the inner loops
and only the scalar base advances. All offsets are int64 (sequences of millions of
tokens times large row strides).
"""

import triton
import triton.language as tl

from ..env import interpreting


def affine_align() -> int:
    """Block lengths that are multiples of this allow SPLIT=1: the largest tile height of
    any config (128 on the GPU; the interpreter's tiles are at most 32)."""
    return 32 if interpreting() else 128


# Largest sequence stride (elements) of any tensor: a tile's offsets from its base,
# up to 256 rows, must fit int32 (see seq_offsets).
MAX_ROW_STRIDE = (2**31 - 1) // 256


def split_mode(is_buffer: bool, batch: int, seq_splits: int, seq_lens) -> int:
    """The SPLIT constexpr of a call (see the module docstring).

    is_buffer: 3-D all-to-all buffer views. seq_lens: the sequence lengths of the
    tensors involved (queries, keys), each split over seq_splits blocks.
    """
    if not is_buffer or batch == 1 or seq_splits == 1:
        return 0  # batch 1: row = s; one block: row = b*S + s (stride_b = S*stride_s)
    align = affine_align() * seq_splits
    return 1 if all(n % align == 0 for n in seq_lens) else 2


@triton.jit
def token_rows(s, b, S, B, P):
    """Row of each token ``s`` (int32 positions) of batch ``b`` in the P-block all-to-all
    buffer (SPLIT=2; see module docstring), as int64, to be scaled by the row stride.
    The block arithmetic runs in int32 (positions and lengths are < 2**31; an int64
    division per token is a slow multi-instruction sequence on the GPU); only the row,
    which can exceed 2**31 for B*S rows, is int64.
    """
    s32 = s.to(tl.int32)
    q = S // P
    rem = S - q * P
    big = rem * (q + 1)
    # Block index of each token: the first `rem` blocks hold q+1 tokens, the rest q.
    blk = tl.where(s32 < big, s32 // (q + 1), rem + (s32 - big) // tl.maximum(q, 1))
    start = blk * q + tl.minimum(blk, rem)
    length = q + (blk < rem).to(tl.int32)
    return start.to(tl.int64) * B + b.to(tl.int64) * length + (s32 - start).to(tl.int64)


@triton.jit
def tile_base(s0, b, S, B, P, stride_b, stride_s, SPLIT: tl.constexpr):
    """int64 element offset of token ``s0`` of batch ``b`` (SPLIT 0 or 1): the tile
    starting at s0 has its token s0 + i at ``tile_base + i*stride_s``."""
    # (s0 is a plain int in the interpreter's loops: widen by adding an int64 zero.)
    start = tl.zeros([], tl.int64) + s0
    if SPLIT == 1:
        length = S // P
        blk = s0 // length
        row = start + length.to(tl.int64) * (blk * (B - 1) + b)
        return row * stride_s
    else:
        return b.to(tl.int64) * stride_b + start * stride_s


@triton.jit
def seq_offsets(s, s0, local, b, S, B, P, stride_b, stride_s, SPLIT: tl.constexpr):
    """Element offsets of the tokens ``s = s0 + local`` of batch ``b`` as ``(scalar, rows)``.

    Callers add ``scalar`` to the base pointer and ``rows`` (a 1-D int64 tensor) to the
    per-element offsets: for SPLIT 0/1 ``rows = local*stride_s`` does not depend on s0,
    so it is hoisted out of the loops (int32: tiles span < 2**31 elements, see
    ``MAX_ROW_STRIDE``); for SPLIT 2 every token's row is computed (int64).
    """
    if SPLIT == 2:
        return tl.zeros([], tl.int64), token_rows(s, b, S, B, P) * stride_s
    else:
        # int32 (the host checks |stride_s| * 256 < 2**31): the hoisted offsets take one
        # register each instead of two (int64 here spilled the forward's 128x128 tile).
        return tile_base(s0, b, S, B, P, stride_b, stride_s, SPLIT), local * stride_s


@triton.jit
def tile_row(s0, b, S, B, P, SPLIT: tl.constexpr):
    """Row of token ``s0`` of batch ``b`` in a tensor descriptor's 2-D view (KV_DESC,
    SPLIT 0 or 1), int32 as TMA coordinates are: the view is batch b's S rows (SPLIT 0), or
    the buffer's B*S rows, block i holding batch b's tokens at ``B*i*L + b*L`` (SPLIT 1,
    L = S/P; tiles never straddle two blocks)."""
    if SPLIT == 1:
        length = S // P
        blk = s0 // length
        return s0 + length * (blk * (B - 1) + b.to(tl.int32))
    else:
        return s0


@triton.jit
def kv_descriptor(base, rows, row_stride, cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """A device-side tensor descriptor (TMA on Hopper) of ``rows x cols`` elements at
    ``base`` with unit column stride, loaded in ``[BLOCK_ROWS, BLOCK_COLS]`` tiles. Tiles
    past its bounds read zeros: keys past the sequence and dims past the head dim need no
    mask. The host checks TMA's rules first (features.descriptor_ok)."""
    return tl.make_tensor_descriptor(base, shape=[rows, cols], strides=[row_stride, 1],
                                     block_shape=[BLOCK_ROWS, BLOCK_COLS])
