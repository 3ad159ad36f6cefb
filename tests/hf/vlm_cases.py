"""Tiny vision-language models and their batches (tests/hf/families/test_hf_vlm.py): Qwen2-VL,
Qwen2.5-VL, Qwen3-VL (deepstack), Qwen3.5 (hybrid text + vision) and Gemma 3, built in
float64 with fixed-seed weights, and rows made the way their processors make them: text,
then per image or video a vision-start token, one placeholder per merged patch
(`t * h * w / merge**2`), a vision-end token; `mm_token_type_ids` 1 at image and 2 at video
placeholders; `pixel_values` one row per patch (`channels * temporal_patch * patch**2`).

`reference_step` runs each row on its own on one process (transformers' own merge and
mRoPE positions) and returns the loss over every target of the batch and every parameter
gradient; `sp_step` runs the batch through the documented calls.
"""

from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

VOCAB = 96
IMAGE, VIDEO, START, END = 90, 91, 92, 93
TOKEN_IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
MERGE, PATCH, TEMPORAL = 2, 2, 2
PIXEL_ROW = 3 * TEMPORAL * PATCH * PATCH
GEMMA_TOKENS = 4
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}


def _text(heads=4, kv_heads=2, **extra):
    return dict(vocab_size=VOCAB, hidden_size=16 * heads, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16, rope_parameters=dict(MROPE),
                attention_dropout=0.0, **extra)


def _vision(**extra):
    return dict(dict(depth=2, num_heads=2, patch_size=PATCH, temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE,
                     in_channels=3), **extra)


# Attention and linear-attention heads per SP size (SP 3: three key heads; SP 4: two key
# heads on four ranks, replicated).
HEADS = {1: (4, 2), 2: (4, 2), 3: (6, 3), 4: (4, 2)}
LINEAR_HEADS = {1: (2, 4), 2: (2, 4), 3: (1, 6), 4: (2, 4)}


def build_vlm(family: str, attn: str, *, world: int = 2, seed: int = 0, dtype=torch.float64):
    """A tiny VLM of `family` in float64, train mode, the same weights for the same seed,
    with head counts that `world` ranks can share. attn "eager64": the float64 reference
    (tests/hf/family_cases.py)."""
    import transformers as tf

    if attn == "eager64":
        from family_cases import register_exact_eager

        register_exact_eager()
    text = _text(*HEADS[world])
    width = text["hidden_size"]   # the vision tower's output width
    if family == "qwen2_vl":
        config = tf.Qwen2VLConfig(text_config=text, vision_config=_vision(embed_dim=32, mlp_ratio=2, hidden_size=width),
                                  **TOKEN_IDS)
        cls = tf.Qwen2VLForConditionalGeneration
    elif family == "qwen2_5_vl":
        config = tf.Qwen2_5_VLConfig(text_config=text, vision_config=_vision(
            hidden_size=32, intermediate_size=48, out_hidden_size=width, window_size=8, fullatt_block_indexes=[1]),
            **TOKEN_IDS)
        cls = tf.Qwen2_5_VLForConditionalGeneration
    elif family == "qwen3_vl":
        text["rope_parameters"]["mrope_interleaved"] = True
        config = tf.Qwen3VLConfig(text_config=text, vision_config=_vision(
            depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=width, num_position_embeddings=16,
            deepstack_visual_indexes=[0, 1]), **TOKEN_IDS)
        cls = tf.Qwen3VLForConditionalGeneration
    elif family == "qwen3_5":
        key_heads, value_heads = LINEAR_HEADS[world]
        text.update(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=key_heads,
                    linear_num_value_heads=value_heads, linear_key_head_dim=16, linear_value_head_dim=16)
        text["rope_parameters"].update(mrope_interleaved=True, partial_rotary_factor=1.0)
        config = tf.Qwen3_5Config(text_config=text, vision_config=_vision(
            hidden_size=32, intermediate_size=48, out_hidden_size=width, num_position_embeddings=16), **TOKEN_IDS)
        cls = tf.Qwen3_5ForConditionalGeneration
    elif family == "gemma3":   # SigLIP tower: 8 x 8 pixels in 2 x 2 patches, pooled to 4 tokens per image
        text = dict(vocab_size=VOCAB, hidden_size=16 * HEADS[world][0], intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=HEADS[world][0], num_key_value_heads=HEADS[world][1], head_dim=16,
                    sliding_window=7, attention_dropout=0.0, pad_token_id=0, bos_token_id=2, eos_token_id=1)
        vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                      image_size=8, patch_size=2)
        config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA_TOKENS,
                                 boi_token_index=START, eoi_token_index=END, image_token_index=IMAGE)
        cls = tf.Gemma3ForConditionalGeneration
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls._from_config(config, attn_implementation=attn, dtype=dtype)
    return model.train()


# ------------------------------------------------------------------------------ rows

Item = Tuple[str, Tuple[int, int, int]]   # ("image" | "video", (t, h, w) in patches)


