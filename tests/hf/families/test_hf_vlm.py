"""Vision-language models under sequence parallelism (ulysses_kernels/hf/families/vision/vision.py), through
the documented calls only: `register`, `attn_implementation="ulysses"`, `shard_batch(...,
pixel_values=..., image_grid_thw=..., mm_token_type_ids=..., vision=...)`, `causal_lm_loss`,
`allreduce_gradients`, `generate`.

One training step of tiny float64 Qwen2-VL (images of two sizes and a video), Qwen2.5-VL
(a padded batch: two rows with different image counts, one left-padded; windowed vision
attention), Qwen3-VL (deepstack) and Qwen3.5 (hybrid text model) at SP 2, 3 (uneven shards)
and 4 (two KV heads on four ranks: replicated) and on a 2 x 2 Ulysses x Ring grid, with
`vision="replicate"` and `"split"`, against one process running every row on its own with
transformers' own merge and positions: the loss and every parameter gradient (the vision
tower's included, summed over the SP group). A row longer than one shard puts images across
shard boundaries; a text-only row leaves a rank without a visual token (checked).

Tolerance 1e-8 in float64 (sums over the SP group of gradients that cancel to 1e-5 of their
terms, a vision block's qkv in Qwen3-VL, leave ~5e-10). Qwen3.5: 1e-6, its RMSNorms compute in
float32 whatever the dtype (~1e-7 left; its gated delta rule, float32 in transformers, is made
float64 in both runs as in test_hf_hybrid.py).
"""

import pytest
import torch
from helpers import SLOW_SPAWN_TIMEOUT, rel_err

pytest.importorskip("transformers", reason="ulysses_kernels.hf needs Hugging Face transformers "
                                           "(pip install -e '.[hf]' in the checkout)")

from family_cases import float64_delta_rule  # noqa: E402
from sweep import largest_error  # noqa: E402
from vlm_cases import (  # noqa: E402
    IMAGE,
    build_vlm,
    collate,
    gemma_batch,
    make_row,
    reference_step,
    sp_step,
    vision_kwargs,
)

import ulysses_kernels as uk  # noqa: E402
from ulysses_kernels import hf as ukhf  # noqa: E402
from ulysses_kernels.hf.families.vision.vision import balanced_blocks  # noqa: E402
from ulysses_kernels.hf.families.vision.vision_shard import TokenShard
from ulysses_kernels.launch import spawn  # noqa: E402

PRELOAD = ["torch", "transformers", "ulysses_kernels.hf"]
TOLERANCE = 1e-8
FAMILY_TOLERANCE = {"qwen3_5": 1e-6, "gemma3": 1e-6}   # their RMSNorms compute in float32 whatever the dtype

# Rows per family (items: (kind, (t, h, w) patches)); the last row of each batch is
# left-padded by two tokens where `PAD_LEFT` says so.
ROWS = {
    "qwen2_vl": [[("image", (1, 8, 14)), ("image", (1, 2, 6)), ("video", (2, 2, 2))], [("image", (1, 2, 2))]],
    "qwen2_5_vl": [[("image", (1, 8, 14)), ("image", (1, 2, 4))], [("image", (1, 4, 2))]],
    "qwen3_vl": [[("image", (1, 8, 14)), ("image", (1, 2, 6))], []],
    "qwen3_5": [[("image", (1, 8, 14))], [("image", (1, 2, 2))]],
    "gemma3": [[("gemma", (1, 8, 8))] * 3, [("gemma", (1, 8, 8))]],
}
PAD_LEFT = {"qwen2_5_vl": [0, 2], "gemma3": [0, 3]}
FAMILIES = tuple(ROWS)
PATCHED = ("qwen2_vl", "qwen3_vl")
SPLIT = tuple(f for f in FAMILIES if f != "gemma3")   # Gemma 3's SigLIP tower takes whole images: no split
RING = SPLIT                                          # Gemma 3's bidirectional blocks: pure Ulysses only


def family_rows(family):
    return [make_row(items, seed=10 + i, text=3 if items else 40) for i, items in enumerate(ROWS[family])]


def family_batch(family):
    rows = family_rows(family)
    return rows, collate(rows, pad_left=PAD_LEFT.get(family))


