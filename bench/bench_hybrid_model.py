"""Modelled attention time of pure Ulysses, pure ring and the Ulysses x Ring hybrid for a
7-8B model at 128K-1M tokens, on one node of 8 GPUs and on 2 nodes x 8 (bench/MODEL.md,
"Ulysses x Ring").

Nothing here is measured: the attention throughputs are published figures (sources in
`SOURCES`, passed on the command line to use a measured value instead), the links are
the H100/H200 NVLink and one 400 Gb/s NIC per GPU, and the byte counts are those of
ulysses_kernels' own exchanges (`ulysses_kernels.layout.place_heads` for the head
placement). The model is per layer and per rank, forward + backward, bf16.

    python bench/bench_hybrid_model.py [--out DIR] [--fwd-tflops 620 --bwd-tflops 561]
"""

import argparse
import os
import sys
from dataclasses import asdict, dataclass
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _results import write_results  # noqa: E402 (bench/ is the script's folder)

from ulysses_kernels.layout import head_plan_error, place_heads  # noqa: E402

SOURCES = {
    "fwd_tflops": "620 TFLOP/s: FlashAttention-3 forward, H100 SXM5, bf16, head dim 128, 16k tokens "
                  "(pytorch/benchmark PR #2391 test plan: 620.73 TFLOP/s at (1, 16, 16384, 128); "
                  "FlashAttention-3 paper, arXiv:2407.08608: up to 740)",
    "bwd_tflops": "561 TFLOP/s: FlashAttention-3 backward, H100 SXM5, bf16, head dim 128, 16k tokens "
                  "(arXiv:2407.08608, figure 'Attention backward speed, head dim 128')",
    "nvlink_gbps": "450 GB/s per direction per GPU: NVLink 4 through NVSwitch (H100/H200 SXM, 900 GB/s total)",
    "ib_gbps": "50 GB/s per direction per GPU: one 400 Gb/s InfiniBand NDR / ConnectX-7 port per GPU",
}
MODELS = {  # query heads, KV heads, head dim, layers (from the models' config.json)
    "llama-3-8b": (32, 8, 128, 32),
    "qwen2.5-7b": (28, 4, 128, 28),
}
A2A_LATENCY_S = 25e-6   # fixed cost of one all-to-all (as in bench/MODEL.md)
P2P_LATENCY_S = 15e-6   # fixed cost of one ring step's send/recv
BF16, FP32 = 2, 4


@dataclass
class Row:
    model: str
    gpus: int
    nodes: int
    seq_len: int
    ulysses: int
    ring: int
    valid: bool
    why_not: Optional[str] = None
    a2a_gb: float = 0.0            # all-to-all bytes this rank sends to others, fwd + bwd, per layer
    ring_gb: float = 0.0           # ring bytes this rank sends, fwd + bwd, per layer
    compute_ms: float = 0.0        # attention forward + backward of this rank
    a2a_ms: float = 0.0            # not overlapped (the Triton path runs the exchanges serially)
    ring_exposed_ms: float = 0.0   # ring time not hidden behind the block computations
    layer_ms: float = 0.0          # compute + a2a + exposed ring
    step_attention_s: float = 0.0  # layer_ms x layers: the attention share of one training step


def _a2a_seconds(bytes_to_others, ulysses, per_node, nvlink, ib):
    """One all-to-all over `ulysses` consecutive ranks: equal chunks to every peer, the
    off-node ones over the NIC, the on-node ones over NVLink, both directions in parallel."""
    peers = ulysses - 1
    if peers == 0:
        return 0.0
    off_node = max(0, ulysses - per_node)
    on_node = peers - off_node
    chunk = bytes_to_others / peers
    return max(on_node * chunk / nvlink, off_node * chunk / ib) + A2A_LATENCY_S


