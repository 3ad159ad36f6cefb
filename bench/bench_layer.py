#!/usr/bin/env python
"""One Ulysses attention layer, forward + backward, with and without overlap.

Measured (P = 1, one GPU, one-rank NCCL engine): the fused layer with one chunk (no
overlap) and with 2 / 4 chunks, next to the Triton path (torch exchange + Triton
attention), and the pieces the P = 8 model needs, measured on this GPU at the P = 8
per-rank shapes: the attention forward/backward over `[B, S, Hq/8, D]` (the whole
sequence, one rank's heads) and the pack/unpack kernels of the P = 8 layouts.

Modelled (P = 8, NVLink 450 GB/s per direction): bench/MODEL.md explains the model; the
all-to-all time is the bytes each rank sends to other ranks divided by the link rate
plus a fixed latency, and the overlapped time comes from simulating the two streams
chunk by chunk. The self-attention block adds this rank's projection GEMMs (measured) and
compares the plain composition with UlyssesSelfAttention's fused layer, whose projections
overlap the exchanges. `--link-gbps` models another link. Nothing of the P = 8 rows is
measured end to end.

Writes layer.json and layer.md into --out (default $OUT, else bench/results).

    python bench/bench_layer.py [--quick] [--out DIR] [--world P] [--link-gbps G]
"""

import argparse
import json
import math
import os
import sys

import _fused_bench

LINK_GBPS = 450.0       # NVLink (H100/H200 NVSwitch), per direction per GPU
A2A_LATENCY_US = 25.0   # fixed cost per NCCL all-to-all (launch + sync), an assumption


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--world", type=int, default=8, help="modelled SP size")
    p.add_argument("--link-gbps", type=float, default=LINK_GBPS,
                   help="modelled per-direction link rate per GPU (450: NVLink 4; ~50: 400 Gb/s InfiniBand)")
    _fused_bench.add_smoke_flag(p)
    return p.parse_args()


def bench(fn, quick):
    return _fused_bench.bench(fn, *((5, 30) if quick else (20, 100)))


def a2a_ms(offrank_bytes, link_gbps):
    return offrank_bytes / (link_gbps * 1e9) * 1e3 + A2A_LATENCY_US * 1e-3


def run_streams(ops):
    """Finishing time (ms) of in-order CUDA streams. ops: (name, stream, ms, deps) in the
    order the host issues them; an op starts when its stream is free and its deps are done."""
    end, free = {}, {}
    for name, stream, ms, deps in ops:
        start = max([free.get(stream, 0.0)] + [end[d] for d in deps])
        end[name] = free[stream] = start + ms
    return max(end.values())


def attention_ops(chunks, comm_in, compute, comm_out, after=()):
    """The fused attention pipeline (ulysses_kernels/fused/pipeline.py), per-chunk costs =
    totals / C: comm packs and sends every chunk, compute runs chunk c's attention after its
    exchange, comm returns chunk c after its attention. `after`: ops the first exchange
    waits for."""
    ops = [(f"in{c}", "comm", comm_in / chunks, list(after)) for c in range(chunks)]
    for c in range(chunks):
        ops.append((f"attn{c}", "compute", compute / chunks, [f"in{c}"]))
        ops.append((f"out{c}", "comm", comm_out / chunks, [f"attn{c}"]))
    return ops


def simulate(chunks, comm_in, compute, comm_out):
    """The attention op alone (bench/MODEL.md, "With overlap")."""
    return run_streams(attention_ops(chunks, comm_in, compute, comm_out))