def _visual_tokens(batch_inputs, groups):
    """This rank's visual tokens, and whether one of its ranges starts inside an image (an
    image across a shard boundary)."""
    sharded = ukhf.shard_batch(batch_inputs["input_ids"], groups, attention_mask=batch_inputs["attention_mask"])
    types = sharded.shard_tokens(batch_inputs["mm_token_type_ids"])
    packed = sharded.padding.pack(batch_inputs["mm_token_type_ids"])[0]
    crossing = any(0 < start < packed.numel() and bool(packed[start] != 0) and bool(packed[start - 1] != 0)
                   for start, _ in sharded.token_ranges)
    return int((types != 0).sum()), crossing


def _training_worker(rank, world, ring_size, families):
    groups = uk.init_sequence_parallel(world, ring_size=ring_size)
    ukhf.register(groups)
    out = {}
    for family in families:
        rows, batch = family_batch(family)
        reference = build_vlm(family, "eager64", world=world)
        model = build_vlm(family, "ulysses", world=world)
        with float64_delta_rule():   # Qwen3.5's gated delta rule in float64 in both runs
            want = reference_step(reference, rows, family)
            replicated = sp_step(model, batch, groups, family, vision="replicate")
            out[family] = dict(replicate=largest_error(replicated, want), visual=_visual_tokens(batch, groups))
            if family in SPLIT:
                split = sp_step(model, batch, groups, family, vision="split")
                out[family].update(split=largest_error(split, want), split_vs_replicate=largest_error(split, replicated))
            if family in PATCHED and world == 2:   # tiled MLP and loss, activation checkpointing
                patched = ukhf.patch_model(build_vlm(family, "ulysses", world=world), mlp_tile_tokens=5,
                                           loss_tile_tokens=5)
                patched.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
                out[family]["patched"] = largest_error(sp_step(patched, batch, groups, family, vision="split"), want)
    return out


def _check_training(per_rank, world, families, rank_without_images=True):
    for family in families:
        tolerance = FAMILY_TOLERANCE.get(family, TOLERANCE)
        for rank, out in enumerate(per_rank):
            modes = ("replicate", "split", "split_vs_replicate") if family in SPLIT else ("replicate",)
            for mode in modes + (("patched",) if family in PATCHED and world == 2 else ()):
                error, where = out[family][mode]
                assert error < tolerance, (world, rank, family, mode, error, where)
    visual = {family: [out[family]["visual"] for out in per_rank] for family in families}
    assert any(crossing for family in families for _, crossing in visual[family]), visual   # an image across shards
    if rank_without_images:   # Qwen3-VL's text-only row fills the last shards
        assert any(count == 0 for count, _ in visual["qwen3_vl"]), visual


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_training_step_equals_rows_on_one_process(world):
    per_rank = spawn(_training_worker, world, args=(1, FAMILIES), timeout=SLOW_SPAWN_TIMEOUT,
                     start_method="forkserver", preload=PRELOAD)
    _check_training(per_rank, world, FAMILIES)


@pytest.mark.slow
def test_training_step_on_a_ulysses_ring_grid():
    per_rank = spawn(_training_worker, 4, args=(2, RING), timeout=SLOW_SPAWN_TIMEOUT,
                     start_method="forkserver", preload=PRELOAD)
    _check_training(per_rank, 4, RING, rank_without_images=False)   # the zigzag gives every rank a part of the images


# ------------------------------------------------------------------ what else must hold

def _counting(monkeypatch_target, name, counter, modules=None):
    original = getattr(monkeypatch_target, name)

    def counted(*args, **kwargs):
        counter[0] += 1
        if modules is not None:
            modules.append(type(args[0]).__name__)
        return original(*args, **kwargs)

    setattr(monkeypatch_target, name, counted)
    return original


