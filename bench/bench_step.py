"""A CPU training step at SP 2 (gloo): ulysses-kernels against DeepSpeed ALST and against no
sequence parallelism, in the same run (docs/architecture.md, "No host read in the step").

Two levels, each contender measured the same way:
- the Hugging Face path: a tiny Llama (float32, `--hidden`, `--layers`, `--seq-len` global
  tokens, batch 1). "ulysses-kernels" is the documented trusted step (`ukhf.shard_batch` of
  the batch on the host, as a data collator returns it, `ukhf.causal_lm_loss`, backward);
  "ALST" is DeepSpeed's `UlyssesSPAttentionHF` around transformers' SDPA attention with its
  documented loss (the ranks' mean losses all-gathered and weighted by their token counts);
  "no SP" is one process running the whole sequence with transformers' SDPA attention and
  its own loss.
- the direct API: causal attention over `[1, S/2, H, D]` shards, forward + backward:
  `uk.ulysses_attention` with trusted `seq_lens` and without them, DeepSpeed's
  `DistributedAttention` around torch SDPA, and torch SDPA over the whole sequence.

Per contender: the step time (median of `--repeats`, the contenders interleaved, after one
warm-up step each), the host reads per step whose nearest caller is the contender's own
code (`Tensor.item`, `tolist`, `__bool__`, `__int__` whose nearest caller outside torch is in
the contender's package; transformers' own, inside the model's forward, are not counted),
the collectives per step with the bytes each rank sends, and the graphs and graph breaks
of one forward under `torch._dynamo.explain`. Every rank runs on one thread.

    python bench/bench_step.py [--seq-len 4096] [--hidden 256] [--layers 2] [--repeats 5] [--out DIR]
"""

import argparse
import collections
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from _results import write_results  # noqa: E402 (bench/ is the script's folder)

HOST_READS = ("item", "tolist", "__bool__", "__int__")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all", "all_to_all_single",
               "broadcast", "reduce_scatter_tensor", "send", "recv", "isend", "irecv")
OWN_CODE = {"ulysses-kernels": "/ulysses_kernels/", "ALST": "/deepspeed/", "no SP": None}


def _sent_bytes(name, args, kwargs):
    """The bytes this rank hands to a collective."""
    if name in ("all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor"):
        tensor = kwargs.get("input", kwargs.get("input_tensor", args[1] if len(args) > 1 else None))
        return tensor.nbytes
    if name == "all_to_all":
        tensors = kwargs.get("input_tensor_list", args[1] if len(args) > 1 else [])
        return sum(t.nbytes for t in tensors)
    if name == "all_gather":
        return kwargs.get("tensor", args[1] if len(args) > 1 else None).nbytes
    tensor = kwargs.get("tensor", args[0] if args else None)
    return tensor.nbytes if isinstance(tensor, torch.Tensor) else 0


def _where(frame) -> str:
    return f"{frame.filename.split('/')[-1]}:{frame.name}"


class Counters:
    """Host reads from one package's frames and every collective, while `active`."""

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.own, self.active = dist, None, False
        self.reads, self.calls, self.bytes = collections.Counter(), collections.Counter(), collections.Counter()
        for name in HOST_READS:
            self._wrap(torch.Tensor, name, self._read)
        for name in COLLECTIVES:
            self._wrap(dist, name, self._collective)

    def _wrap(self, owner, name, record):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            if self.active:
                record(name, args, kwargs)
            return original(*args, **kwargs)

        setattr(owner, name, counted)

    def _read(self, name, args, kwargs):
        if self.own is None:
            return
        # The nearest frame outside torch decides: the contender's code counts; transformers'
        # own reads (inside the model's forward) and the benchmark's glue do not. A site is
        # named by that frame and by the contender's entry it runs under (the outermost of its
        # consecutive frames: shard_batch, the loss, the attention), so that moving a helper to
        # another file does not change what the read is charged to.
        frames = [f for f in traceback.extract_stack()[:-2][::-1] if "/torch/" not in f.filename]
        if not frames or self.own not in frames[0].filename:
            return
        entry = frames[0]
        for frame in frames[1:]:
            if self.own not in frame.filename:
                break
            entry = frame
        self.reads[f"{name} in {_where(frames[0])} under {_where(entry)}"] += 1

    def _collective(self, name, args, kwargs):
        self.calls[name] += 1
        self.bytes[name] += _sent_bytes(name, args, kwargs)

    def measure(self, own, fn):
        self.own, self.active = own, True
        self.reads.clear(), self.calls.clear(), self.bytes.clear()
        try:
            fn()
        finally:
            self.active = False
        return {"host_reads": sum(self.reads.values()), "host_read_sites": dict(self.reads),
                "collectives": {name: {"calls": n, "bytes": self.bytes[name]} for name, n in self.calls.items()}}