def simulate_block(chunks, gemm_in, comm_in, compute, comm_out, gemm_out, overlap_projections, gemm_mid=0.0):
    """A self-attention block: projection GEMMs in and out around the attention pipeline.
    Plain composition: all of gemm_in and gemm_mid, then the attention op, then all of
    gemm_out. The fused layer (ulysses_kernels/fused/layer.py): chunk c's input GEMM precedes
    chunk c's exchange, gemm_mid (dW_o in the backward) follows the input GEMMs, and chunk
    c's output GEMM runs after chunk c+1's attention has been issued."""
    if not overlap_projections:
        ops = [("gin", "compute", gemm_in + gemm_mid, [])]
        ops += attention_ops(chunks, comm_in, compute, comm_out, after=["gin"])
        ops.append(("gout", "compute", gemm_out, [f"out{c}" for c in range(chunks)]))
        return run_streams(ops)
    ops = []
    for c in range(chunks):
        ops.append((f"gin{c}", "compute", gemm_in / chunks, []))
        ops.append((f"in{c}", "comm", comm_in / chunks, [f"gin{c}"]))
    ops.append(("gmid", "compute", gemm_mid, []))
    for c in range(chunks):
        ops.append((f"attn{c}", "compute", compute / chunks, [f"in{c}"]))
        ops.append((f"out{c}", "comm", comm_out / chunks, [f"attn{c}"]))
        if c:
            ops.append((f"gout{c - 1}", "compute", gemm_out / chunks, [f"out{c - 1}"]))
    ops.append((f"gout{chunks - 1}", "compute", gemm_out / chunks, [f"out{chunks - 1}"]))
    return run_streams(ops)


def write_results(args, meta, measured, blocks, modelled):
    """layer.json and layer.md with the rows so far (called after every section and model
    row: a later failure or a time limit keeps what was measured)."""
    P8 = args.world
    with open(os.path.join(args.out, "layer.json"), "w") as f:
        json.dump(dict(meta=meta, measured=measured, blocks=blocks, modelled=modelled), f, indent=1)
    with open(os.path.join(args.out, "layer.md"), "w") as f:
        f.write(f"# Ulysses attention layer, forward + backward ({meta['device']}, {meta['dtype']})\n\n")
        f.write("## Measured, P = 1 (one-rank NCCL engine)\n\n| B | S | Hq/Hkv | D | triton path (ms) | "
                "fused 1 chunk (ms) | fused 2 chunks (ms) | fused 4 chunks (ms) | fused TFLOP/s |\n"
                "|---|---|---|---|---|---|---|---|---|\n")
        for r in measured:
            f.write(f"| {r['B']} | {r['S']} | {r['Hq']}/{r['Hkv']} | {r['D']} | {r['triton_path_ms']:.2f} | "
                    f"{r['fused_c1_ms']:.2f} | {r['fused_c2_ms']:.2f} | {r['fused_c4_ms']:.2f} | "
                    f"{r['fused_c1_TFLOPs']:.0f} |\n")
        f.write("\n## Self-attention block (UlyssesSelfAttention), P = 1, forward + backward\n\n"
                "Projections inside the exchange pipeline (overlap) vs QKV GEMM -> fused attention -> output "
                "GEMM. At P = 1 there is nothing to hide: this is the cost of the chunked projections.\n\n"
                "| B | S | hidden | Hq/Hkv | D | overlap_projections | chunks | ms |\n|---|---|---|---|---|---|---|---|\n")
        for r in blocks:
            f.write(f"| {r['B']} | {r['S']} | {r['hidden']} | {r['Hq']}/{r['Hkv']} | {r['D']} | "
                    f"{r['overlap_projections']} | {r['chunks']} | {r['ms']:.2f} |\n")
        f.write(f"\n## Modelled, P = {P8}, link {args.link_gbps:.0f} GB/s per direction (see bench/MODEL.md)\n\n"
                "Attention and pack/unpack times are measured on this GPU at the per-rank P = 8 shapes; the "
                "all-to-all times are modelled.\n\n| S (global) | attn fwd+bwd (ms) | a2a qkv (ms) | a2a out (ms) | "
                "no overlap (ms) | overlap 2 chunks (ms) | overlap 4 chunks (ms) | comm share w/o overlap |\n"
                "|---|---|---|---|---|---|---|---|\n")
        for r in modelled:
            f.write(f"| {r['S']} | {r['attn_fwd_ms'] + r['attn_bwd_ms']:.2f} | {r['a2a_qkv_ms']:.3f} | "
                    f"{r['a2a_out_ms']:.3f} | {r['no_overlap_ms']:.2f} | {r['overlap_c2_ms']:.2f} | "
                    f"{r['overlap_c4_ms']:.2f} | {r['comm_fraction_no_overlap']:.1%} |\n")
        f.write("\nThe whole self-attention block (projection GEMMs measured at the per-rank shapes, hidden = "
                "Hq * D): plain composition (only the attention chunks overlap the exchanges) vs "
                "UlyssesSelfAttention's fused layer (the projections overlap them too).\n\n"
                "| S (global) | qkv GEMM (ms) | out GEMM (ms) | plain, 1 chunk (ms) | plain, 4 chunks (ms) | "
                "fused layer, 2 chunks (ms) | fused layer, 4 chunks (ms) |\n|---|---|---|---|---|---|---|\n")
        for r in modelled:
            f.write(f"| {r['S']} | {r['gemm_qkv_ms']:.3f} | {r['gemm_o_ms']:.3f} | {r['block_plain_c1_ms']:.2f} | "
                    f"{r['block_plain_c4_ms']:.2f} | {r['block_fused_c2_ms']:.2f} | {r['block_fused_c4_ms']:.2f} |\n")