def _outcome(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test compares what every rank raised
        return type(exc).__name__, str(exc)
    return None


def _behaviour_worker(rank, world):
    from family_cases import register_exact_eager

    from ulysses_kernels.hf.core import attention as hf_attention

    groups = uk.init_sequence_parallel(world)
    ukhf.register(groups)
    out = {}
    rows, batch = family_batch("qwen2_vl")
    model = build_vlm("qwen2_vl", "ulysses", world=world)
    # The vision tower's attention never reaches the Ulysses function.
    ulysses_calls, local_calls, local_modules = [0], [0], []
    original_ulysses = _counting(hf_attention, "ulysses_attention", ulysses_calls)
    original_local = _counting(hf_attention, "local_attention", local_calls, local_modules)
    try:
        for vision in ("replicate", "split"):
            sharded = ukhf.shard_batch(batch["input_ids"], groups, attention_mask=batch["attention_mask"],
                                       vision=vision, **vision_kwargs(batch, "qwen2_vl"))
            ukhf.causal_lm_loss(model, sharded, groups)
    finally:
        hf_attention.ulysses_attention, hf_attention.local_attention = original_ulysses, original_local
    out["calls"] = (ulysses_calls[0], local_calls[0], sorted(set(local_modules)))
    # A text-only batch through a VLM.
    text_rows = [make_row([], seed=3, text=19), make_row([], seed=4, text=11)]
    text = collate(text_rows)
    reference = build_vlm("qwen2_vl", register_exact_eager(), world=world)
    want = reference_step(reference, text_rows, "qwen2_vl")
    got = sp_step(model, dict(input_ids=text["input_ids"], attention_mask=text["attention_mask"]), groups, "qwen2_vl")
    out["text_only"] = largest_error(got, want)
    # More placeholders than features (one image token too many), and a grid that does not
    # match the patches: the same error on every rank, in both vision modes.
    ids = batch["input_ids"].clone()
    ids[0, 1] = IMAGE
    extra_token = dict(batch, input_ids=ids)
    wrong_grid = dict(batch, image_grid_thw=batch["image_grid_thw"].flip(0) * torch.tensor([1, 2, 1]))
    for name, bad in (("extra_token", extra_token), ("wrong_grid", wrong_grid)):
        for vision in ("replicate", "split"):
            sharded = ukhf.shard_batch(bad["input_ids"], groups, attention_mask=bad["attention_mask"],
                                       vision=vision, **vision_kwargs(bad, "qwen2_vl"))
            out[(name, vision)] = _outcome(lambda: ukhf.causal_lm_loss(model, sharded, groups))
    # Gemma 3: its image tokens attend to each other both ways (token_type_ids): exact on the
    # reference path (the training test); vision="split" (its tower takes whole images), a
    # kernel path and a ring are refused on every rank; its text-only batches run.
    gemma = build_vlm("gemma3", "ulysses", world=world)
    images = gemma_batch(seed=5)
    sharded = ukhf.shard_batch(images["input_ids"], groups, vision="split", **vision_kwargs(images, "gemma3"))
    out[("gemma3", "split")] = _outcome(lambda: ukhf.causal_lm_loss(gemma, sharded, groups))
    import ulysses_kernels.api as api

    resolve_path, api.resolve_path = api.resolve_path, lambda *args, **kwargs: "triton"   # as on a GPU
    try:
        sharded = ukhf.shard_batch(images["input_ids"], groups, **vision_kwargs(images, "gemma3"))
        out[("gemma3", "triton")] = _outcome(lambda: ukhf.causal_lm_loss(gemma, sharded, groups))
    finally:
        api.resolve_path = resolve_path
    want = reference_step(build_vlm("gemma3", "eager64", world=world), text_rows, "gemma3")
    got = sp_step(gemma, dict(input_ids=text["input_ids"], attention_mask=text["attention_mask"]), groups, "gemma3")
    out["gemma3_text_only"] = largest_error(got, want)
    # position_ids with images.
    out["positions"] = _outcome(lambda: ukhf.shard_batch(batch["input_ids"], groups,
                                                         position_ids=torch.arange(batch["input_ids"].shape[1]),
                                                         **vision_kwargs(batch, "qwen2_vl")))
    return out


def _gemma_ring_worker(rank, world):
    groups = uk.init_sequence_parallel(world, ring_size=world)
    ukhf.register(groups)
    images = gemma_batch(seed=5)
    sharded = ukhf.shard_batch(images["input_ids"], groups, **vision_kwargs(images, "gemma3"))
    return _outcome(lambda: ukhf.causal_lm_loss(build_vlm("gemma3", "ulysses", world=1), sharded, groups))


@pytest.mark.slow
def test_gemma3_image_blocks_on_a_ring_are_refused_on_every_rank():
    per_rank = spawn(_gemma_ring_worker, 2, timeout=SLOW_SPAWN_TIMEOUT, start_method="forkserver", preload=PRELOAD)
    assert per_rank[0] == per_rank[1] and per_rank[0][0] == "NotSequenceParallelError", per_rank
    assert "a ring of more than one rank" in per_rank[0][1], per_rank


@pytest.mark.slow
def test_vision_tower_text_only_batches_and_errors():
    per_rank = spawn(_behaviour_worker, 2, timeout=SLOW_SPAWN_TIMEOUT, start_method="forkserver", preload=PRELOAD)
    for rank, out in enumerate(per_rank):
        ulysses_calls, local_calls, local_modules = out["calls"]
        assert ulysses_calls == 2 * 2, out["calls"]   # two text layers, two forwards: the text layers only
        assert local_calls > 0 and local_modules == ["VisionAttention"], out["calls"]
        for case, family in (("text_only", "qwen2_vl"), ("gemma3_text_only", "gemma3")):
            error, where = out[case]
            assert error < FAMILY_TOLERANCE.get(family, TOLERANCE), (rank, case, error, where)
        for key in [("extra_token", "replicate"), ("extra_token", "split"), ("wrong_grid", "replicate"),
                    ("wrong_grid", "split"), "positions", ("gemma3", "triton"), ("gemma3", "split")]:
            assert out[key] is not None, (rank, key)
            assert out[key] == per_rank[0][key], (rank, key, out[key], per_rank[0][key])
    assert "do not match" in per_rank[0][("extra_token", "replicate")][1]
    assert "patches" in per_rank[0][("wrong_grid", "split")][1]
    assert "position_ids with images" in per_rank[0]["positions"][1]
    for case, words in (("split", 'vision="split" cannot divide'), ("triton", "the triton path")):
        kind, message = per_rank[0][("gemma3", case)]
        assert kind == "NotSequenceParallelError" and words in message, (case, kind, message)


# -------------------------------------------------------------------------- generation

NEW_TOKENS = 6
# Generation prompts: (items, text runs). "two_images" for every family; "sizes" (two
# images of different sizes, the larger 8 x 8 patch grid first, between text runs of 7, 9
# and 11 tokens) for Qwen2-VL at SP 2.
GENERATION_PROMPTS = {
    "two_images": ([("image", (1, 4, 4)), ("image", (1, 2, 6))], 3),
    "sizes": ([("image", (1, 8, 8)), ("image", (1, 4, 4))], (7, 9, 11)),
}
SIZES_FAMILIES = ("qwen2_vl",)


def _generation_prompts(family, ring_size):
    return ["two_images"] + (["sizes"] if family in SIZES_FAMILIES and ring_size == 1 else [])


def _generation_worker(rank, world, ring_size, families):
    groups = uk.init_sequence_parallel(world, ring_size=ring_size)
    ukhf.register(groups)
    out = {}
    for family in families:
        reference = build_vlm(family, "sdpa", world=world).eval()
        model = build_vlm(family, "ulysses", world=world).eval()
        for name in _generation_prompts(family, ring_size):   # one model for every prompt: nothing carries over
            items, text = GENERATION_PROMPTS[name]
            prompt = collate([make_row(items, seed=21, text=text)])
            kwargs = vision_kwargs(prompt, family)
            with torch.no_grad():
                want = reference.generate(prompt["input_ids"], **kwargs, max_new_tokens=NEW_TOKENS, do_sample=False)
                want_logits = reference(input_ids=prompt["input_ids"], **kwargs).logits[:, -1]
            got = ukhf.generate(model, prompt["input_ids"], groups, **kwargs, max_new_tokens=NEW_TOKENS,
                                do_sample=False)
            logits, _ = ukhf.prefill(model, prompt["input_ids"], groups, chunk_size=9, **kwargs)
            out[family, name] = dict(same=torch.equal(got, want), new=want[0, -NEW_TOKENS:].tolist(),
                                     logits=rel_err(logits, want_logits))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world,ring_size", [(2, 1), (4, 2)], ids=["sp2", "ring2x2"])
def test_generate_with_images_equals_model_generate(world, ring_size):
    families = ("qwen2_vl", "qwen3_vl", "qwen3_5") if ring_size == 1 else ("qwen2_5_vl", "qwen3_vl")
    per_rank = spawn(_generation_worker, world, args=(ring_size, families), timeout=SLOW_SPAWN_TIMEOUT,
                     start_method="forkserver", preload=PRELOAD)
    cases = [(family, name) for family in families for name in _generation_prompts(family, ring_size)]
    assert (ring_size == 1) == (("qwen2_vl", "sizes") in cases), cases
    for rank, out in enumerate(per_rank):
        assert sorted(out) == sorted(cases), (rank, sorted(out))
        for case in cases:
            assert out[case]["same"], (rank, case, out[case])
            assert out[case]["logits"] < 1e-6, (rank, case, out[case])


# ------------------------------------------------------------------------- unit tests

def test_make_row_lays_out_the_text_runs():
    """The "sizes" generation prompt: 7 text tokens, the 8 x 8 patch grid's 16 placeholders
    between a vision start and end token, 9 text tokens, the 4 x 4 grid's 4, 11 text tokens."""
    import itertools

    from vlm_cases import END, START

    items, text = GENERATION_PROMPTS["sizes"]
    row = make_row(items, seed=21, text=text)
    kinds = ["text" if t == 0 and i not in (START, END) else i for i, t in zip(row["ids"], row["types"])]
    runs = [(kind, len(list(run))) for kind, run in itertools.groupby(kinds)]
    assert runs == [("text", 7), (START, 1), (IMAGE, 16), (END, 1), ("text", 9), (START, 1), (IMAGE, 4), (END, 1),
                    ("text", 11)], runs
    assert row["pixels"]["image"].shape[0] == 64 + 16   # one row per patch
    with pytest.raises(ValueError, match="text runs"):
        make_row([("image", (1, 2, 2))], seed=0, text=(3,))


def test_balanced_blocks_cut_at_image_boundaries():
    assert balanced_blocks([16, 12, 8, 4], 2) == [0, 1, 4]
    assert balanced_blocks([4], 3) == [0, 0, 1, 1] or balanced_blocks([4], 3) == [0, 1, 1, 1]
    bounds = balanced_blocks([5, 5, 5, 5, 5, 5], 3)
    assert bounds == [0, 2, 4, 6]
    assert balanced_blocks([], 2) == [0, 0, 0]


def test_token_shard_cuts_packed_rows_and_deepstack_rows():
    """The language model's inputs of a padded batch cut like shard_batch cuts the tokens,
    against direct indexing; deepstack rows follow this rank's visual tokens."""
    from ulysses_kernels.hf.core.batch import padding_from_mask

    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]])
    padding = padding_from_mask(mask, mask.shape)
    ranges = [(4, 3), (1, 2)]   # a zigzag-like order: global packed tokens 4..6 then 1..2
    shard = TokenShard(shape=(2, 6), ranges=ranges, padding=padding)
    embeds = torch.randn(2, 6, 5, dtype=torch.float64)
    packed = embeds[mask.bool()]                      # [9, 5], row-major valid tokens
    want = torch.cat([packed[4:7], packed[1:3]]).unsqueeze(0)
    assert torch.equal(shard.cut(embeds), want)
    positions = torch.randint(0, 50, (3, 2, 6))
    got = shard.cut(positions, batch_dim=1)
    assert got.shape == (3, 1, 5)
    for row in range(3):
        assert torch.equal(got[row, 0], torch.cat([positions[row][mask.bool()][4:7], positions[row][mask.bool()][1:3]]))
    visual = torch.tensor([[0, 1, 1, 0, 0, 0], [0, 0, 1, 0, 1, 1]], dtype=torch.bool)
    features = [torch.randn(int(visual.sum()), 4, dtype=torch.float64) for _ in range(2)]
    rows = shard._deepstack(visual, features)
    ordinal = torch.full((2, 6), -1)
    ordinal[visual] = torch.arange(int(visual.sum()))
    packed_ordinal = ordinal[mask.bool()]
    mine = torch.cat([packed_ordinal[4:7], packed_ordinal[1:3]])
    mine = mine[mine >= 0]
    for got_rows, f in zip(rows, features):
        assert torch.equal(got_rows, f[mine])


