"""Validate the memory planner (ulysses_kernels/planner.py) against measured peak memory of
one training step on CPU: tiny Hugging Face Llama-style models in float32 with the
"ulysses" attention (the reference path), AdamW, under several option sets (checkpointing,
tiled MLP and loss, checkpoint offload), at SP 1 and SP 2 (gloo).

Measured: the peak of live CPU tensor bytes during the second step (forward, backward,
optimizer step; the first step creates the gradients and AdamW states), counted by
`PeakTracker`: the storages of the parameters, gradients and optimizer states, plus every
storage an operator creates during the step, released when the storage is freed. Predicted: the planner with the same shape and options,
`attention="flash"` (these float32 causal calls run on torch SDPA's flash kernel, which keeps
O(S) state like the Triton kernels: docs/architecture.md, "Reference path"), no FSDP, no
reserve. Offload runs with the host/device roles simulated
(`CheckpointOffload(device_type="cpu")`): the offloaded inputs are counted where they live
(in host buffers, which the tracker also sees), so that case checks the planner's
device + host total.

    python bench/plan_validation.py [--check] [--json]
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

CASES = [
    dict(name="checkpointing", S=2048, hidden=256, layers=4, heads=8, kv=2, inter=704, vocab=2048),
    dict(name="checkpointing, long", S=4096, hidden=128, layers=4, heads=4, kv=2, inter=352, vocab=1024),
    dict(name="checkpointing + tiled", S=2048, hidden=256, layers=4, heads=8, kv=2, inter=704, vocab=2048,
         tiled=True),
    dict(name="no checkpointing", S=1024, hidden=256, layers=4, heads=8, kv=2, inter=704, vocab=2048,
         checkpointing=False),
    dict(name="large vocab", S=1024, hidden=128, layers=2, heads=4, kv=2, inter=352, vocab=32000),
    dict(name="large vocab + tiled", S=1024, hidden=128, layers=2, heads=4, kv=2, inter=352, vocab=32000,
         tiled=True),
    dict(name="checkpoint offload (simulated) + tiled", S=2048, hidden=256, layers=6, heads=8, kv=2, inter=704,
         vocab=2048, tiled=True, offload=True),
]


def _shape(c):
    from ulysses_kernels.planner import ModelShape

    return ModelShape(c["hidden"], c["layers"], c["heads"], c["kv"], c["hidden"] // c["heads"], c["inter"], c["vocab"])


def _options(c, sp):
    from ulysses_kernels.planner import PlanOptions

    return PlanOptions(seq_len=c["S"], gpus_per_node=sp, sp_size=sp, fsdp=False,
                       checkpointing=c.get("checkpointing", True), checkpoint_offload=c.get("offload", False),
                       tiled_mlp=c.get("tiled", False), tiled_loss=c.get("tiled", False), dtype_bytes=4,
                       reserve_gib=0.0, attention="flash", gpu_memory_gib=1e9)


class PeakTracker:
    """Live tensor storage bytes and their peak (a TorchDispatchMode sees every operator
    output; a weak reference to each new storage returns its bytes when it is freed)."""

    def __init__(self, tensors):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode

        self.live, self.current, self.peak, self._refs = {}, 0, 0, {}
        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        tracker.add(t)
                return out

        self.mode, self._weakref = Mode(), weakref
        for t in tensors:
            self.add(t)

    def add(self, t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self.live:
            return
        self.live[key] = storage.nbytes()
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        self._refs[key] = self._weakref.ref(storage, lambda _, key=key: self._free(key))

    def _free(self, key):
        self.current -= self.live.pop(key, 0)
        self._refs.pop(key, None)


def _persistent(model, opt):
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    for state in opt.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return tensors


def measure(rank, world, cases):
    """Runs on every rank (world = SP size): measured peak bytes of each case's second step."""
    import torch.distributed as dist
    import transformers

    from ulysses_kernels import hf as ukhf

    group = dist.group.WORLD if world > 1 else None
    ukhf.register(group)
    out = []
    for c in cases:
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=c["hidden"], num_hidden_layers=c["layers"],
                                       num_attention_heads=c["heads"], num_key_value_heads=c["kv"],
                                       intermediate_size=c["inter"], vocab_size=c["vocab"],
                                       max_position_embeddings=c["S"], attention_dropout=0.0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="ulysses").float().train()
        if c.get("checkpointing", True):
            model.gradient_checkpointing_enable()
        offload = ukhf.CheckpointOffload(device_type="cpu", min_bytes=0) if c.get("offload") else False
        ukhf.patch_model(model, tiled_mlp=c.get("tiled", False), tiled_loss=c.get("tiled", False),
                         offload_checkpoints=offload)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, c["vocab"], (1, c["S"]), generator=torch.Generator().manual_seed(1))
        batch = ukhf.shard_batch(ids, group)

        def step():
            loss = ukhf.causal_lm_loss(model, batch, group)
            loss.backward()
            ukhf.allreduce_gradients(model, group)
            opt.step()
            opt.zero_grad(set_to_none=False)

        step()
        tracker = PeakTracker(_persistent(model, opt))
        with tracker.mode:
            step()
        out.append(float(tracker.peak))

    return out


def rows(per_rank_measured, cases, sp):
    from ulysses_kernels.planner import GIB, memory_terms, peak_bytes

    result = []
    for i, c in enumerate(cases):
        terms = memory_terms(_shape(c), _options(c, sp))
        if c.get("offload"):  # simulated offload: the host copies are CPU tensors too
            from ulysses_kernels.planner import host_terms

            terms = dict(terms, **host_terms(_shape(c), _options(c, sp)))
        predicted = peak_bytes(terms)
        measured = max(r[i] for r in per_rank_measured)
        result.append(dict(case=c["name"], sp=sp, seq_len=c["S"], measured_mib=measured / 2**20,
                           predicted_mib=predicted / 2**20, ratio=predicted / measured,
                           largest_term=max(terms, key=terms.get), gib=predicted / GIB))
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a prediction is off by more than 15%%")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cases", type=int, nargs="+", default=None, help="indices into CASES")
    args = parser.parse_args(argv)
    from ulysses_kernels.launch import spawn

    cases = [CASES[i] for i in args.cases] if args.cases else CASES
    table = []
    for sp in args.sp:
        per_rank = spawn(measure, sp, args=(cases,), timeout=900)
        table += rows(per_rank, cases, sp)
    if args.json:
        print(json.dumps(table, indent=1))
    else:
        print("| case | SP | S | measured MiB | planner MiB | planner / measured | largest term |\n|---|---|---|---|---|---|---|")
        for r in table:
            print(f"| {r['case']} | {r['sp']} | {r['seq_len']} | {r['measured_mib']:.1f} | {r['predicted_mib']:.1f} | "
                  f"{r['ratio']:.3f} | {r['largest_term']} |")
    bad = [r for r in table if not 0.85 <= r["ratio"] <= 1.15]
    for r in bad:
        print(f"FAIL: {r['case']} at SP {r['sp']}: planner / measured = {r['ratio']:.3f}")
    return 1 if bad and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
