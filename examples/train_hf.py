"""Train a Hugging Face causal LM with Ulysses sequence parallelism (DP x SP).

    torchrun --nproc-per-node 4 examples/train_hf.py --sp 2 --dp 2 --seq-len 512 --steps 5

Runs on CPU (gloo) or GPUs (NCCL, one per rank). No network is needed: the model is a
tiny random Llama-style config unless --model points at a local HF checkpoint directory,
and the text is --text (a file or a directory of files) or, by default, this repository's
own README and sources. Without a local tokenizer a byte-level one is used (vocab 256).

Every SP group trains on one packed sequence of --seq-len tokens per step (documents
concatenated, position ids restarting at 0 per document so attention never crosses
them); DP groups take different sequences. Options: --tiled (tiled MLP + tiled LM-head
loss), --checkpointing (activation checkpointing), --parallel {fsdp,hsdp,ddp,none}
(FSDP2 sharded across the whole DP x SP world, FSDP2 sharded inside SP groups, DDP, or
plain all-reduces).

Also callable in-process for tests: `run(rank, world, argv)` with torch.distributed
already initialised (e.g. by ulysses_kernels.launch.spawn); returns the per-step losses.
"""

import argparse
import glob
import os

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sp", type=int, default=None, help="sequence-parallel size (default: world / dp)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: world / sp)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (global, per SP group)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--model", default=None, help="local HF model directory (default: tiny random Llama)")
    p.add_argument("--text", default=None, help="text file or directory (default: this repo's files)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--tiled", action="store_true", help="tiled MLP and tiled LM-head loss")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument("--offload", action="store_true", help="checkpoint offload to host memory (needs --checkpointing)")
    p.add_argument("--ring", type=int, default=1, help="ring degree of Ulysses x Ring (default 1)")
    p.add_argument("--parallel", choices=["fsdp", "hsdp", "ddp", "none"], default="fsdp")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--backend", default=None, help="ulysses_attention backend (default: auto)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- data

class ByteTokenizer:
    vocab_size = 256

    def encode(self, text):
        return list(text.encode("utf-8", errors="replace"))


def load_documents(path):
    if path is None:
        files = [os.path.join(REPO, "README.md"), os.path.join(REPO, "docs", "architecture.md")]
        files += sorted(glob.glob(os.path.join(REPO, "ulysses_kernels", "*.py")))
        files += sorted(glob.glob(os.path.join(REPO, "tests", "*.py")))
    elif os.path.isdir(path):
        files = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True) if os.path.isfile(f))
    else:
        files = [path]
    docs = []
    for f in files:
        if os.path.isfile(f):
            with open(f, encoding="utf-8", errors="replace") as fh:
                text = fh.read()
            if text.strip():
                docs.append(text)
    if not docs:
        raise SystemExit(f"no text found in {path or REPO}")
    return docs


def packed_sequences(token_docs, seq_len):
    """Endless stream of (input_ids [1, S], position_ids [1, S]): documents concatenated,
    positions restarting at 0 at each document start."""
    ids, pos = [], []
    while True:
        for doc in token_docs:
            for i, t in enumerate(doc):
                ids.append(t)
                pos.append(i)
                if len(ids) == seq_len:
                    yield torch.tensor([ids]), torch.tensor([pos])
                    ids, pos = [], []


# ---------------------------------------------------------------------------- model

def build_model(args, vocab_size, attn):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=attn, dtype=dtype,
                                                     local_files_only=True)
    else:
        cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                          num_hidden_layers=args.layers, num_attention_heads=args.heads,
                          num_key_value_heads=args.kv_heads, vocab_size=vocab_size,
                          max_position_embeddings=max(4096, args.seq_len), attention_dropout=0.0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).to(dtype)
    return model


def load_tokenizer(args):
    if args.model:
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        except Exception:  # no tokenizer files next to the weights
            pass
    return ByteTokenizer()


# ----------------------------------------------------------------------------- train

def run(rank, world, argv=None):
    import ulysses_kernels as uk
    from ulysses_kernels import hf as ukhf

    args = parse_args(argv)
    sp = args.sp or (world // args.dp if args.dp else world)
    dp = args.dp or world // sp
    if sp * dp != world:
        raise SystemExit(f"--sp {sp} x --dp {dp} != world size {world}")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    groups = uk.init_sequence_parallel(sp, ring_size=args.ring)
    ukhf.register(groups, backend=args.backend)  # the Ulysses (and ring) groups

    tok = load_tokenizer(args)
    docs = [tok.encode(d) for d in load_documents(args.text)]
    vocab = getattr(tok, "vocab_size", 256)
    model = build_model(args, vocab, ukhf.ATTN_IMPLEMENTATION).to(device).train()
    if args.checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    if args.offload and not args.checkpointing:
        raise SystemExit("--offload needs --checkpointing")
    offload = ukhf.CheckpointOffload() if args.offload else False
    if args.tiled or args.offload:
        ukhf.patch_model(model, tiled_mlp=args.tiled, tiled_loss=args.tiled, offload_checkpoints=offload)
    if args.parallel == "fsdp":
        model = ukhf.apply_fsdp(model, groups, shard="world")
    elif args.parallel == "hsdp":
        model = ukhf.apply_fsdp(model, groups, shard="sp")
    elif args.parallel == "ddp":
        model = ukhf.apply_ddp(model, groups)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    nparams = sum(p.numel() for p in model.parameters())

    monitor = uk.StepMonitor(model=getattr(model, "module", model), sp_size=sp, ring_size=args.ring, device=device,
                             checkpointing=args.checkpointing, checkpoint_offload=args.offload, tiled_mlp=args.tiled,
                             tiled_loss=args.tiled)
    stream = packed_sequences(docs, args.seq_len)
    if rank == 0:
        print(f"world {world} = dp {dp} x sp {sp}, seq_len {args.seq_len}, {len(docs)} documents, "
              f"vocab {vocab}, parallel {args.parallel}, tiled {args.tiled}, "
              f"checkpointing {args.checkpointing}, params {nparams:,}", flush=True)
    losses = []
    for step in range(args.steps):
        # every rank draws all dp sequences of this step and keeps its DP group's one
        seqs = [next(stream) for _ in range(dp)]
        ids, pos = seqs[groups.dp_rank]
        monitor.begin()
        batch = ukhf.shard_batch(ids.to(device), groups, position_ids=pos.to(device))
        loss = ukhf.causal_lm_loss(model, batch, groups)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.parallel == "none":
            ukhf.allreduce_gradients(model, groups.sp_group, groups.dp_group)
        opt.step()
        lv = loss.detach().float().reshape(1).clone()
        dist.all_reduce(lv)  # every rank holds its SP group's global mean
        mean_loss = lv.item() / world
        record = monitor.end(tokens=dp * ids.numel(), seq_len=ids.numel())
        host = torch.tensor([offload.pool.allocated_bytes / 2**20 if offload else 0.0], dtype=torch.float64,
                            device=device)
        if offload:
            dist.all_reduce(host, op=dist.ReduceOp.MAX)
        losses.append(mean_loss)
        if rank == 0:
            print(f"step {step + 1}/{args.steps}  loss {mean_loss:.4f}  {record.line()}"
                  + (f"  offload host buffers/rank {host.item():,.1f} MiB" if offload else ""), flush=True)
    return losses


def main():
    from ulysses_kernels.launch import torchrun_main

    torchrun_main(run, "torchrun --nproc-per-node 4 examples/train_hf.py --sp 2 --dp 2")


if __name__ == "__main__":
    main()
