"""Train a vision-language model with Ulysses sequence parallelism, then generate from an
image prompt (docs/hf_vlm.md, "Vision-language models").

    torchrun --nproc-per-node 2 examples/train_vlm.py --sp 2 --steps 5 --vision split

Runs on CPU (gloo) or GPUs (NCCL, one per rank), without network: the model is a tiny
random Qwen2.5-VL unless --model points at a local checkpoint of a Qwen2-VL, Qwen2.5-VL,
Qwen3-VL or Qwen3.5 model, and the samples are made the way the Qwen processors make them
(text, then per image a vision-start token, one placeholder per merged patch, a vision-end
token; `pixel_values` one row per patch) from random pixels, since the point here is the
parallelism, not the data. Every step trains on a padded batch of --batch rows, each with
one to three images of different sizes (a text-only row among them); each SP group gets the
same batch, DP groups different ones.

What each step does, through the documented calls only: `shard_batch(input_ids, groups,
labels=..., attention_mask=..., pixel_values=..., image_grid_thw=..., mm_token_type_ids=...,
vision=...)` (no loss on the image placeholders), `causal_lm_loss`, `allreduce_gradients`. At the end `ukhf.generate` continues
an image prompt greedily on every rank.

Also callable in-process for tests: `run(rank, world, argv)` with torch.distributed already
initialised (e.g. by ulysses_kernels.launch.spawn); returns the per-step losses and the
generated tokens.
"""

import argparse

import torch
import torch.distributed as dist

# Token ids of the tiny model's vocabulary (a real checkpoint's come from its config).
VOCAB, IMAGE, START, END = 128, 120, 121, 122


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sp", type=int, default=None, help="sequence-parallel size (default: the world)")
    p.add_argument("--ring", type=int, default=1, help="ring degree of Ulysses x Ring (default 1)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=3, help="rows per step (padded batch)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vision", choices=["replicate", "split"], default="replicate",
                   help="every rank encodes every image, or each a block of them (features gathered)")
    p.add_argument("--model", default=None, help="local Qwen-VL checkpoint (default: tiny random Qwen2.5-VL)")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def tiny_model(attn, seed):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, attention_dropout=0.0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=2,
                  temporal_patch_size=2, spatial_merge_size=2, window_size=8, fullatt_block_indexes=[1])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE,
                              vision_start_token_id=START, vision_end_token_id=END, video_token_id=VOCAB - 1)
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration._from_config(config, attn_implementation=attn)


def load_model(args, attn):
    if args.model is None:
        return tiny_model(attn, args.seed)
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(args.model, attn_implementation=attn, local_files_only=True)


class Samples:
    """Processor-like samples for `model`'s config: rows of text and images (random
    pixels; patch, merge and token ids from the config)."""

    def __init__(self, model, seed):
        config = model.config
        vision = config.vision_config
        self.merge = vision.spatial_merge_size
        self.row_width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        self.ids = dict(image=config.image_token_id, start=config.vision_start_token_id,
                        end=config.vision_end_token_id)
        self.words = min(config.image_token_id, config.vision_start_token_id) - 1
        self.g = torch.Generator().manual_seed(seed)

    def _text(self, n):
        return torch.randint(0, self.words, (n,), generator=self.g).tolist()

    def row(self, images):
        """(token ids, token types, pixel rows, grids) of one sample with `images` images."""
        ids, types, pixels, grids = self._text(6), [0] * 6, [], []
        for _ in range(images):
            h, w = (self.merge * int(torch.randint(1, 4, (1,), generator=self.g)) for _ in range(2))
            n = h * w // self.merge ** 2
            ids += [self.ids["start"]] + [self.ids["image"]] * n + [self.ids["end"]] + self._text(5)
            types += [0] + [1] * n + [0] + [0] * 5
            pixels.append(torch.randn(h * w, self.row_width, generator=self.g))
            grids.append([1, h, w])
        return ids, types, pixels, grids

    def batch(self, rows):
        """A padded batch of `rows` samples, the first text only, the others with one to
        three images."""
        return self.collate([self.row(images=(i % 3) + 1 if i else 0) for i in range(rows)])

    def collate(self, samples):
        """The processor's padded batch (right padding) of `samples`: input_ids,
        attention_mask, mm_token_type_ids, pixel_values, image_grid_thw."""
        rows = len(samples)
        S = max(len(ids) for ids, *_ in samples)
        out = dict(input_ids=torch.zeros(rows, S, dtype=torch.long), attention_mask=torch.zeros(rows, S, dtype=torch.long),
                   mm_token_type_ids=torch.zeros(rows, S, dtype=torch.long))
        for i, (ids, types, _, _) in enumerate(samples):
            out["input_ids"][i, :len(ids)] = torch.tensor(ids)
            out["mm_token_type_ids"][i, :len(ids)] = torch.tensor(types)
            out["attention_mask"][i, :len(ids)] = 1
        out["pixel_values"] = torch.cat([p for *_, pixels, _ in samples for p in pixels])
        out["image_grid_thw"] = torch.tensor([g for *_, grids in samples for g in grids])
        return out


def run(rank, world, argv=None):
    import ulysses_kernels as uk
    from ulysses_kernels import hf as ukhf

    args = parse_args(argv)
    sp = args.sp or world
    if world % sp:
        raise SystemExit(f"--sp {sp} does not divide the world size {world}")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    groups = uk.init_sequence_parallel(sp, ring_size=args.ring)
    ukhf.register(groups)
    model = load_model(args, ukhf.ATTN_IMPLEMENTATION).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    samples = Samples(model, args.seed)
    if rank == 0:
        print(f"world {world} = dp {groups.dp_size} x sp {sp} (ring {args.ring}), vision={args.vision}, "
              f"params {sum(p.numel() for p in model.parameters()):,}", flush=True)
    losses = []
    for step in range(args.steps):
        batches = [samples.batch(args.batch) for _ in range(groups.dp_size)]   # every rank draws every DP group's
        batch = {k: v.to(device) for k, v in batches[groups.dp_rank].items()}
        ids = batch.pop("input_ids")
        labels = ids.masked_fill(batch["mm_token_type_ids"] != 0, -100)   # no loss on the image placeholders
        sharded = ukhf.shard_batch(ids, groups, labels=labels, attention_mask=batch.pop("attention_mask"),
                                   vision=args.vision, **batch)
        loss = ukhf.causal_lm_loss(model, sharded, groups)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        ukhf.allreduce_gradients(model, groups.sp_group, groups.dp_group)
        opt.step()
        mean = loss.detach().double().reshape(1).clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if rank == 0:
            print(f"step {step + 1}/{args.steps}  loss {losses[-1]:.4f}  tokens this rank "
                  f"{sharded.input_ids.shape[1]} of {sum(sharded.seq_lens)}", flush=True)
    prompt = {k: v.to(device) for k, v in samples.collate([samples.row(images=2)]).items()}   # text, 2 images, text
    model.eval()
    tokens = ukhf.generate(model, prompt["input_ids"], groups, pixel_values=prompt["pixel_values"],
                           image_grid_thw=prompt["image_grid_thw"], mm_token_type_ids=prompt["mm_token_type_ids"],
                           max_new_tokens=args.new_tokens, do_sample=False)
    new = tokens[0, -args.new_tokens:].tolist()
    if rank == 0:
        print(f"generated (greedy, every rank the same): {new}", flush=True)
    return dict(losses=losses, generated=new)


def main():
    from ulysses_kernels.launch import torchrun_main

    torchrun_main(run, "torchrun --nproc-per-node 2 examples/train_vlm.py --sp 2")


if __name__ == "__main__":
    main()
