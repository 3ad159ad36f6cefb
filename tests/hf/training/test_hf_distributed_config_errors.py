"""`sequence_parallel_groups` (ulysses_kernels/hf/training/distributed_config.py) without a
process group: the SP and DP groups it carves out of transformers' dense mesh, and the
errors it raises before any collective (so every rank raises the same one): a model
transformers did not distribute, transformers' pipeline parallelism, an SP size that does not divide the fsdp dimension, local
heads (after TP) that the SP size cannot split."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from ulysses_kernels.hf import sequence_parallel_groups  # noqa: E402
from ulysses_kernels.hf.training.distributed_config import DENSE_DIMS, mesh_groups  # noqa: E402


def test_sp_groups_are_consecutive_fsdp_coordinates_and_dp_groups_the_rest():
    # 16 ranks: dp_replicate 2 x fsdp 4 x tp 2 (tp fastest, as transformers numbers them)
    ranks = torch.arange(16).reshape(1, 2, 4, 2)
    sp, dp = mesh_groups(ranks, 2)
    assert sp == [[0, 2], [4, 6], [1, 3], [5, 7], [8, 10], [12, 14], [9, 11], [13, 15]]
    assert dp == [[0, 4, 8, 12], [2, 6, 10, 14], [1, 5, 9, 13], [3, 7, 11, 15]]
    for groups in (sp, dp):   # every rank in exactly one group of each kind
        assert sorted(r for g in groups for r in g) == list(range(16))


class _Model(torch.nn.Module):
    def __init__(self, mesh=None, heads=4, kv_heads=2):
        super().__init__()
        self.config = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads)
        if mesh is not None:
            self._mesh_manager = SimpleNamespace(_dense_mesh=mesh)


def _mesh(fsdp, tp, names=DENSE_DIMS, pp=1):
    return SimpleNamespace(mesh=torch.arange(pp * fsdp * tp).reshape(pp, 1, fsdp, tp), mesh_dim_names=names)


def test_a_model_transformers_did_not_distribute_is_refused():
    with pytest.raises(ValueError, match="the model was not distributed by transformers"):
        sequence_parallel_groups(_Model(), 2)
    with pytest.raises(ValueError, match=r"dense mesh has dimensions \('fsdp', 'tp'\)"):
        sequence_parallel_groups(_Model(SimpleNamespace(mesh=torch.arange(4).reshape(2, 2),
                                                        mesh_dim_names=("fsdp", "tp"))), 2)


def test_an_sp_size_that_does_not_divide_fsdp_is_refused():
    with pytest.raises(ValueError, match=r"sp_size 3 must divide the model's fsdp dimension \(4"):
        sequence_parallel_groups(_Model(_mesh(fsdp=4, tp=1)), 3)


def test_local_heads_the_sp_size_cannot_split_are_refused():
    with pytest.raises(ValueError, match="each TP rank holds 1 query and 1 key/value heads .* which 2 SP ranks"):
        sequence_parallel_groups(_Model(_mesh(fsdp=2, tp=2), heads=2, kv_heads=2), 2)


def test_experts_that_cannot_train_are_refused_before_any_collective():
    """transformers' DeepGEMM experts (no backward): refused first, on every rank alike;
    grouped_mm and eager pass this check."""
    model = _Model(_mesh(fsdp=2, tp=1))
    model.config._experts_implementation = "deepgemm_megamoe"
    with pytest.raises(ValueError, match="sequence_parallel_groups: experts_implementation='deepgemm_megamoe' cannot "
                                         "train: its fused dispatch, experts and combine kernel has no backward"):
        sequence_parallel_groups(model, 2)
    from ulysses_kernels.hf.training.experts import experts_training_problem

    for kind in ("grouped_mm", "eager", None):
        model.config._experts_implementation = kind
        assert experts_training_problem(model) is None


def test_pipeline_parallelism_is_refused_with_transformers_own_limit():
    """transformers 5.25's pipeline schedule sends activations without autograd: it cannot train."""
    with pytest.raises(ValueError, match=r"pipeline parallelism \(pp_size 2\), whose schedule is forward-only"):
        sequence_parallel_groups(_Model(_mesh(fsdp=2, tp=1, pp=2)), 2)
