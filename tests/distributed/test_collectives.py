"""ulysses_kernels.distributed.collectives and the devices they run on: the rules that do
not need a process group (the collectives themselves run in every spawned test)."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from ulysses_kernels.distributed import collectives, groups


@pytest.mark.parametrize("backend,tensor_device,want", [
    ("nccl", "cuda:1", "cuda:1"),             # NCCL gathers a CUDA tensor where it lives
    ("cpu:gloo,cuda:nccl", "cuda:0", "cuda:0"),   # ... and so does a mixed group (no detour)
    ("cpu:gloo,cuda:nccl", "cpu", "cpu"),
    ("gloo", "cpu", "cpu"),
    ("gloo", "cuda:0", "cpu"),                # gloo only: through the host
])
def test_tensors_are_gathered_where_the_backend_runs(monkeypatch, backend, tensor_device, want):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    device = torch.device(tensor_device)
    tensor = SimpleNamespace(is_cuda=device.type == "cuda", device=device)
    assert groups.tensor_collective_device(object(), tensor) == torch.device(want)


def test_single_process_collectives_are_the_identity():
    t = torch.arange(6.0)
    assert collectives.gather_ints([3, 4], None) == [[3, 4]]
    assert collectives.all_gather_tensor(t, None)[0] is t
    assert collectives.broadcast_tensor(t, 0, None) is t
    assert collectives.any_rank(True, None) and not collectives.any_rank(False, None)
    assert collectives.first_message("m", None) == (0, "m")
    assert torch.equal(collectives.all_to_all(t, [6], [6], None), t)


def test_an_unresolved_default_group_is_refused(monkeypatch):
    """group=None means a single process only without torch.distributed: with it, None
    would be each rank answering for itself (the ranks would disagree or hang)."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match="resolve it first"):
        collectives.gather_ints([1], None)
