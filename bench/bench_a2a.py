#!/usr/bin/env python
"""Pack/unpack kernels and the fused QKV exchange, on one GPU.

1. pack (q,k,v -> send `[P, B, S_p, Hc, D]`), unpack of the attention output and the
   backward unpack (replica sums) for P = 8 layouts (the kernels are local: they only
   reorder), in GB/s of bytes read + written, against a device-to-device copy
   (`dst.copy_(src)`) of the same number of bytes measured in the same run.
2. The fused QKV exchange (one pack kernel + one grouped NCCL send/recv) against the
   usual torch path (permute + contiguous per tensor, three `all_to_all_single`, permute
   back) at P = 1 (a one-rank NCCL group: the exchange is a self copy, so this measures
   the layout work and launch overheads; P = 8 is modelled in bench/MODEL.md).

Timing: triton.testing.do_bench (median ms) after warm-up, random bf16 data.
Writes a2a.json and a2a.md into --out (default $OUT, else bench/results).

    python bench/bench_a2a.py [--quick] [--out DIR]
"""

import argparse
import json
import os
import sys

import _fused_bench


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--quick", action="store_true")
    _fused_bench.add_smoke_flag(p)
    return p.parse_args()


def bench(fn, quick):
    return _fused_bench.bench(fn, *((10, 40) if quick else (25, 100)))