def test_shard_batch_takes_images_and_checks_the_mode():
    ids = torch.randint(0, 80, (1, 12))
    pixels = torch.randn(4, 24)
    grid = torch.tensor([[1, 2, 2]])
    batch = ukhf.shard_batch(ids, None, pixel_values=pixels, image_grid_thw=grid)
    inputs = batch.model_inputs()
    assert inputs["input_ids"] is ids and inputs["pixel_values"] is pixels and "position_ids" not in inputs
    assert isinstance(inputs["ulysses_shard"], TokenShard) and sum(n for _, n in inputs["ulysses_shard"].ranges) == 12
    text = ukhf.shard_batch(ids, None, mm_token_type_ids=torch.zeros_like(ids))   # no image: the text path
    assert text.multimodal is None and "ulysses_shard" not in text.model_inputs()
    with pytest.raises(ValueError, match="vision must be one of"):
        ukhf.shard_batch(ids, None, pixel_values=pixels, image_grid_thw=grid, vision="shard")


# ------------------------------------------------------------------------ the Trainer

TRAIN_ROWS = [[("image", (1, 4, 6))], [("image", (1, 2, 2)), ("image", (1, 4, 2))], [], [("video", (2, 2, 4))],
              [("image", (1, 2, 6))], [("image", (1, 4, 4))], [("image", (1, 2, 2))], []]