# ------------------------------------------------------------------------ the steps

def _llama(hidden, layers, attn, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128),
                         max_position_embeddings=1 << 20, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM._from_config(config, attn_implementation=attn).float().train()


def hf_steps(args, rank, world):
    """{contender: (step function, forward function for dynamo.explain, own-code marker)}."""
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_nn
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import ulysses_kernels as uk
    from ulysses_kernels import hf as ukhf

    S = args.seq_len
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (1, S), generator=g)
    pos = torch.arange(S).unsqueeze(0)

    groups = uk.init_sequence_parallel(world)
    ukhf.register(groups)
    ours = _llama(args.hidden, args.layers, "ulysses")

    def ours_step():
        batch = ukhf.shard_batch(ids, groups, position_ids=pos)
        ukhf.causal_lm_loss(ours, batch, groups).backward()

    def ours_forward():
        batch = ukhf.shard_batch(ids, groups, position_ids=pos)
        return lambda: ours(**batch.model_inputs()).logits

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    alst_model = _llama(args.hidden, args.layers, "sdpa")
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    mpu = UlyssesSPAttentionHF.register_with_transformers(alst_model, "sdpa", sequence_parallel_size=world,
                                                          micro_batch_size=1, seq_length_is_variable=True)
    alst_attention = ALL_ATTENTION_FUNCTIONS["sdpa"]
    sp_group = mpu.get_sequence_parallel_group()
    local = slice(rank * S // world, (rank + 1) * S // world)
    shift_labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)

    def alst_step():
        ALL_ATTENTION_FUNCTIONS["sdpa"] = alst_attention
        # transformers computes a loss only with `labels`; `shift_labels` (ALST's pre-shifted global labels) wins
        out = alst_model(input_ids=ids[:, local], position_ids=pos[:, local], labels=ids[:, local],
                         shift_labels=shift_labels[:, local], use_cache=False)
        good = (shift_labels[:, local] != -100).sum()
        losses = dist_nn.all_gather(out.loss, group=sp_group)
        goods = dist_nn.all_gather(good, group=sp_group)
        loss = sum(l * n for l, n in zip(losses, goods)) / sum(goods)
        loss.backward()

    def alst_forward():
        ALL_ATTENTION_FUNCTIONS["sdpa"] = alst_attention
        return lambda: alst_model(input_ids=ids[:, local], position_ids=pos[:, local], use_cache=False).logits

    plain = _llama(args.hidden, args.layers, "sdpa")

    def plain_step():
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
        plain(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss.backward()

    def plain_forward():
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
        return lambda: plain(input_ids=ids, position_ids=pos, use_cache=False).logits

    dist.barrier()
    return {"ulysses-kernels": (ours_step, ours_forward), "ALST": (alst_step, alst_forward),
            "no SP": (plain_step, plain_forward)}


def api_steps(args, rank, world):
    """The direct API's contenders: causal attention of the Llama's heads over S/world-token shards."""
    import torch.nn.functional as F
    from deepspeed.sequence.layer import DistributedAttention

    import ulysses_kernels as uk

    S, heads, kv_heads = args.seq_len, args.hidden // 64, max(1, args.hidden // 128)
    g = torch.Generator().manual_seed(2)
    q, k, v, do = (torch.randn(1, S, h, 64, generator=g) for h in (heads, kv_heads, kv_heads, heads))
    lens = uk.split_lengths(S, world)
    shard = lambda t: torch.tensor_split(t, world, dim=1)[rank].clone()  # noqa: E731
    ql, kl, vl, dol = (shard(t) for t in (q, k, v, do))
    group = uk.init_sequence_parallel(world).sp_group

    def leaves(*tensors):
        return [t.clone().requires_grad_(True) for t in tensors]

    def ours(trusted):
        def call(a, b, c):
            return uk.ulysses_attention(a, b, c, group=group, causal=True, seq_lens=lens if trusted else None)
        return (lambda: call(*leaves(ql, kl, vl)).backward(dol)), (lambda: lambda: call(ql, kl, vl))

    def sdpa_bshd(a, b, c, *extra, **kwargs):
        # [B, S, H, D] in and out, as DistributedAttention's local attention sees them (batch_dim_idx 0)
        out = F.scaled_dot_product_attention(a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2), is_causal=True,
                                             enable_gqa=True)
        return out.transpose(1, 2)

    ds = DistributedAttention(sdpa_bshd, group, scatter_idx=2, gather_idx=1)
    kv_rep = max(1, world // kv_heads)   # DistributedAttention splits heads evenly: replicate KV heads as ALST does

    def deepspeed_call(a, b, c):
        return ds(a, b.repeat_interleave(kv_rep, 2), c.repeat_interleave(kv_rep, 2), 0)

    full = lambda a, b, c: sdpa_bshd(a, b, c)  # noqa: E731
    return {"ulysses-kernels (seq_lens)": ours(True),
            "ulysses-kernels (checked)": ours(False),
            "DeepSpeed DistributedAttention": ((lambda: deepspeed_call(*leaves(ql, kl, vl)).backward(dol)),
                                               (lambda: lambda: deepspeed_call(ql, kl, vl))),
            "no SP (torch SDPA)": ((lambda: full(*leaves(q, k, v)).backward(do)), (lambda: lambda: full(q, k, v)))}


def _own(name):
    for key, marker in OWN_CODE.items():
        if name.startswith(key):
            return marker
    return "/deepspeed/" if name.startswith("DeepSpeed") else None


def _graphs(forward):
    import torch._dynamo as dynamo

    try:
        explanation = dynamo.explain(forward())()
        return {"graphs": explanation.graph_count, "graph_breaks": explanation.graph_break_count,
                "break_reasons": sorted({str(b.reason).split("\n")[0][:160] for b in explanation.break_reasons})}
    except Exception as exc:  # noqa: BLE001 - a contender that cannot be traced is a result too
        return {"graphs": None, "graph_breaks": None, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    finally:
        dynamo.reset()


def _worker(rank, world, args):
    import deepspeed

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    counters = Counters()
    report = {}
    for level, build in (("hf", hf_steps), ("api", api_steps)):
        contenders = build(args, rank, world)
        rows = {}
        for name, (step, forward) in contenders.items():
            step()                                                   # warm-up (and the first call's checks)
            rows[name] = counters.measure(_own(name), step)
            rows[name].update(_graphs(forward))
        times = collections.defaultdict(list)
        for _ in range(args.repeats):
            for name, (step, _) in contenders.items():
                torch.distributed.barrier()
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
        for name in contenders:
            rows[name]["step_s"] = statistics.median(times[name])
            rows[name]["step_s_all"] = times[name]
        report[level] = rows
    return report


def table(level, rows, baseline, sp_reference):
    lines = [f"| {level} | step s | vs {sp_reference} | vs {baseline} | host reads / step | collectives / step "
             "(calls, MB sent) | graphs / breaks |", "|" + "---|" * 7]
    for name, r in rows.items():
        coll = ", ".join(f"{k} {v['calls']} ({v['bytes'] / 1e6:.2f})" for k, v in sorted(r["collectives"].items()))
        graphs = f"{r['graphs']} / {r['graph_breaks']}" if r["graphs"] is not None else f"n/a ({r['error']})"
        lines.append(f"| {name} | {r['step_s']:.3f} | {r['step_s'] / rows[sp_reference]['step_s']:.2f}x | "
                     f"{r['step_s'] / rows[baseline]['step_s']:.2f}x | {r['host_reads']} | {coll or '-'} | "
                     f"{graphs} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for step.{md,json}")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one repeat (the bench smoke test)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.seq_len, args.hidden, args.repeats = 256, 128, 1
    from ulysses_kernels.launch import spawn

    per_rank = spawn(_worker, args.world, args=(args,), timeout=1800, start_method="forkserver",
                     preload=["torch", "transformers", "deepspeed", "ulysses_kernels.hf"])
    report = per_rank[0]
    md = (f"# CPU training step at SP {args.world} (gloo, one thread per rank)\n\n"
          f"Llama, hidden {args.hidden}, {args.layers} layers, {args.hidden // 64} heads of 64, "
          f"{max(1, args.hidden // 128)} KV heads, float32, S {args.seq_len}, batch 1; median of {args.repeats} "
          f"interleaved steps; rank 0's counts.\n\n"
          f"{table('HF path', report['hf'], 'no SP', 'ALST')}\n\n"
          f"{table('direct API', report['api'], 'no SP (torch SDPA)', 'DeepSpeed DistributedAttention')}\n")
    write_results(args.out, "step", md, {"args": vars(args), "ranks": per_rank})
    return 0


if __name__ == "__main__":
    sys.exit(main())