def make_row(items: Sequence[Item], *, seed: int, text: Union[int, Sequence[int]] = 3) -> Dict[str, object]:
    """One sample: `text` random tokens, then per item its placeholders (between a vision
    start and end token) and `text` tokens; `text` a sequence: the lengths of the text runs,
    before, between and after the items (`len(items) + 1` of them)."""
    g = torch.Generator().manual_seed(seed)
    runs = [text] * (len(items) + 1) if isinstance(text, int) else list(text)
    if len(runs) != len(items) + 1:
        raise ValueError(f"make_row: {len(items)} items need {len(items) + 1} text runs, got {len(runs)}")

    def words(n):
        return torch.randint(0, 80, (n,), generator=g).tolist()

    ids, types = words(runs[0]), [0] * runs[0]
    for (kind, (t, h, w)), after in zip(items, runs[1:]):
        n = GEMMA_TOKENS if kind == "gemma" else t * h * w // MERGE ** 2
        code = 2 if kind == "video" else 1
        ids += [START] + [VIDEO if code == 2 else IMAGE] * n + [END] + words(after)
        types += [0] + [code] * n + [0] + [0] * after
    pixels = {kind: torch.randn(sum(t * h * w for k, (t, h, w) in items if k == kind), PIXEL_ROW,
                                generator=g, dtype=torch.float64) for kind in ("image", "video")}
    pixels["gemma"] = torch.randn(sum(k == "gemma" for k, _ in items), 3, 8, 8, generator=g, dtype=torch.float64)
    return dict(ids=ids, types=types, items=list(items), pixels=pixels)


def collate(rows: List[Dict[str, object]], *, pad_left: Optional[List[int]] = None) -> Dict[str, torch.Tensor]:
    """The processor's batch of `rows`: right padding to the longest (plus `pad_left[i]`
    padding tokens in front of row i), the images of every row in order, then the videos."""
    pad_left = pad_left or [0] * len(rows)
    S = max(len(r["ids"]) + p for r, p in zip(rows, pad_left))
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    types = torch.zeros(len(rows), S, dtype=torch.long)
    mask = torch.zeros(len(rows), S, dtype=torch.long)
    for i, (r, p) in enumerate(zip(rows, pad_left)):
        n = len(r["ids"])
        ids[i, p:p + n] = torch.tensor(r["ids"])
        types[i, p:p + n] = torch.tensor(r["types"])
        mask[i, p:p + n] = 1
    batch = dict(input_ids=ids, mm_token_type_ids=types, attention_mask=mask)
    for kind, pixel_key, grid_key in (("image", "pixel_values", "image_grid_thw"),
                                      ("video", "pixel_values_videos", "video_grid_thw")):
        grids = [g for r in rows for k, g in r["items"] if k == kind]
        if grids:
            batch[pixel_key] = torch.cat([r["pixels"][kind] for r in rows])
            batch[grid_key] = torch.tensor(grids)
    if "video_grid_thw" in batch:
        batch["second_per_grid_ts"] = torch.ones(len(batch["video_grid_thw"]))
    if any(k == "gemma" for r in rows for k, _ in r["items"]):   # Gemma 3: whole images, token_type_ids
        batch["pixel_values"] = torch.cat([r["pixels"]["gemma"] for r in rows])
        batch["token_type_ids"] = (types == 1).long()
    return batch


def vision_kwargs(batch: Dict[str, torch.Tensor], family: str) -> Dict[str, torch.Tensor]:
    keys = ["pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "mm_token_type_ids"]
    if family == "qwen2_5_vl":
        keys.append("second_per_grid_ts")
    if family == "gemma3":
        keys = ["pixel_values", "token_type_ids"]
    return {k: batch[k] for k in keys if k in batch}


def targets_of(ids: torch.Tensor, mask: torch.Tensor) -> int:
    """The targets shard_batch keeps: every valid token whose next token is valid."""
    valid = mask.bool()
    return int((valid[:, :-1] & valid[:, 1:]).sum())


def reference_step(model, rows: List[Dict[str, object]], family: str) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Each row on its own on one process: (mean loss over every target of the batch,
    {name: gradient})."""
    model.zero_grad(set_to_none=True)
    count = sum(len(r["ids"]) - 1 for r in rows)
    loss = 0.0
    for row in rows:
        one = collate([row])
        out = model(input_ids=one["input_ids"], use_cache=False, **vision_kwargs(one, family))
        logits = out.logits[0, :-1]
        loss = loss + torch.nn.functional.cross_entropy(logits, one["input_ids"][0, 1:], reduction="sum") / count
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def sp_step(model, batch: Dict[str, torch.Tensor], groups, family: str, *, vision: str = "replicate",
            padded: bool = True):
    """One step through the documented calls: (loss, {name: gradient summed over the SP group})."""
    from ulysses_kernels import hf as ukhf

    model.zero_grad(set_to_none=True)
    sharded = ukhf.shard_batch(batch["input_ids"], groups, attention_mask=batch["attention_mask"] if padded else None,
                               vision=vision, **vision_kwargs(batch, family))
    loss = ukhf.causal_lm_loss(model, sharded, groups)
    loss.backward()
    ukhf.allreduce_gradients(model, groups)
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def gemma_batch(seed: int, images: int = 2) -> Dict[str, torch.Tensor]:
    """A Gemma 3 row as its processor makes it: text, then per image a start token, 4
    image tokens and an end token; `token_type_ids` 1 at the image tokens (which Gemma 3
    lets attend to each other both ways)."""
    return collate([make_row([("gemma", (1, 8, 8))] * images, seed=seed, text=4)])
