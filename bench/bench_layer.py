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
chunk by chunk. Nothing of the P = 8 rows is measured end to end.

Writes layer.json and layer.md into --out (default $OUT, else bench/results).

    python bench/bench_layer.py [--quick] [--out DIR]
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
    return p.parse_args()


def bench(fn, quick):
    return _fused_bench.bench(fn, *((5, 30) if quick else (20, 100)))


def a2a_ms(offrank_bytes):
    return offrank_bytes / (LINK_GBPS * 1e9) * 1e3 + A2A_LATENCY_US * 1e-3


def simulate(chunks, comm_in, compute, comm_out):
    """Two in-order streams: comm runs in_0..in_{C-1} then out_0..out_{C-1} (out_c after
    compute_c), compute runs compute_c after in_c. Per-chunk times are totals / C.
    Returns the finishing time (ms)."""
    ci, cp, co = comm_in / chunks, compute / chunks, comm_out / chunks
    t_comm = 0.0
    in_done = []
    for _ in range(chunks):
        t_comm += ci
        in_done.append(t_comm)
    t_comp = 0.0
    comp_done = []
    for c in range(chunks):
        t_comp = max(t_comp, in_done[c]) + cp
        comp_done.append(t_comp)
    for c in range(chunks):
        t_comm = max(t_comm, comp_done[c]) + co
    return max(t_comm, t_comp)


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = _fused_bench.fused_device("bench_layer")
    if dev is None:
        return 2
    import torch
    import ulysses_kernels as uk
    from ulysses_kernels.triton import flash_attention_backward, flash_attention_forward
    from ulysses_kernels import fused
    ops = torch.ops.ulysses_kernels
    dtype = torch.bfloat16
    esize = 2
    P8 = args.world
    measured, modelled = [], []

    # ----------------------------------------------------------- measured, P = 1
    cases = [(1, 8192, 32, 8, 128, True)] + ([] if args.quick else [(1, 16384, 32, 8, 128, True)])
    for B, S, Hq, Hkv, D, causal in cases:
        q = torch.randn(B, S, Hq, D, device=dev, dtype=dtype, requires_grad=True)
        k = torch.randn(B, S, Hkv, D, device=dev, dtype=dtype, requires_grad=True)
        v = torch.randn(B, S, Hkv, D, device=dev, dtype=dtype, requires_grad=True)
        do = torch.randn(B, S, Hq, D, device=dev, dtype=dtype)
        scale = 1.0 / math.sqrt(D)

        def layer(chunks):
            def run():
                out = fused.ulysses_attention(q, k, v, group=None, rank=0, seq_lens=[S], causal=causal,
                                              softmax_scale=scale, num_chunks=chunks)
                torch.autograd.grad(out, (q, k, v), do)
            return run

        def triton_layer():
            out = uk.ulysses_attention(q, k, v, causal=causal, seq_lens=[S], backend="triton")
            torch.autograd.grad(out, (q, k, v), do)

        row = dict(B=B, S=S, Hq=Hq, Hkv=Hkv, D=D, causal=causal, P=1)
        row["triton_path_ms"] = bench(triton_layer, args.quick)
        for c in (1, 2, 4):
            row[f"fused_c{c}_ms"] = bench(layer(c), args.quick)
        flops = 4 * B * Hq * S * S * D * (0.5 if causal else 1.0) * 3.5
        row["fused_c1_TFLOPs"] = flops / row["fused_c1_ms"] / 1e9
        measured.append(row)
        print(f"[P=1] B{B} S{S}: triton path {row['triton_path_ms']:.2f} ms, fused c1 {row['fused_c1_ms']:.2f} ms, "
              f"c2 {row['fused_c2_ms']:.2f} ms, c4 {row['fused_c4_ms']:.2f} ms", flush=True)
    # The whole self-attention block (QKV projection, attention, output projection) as
    # UlyssesSelfAttention: projections inside the exchange pipeline vs the plain
    # composition, one chunk and four. At P = 1 nothing is exchanged between GPUs, so this
    # measures what the chunked projections cost, not what they hide.
    blocks = []
    B, S, hidden, Hq, Hkv, D = 1, 8192, 4096, 32, 8, 128
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
            os.environ["ULYSSES_KERNELS_NUM_CHUNKS"] = str(chunks)
            ms = bench(block_step, args.quick)
            blocks.append(dict(B=B, S=S, hidden=hidden, Hq=Hq, Hkv=Hkv, D=D, P=1, overlap_projections=overlap,
                               chunks=chunks, ms=ms))
            print(f"[P=1 block] overlap_projections={overlap} chunks={chunks}: {ms:.2f} ms", flush=True)
    os.environ.pop("ULYSSES_KERNELS_NUM_CHUNKS", None)
    block = x = dy = params = None
    fused.close()

    # --------------------------------- P = 8: measured pieces + modelled exchange
    seqs = [16384, 65536] if args.quick else [16384, 65536, 131072]
    B, Hq, Hkv, D, causal = 1, 32, 8, 128, True
    hl_q, hl_kv = Hq // P8, (Hkv // P8 if Hkv % P8 == 0 else 1)
    hc = hl_q + 2 * hl_kv
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
        a_qkv, a_out = a2a_ms(qkv_bytes), a2a_ms(out_bytes)
        fwd_in, fwd_out = t_pack + a_qkv, a_out + t_unpack
        bwd_in, bwd_out = t_dpack + a2a_ms(out_bytes), a2a_ms(qkv_bytes) + t_gunpack
        row = dict(P=P8, B=B, S=S, S_local=Sp, Hq=Hq, Hkv=Hkv, D=D, causal=causal,
                   attn_fwd_ms=t_fwd, attn_bwd_ms=t_bwd, pack_ms=t_pack, unpack_ms=t_unpack,
                   dpack_ms=t_dpack, grad_unpack_ms=t_gunpack, a2a_qkv_ms=a_qkv, a2a_out_ms=a_out,
                   qkv_bytes_offrank=qkv_bytes, out_bytes_offrank=out_bytes)
        row["no_overlap_ms"] = fwd_in + t_fwd + fwd_out + bwd_in + t_bwd + bwd_out
        for c in (2, 4):
            row[f"overlap_c{c}_ms"] = (simulate(c, fwd_in, t_fwd, fwd_out) + simulate(c, bwd_in, t_bwd, bwd_out))
        row["comm_fraction_no_overlap"] = (fwd_in + fwd_out + bwd_in + bwd_out) / row["no_overlap_ms"]
        modelled.append(row)
        print(f"[P={P8} model] S{S}: attn fwd {t_fwd:.2f} bwd {t_bwd:.2f} ms, a2a qkv {a_qkv:.3f} ms; "
              f"no overlap {row['no_overlap_ms']:.2f} ms, overlap c2 {row['overlap_c2_ms']:.2f}, "
              f"c4 {row['overlap_c4_ms']:.2f} ms", flush=True)

    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, dtype=str(dtype),
                link_GBps=LINK_GBPS, a2a_latency_us=A2A_LATENCY_US,
                triton_autotune=os.environ.get("ULYSSES_KERNELS_TRITON_AUTOTUNE", "1"))
    with open(os.path.join(args.out, "layer.json"), "w") as f:
        json.dump(dict(meta=meta, measured=measured, blocks=blocks, modelled=modelled), f, indent=1)
    with open(os.path.join(args.out, "layer.md"), "w") as f:
        f.write(f"# Ulysses attention layer, forward + backward ({meta['device']}, bf16)\n\n")
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
        f.write(f"\n## Modelled, P = {P8} on NVLink ({LINK_GBPS:.0f} GB/s per direction; see bench/MODEL.md)\n\n"
                "Attention and pack/unpack times are measured on this GPU at the per-rank P = 8 shapes; the "
                "all-to-all times are modelled.\n\n| S (global) | attn fwd+bwd (ms) | a2a qkv (ms) | a2a out (ms) | "
                "no overlap (ms) | overlap 2 chunks (ms) | overlap 4 chunks (ms) | comm share w/o overlap |\n"
                "|---|---|---|---|---|---|---|---|\n")
        for r in modelled:
            f.write(f"| {r['S']} | {r['attn_fwd_ms'] + r['attn_bwd_ms']:.2f} | {r['a2a_qkv_ms']:.3f} | "
                    f"{r['a2a_out_ms']:.3f} | {r['no_overlap_ms']:.2f} | {r['overlap_c2_ms']:.2f} | "
                    f"{r['overlap_c4_ms']:.2f} | {r['comm_fraction_no_overlap']:.1%} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