LEARNING_RATE = 0.5


class _RowIndices(torch.utils.data.Dataset):
    def __len__(self):
        return len(TRAIN_ROWS)

    def __getitem__(self, i):
        return {"row": i}


def _trainer_worker(rank, world, sp, vision, sft=False):
    """Trainer (or TRL's SFTTrainer) + mixin at SP `sp` x DP world / sp for two SGD steps
    on a VLM collator's padded batches; the rows each step saw on every rank, the
    parameters' updates."""
    import tempfile

    import torch.distributed as dist
    from trainer_cases import launch_env, tiny_tokenizer
    from transformers import Trainer, TrainingArguments

    launch_env(rank, world)
    rows = [make_row(items, seed=30 + i, text=3 if items else 9) for i, items in enumerate(TRAIN_ROWS)]

    def collator(items):
        picked = [item["row"] for item in items]
        return dict(collate([rows[i] for i in picked]), row_ids=torch.tensor(picked))

    base = Trainer
    if sft:
        from trl import SFTConfig, SFTTrainer

        base = SFTTrainer

    class RecordingTrainer(ukhf.SequenceParallelTrainerMixin, base):
        seen = []

        def compute_loss(self, model, inputs, **kwargs):
            self.seen.append(inputs["row_ids"].tolist())
            return super().compute_loss(model, inputs, **kwargs)

    groups = uk.init_sequence_parallel(sp)
    ukhf.register(groups)
    model = build_vlm("qwen2_vl", "ulysses", world=sp)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    common = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2, max_steps=2, logging_steps=1,
                  save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True, ddp_backend="gloo",
                  optim="sgd", learning_rate=LEARNING_RATE, max_grad_norm=0.0, lr_scheduler_type="constant",
                  remove_unused_columns=False)
    extra = {}
    if sft:   # the collator's batches as they are: no dataset preparation, no bf16 autocast
        args = SFTConfig(**common, dataset_kwargs={"skip_prepare_dataset": True}, packing=False, padding_free=False,
                         max_length=None, bf16=False)
        extra = dict(processing_class=tiny_tokenizer())
    else:
        args = TrainingArguments(**common)
    dataset = _RowIndices()
    if sft:   # TRL takes a datasets.Dataset
        from datasets import Dataset

        dataset = Dataset.from_dict({"row": list(range(len(TRAIN_ROWS)))})
    trainer = RecordingTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator,
                               sp_groups=groups, sp_vision=vision, **extra)
    trainer.train()
    seen = [None] * world
    dist.all_gather_object(seen, RecordingTrainer.seen)
    # The reference: every row a step saw (over the DP groups), each on its own on one
    # process, the loss over all their targets, two SGD steps.
    reference = build_vlm("qwen2_vl", "eager64", world=sp)
    for step in range(2):
        step_rows = sorted({row for per_rank in seen for row in per_rank[step]})
        _, grads = reference_step(reference, [rows[i] for i in step_rows], "qwen2_vl")
        with torch.no_grad():
            for name, p in reference.named_parameters():
                p -= LEARNING_RATE * grads[name]
    trained = dict(trainer.accelerator.unwrap_model(trainer.model).named_parameters())
    one = torch.ones((), dtype=torch.float64)
    updates = {n: (trained[n] - initial[n]).detach() for n in initial}
    want = {n: (p - initial[n]).detach() for n, p in reference.named_parameters()}
    return dict(seen=seen, worst=largest_error((one, updates), (one, want)))   # updates compared like gradients


