"""The user's own DeviceMesh (`uk.groups_from_mesh`, and a 1-D mesh wherever a group is
taken), four ranks on CPU with gloo: a tiny float64 Llama trains one step equal to one
process on a ("dp", "sp") mesh, on a ("ring", "sp") mesh as Ulysses 2 x ring 2, with two
dimensions flattened into one Ulysses group of 4, and beside tensor parallelism on a ("tp",
"sp") mesh (the model's own tp_plan applied with torch's parallelize_module: Ulysses over the
heads local to the TP rank, DTensor gradients reduced over SP); the groups are the ranks the
mesh says; what is not a group raises the same error on every rank.
"""

import pytest
import torch
from family_cases import make_family_model
from helpers import SLOW_SPAWN_TIMEOUT, rel_err
from sweep import DOCUMENTS, reference_step, sp_step

pytest.importorskip("transformers", reason="ulysses_kernels.hf needs Hugging Face transformers "
                                           "(pip install -e '.[hf]' in the checkout)")

import torch.distributed as dist  # noqa: E402

import ulysses_kernels as uk  # noqa: E402
from ulysses_kernels import hf as ukhf  # noqa: E402
from ulysses_kernels.launch import spawn  # noqa: E402

PACKED = DOCUMENTS["two packed documents"]
MESH_FAMILIES = ("llama", "qwen3_moe")   # Qwen3-MoE: every MLP a mixture of experts, q/k norms


def _ranks(group):
    return dist.get_process_group_ranks(group)


def _step(groups):
    ukhf.register(groups)
    return sp_step(make_family_model("llama", "ulysses"), PACKED, groups)


def _error(call):
    try:
        call()
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def apply_tp_plan(model, tp_mesh):
    """docs/api.md's recipe for TP beside SP: the model's `base_model_tp_plan` applied on the
    "tp" dimension with torch's parallelize_module ("colwise" / "rowwise" entries whose modules
    exist); the parameters its "replicated_with_grad_allreduce" entries name (Qwen3's q/k norms:
    each TP rank sees its own heads) returned, to be summed over TP after the backward."""
    import fnmatch

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = model.config.base_model_tp_plan
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    names = [name for name, _ in model.model.named_modules()]
    parallelize_module(model.model, tp_mesh, {pattern: styles[style]() for pattern, style in plan.items()
                                              if style in styles and fnmatch.filter(names, pattern)})
    replicated = [pattern for pattern, style in plan.items() if style == "replicated_with_grad_allreduce"]
    return [p for name, p in model.model.named_parameters()
            if any(fnmatch.fnmatch(name.rsplit(".", 1)[0], pattern) for pattern in replicated)]


def _tensor_parallel_step(mesh, family, **overrides):
    """One step of `family` on a ("tp", "sp") mesh, the groups from the "sp" dimension (the TP
    ranks take the same batch). The step's gradients, DTensors gathered whole."""
    from sweep import batch_ids, positions
    from torch.distributed.tensor import DTensor

    groups = uk.groups_from_mesh(mesh, sp="sp")
    ukhf.register(groups)
    model = make_family_model(family, "ulysses", **overrides)
    summed_over_tp = apply_tp_plan(model, mesh["tp"])
    loss = ukhf.causal_lm_loss(model, ukhf.shard_batch(batch_ids(), groups, position_ids=positions(PACKED)), groups)
    loss.backward()
    for p in summed_over_tp:
        dist.all_reduce(p.grad, group=mesh["tp"].get_group())
    ukhf.allreduce_gradients(model, groups)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    sharded = sum(isinstance(g, DTensor) for g in grads.values())
    return ((loss.detach(), {n: g.full_tensor() if isinstance(g, DTensor) else g for n, g in grads.items()}),
            sharded, len(summed_over_tp))


def _fsdp_steps(mesh, family="llama", dp="dp", steps=2, lr=0.1):
    """FSDP2 over the mesh's DP x SP ranks (`apply_fsdp(shard="world")`), with patch_model's
    tiles and activation checkpointing: `steps` SGD steps, each step's loss and gradients
    (gathered whole; FSDP reduces them, `allreduce_gradients` is not called)."""
    from sweep import batch_ids, positions

    groups = uk.groups_from_mesh(mesh, sp="sp", dp=dp)
    ukhf.register(groups)
    moe = family == "qwen3_moe"   # mixture-of-experts blocks are not tiled (patch_model refuses them)
    model = ukhf.patch_model(make_family_model(family, "ulysses"), tiled_mlp=not moe, mlp_tile_tokens=5,
                             loss_tile_tokens=7)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
    model = ukhf.apply_fsdp(model, groups, shard="world")
    out = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        loss = ukhf.causal_lm_loss(model, ukhf.shard_batch(batch_ids(), groups, position_ids=positions(PACKED)),
                                   groups)
        loss.backward()
        out.append((loss.detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters()
                                    if p.grad is not None}))
        out.append(_error(lambda: ukhf.allreduce_gradients(model, groups)))   # FSDP reduced them already
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return out


