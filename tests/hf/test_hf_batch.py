"""`shard_batch` and `cu_seqlens_from_position_ids` (ulysses_kernels/hf/batch.py)."""

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
