"""Numerics of the Ulysses x Ring hybrid: does the error against float64 grow with the
ring size? (docs/architecture.md, "Ulysses x Ring").

For each input dtype and global length S, one world of 4 ranks runs causal attention
forward + backward as 4 Ulysses x 1 ring (no ring: the single-device attention's error,
the exchanges being exact copies), 2 x 2 and 1 x 4, and prints the relative error
`||x - ref|| / ||ref||` of the output and of dq against float64 attention of the same
inputs. The criterion (`--check`): at every length, the ring's error stays within
`--factor` (2x) of the no-ring error at the same length, so it grows no faster with ring
size than single-device attention's does with the length it covers; the table shows both.

    python bench/ring_numerics.py [--backend reference|triton] [--lengths 512 2048] [--check]
    python bench/ring_numerics.py --dkv-wire [--lengths 4096] [--rings 2 4 8]

`--dkv-wire`: the precision dK/dV travel the ring in (ring/schedule.py, `RingSpec.dkv_wire`):
pure rings of 2 to 8 ranks, the gradients' error against float64 with the partial sums on
the wire in fp32 (the package's choice) and in the input dtype, next to the ring bytes.

On CPU the Triton backend runs in the interpreter (slow: use short lengths). The numbers
are accuracy, not speed; they need no GPU.
"""

import argparse
import json
import os
import sys

import torch


def _errors(rank, world, rings, lengths, dtypes, backend, heads, head_dim):
    import ulysses_kernels as uk
    from ulysses_kernels.reference import reference_attention

    rows = []
    for ring in rings:
        g = uk.init_sequence_parallel(world, ring_size=ring)
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            for S in lengths:
                gen = torch.Generator().manual_seed(S)
                q, k, v, do = (torch.randn(1, S, heads, head_dim, generator=gen) for _ in range(4))
                q64, k64, v64 = (t.double().requires_grad_(True) for t in (q, k, v))
                ref, _ = reference_attention(q64, k64, v64, causal=True)
                ref.backward(do.double())
                shard = lambda t: uk.shard_sequence(t, g.ulysses_group, ring_group=g.ring_group)  # noqa: E731
                local = [shard(t.to(dtype)).detach().requires_grad_(True) for t in (q, k, v)]
                out = uk.ulysses_attention(*local, group=g.ulysses_group, ring_group=g.ring_group, causal=True,
                                           backend=backend)
                out.backward(shard(do.to(dtype)))
                gather = lambda t: uk.gather_sequence(t.detach(), g.ulysses_group, ring_group=g.ring_group)  # noqa: E731
                err = lambda x, r: ((x.double() - r).norm() / r.norm()).item()  # noqa: E731
                rows.append(dict(dtype=dtype_name, S=S, ring=ring, ulysses=world // ring,
                                 out=err(gather(out), ref.detach()), dq=err(gather(local[0].grad), q64.grad)))
    return rows


def _wire_errors(rank, world, S, dtype_name, heads, head_dim):
    """`--dkv-wire`: a pure ring of `world` ranks (Ulysses degree 1), causal, the dK/dV partial
    sums on the wire in the fp32 accumulator (the package's choice) and in the input dtype:
    the gradients' error against float64 and the ring bytes of one backward per rank."""
    import ulysses_kernels as uk
    from ulysses_kernels.reference import reference_attention
    from ulysses_kernels.reference.block_ops import TorchBlockOps
    from ulysses_kernels.ring.schedule import RingSpec, ring_attention

    dtype = getattr(torch, dtype_name)
    g = uk.init_sequence_parallel(world, ring_size=world)
    gen = torch.Generator().manual_seed(S + world)
    q, k, v, do = (torch.randn(1, S, heads, head_dim, generator=gen) for _ in range(4))
    q64, k64, v64 = (t.double().requires_grad_(True) for t in (q, k, v))
    ref, _ = reference_attention(q64, k64, v64, causal=True)
    ref.backward(do.double())
    shard = lambda t: uk.shard_sequence(t, g.ulysses_group, ring_group=g.ring_group)  # noqa: E731
    gather = lambda t: uk.gather_sequence(t.detach(), g.ulysses_group, ring_group=g.ring_group)  # noqa: E731
    err = lambda x, r: ((x.double() - r).norm() / r.norm()).item()  # noqa: E731
    rows = []
    for wire in (torch.float32, dtype):
        spec = RingSpec(g.ring_group, world, g.ring_rank, S, True, head_dim ** -0.5, block_ops=TorchBlockOps,
                        dkv_wire=wire)
        local = [shard(t.to(dtype)).detach().requires_grad_(True) for t in (q, k, v)]
        ring_attention(*local, spec).backward(shard(do.to(dtype)))
        portion = local[1].shape[1]
        kv_bytes = 2 * portion * heads * head_dim * dtype.itemsize
        dkv_bytes = 2 * portion * heads * head_dim * wire.itemsize
        rows.append(dict(dtype=dtype_name, S=S, ring=world, wire=str(wire).replace("torch.", ""),
                         dq=err(gather(local[0].grad), q64.grad), dk=err(gather(local[1].grad), k64.grad),
                         dv=err(gather(local[2].grad), v64.grad),
                         backward_mb=((world - 1) * kv_bytes + world * dkv_bytes) / 1e6,
                         forward_mb=(world - 1) * kv_bytes / 1e6))
    return rows