def mesh_jobs(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    dp_sp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    groups = uk.groups_from_mesh(dp_sp, sp="sp", dp="dp")
    out["dp_sp ranks"] = (_ranks(groups.sp_group), _ranks(groups.dp_group), groups.sp_rank, groups.dp_rank,
                          groups.sp_size, groups.dp_size, groups.ring_group is None,
                          tuple(groups.mesh.mesh_dim_names))
    out["dp_sp"] = _step(groups)    # both DP groups take the same batch: the DP mean is the one-process step
    out["1-D mesh"] = _step(dp_sp["sp"])   # the mesh dimension itself where a group is taken

    ring_sp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "sp"))
    ring = uk.groups_from_mesh(ring_sp, sp="sp", ring="ring")
    out["ring ranks"] = (_ranks(ring.sp_group), _ranks(ring.ulysses_group), _ranks(ring.ring_group),
                         ring.sp_rank, ring.ulysses_rank, ring.ring_rank, ring.sp_size, ring.dp_size)
    out["ring"] = _step(ring)

    two = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    flat = uk.groups_from_mesh(two, sp=("a", "b"))
    out["flat ranks"] = (_ranks(flat.sp_group), flat.sp_rank, flat.sp_size, flat.dp_size, _ranks(flat.dp_group))
    out["flat"] = _step(flat)

    tp_sp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "sp"))
    for family in MESH_FAMILIES:
        out[("tp", family)] = _tensor_parallel_step(tp_sp, family)
        out[("fsdp", family)] = _fsdp_steps(dp_sp, family)
    out["tp heads"] = _error(lambda: _tensor_parallel_step(tp_sp, "llama", num_attention_heads=6,
                                                           num_key_value_heads=2))   # 3 heads a TP rank, SP 2
    ukhf.register(groups)
    out["dp_sp moe"] = sp_step(make_family_model("qwen3_moe", "ulysses"), PACKED, groups)
    # a dimension the groups do not name (here replicas of the same batch; tensor or expert
    # parallel in practice): FSDP shards over the SP ranks only, not the world
    out["fsdp, another dimension"] = _fsdp_steps(init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "sp")),
                                                  dp=None)

    q = torch.randn(1, 4, 4, 16, dtype=torch.float64)
    out["errors"] = [
        _error(lambda: uk.ulysses_attention(q, q, q, group=dp_sp)),
        _error(lambda: ukhf.register(dp_sp)),
        _error(lambda: ukhf.shard_batch(torch.zeros(1, 8, dtype=torch.long), [0, 1])),
        _error(lambda: uk.groups_from_mesh(dp_sp, sp="cp")),
        _error(lambda: uk.groups_from_mesh(dp_sp, sp="sp", dp="sp")),
        _error(lambda: uk.groups_from_mesh(dp_sp["sp"].get_group())),
    ]
    ukhf.register(None)
    return out


@pytest.fixture(scope="module")
def per_rank():
    return spawn(mesh_jobs, 4, timeout=SLOW_SPAWN_TIMEOUT, start_method="forkserver",
                 preload=["torch", "transformers", "ulysses_kernels.hf"])


@pytest.fixture(scope="module")
def reference():
    return reference_step(make_family_model("llama", "eager64"), PACKED)


@pytest.fixture(scope="module")
def references():
    """Per family of MESH_FAMILIES: the one-process steps (two SGD steps)."""
    out = {}
    for family in MESH_FAMILIES:
        model, steps = make_family_model(family, "eager64"), []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            steps.append(reference_step(model, PACKED))
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p -= 0.1 * p.grad
        out[family] = steps
    return out


def _assert_step(got, want, what):
    (loss, grads), (want_loss, want_grads) = got, want
    assert rel_err(loss, want_loss) < 1e-9, what
    assert set(grads) == set(want_grads), what
    worst = max(rel_err(grads[n], g) for n, g in want_grads.items())
    assert worst < 1e-9, (what, worst)


