"""`shard_batch` and `cu_seqlens_from_position_ids` (ulysses_kernels/hf/core/batch.py)."""

import pytest
import torch

from ulysses_kernels import hf as ukhf

pytestmark = pytest.mark.slow  # imports transformers

def test_shard_batch_shifts_before_sharding():
    ids = torch.arange(11).unsqueeze(0) + 100
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2]])
    b = ukhf.shard_batch(ids, None, position_ids=pos)
    assert b.labels.tolist() == [[*range(101, 111), -100]]
    assert b.cu_seqlens.tolist() == [0, 3, 8, 11]
    m = ukhf.shard_batch(ids, None, position_ids=pos, mask_document_ends=True)
    assert m.labels[0, 2] == -100 and m.labels[0, 7] == -100 and m.labels[0, 3] == 104


def test_cu_seqlens_from_position_ids():
    assert ukhf.cu_seqlens_from_position_ids(torch.arange(7)[None]) is None
    assert ukhf.cu_seqlens_from_position_ids(torch.tensor([[5, 6, 0, 1, 0]])).tolist() == [0, 2, 4, 5]
    with pytest.raises(ValueError, match="batch size 1"):
        ukhf.cu_seqlens_from_position_ids(torch.tensor([[0, 1, 0], [0, 1, 2]]))


def test_loss_for_world_average_scales_by_the_sp_size_and_checks_the_engine():
    """x sp_size (the engine's mean over the world is then the SP sum and the DP mean);
    anything but init_sequence_parallel's groups is refused, and so is an engine that
    averages over fewer ranks than the world (an mpu, DeepSpeed's own sequence parallelism)."""
    from types import SimpleNamespace

    from ulysses_kernels import ParallelGroups
    from ulysses_kernels.hf import loss_for_world_average

    groups = ParallelGroups(*[None] * len(ParallelGroups._fields))._replace(sp_size=4)
    loss = torch.tensor(1.5, dtype=torch.float64)
    assert loss_for_world_average(loss, groups).item() == 6.0
    assert loss_for_world_average(loss, groups, engine=SimpleNamespace(dp_world_size=1)).item() == 6.0
    with pytest.raises(TypeError, match="init_sequence_parallel"):
        loss_for_world_average(loss, 4)
    with pytest.raises(ValueError, match="averages gradients over 1 of the 1 ranks \\(sequence_parallel_size 2\\)"):
        loss_for_world_average(loss, groups, engine=SimpleNamespace(dp_world_size=1, sequence_parallel_size=2))


def test_gradient_for_world_average_keeps_the_value_and_scales_the_gradient():
    """Global values (the reward mixin's scores): the value as it is, the gradient x sp_size,
    nothing at SP 1; anything but init_sequence_parallel's groups is refused."""
    from ulysses_kernels import ParallelGroups
    from ulysses_kernels.hf import gradient_for_world_average

    groups = ParallelGroups(*[None] * len(ParallelGroups._fields))._replace(sp_size=3)
    x = torch.randn(4, 1, dtype=torch.float64, requires_grad=True)
    y = gradient_for_world_average(x, groups)
    assert torch.equal(y, x)
    (y.square().sum()).backward()
    assert torch.allclose(x.grad, 3 * 2 * x.detach(), rtol=0, atol=1e-15)
    assert gradient_for_world_average(x, groups._replace(sp_size=1)) is x
    with pytest.raises(TypeError, match="init_sequence_parallel"):
        gradient_for_world_average(x, 3)