def main():
    args = parse_args()
    if _fused_bench.dry_run_requested(args):
        return _fused_bench.dry_run("bench_layer", args)
    started = _fused_bench.start("bench_layer", args)
    if started is None:
        return 2
    dev, dtype, meta = started
    import torch

    import ulysses_kernels as uk
    from ulysses_kernels import env, fused
    from ulysses_kernels.triton import flash_attention_backward, flash_attention_forward
    ops = _fused_bench.ops()
    esize = torch.empty((), dtype=dtype).element_size()
    P8 = args.world
    measured, blocks, modelled = [], [], []
    meta.update(link_GBps=args.link_gbps, a2a_latency_us=A2A_LATENCY_US,
                triton_autotune=os.environ.get("ULYSSES_KERNELS_TRITON_AUTOTUNE", "1"))

    # ----------------------------------------------------------- measured, P = 1
    cases = [(1, 8192, 32, 8, 128, True)] + ([] if args.quick else [(1, 16384, 32, 8, 128, True)])
    if args.smoke:
        cases = [(1, 24, 8, 4, 16, True)]
    for B, S, Hq, Hkv, D, causal in cases:
        q = torch.randn(B, S, Hq, D, device=dev, dtype=dtype, requires_grad=True)
        k = torch.randn(B, S, Hkv, D, device=dev, dtype=dtype, requires_grad=True)
        v = torch.randn(B, S, Hkv, D, device=dev, dtype=dtype, requires_grad=True)
        do = torch.randn(B, S, Hq, D, device=dev, dtype=dtype)
        scale = 1.0 / math.sqrt(D)

        def layer(chunks):
            def run():
                os.environ[env.NUM_CHUNKS.name] = str(chunks)
                out = uk.ulysses_attention(q, k, v, causal=causal, softmax_scale=scale, seq_lens=[S],
                                           backend="fused")
                torch.autograd.grad(out, (q, k, v), do)
            return run

        def triton_layer():
            out = uk.ulysses_attention(q, k, v, causal=causal, seq_lens=[S], backend="triton")
            torch.autograd.grad(out, (q, k, v), do)

        row = dict(B=B, S=S, Hq=Hq, Hkv=Hkv, D=D, causal=causal, P=1)
        row["triton_path_ms"] = bench(triton_layer, args.quick)
        for c in (1, 2, 4):
            row[f"fused_c{c}_ms"] = bench(layer(c), args.quick)
        os.environ.pop(env.NUM_CHUNKS.name, None)
        flops = 4 * B * Hq * S * S * D * (0.5 if causal else 1.0) * 3.5
        row["fused_c1_TFLOPs"] = flops / row["fused_c1_ms"] / 1e9
        measured.append(row)
        print(f"[P=1] B{B} S{S}: triton path {row['triton_path_ms']:.2f} ms, fused c1 {row['fused_c1_ms']:.2f} ms, "
              f"c2 {row['fused_c2_ms']:.2f} ms, c4 {row['fused_c4_ms']:.2f} ms", flush=True)
    write_results(args, meta, measured, blocks, modelled)

    # The whole self-attention block (QKV projection, attention, output projection) as
    # UlyssesSelfAttention: projections inside the exchange pipeline vs the plain
    # composition, one chunk and four. At P = 1 nothing is exchanged between GPUs, so this
    # measures what the chunked projections cost, not what they hide.
    B, S, hidden, Hq, Hkv, D = (1, 24, 64, 8, 4, 16) if args.smoke else (1, 8192, 4096, 32, 8, 128)
    torch.manual_seed(0)
    block = uk.UlyssesSelfAttention(hidden, Hq, Hkv, D, causal=True, backend="fused", device=dev, dtype=dtype)
    x = torch.randn(B, S, hidden, device=dev, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    params = [x] + list(block.parameters())

    def block_step():
        torch.autograd.grad(block(x, seq_lens=[S]), params, dy)

    for overlap in (False, True):
        for chunks in (1, 4):
            block.overlap_projections = overlap
            os.environ[env.NUM_CHUNKS.name] = str(chunks)
            ms = bench(block_step, args.quick)
            blocks.append(dict(B=B, S=S, hidden=hidden, Hq=Hq, Hkv=Hkv, D=D, P=1, overlap_projections=overlap,
                               chunks=chunks, ms=ms))
            print(f"[P=1 block] overlap_projections={overlap} chunks={chunks}: {ms:.2f} ms", flush=True)
    os.environ.pop(env.NUM_CHUNKS.name, None)
    block = x = dy = params = None
    fused.close()
    write_results(args, meta, measured, blocks, modelled)

    # --------------------------------- P = 8: measured pieces + modelled exchange
    seqs = [16384, 65536] if args.quick else [16384, 65536, 131072]
    B, Hq, Hkv, D, causal = 1, 32, 8, 128, True
    if args.smoke:
        seqs, Hq, Hkv, D = [64], 16, 8, 16
    heads = uk.HeadPlan(P8, Hq, Hkv)
    hl_q, hl_kv, hc = heads.local_q_heads, heads.local_kv_heads, heads.channels
    for S in seqs:
        Sp = S // P8
        # attention of one rank at P = 8: the whole sequence, Hq/P query heads
        qh = torch.randn(B, S, hl_q, D, device=dev, dtype=dtype)
        kh = torch.randn(B, S, hl_kv, D, device=dev, dtype=dtype)
        vh = torch.randn(B, S, hl_kv, D, device=dev, dtype=dtype)
        out, lse = flash_attention_forward(qh, kh, vh, causal=causal, softmax_scale=None)
        doh = torch.randn_like(out)
        t_fwd = bench(lambda: flash_attention_forward(qh, kh, vh, causal=causal, softmax_scale=None, out=out),
                      args.quick)
        t_bwd = bench(lambda: flash_attention_backward(doh, qh, kh, vh, out, lse, causal=causal, softmax_scale=None),
                      args.quick)
        # pack / unpack kernels of this rank's P = 8 layouts (local work)
        q = torch.randn(B, Sp, Hq, D, device=dev, dtype=dtype)
        k = torch.randn(B, Sp, Hkv, D, device=dev, dtype=dtype)
        send = ops.pack([q, k, k], P8)
        t_pack = bench(lambda: ops.pack_into([q, k, k], send, [0, 0, 0], [hl_q, hl_kv, hl_kv]), args.quick)
        orecv = torch.randn(P8, B, Sp, hl_q, D, device=dev, dtype=dtype)
        oq = torch.empty_like(q)
        t_unpack = bench(lambda: ops.unpack_into(orecv, [oq], [0], [hl_q]), args.quick)
        dsend = torch.empty(P8, B, Sp, hl_q, D, device=dev, dtype=dtype)
        t_dpack = bench(lambda: ops.pack_into([oq], dsend, [0], [hl_q]), args.quick)
        grads = [torch.empty_like(q), torch.empty_like(k), torch.empty_like(k)]
        t_gunpack = bench(lambda: ops.unpack_into(send, grads, [0, 0, 0], [hl_q, hl_kv, hl_kv]), args.quick)
        # bytes each rank sends to the other P-1 ranks
        qkv_bytes = B * Sp * hc * D * esize * (P8 - 1)
        out_bytes = B * Sp * hl_q * D * esize * (P8 - 1)
        a_qkv, a_out = a2a_ms(qkv_bytes, args.link_gbps), a2a_ms(out_bytes, args.link_gbps)
        fwd_in, fwd_out = t_pack + a_qkv, a_out + t_unpack
        bwd_in, bwd_out = t_dpack + a2a_ms(out_bytes, args.link_gbps), a2a_ms(qkv_bytes, args.link_gbps) + t_gunpack
        row = dict(P=P8, B=B, S=S, S_local=Sp, Hq=Hq, Hkv=Hkv, D=D, causal=causal,
                   attn_fwd_ms=t_fwd, attn_bwd_ms=t_bwd, pack_ms=t_pack, unpack_ms=t_unpack,
                   dpack_ms=t_dpack, grad_unpack_ms=t_gunpack, a2a_qkv_ms=a_qkv, a2a_out_ms=a_out,
                   qkv_bytes_offrank=qkv_bytes, out_bytes_offrank=out_bytes)
        row["no_overlap_ms"] = fwd_in + t_fwd + fwd_out + bwd_in + t_bwd + bwd_out
        for c in (2, 4):
            row[f"overlap_c{c}_ms"] = (simulate(c, fwd_in, t_fwd, fwd_out) + simulate(c, bwd_in, t_bwd, bwd_out))
        row["comm_fraction_no_overlap"] = (fwd_in + fwd_out + bwd_in + bwd_out) / row["no_overlap_ms"]
        # The self-attention block around it (hidden = Hq * D): this rank's projection GEMMs,
        # measured. Forward: qkv GEMM in, output GEMM out. Backward: dO = dy W_o in, dW_o in
        # the middle, dx and dW_qkv out.
        hidden = Hq * D
        xg = torch.randn(B * Sp, hidden, device=dev, dtype=dtype)
        w_qkv = torch.randn((Hq + 2 * Hkv) * D, hidden, device=dev, dtype=dtype) / math.sqrt(hidden)
        w_o = torch.randn(hidden, Hq * D, device=dev, dtype=dtype) / math.sqrt(hidden)
        t_gq = bench(lambda: torch.nn.functional.linear(xg, w_qkv), args.quick)
        t_go = bench(lambda: torch.nn.functional.linear(xg, w_o), args.quick)
        xg = w_qkv = w_o = None  # free (not del: the closures read them)

        def block_ms(overlap, c):
            return (simulate_block(c, t_gq, fwd_in, t_fwd, fwd_out, t_go, overlap)
                    + simulate_block(c, t_go, bwd_in, t_bwd, bwd_out, 2 * t_gq, overlap, gemm_mid=t_go))

        row.update(gemm_qkv_ms=t_gq, gemm_o_ms=t_go, block_plain_c1_ms=block_ms(False, 1))
        for c in (2, 4):
            row[f"block_plain_c{c}_ms"] = block_ms(False, c)  # attention chunks overlap, projections do not
            row[f"block_fused_c{c}_ms"] = block_ms(True, c)   # the fused layer: projections overlap too
        modelled.append(row)
        print(f"[P={P8} model] S{S}: attn fwd {t_fwd:.2f} bwd {t_bwd:.2f} ms, a2a qkv {a_qkv:.3f} ms; "
              f"no overlap {row['no_overlap_ms']:.2f} ms, overlap c2 {row['overlap_c2_ms']:.2f}, "
              f"c4 {row['overlap_c4_ms']:.2f} ms", flush=True)
        write_results(args, meta, measured, blocks, modelled)

    write_results(args, meta, measured, blocks, modelled)
    return 0


if __name__ == "__main__":
    sys.exit(main())
