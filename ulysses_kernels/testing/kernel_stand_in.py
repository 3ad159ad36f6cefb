"""A candidate kernel that runs on CPU with every feature an external kernel may declare
(packed documents, windows, softcap, grouped heads, the ring's LSE pair), computed by the
reference path in torch: registered by the tests, it takes the place of cuDNN or
FlashAttention in the paths' plumbing (the fused pipeline's recorded graphs, the Triton
path's receive-buffer views, the ring's block ops), so that plumbing runs against float64
without a GPU. It counts its calls, so a test can tell it ran."""

import contextlib
import dataclasses
import math

import torch

from .. import kernel_choice
from ..reference import reference_attention
from ..reference.block_ops import TorchBlockOps
from ..ring.plan import Block
from ..variants import band_lengths

NAME = "reference_stand_in"
CALLS = {"run": 0, "forward_lse": 0, "backward_lse": 0}

TABLE = kernel_choice.Capabilities(
    devices=("cpu",), dtypes=("float32", "float64", "bfloat16", "float16"), head_dims=(8, 256, 8), windows=True,
    shifted_bands=True, softcap=True, packed=True, lse=True, min_capability=(0, 0))


def _run(q, k, v, *, causal, scale, cu_seqlens, variant, sinks, deterministic):
    CALLS["run"] += 1
    left, right = band_lengths(variant.window)
    out, _ = reference_attention(q, k, v, causal=causal, softmax_scale=scale, cu_seqlens=cu_seqlens,
                                 window_size=(left, right), softcap=variant.softcap)
    return out


def _block(q, k, causal, cu_seqlens, band) -> Block:
    documents = tuple(int(x) for x in cu_seqlens.tolist()) if cu_seqlens is not None else None
    return Block(0, q.shape[1], 0, k.shape[1], diagonal=causal or documents is not None, causal=causal,
                 documents=documents, band=band)


def _forward_lse(q, k, v, *, causal, scale, cu_seqlens, band, softcap):
    CALLS["forward_lse"] += 1
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out, lse = TorchBlockOps.forward(q, k, v, _block(q, k, causal, cu_seqlens, band), scale, softcap)
    return out.to(q.dtype), lse.float() if q.dtype != torch.float64 else lse


def _backward_lse(do, q, k, v, out, lse, *, causal, scale, cu_seqlens, band, softcap):
    CALLS["backward_lse"] += 1
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return TorchBlockOps.backward(do, q, k, v, out, lse, _block(q, k, causal, cu_seqlens, band), scale, softcap)


CANDIDATE = kernel_choice.Candidate(NAME, "ulysses_kernels.testing (the reference in torch)", lambda: TABLE,
                                    lambda: (True, "test"), _run, _forward_lse, _backward_lse)


@contextlib.contextmanager
def kernel_stand_in(**table_changes):
    """The stand-in registered (its table changed by `table_changes`) and forced with
    ULYSSES_KERNELS_ATTENTION, the call counts reset; everything restored after."""
    import os

    from .. import env

    candidate = dataclasses.replace(CANDIDATE, table=lambda: dataclasses.replace(TABLE, **table_changes))
    previous = os.environ.get(env.ATTENTION.name)
    kernel_choice.register(candidate)
    kernel_choice.clear_memory_cache()
    os.environ[env.ATTENTION.name] = NAME
    CALLS.update(run=0, forward_lse=0, backward_lse=0)
    try:
        yield CALLS
    finally:
        kernel_choice.unregister(NAME)
        kernel_choice.clear_memory_cache()
        if previous is None:
            os.environ.pop(env.ATTENTION.name, None)
        else:
            os.environ[env.ATTENTION.name] = previous