@pytest.mark.slow
@pytest.mark.parametrize("vision,sft", [("replicate", False), ("split", False), ("split", True)],
                         ids=["trainer-replicate", "trainer-split", "sft-split"])
def test_trainer_mixin_with_a_vlm_collator_equals_rows_on_one_process(vision, sft):
    per_rank = spawn(_trainer_worker, 4, args=(2, vision, sft), timeout=SLOW_SPAWN_TIMEOUT,
                     start_method="forkserver", preload=PRELOAD)
    seen = per_rank[0]["seen"]
    assert seen[0] == seen[1] and seen[2] == seen[3] and seen[0] != seen[2], seen   # SP ranks share, DP differ
    for rank, out in enumerate(per_rank):
        error, where = out["worst"]
        assert error < 1e-8, (rank, error, where)


# ---------------------------------------------------------------------------- example

def _example_worker(rank, world, argv):
    import sys

    from helpers import ROOT

    sys.path.insert(0, str(ROOT / "examples"))
    import train_vlm

    return train_vlm.run(rank, world, argv)


@pytest.mark.slow
def test_example_trains_and_generates_on_cpu():
    per_rank = spawn(_example_worker, 4, args=(["--sp", "2", "--steps", "6", "--vision", "split"],),
                     timeout=SLOW_SPAWN_TIMEOUT, start_method="forkserver", preload=PRELOAD)
    losses = per_rank[0]["losses"]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], losses   # AdamW on the tiny model learns the text
    assert all(out == per_rank[0] for out in per_rank), per_rank   # one loss and one generation everywhere
    assert len(per_rank[0]["generated"]) == 8