@pytest.mark.slow
def test_a_dp_sp_mesh_gives_the_groups_it_names_and_trains_like_one_process(per_rank, reference):
    for rank, out in enumerate(per_rank):
        sp_ranks, dp_ranks, sp_rank, dp_rank, sp_size, dp_size, no_ring, names = out["dp_sp ranks"]
        assert sp_ranks == [2 * (rank // 2), 2 * (rank // 2) + 1] and dp_ranks == [rank % 2, rank % 2 + 2]
        assert (sp_rank, dp_rank, sp_size, dp_size, no_ring, names) == (rank % 2, rank // 2, 2, 2, True,
                                                                        ("dp", "sp"))
        _assert_step(out["dp_sp"], reference, f"dp_sp rank {rank}")
        _assert_step(out["1-D mesh"], reference, f"1-D mesh rank {rank}")


@pytest.mark.slow
def test_a_ring_dimension_and_flattened_dimensions(per_rank, reference):
    """("ring", "sp"): SP 4 = ring 2 x Ulysses 2, SP rank ring_rank * 2 + ulysses_rank (the
    numbering of init_sequence_parallel); ("a", "b") flattened: one Ulysses group of 4, DP 1."""
    for rank, out in enumerate(per_rank):
        sp, ulysses, ring, sp_rank, ulysses_rank, ring_rank, sp_size, dp_size = out["ring ranks"]
        assert sp == [0, 1, 2, 3] and ulysses == [2 * (rank // 2), 2 * (rank // 2) + 1]
        assert ring == [rank % 2, rank % 2 + 2]
        assert (sp_rank, ulysses_rank, ring_rank, sp_size, dp_size) == (rank, rank % 2, rank // 2, 4, 1)
        _assert_step(out["ring"], reference, f"ring rank {rank}")
        assert out["flat ranks"] == ([0, 1, 2, 3], rank, 4, 1, [rank])
        _assert_step(out["flat"], reference, f"flat rank {rank}")


@pytest.mark.slow
def test_fsdp2_over_dp_and_sp_with_checkpointing_and_tiles(per_rank, references):
    """FSDP2 sharded over a ("dp", "sp") mesh's four ranks (both DP groups take the same batch,
    so the DP-only run is one process), patch_model's tiled MLP and loss and activation
    checkpointing on (Qwen3-MoE: the loss tiled, not its experts), a tiny Llama and a tiny
    Qwen3-MoE: two SGD steps, each step's loss and
    every gradient equal to one process's (the SP ranks' gradients summed, not averaged: no
    double counting over SP); `allreduce_gradients` on the FSDP model is refused (it would
    reduce them twice). On a ("rep", "sp") mesh whose "rep" the groups do not name, FSDP
    shards over SP only (over the whole world it summed the replicas too: twice the
    gradient)."""
    for rank, out in enumerate(per_rank):
        for case, family in [(("fsdp", f), f) for f in MESH_FAMILIES] + [("fsdp, another dimension", "llama")]:
            steps, refusals = out[case][0::2], out[case][1::2]
            for step, (got, expected) in enumerate(zip(steps, references[family])):
                _assert_step(got, expected, f"{case} rank {rank} step {step}")
            assert all(r is not None and "sharded by FSDP" in r for r in refusals), refusals


@pytest.mark.slow
def test_tensor_parallelism_beside_sequence_parallelism(per_rank, references):
    """("tp", "sp") at TP 2 x SP 2, a tiny Llama and a tiny Qwen3-MoE: q/k/v/o (and Llama's
    MLP) sharded by the model's tp_plan (2 of 4 query heads, 1 of 2 KV heads on each TP rank,
    Ulysses 2 over them; Qwen3-MoE's experts replicated), Qwen3's q/k norms summed over TP as
    its plan says, one step equal to one process; `allreduce_gradients` sums the DTensor
    gradients' local shards over SP (it raised "aten.cat.default got mixed torch.Tensor and
    DTensor")."""
    expected_shards = {"llama": (2 * 7, 0), "qwen3_moe": (2 * 4, 2 * 2)}   # (DTensor grads, norms summed over TP)
    for rank, out in enumerate(per_rank):
        for family in MESH_FAMILIES:
            step, sharded, summed = out[("tp", family)]
            assert (sharded, summed) == expected_shards[family], (family, sharded, summed)
            _assert_step(step, references[family][0], f"tp {family} rank {rank}")


@pytest.mark.slow
def test_heads_of_a_tensor_parallel_rank_not_divisible_by_sp_are_refused_on_every_rank(per_rank):
    """6 query heads at TP 2 leave 3 on a rank, which SP 2 cannot split: the same ValueError
    on every rank, naming tensor parallelism's split, and nothing hangs."""
    error = per_rank[0]["tp heads"]
    assert all(out["tp heads"] == error for out in per_rank), [out["tp heads"] for out in per_rank]
    assert error is not None and "the model's 6 query heads are split by tensor parallelism first (3 on this rank)" \
        in error and "must be divisible by the sequence-parallel size 2" in error, error


@pytest.mark.slow
def test_a_mixture_of_experts_on_a_dp_sp_mesh(per_rank, references):
    """A tiny Qwen3-MoE through groups_from_mesh on the ("dp", "sp") mesh: one step equal to
    one process (the experts only some ranks' tokens chose reduced on every rank)."""
    for rank, out in enumerate(per_rank):
        _assert_step(out["dp_sp moe"], references["qwen3_moe"][0], f"dp_sp moe rank {rank}")


@pytest.mark.slow
def test_what_is_not_a_group_is_refused_the_same_on_every_rank(per_rank):
    errors = per_rank[0]["errors"]
    assert all(out["errors"] == errors for out in per_rank), [out["errors"] for out in per_rank]
    two_dims, registered, a_list, unknown, twice, not_a_mesh = errors
    assert two_dims is not None and "a DeviceMesh of 2 dimensions ('dp', 'sp')" in two_dims
    assert registered == two_dims
    assert a_list is not None and "group must be a torch.distributed ProcessGroup, a 1-D DeviceMesh" in a_list
    assert unknown is not None and "must name distinct dimensions of the mesh ('dp', 'sp')" in unknown
    assert twice is not None and "distinct" in twice
    assert not_a_mesh is not None and "mesh must be a torch DeviceMesh" in not_a_mesh
