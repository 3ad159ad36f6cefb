"""Gemma 3's bidirectional image blocks under sequence parallelism (docs/hf_vlm.md,
"Vision-language models"): each run of image tokens attends to itself both ways. The blocks
come from `token_type_ids` (`image_blocks`), travel with the shard (`BLOCKS_KEY`), let the
mask function accept the model's overlay (`honours_blocks`) and are honoured by the attention
over the gathered sequence (`block_attention`)."""

from typing import Optional

import torch

from ...model import refusal

BLOCKS_KEY = "ulysses_image_blocks"   # the keyword that carries Gemma 3's image blocks to the attention


def image_blocks(token_type_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """Gemma 3's image blocks: `[B, S]`, each run of image tokens (`token_type_ids` 1) one
    block with an id of its own in the batch, -1 at text; None when there is no image token.
    Inside a block the tokens attend to each other both ways (transformers'
    `get_block_sequence_ids_for_mask`)."""
    image = token_type_ids == 1
    if not bool(image.any()):
        return None
    previous = torch.nn.functional.pad(image, (1, 0))[:, :-1]
    starts = (image & ~previous).reshape(-1)
    ids = (starts.long().cumsum(0) - 1).view_as(image)
    return torch.where(image, ids, torch.full_like(ids, -1))


def honours_blocks(mask_kwargs: dict, shard) -> bool:
    """A mask request (the model's `mask_function` over the whole batch) that opens exactly
    `shard`'s image blocks above the diagonal: each block's first token sees its last, a
    token sees the next one iff both are in one block, and a block never sees the next
    block. Probed at O(S) points, as the guard probes any mask (guard.py)."""
    blocks = getattr(shard, "blocks", None)
    mask_function = mask_kwargs.get("mask_function")
    if blocks is None or mask_function is None or int(mask_kwargs.get("q_offset", 0) or 0) \
            or int(mask_kwargs.get("kv_offset", 0) or 0) or mask_kwargs.get("q_length") != blocks.shape[1]:
        return False
    rows, q, kv, want = _block_probes(blocks.to(mask_kwargs.get("device") or blocks.device))
    try:
        opened = torch.as_tensor(mask_function(rows, torch.zeros_like(q), q, kv))
    except Exception:  # noqa: BLE001 - a mask function that cannot be probed is not known to be these blocks
        return False
    return bool((opened.bool() == want).all())


def _block_probes(blocks: torch.Tensor):
    """(rows, queries, keys, expected) of `honours_blocks`' probes."""
    B, S = blocks.shape
    row = torch.arange(B, device=blocks.device).repeat_interleave(S - 1)
    q = torch.arange(S - 1, device=blocks.device).repeat(B)
    flat = blocks[:, :-1].reshape(-1), blocks[:, 1:].reshape(-1)
    probes = [(row, q, q + 1, (flat[0] == flat[1]) & (flat[0] >= 0))]
    ids = blocks.reshape(-1)
    image = torch.nonzero(ids >= 0).flatten()
    if image.numel():
        block = ids[image]
        first = torch.full((int(block.max()) + 1,), ids.numel(), device=blocks.device).scatter_reduce(0, block, image, "amin")
        last = torch.zeros_like(first).scatter_reduce(0, block, image, "amax")
        present = first < ids.numel()
        first, last = first[present], last[present]
        probes.append((first // S, first % S, last % S, torch.ones_like(first, dtype=torch.bool)))
        same_row = (first[1:] // S) == (last[:-1] // S)   # a block never sees the next one in its row
        probes.append(((last[:-1] // S)[same_row], (last[:-1] % S)[same_row], (first[1:] % S)[same_row],
                       torch.zeros(int(same_row.sum()), dtype=torch.bool, device=blocks.device)))
    return tuple(torch.cat(parts) for parts in zip(*probes))


def block_attention(context, module, query, key, value, *, lens, cu_seqlens, blocks, scaling, window_size,
                    softcap, sinks):
    """Causal attention opened both ways inside each image block (Gemma 3), on the
    reference path: the heads of the whole sequence on each rank (`ulysses_head_parallel`),
    the mask built over it (documents, the window's left bound, causal OR same block, as
    transformers composes them), softmax in float32 at least. Another path (a kernel
    without such a mask), a ring, or sinks: refused on every rank."""
    from ....api import resolve_path, ulysses_head_parallel

    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    path = resolve_path(context.backend, q.device, distributed=True, tensors=(q, k, v))
    problem = ("a ring of more than one rank" if context.ring()[1] > 1 else
               f"the {path} path (its kernels have no such mask)" if path != "reference" else
               "attention sinks" if sinks is not None else None)
    if problem:
        raise refusal(module, f"its image tokens attend to each other both ways (token_type_ids); the bidirectional "
                              f"blocks run on the reference path of pure Ulysses, not with {problem}",
                      'Use backend="reference" and ring_size=1, or drop token_type_ids (causal image tokens).')
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    allowed = _block_mask(blocks, cu_seqlens, window_size[0], sum(lens), q.device)
    group_size = q.shape[2] // k.shape[2]

    def attend(local, heads):
        kv_heads = list(heads.heads("k"))
        pick = torch.tensor([kv_heads.index(h // group_size) for h in heads.heads("q")], device=q.device)
        qh = local["q"]
        compute = torch.float64 if qh.dtype == torch.float64 else torch.float32
        kh, vh = local["k"].index_select(2, pick), local["v"].index_select(2, pick)
        scores = torch.einsum("bqhd,bkhd->bhqk", qh.to(compute), kh.to(compute)) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        return torch.einsum("bhqk,bkhd->bqhd", probs, vh.to(compute)).to(qh.dtype)

    return ulysses_head_parallel(attend, dict(q=q, k=k, v=v), context.group, seq_lens=lens)


def _block_mask(blocks, cu_seqlens, left, total, device):
    """`[B, 1, T, T]`: key k visible to query q (same document; k >= q - left when the
    window is bounded; k <= q, or both in one image block)."""
    idx = torch.arange(total, device=device)
    blocks = blocks.to(device)
    if cu_seqlens is not None:
        document = torch.bucketize(idx, cu_seqlens.to(device=device, dtype=torch.int64)[1:], right=True)
        same_document = document[:, None] == document[None, :]
    else:
        same_document = torch.ones(total, total, dtype=torch.bool, device=device)
    causal = idx[None, :] <= idx[:, None]
    same_block = (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0)
    allowed = same_document & (causal | same_block)
    if left >= 0:
        allowed = allowed & (idx[None, :] >= idx[:, None] - left)
    return allowed.unsqueeze(1)
