"""The node rule of `ring_size="auto"` (ulysses_kernels/distributed/groups.py,
layout.choose_ring_size) in a simulated two-node launch: two `torchrun` agents
(`--nnodes 2 --nproc-per-node 2`, a static rendezvous on 127.0.0.1), so every rank sees
`LOCAL_WORLD_SIZE` 2 in a world of 4. The Ulysses groups are the node-local ranks, the ring
groups span the nodes, and the attention and a tiny Llama's training step equal one
process (two_node_step.py)."""

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, SLOW_SPAWN_TIMEOUT, free_port

pytest.importorskip("transformers", reason="the step trains a tiny Hugging Face Llama")


@pytest.mark.slow
def test_a_two_node_launch_keeps_ulysses_inside_each_node(tmp_path):
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                                "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                                str(ROOT / "tests" / "distributed" / "two_node_step.py"), str(tmp_path)],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for node in (0, 1)]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=SLOW_SPAWN_TIMEOUT)[0])
    finally:
        for agent in agents:
            agent.kill()
    assert all(a.returncode == 0 for a in agents), "\n".join(o[-3000:] for o in outputs)
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    for r in results:
        node = r["rank"] // 2
        assert r["local_world"] == 2
        assert r["ulysses"] == [2 * node, 2 * node + 1], r      # the node's own ranks
        assert r["ring"] == [r["rank"] % 2, r["rank"] % 2 + 2], r   # one rank of each node
        assert r["attention"] < 1e-12, r
        assert r["model"] < 1e-9, r