def _wire_table(rows):
    lines = ["| ring | dK/dV wire | dq rel err | dk rel err | dv rel err | fwd ring MB / rank | bwd ring MB / rank |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['ring']} | {r['wire']} | {r['dq']:.3e} | {r['dk']:.3e} | {r['dv']:.3e} | "
                     f"{r['forward_mb']:.2f} | {r['backward_mb']:.2f} |")
    return "\n".join(lines)


def _table(rows):
    lines = ["| dtype | S | ulysses x ring | out rel err | dq rel err | out / no-ring | dq / no-ring |",
             "|---|---|---|---|---|---|---|"]
    base = {(r["dtype"], r["S"]): r for r in rows if r["ring"] == 1}
    for r in sorted(rows, key=lambda r: (r["dtype"], r["S"], r["ring"])):
        b = base[(r["dtype"], r["S"])]
        lines.append(f"| {r['dtype']} | {r['S']} | {r['ulysses']} x {r['ring']} | {r['out']:.3e} | {r['dq']:.3e} | "
                     f"{r['out'] / b['out']:.2f} | {r['dq'] / b['dq']:.2f} |")
    return "\n".join(lines)


def _failures(rows, factor):
    base = {(r["dtype"], r["S"]): r for r in rows if r["ring"] == 1}
    bad = []
    for r in rows:
        b = base[(r["dtype"], r["S"])]
        for key in ("out", "dq"):
            if r[key] > factor * b[key]:
                bad.append(f"{r['dtype']} S={r['S']} ring {r['ring']}: {key} error {r[key]:.3e} > {factor} x "
                           f"{b[key]:.3e} (no ring)")
    return bad


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="reference", choices=["reference", "triton"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--check", action="store_true", help="exit 1 when the criterion fails")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--dkv-wire", action="store_true",
                        help="instead: pure rings of 2-8 ranks, dK/dV on the wire in fp32 and in the input dtype "
                             "(bfloat16 by default), at the first --lengths entry")
    parser.add_argument("--rings", type=int, nargs="+", default=[2, 3, 4, 5, 6, 7, 8])
    args = parser.parse_args(argv)
    if args.backend == "triton" and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from ulysses_kernels.launch import spawn

    if args.dkv_wire:
        dtype = next((d for d in args.dtypes if d != "float32"), "bfloat16")
        rows = [row for ring in args.rings
                for row in spawn(_wire_errors, ring, args=(args.lengths[0], dtype, args.heads, args.head_dim),
                                 timeout=1800)[0]]
        print(json.dumps(rows, indent=1) if args.json else
              f"pure ring, causal, {dtype}, S {args.lengths[0]}, {args.heads} heads x {args.head_dim}, "
              f"reference block ops\n\n{_wire_table(rows)}")
        return 0
    per_rank = spawn(_errors, 4, args=((1, 2, 4), args.lengths, args.dtypes, args.backend, args.heads,
                                       args.head_dim), timeout=1800)
    rows = per_rank[0]
    print(json.dumps(rows, indent=1) if args.json else
          f"world 4, causal, {args.heads} heads x {args.head_dim}, backend {args.backend}\n\n{_table(rows)}")
    bad = _failures(rows, args.factor)
    for line in bad:
        print("FAIL:", line)
    return 1 if (bad and args.check) else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