def model_row(name, gpus, per_node, S, ulysses, ring, fwd_tflops, bwd_tflops, nvlink, ib) -> Row:
    hq, hkv, d, layers = MODELS[name]
    row = Row(name, gpus, gpus // per_node, S, ulysses, ring, True)
    err = head_plan_error(ulysses, hq, hkv)
    if err:
        row.valid, row.why_not = False, err
        return row
    q, kv = place_heads(hq, ulysses), place_heads(hkv, ulysses)
    s_local = S / gpus
    channels = q.local + 2 * kv.local
    # the four exchanges (bench/MODEL.md): q|k|v and dq|dk|dv carry `channels`, out and dO the query heads
    a2a_bytes = 2 * (ulysses - 1) * s_local * d * BF16 * (channels + q.local)
    row.a2a_gb = a2a_bytes / 1e9
    link_ring = ib if (ring > 1 and gpus > per_node) else nvlink  # a ring over strided ranks crosses nodes
    kv_step = 2 * (S / ring) * kv.local * d * BF16                  # K and V of one portion, unexpanded
    dkv_step = 2 * (S / ring) * kv.local * d * FP32                 # their fp32 gradient accumulator
    row.ring_gb = ((ring - 1) * 2 * kv_step + ring * dkv_step) / 1e9 if ring > 1 else 0.0
    flops_fwd = 2 * S * S * d * hq / gpus                            # causal: half of 4 S^2 D per head
    t_fwd, t_bwd = flops_fwd / (fwd_tflops * 1e12), 2.5 * flops_fwd / (bwd_tflops * 1e12)
    row.compute_ms = (t_fwd + t_bwd) * 1e3
    row.a2a_ms = 4 * _a2a_seconds(a2a_bytes / 4, ulysses, per_node, nvlink, ib) * 1e3 if ulysses > 1 else 0.0
    if ring > 1:  # each step overlaps its transfers with its block (zigzag: equal work per step)
        kv_t = kv_step / link_ring + P2P_LATENCY_S
        dkv_t = dkv_step / link_ring + P2P_LATENCY_S
        fwd = (ring - 1) * max(t_fwd / ring, kv_t) + t_fwd / ring
        bwd = (ring - 1) * max(t_bwd / ring, kv_t + dkv_t) + t_bwd / ring + dkv_t  # last dK/dV goes home
        row.ring_exposed_ms = (fwd + bwd - t_fwd - t_bwd) * 1e3
    row.layer_ms = row.compute_ms + row.a2a_ms + row.ring_exposed_ms
    row.step_attention_s = row.layer_ms * layers / 1e3
    return row


def layouts(gpus):
    out, r = [], 1
    while r <= gpus:
        if gpus % r == 0:
            out.append((gpus // r, r))
        r *= 2
    return out


def table(rows):
    lines = ["| model | GPUs | S | Ulysses x ring | a2a GB | ring GB | compute ms | a2a ms | ring exposed ms | "
             "layer ms | vs best | attention per step s |", "|" + "---|" * 12]
    best = {}
    for r in rows:
        if r.valid:
            key = (r.model, r.gpus, r.seq_len)
            best[key] = min(best.get(key, float("inf")), r.layer_ms)
    for r in rows:
        gpus = f"{r.gpus} ({r.nodes} node{'s' if r.nodes > 1 else ''})"
        if not r.valid:
            lines.append(f"| {r.model} | {gpus} | {r.seq_len // 1024}K | {r.ulysses} x {r.ring} | n/a: "
                         f"{r.why_not} |" + " |" * 7)
            continue
        ratio = r.layer_ms / best[(r.model, r.gpus, r.seq_len)]
        lines.append(f"| {r.model} | {gpus} | {r.seq_len // 1024}K | {r.ulysses} x {r.ring} | {r.a2a_gb:.2f} | "
                     f"{r.ring_gb:.2f} | {r.compute_ms:.1f} | {r.a2a_ms:.2f} | {r.ring_exposed_ms:.2f} | "
                     f"{r.layer_ms:.1f} | {ratio:.3f} | {r.step_attention_s:.1f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for hybrid_model.{md,json}")
    parser.add_argument("--fwd-tflops", type=float, default=620.0)
    parser.add_argument("--bwd-tflops", type=float, default=561.0)
    parser.add_argument("--nvlink-gbps", type=float, default=450.0)
    parser.add_argument("--ib-gbps", type=float, default=50.0)
    parser.add_argument("--lengths", type=int, nargs="+", default=[k * 1024 for k in (32, 128, 512, 1024)])
    parser.add_argument("--smoke", action="store_true", help="accepted for the bench smoke tests (it is fast)")
    args = parser.parse_args(argv)
    rows = []
    for name in MODELS:
        for gpus in (8, 16):
            for S in args.lengths:
                for ulysses, ring in layouts(gpus):
                    rows.append(model_row(name, gpus, 8, S, ulysses, ring, args.fwd_tflops, args.bwd_tflops,
                                          args.nvlink_gbps * 1e9, args.ib_gbps * 1e9))
    sources = "\n".join(f"- {k}: {v}" for k, v in SOURCES.items())
    md = (f"# Modelled attention layer time: Ulysses, ring, Ulysses x Ring (not measured)\n\n"
          f"Per rank, per layer, forward + backward, bf16, causal, batch 1; 8 GPUs per node.\n"
          f"Inputs: fwd {args.fwd_tflops:g} TFLOP/s, bwd {args.bwd_tflops:g} TFLOP/s, NVLink "
          f"{args.nvlink_gbps:g} GB/s, NIC {args.ib_gbps:g} GB/s per GPU.\n\nSources of the defaults:\n{sources}\n\n"
          f"{table(rows)}\n")
    write_results(args.out, "hybrid_model", md, {"sources": SOURCES, "args": vars(args), "rows": [asdict(r) for r in rows]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
