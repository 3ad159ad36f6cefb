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


def _bounds_by_hand(rows):
    """transformers' rule written out token by token: a document starts wherever a position
    is not its predecessor + 1; None without packing; packed rows must all be equal."""
    starts = [[t for t in range(1, len(r)) if r[t] != r[t - 1] + 1] for r in rows]
    if not any(starts):
        return None
    if any(r != rows[0] for r in rows):
        return "refused"
    return [0, *(t for t in starts[0]), len(rows[0])]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float64])
def test_cu_seqlens_from_position_ids_against_the_rule_by_hand(dtype):
    """Random rows of restarting positions: integer CPU positions take the host-array branch
    (numpy, what shard_batch meets from a collator), float ones the tensor branch (what runs
    on an accelerator); both equal the rule written out, on the device asked for."""
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        B, S = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(0, 10, (1,), generator=g))
        row = torch.randint(0, 4, (S,), generator=g).cumsum(0) * torch.randint(0, 2, (S,), generator=g)
        rows = [row.tolist()] * B if torch.rand(1, generator=g) < 0.7 else \
            [torch.randint(0, 3, (S,), generator=g).tolist() for _ in range(B)]
        want = _bounds_by_hand(rows)
        pos = torch.tensor(rows, dtype=dtype).view(B, S)
        if want == "refused":
            with pytest.raises(ValueError, match="batch size 1"):
                ukhf.cu_seqlens_from_position_ids(pos)
            continue
        got = ukhf.cu_seqlens_from_position_ids(pos, device="cpu")
        assert (got if got is None else got.tolist()) == want, rows
        assert got is None or got.dtype == torch.int32


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