def write_results(out, rows, meta):
    """a2a.json and a2a.md with the rows so far (called after every row: a later failure
    or a time limit keeps what was measured)."""
    with open(os.path.join(out, "a2a.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(os.path.join(out, "a2a.md"), "w") as f:
        f.write(f"# Pack/unpack and fused exchange ({meta['device']}, {meta['dtype']})\n\n")
        f.write("| config | op | time (us) | GB/s | D2D copy GB/s (same bytes) | ratio |\n|---|---|---|---|---|---|\n")
        for r in rows:
            if r["section"] == "kernels":
                f.write(f"| {r['config']} | {r['op']} | {r['ms']*1e3:.1f} | {r['GBps']:.0f} | {r['copy_GBps']:.0f} | "
                        f"{r['ratio_vs_copy']:.2f} |\n")
        f.write("\n| exchange (P=1, one-rank NCCL) | torch permute + 3x all_to_all_single (us) | fused pack + "
                "grouped send/recv (us) | speedup | fused payload GB/s | D2D copy of the payload GB/s |\n"
                "|---|---|---|---|---|---|\n")
        for r in rows:
            if r["section"] == "exchange":
                f.write(f"| {r['config']} | {r['torch_ms']*1e3:.1f} | {r['fused_ms']*1e3:.1f} | {r['speedup']:.2f} | "
                        f"{r['fused_payload_GBps']:.0f} | {r['copy_GBps']:.0f} |\n")


def main():
    args = parse_args()
    if _fused_bench.dry_run_requested(args):
        return _fused_bench.dry_run("bench_a2a", args)
    started = _fused_bench.start("bench_a2a", args)
    if started is None:
        return 2
    dev, dtype, meta = started
    import torch
    import torch.distributed as dist

    from ulysses_kernels import HeadPlan, fused
    from ulysses_kernels.testing.bench import qkv_exchange
    ops = _fused_bench.ops()
    rows = []

    # ---------------------------------------------------------------- 1. kernels
    configs = [  # (label, P, B, S_p, Hq, Hkv, D)
        ("llama-GQA P8 (KV split)", 8, 1, 8192, 32, 8, 128),
        ("GQA P8 (KV replicated x4)", 8, 1, 8192, 32, 2, 128),
        ("MHA P8 B2", 8, 2, 4096, 16, 16, 64),
    ]
    if args.quick:
        configs = configs[:2]
    if args.smoke:
        configs = [("smoke GQA P4 (KV split)", 4, 1, 8, 8, 4, 16), ("smoke MQA P4 (KV replicated)", 4, 2, 8, 8, 1, 16)]
    for label, P, B, Sp, Hq, Hkv, D in configs:
        q = torch.randn(B, Sp, Hq, D, device=dev, dtype=dtype)
        k = torch.randn(B, Sp, Hkv, D, device=dev, dtype=dtype)
        v = torch.randn(B, Sp, Hkv, D, device=dev, dtype=dtype)
        send = ops.pack([q, k, v], P)
        heads = HeadPlan(P, Hq, Hkv)
        hl_q, hl_kv = heads.local_q_heads, heads.local_kv_heads
        nbytes = send.numel() * send.element_size()
        src = torch.randn(send.numel(), device=dev, dtype=dtype)
        dst = torch.empty_like(src)
        t_copy = bench(lambda: dst.copy_(src), args.quick)
        t_pack = bench(lambda: ops.pack_into([q, k, v], send, [0, 0, 0], [hl_q, hl_kv, hl_kv]), args.quick)
        # unpack of the attention output: recv [P, B, S_p, Hl_q, D] -> [B, S_p, Hq, D]
        orecv = torch.randn(P, B, Sp, hl_q, D, device=dev, dtype=dtype)
        out = torch.empty_like(q)
        t_unpack = bench(lambda: ops.unpack_into(orecv, [out], [0], [hl_q]), args.quick)
        ob = orecv.numel() * orecv.element_size()
        src2, dst2 = src[:orecv.numel()], dst[:orecv.numel()]
        t_copy2 = bench(lambda: dst2.copy_(src2), args.quick)
        # backward unpack (dq, dk, dv; replicas summed when KV heads are replicated)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        t_bunpack = bench(lambda: ops.unpack_into(send, grads, [0, 0, 0], [hl_q, hl_kv, hl_kv]), args.quick)
        out_bytes = sum(g.numel() for g in grads) * 2
        for kernel, t, moved, t_ref, ref_moved in (
                ("pack q,k,v", t_pack, 2 * nbytes, t_copy, 2 * nbytes),
                ("unpack out", t_unpack, 2 * ob, t_copy2, 2 * ob),
                ("unpack dq,dk,dv", t_bunpack, nbytes + out_bytes, t_copy, 2 * nbytes)):
            rows.append(dict(section="kernels", config=label, op=kernel, P=P, B=B, S_local=Sp, Hq=Hq, Hkv=Hkv, D=D,
                             ms=t, bytes_moved=moved, GBps=moved / t / 1e6,
                             copy_ms=t_ref, copy_GBps=ref_moved / t_ref / 1e6,
                             ratio_vs_copy=(moved / t) / (ref_moved / t_ref)))
            print(f"[kernels] {label:28s} {kernel:16s} {t*1e3:8.1f} us  {moved/t/1e6:7.0f} GB/s  "
                  f"(copy {ref_moved/t_ref/1e6:7.0f} GB/s)", flush=True)
        write_results(args.out, rows, meta)

    # ---------------------------------------------- 2. fused exchange vs torch (P = 1)
    if not dist.is_initialized():
        store = dist.HashStore()
        if args.smoke:
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        else:
            dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=dev)
    group = dist.group.WORLD
    engine = fused.get_engine(group, 1, 0, dev)
    shapes = [(1, 32768, 32, 8, 128)] + ([] if args.quick else [(2, 16384, 16, 16, 64)])
    for B, S, Hq, Hkv, D in ([(2, 16, 4, 2, 16)] if args.smoke else shapes):
        q = torch.randn(B, S, Hq, D, device=dev, dtype=dtype)
        k = torch.randn(B, S, Hkv, D, device=dev, dtype=dtype)
        v = torch.randn(B, S, Hkv, D, device=dev, dtype=dtype)
        P = 1

        def torch_path():
            outs = []
            for x in (q, k, v):
                H = x.shape[2]
                send = x.reshape(B, S, P, H // P, D).permute(2, 0, 1, 3, 4).contiguous()
                recv = torch.empty_like(send)
                dist.all_to_all_single(recv, send, group=group)
                outs.append(recv.permute(1, 0, 2, 3, 4).reshape(B, P * S, H // P, D).contiguous())
            return outs

        def fused_path():
            return qkv_exchange(q, k, v, engine, [S])

        t_torch = bench(torch_path, args.quick)
        t_fused = bench(fused_path, args.quick)
        moved = (q.numel() + k.numel() + v.numel()) * 2
        # baseline: one device-to-device copy of the same payload, measured in this run
        csrc = torch.randn(moved // 2, device=dev, dtype=dtype)
        cdst = torch.empty_like(csrc)
        t_copy = bench(lambda: cdst.copy_(csrc), args.quick)
        csrc = cdst = None  # free (not del: the closure above reads them)
        rows.append(dict(section="exchange", config=f"P1 B{B} S{S} Hq{Hq} Hkv{Hkv} D{D}", op="qkv seq->heads",
                         P=1, B=B, S_local=S, Hq=Hq, Hkv=Hkv, D=D, torch_ms=t_torch, fused_ms=t_fused,
                         speedup=t_torch / t_fused, bytes_per_tensor_set=moved,
                         fused_payload_GBps=moved / t_fused / 1e6, torch_payload_GBps=moved / t_torch / 1e6,
                         copy_ms=t_copy, copy_GBps=moved / t_copy / 1e6, fused_vs_copy=t_copy / t_fused))
        print(f"[exchange] B{B} S{S} Hq{Hq} Hkv{Hkv}: torch {t_torch*1e3:.1f} us, fused {t_fused*1e3:.1f} us "
              f"({t_torch/t_fused:.2f}x); payload {moved/t_fused/1e6:.0f} GB/s vs D2D copy "
              f"{moved/t_copy/1e6:.0f} GB/s", flush=True)
        write_results(args.out, rows, meta)

    write_results(args.out, rows, meta)
    fused.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