# ------------------------------------------------------ ZeRO-3: a DP group without images

def _zero3_worker(rank, world, dummy, vision):
    """A DeepSpeed ZeRO-3 engine loop at SP 2 x DP 2 (examples/train_deepspeed.py's recipe):
    DP group 0 trains on rows with images, DP group 1 on text-only rows, so only the first
    runs the vision tower unless the package runs it on a dummy image on the second."""
    import os

    import deepspeed
    from train_deepspeed import deepspeed_config
    from trainer_cases import launch_env

    from ulysses_kernels.hf.families.vision import vision as vision_module

    launch_env(rank, world)
    os.environ["DS_ACCELERATOR"] = "cpu"
    if not dummy:   # the control: without the dummy the text-only group never gathers the tower
        vision_module._with_tower_dummy.__code__ = (lambda module, args, kwargs: None).__code__
    groups = uk.init_sequence_parallel(2)
    ukhf.register(groups)
    model = build_vlm("qwen2_vl", "ulysses", world=2, dtype=torch.float32)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=deepspeed_config(3, LEARNING_RATE))
    items = [[("image", (1, 4, 6))], [("image", (1, 2, 2)), ("image", (1, 2, 4))]] if groups.dp_rank == 0 else [[], []]
    rows = [make_row(row, seed=40 + 2 * groups.dp_rank + i, text=3 if row else 11) for i, row in enumerate(items)]
    batch = collate(rows)
    sharded = ukhf.shard_batch(batch["input_ids"], groups, attention_mask=batch["attention_mask"], vision=vision,
                               **(vision_kwargs(batch, "qwen2_vl") if groups.dp_rank == 0 else {}))
    loss = ukhf.causal_lm_loss(engine, sharded, groups)
    engine.backward(ukhf.loss_for_world_average(loss, groups, engine=engine))
    engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        trained = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return dict(rows=rows, trained=trained, initial=initial)


def _zero3_reference(per_rank):
    """One SGD step on one process: the mean over the two DP groups of each group's mean
    loss over its rows (each row on its own), in float64."""
    from train_deepspeed import deepspeed_config  # noqa: F401 - the examples are on the path

    reference = build_vlm("qwen2_vl", "eager64", world=2)
    initial = per_rank[0]["initial"]
    with torch.no_grad():   # the float32 run's starting weights, in float64
        for name, p in reference.named_parameters():
            p.copy_(initial[name])
    grads = {}
    for dp_rank in (0, 2):
        _, g = reference_step(reference, per_rank[dp_rank]["rows"], "qwen2_vl")
        for name, value in g.items():
            grads[name] = grads.get(name, 0) + value / 2
    one = torch.ones((), dtype=torch.float64)
    want = {n: -LEARNING_RATE * grads.get(n, torch.zeros_like(initial[n], dtype=torch.float64)) for n in initial}
    return [largest_error((one, {n: (out["trained"][n] - initial[n]).double() for n in initial}), (one, want))
            for out in per_rank]


