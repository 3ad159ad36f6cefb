"""The fused engine's NCCL communicator beside torch's (ulysses_kernels/nccl_order.py):
NCCL_LAUNCH_ORDER_IMPLICIT set at import unless the user set it, the cases in which a
multi-rank NCCL transport is refused, and the refusal raised alike on every rank (before
the extension is touched, so it is tested on CPU over gloo)."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from helpers import ROOT, SPAWN_TIMEOUT, raised

from ulysses_kernels import nccl_order
from ulysses_kernels.fused.transport import NcclTransport
from ulysses_kernels.launch import spawn

NAME = nccl_order.LAUNCH_ORDER


def _python(code: str, **env) -> str:
    run_env = {k: v for k, v in os.environ.items() if k != NAME}
    run_env.update(env)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=run_env, capture_output=True, text=True,
                          timeout=120, check=True).stdout.strip()


def test_import_sets_the_launch_order_unless_the_user_did():
    code = ("import os, ulysses_kernels; from ulysses_kernels import nccl_order; "
            "print(os.environ['NCCL_LAUNCH_ORDER_IMPLICIT'], nccl_order.problem((2, 30, 7)))")
    assert _python(code) == "1 None"
    assert _python(code, **{NAME: "1"}) == "1 None"
    out = _python(code, **{NAME: "0"})
    assert out.startswith("0 NCCL_LAUNCH_ORDER_IMPLICIT=0: the fused path's NCCL communicator beside torch's") and \
        "export NCCL_LAUNCH_ORDER_IMPLICIT=1 before the processes start" in out


def test_set_after_torch_distributed_started_is_refused():
    """Imported after init_process_group: NCCL may have read the variable already."""
    code = ("import os, torch.distributed as dist; "
            "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1); "
            "import ulysses_kernels; from ulysses_kernels import nccl_order; "
            "print(nccl_order.problem((2, 30, 7))); print(nccl_order.describe())")
    problem, described = _python(code).splitlines()
    assert "set NCCL_LAUNCH_ORDER_IMPLICIT=1 when it was imported, after torch.distributed was initialized" in problem
    assert "import ulysses_kernels before init_process_group" in problem
    assert "the NCCL engine refuses" in described


def test_nccl_older_than_the_launch_order_is_refused(monkeypatch):
    monkeypatch.setenv(NAME, "1")
    assert nccl_order.problem((2, 30, 7)) is None and nccl_order.problem(None) is None
    assert "needs NCCL >= 2.26" in nccl_order.problem((2, 21, 5)) and "2.21.5" in nccl_order.problem((2, 21, 5))


def transport_rank(rank, world, bad_rank):
    """Every rank builds the NCCL transport; `bad_rank` alone has the launch order off."""
    os.environ[NAME] = "0" if rank == bad_rank else "1"
    return raised(lambda: NcclTransport(dist.group.WORLD, world, rank, torch.device("cpu")), (RuntimeError,))


@pytest.mark.slow
@pytest.mark.parametrize("world,bad_rank", [(2, 0), (3, 1)])
def test_the_refusal_is_the_same_on_every_rank(world, bad_rank):
    """One rank's setting differs: every rank raises the same error, naming that rank,
    and none hangs in the communicator's bootstrap."""
    errors = spawn(transport_rank, world, args=(bad_rank,), timeout=SPAWN_TIMEOUT)
    assert len(set(errors)) == 1 and errors[0] is not None, errors
    assert f"refused on rank(s) [{bad_rank}] of {world}: NCCL_LAUNCH_ORDER_IMPLICIT=0" in errors[0]