@pytest.mark.slow
def test_zero3_with_a_dp_group_without_images_runs_the_tower_on_a_dummy():
    import sys

    from helpers import ROOT

    pytest.importorskip("deepspeed")
    sys.path.insert(0, str(ROOT / "examples"))
    per_rank = spawn(_zero3_worker, 4, args=(True, "split"), timeout=SLOW_SPAWN_TIMEOUT,
                     start_method="forkserver", preload=PRELOAD)
    # float32 training against float64: a norm weight (about 1.0) moves by about 1e-4 in the
    # step and float32 holds it to 6e-8, so its update is known to ~1e-3 (trainer_cases.py);
    # a wrongly scaled gradient is off by tens of percent, a missing dummy hangs.
    for rank, (error, where) in enumerate(_zero3_reference(per_rank)):
        assert error < 3e-3, (rank, error, where)


# ------------------------------------------------------------------ error paths, unit

def test_block_overlay_is_accepted_only_where_it_equals_the_batch_blocks():
    """The model's block mask (transformers' own builders) is honoured when its probe equals
    the blocks shard_batch derived from token_type_ids, not when the blocks differ."""
    from transformers import masking_utils as mu

    from ulysses_kernels.hf.families.attention.gemma3 import honours_blocks, image_blocks

    types = torch.tensor([[0, 1, 1, 1, 0, 0, 1, 1, 0], [0, 0, 1, 1, 0, 1, 1, 1, 0]])
    blocks = image_blocks(types)
    assert blocks.tolist() == [[-1, 0, 0, 0, -1, -1, 1, 1, -1], [-1, -1, 2, 2, -1, 3, 3, 3, -1]]
    shard = TokenShard(shape=tuple(types.shape), ranges=[(0, 18)], blocks=blocks)

    def request(ids):
        return dict(mask_function=mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(ids)),
                    q_length=types.shape[1], kv_length=types.shape[1], batch_size=2)

    assert honours_blocks(request(blocks), shard)
    merged = blocks.clone()
    merged[0, 6:8] = 0   # the two images of row 0 as one block: opens the second to the first
    assert not honours_blocks(request(merged), shard)
    shifted = torch.where(types == 1, blocks, -1).roll(1, dims=1)
    assert not honours_blocks(request(shifted), shard)
    assert not honours_blocks(request(blocks), TokenShard(shape=(2, 9), ranges=[(0, 18)]))   # no blocks known


def test_language_inputs_refuse_what_the_hook_cannot_cut():
    from ulysses_kernels.hf import NotSequenceParallelError
    from ulysses_kernels.hf.families.vision.vision import _shard_language_inputs

    shard = TokenShard(shape=(1, 6), ranges=[(0, 3)])
    embeds = torch.randn(1, 6, 4, dtype=torch.float64)
    with pytest.raises(NotSequenceParallelError, match="'router_bias'"):
        shard.language_inputs(torch.nn.Linear(1, 1), dict(inputs_embeds=embeds, router_bias=torch.ones(1, 6)))
    with pytest.raises(NotSequenceParallelError, match="positional arguments"):
        _shard_language_inputs(torch.nn.Linear(1, 1), (embeds,), {"ulysses_shard": shard})
    with pytest.raises(ValueError, match="sharded as"):   # a merged sequence of another length
        shard.language_inputs(torch.nn.Linear(1, 1), dict(inputs_embeds=torch.randn(1, 7, 4)))
    out = shard.language_inputs(torch.nn.Linear(1, 1), dict(inputs_embeds=embeds, position_ids=None))
    assert torch.equal(out["inputs_embeds"], embeds[:, :3]) and out["position_ids"].tolist() == [[0, 1, 2]]


def test_generation_with_images_checks_its_prompt():
    from ulysses_kernels.hf.inference.generation import _check_last_token_is_text, _merged_prompt

    ids = torch.randint(0, 80, (1, 8))
    types = torch.zeros(1, 8, dtype=torch.long)
    types[0, 2:5] = 1
    images = dict(pixel_values=torch.randn(4, 24), image_grid_thw=torch.tensor([[1, 2, 2]]), mm_token_type_ids=types)
    _check_last_token_is_text(ids, images)
    ending = dict(images, mm_token_type_ids=torch.ones_like(types))
    with pytest.raises(ValueError, match="must end with a text token"):
        _check_last_token_is_text(ids, ending)
    with pytest.raises(TypeError, match="'pixel_mask'"):
        _merged_prompt(None, ids, dict(images, pixel_mask=torch.ones(1)), 0)
    with pytest.raises(ValueError, match="empty cache"):
        _merged_prompt(None, ids, images, start=5)
    assert _merged_prompt(None, ids, dict(mm_token_type_ids=types), 0) is None   # no image: the text path
