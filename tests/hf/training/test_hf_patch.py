"""`patch_model` (ulysses_kernels/hf/training/patch.py) on transformers models: tiling with activation
checkpointing against the eager model, and checkpoint offload exact at SP 2, with its
host buffers from the pool (and pinned on a GPU)."""

import pytest
import torch
from helpers import rel_err
from hf_cases import TOL, _grad_errors, _run, enable_checkpointing, make_batch, make_model, offload_steps

from ulysses_kernels import hf as ukhf
from ulysses_kernels.hf.model import record_of

pytestmark = pytest.mark.slow

def test_checkpoint_offload_is_exact_at_sp2():
    for r in [r["offload"] for r in _run(2)]:
        assert r["same"], "losses or gradients differ with checkpoint offload"
        # 3 layers: the inputs of the first 2 are offloaded (the last stays), on each of 2 steps;
        # the second step reuses the first step's host buffers
        assert r["packed"] == 4 and r["allocations"] == 2, r


def test_checkpoint_offload_saves_host_buffers_from_the_pool():
    model = make_model("qwen2", "eager", num_hidden_layers=3)
    enable_checkpointing(model)
    offload = ukhf.CheckpointOffload(device_type="cpu", min_bytes=0)
    ukhf.patch_model(model, tiled_mlp=False, tiled_loss=False, offload_checkpoints=offload)
    ids, pos = make_batch(6, 23)
    out = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False)
    handles, h = [], offload._last
    while h is not None:  # what the autograd graph holds now: host buffers of the pool
        handles.append(h)
        h = h.previous
    assert len(handles) == 2 and all(offload.pool.owns(h.host) and h.host.device.type == "cpu" for h in handles)
    assert [h.shape for h in handles] == [(1, 23, 64)] * 2
    out.loss.backward()
    assert all(h.host is None for h in handles)  # read back once, buffers returned to the pool
    with pytest.raises(ValueError, match="needs activation checkpointing"):
        ukhf.patch_model(make_model("llama", "eager"), tiled_mlp=False, tiled_loss=False, offload_checkpoints=True)
    ukhf.unpatch_model(model)
    model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss.backward()
    assert offload.packed == 2  # unpatched: nothing more offloaded


@pytest.mark.gpu
def test_checkpoint_offload_gpu_pinned_and_exact():
    """On a GPU: the saved inputs go to pinned host buffers on a side stream and come back
    bitwise; the second step allocates no host memory."""
    ids, pos = make_batch(7, 257)
    ids, pos = ids.cuda(), pos.cuda()
    results, offload = [], None
    for use in (False, True):
        model = make_model("llama", "eager", num_hidden_layers=3).cuda()
        enable_checkpointing(model)
        if use:
            offload = ukhf.CheckpointOffload(min_bytes=0)
            ukhf.patch_model(model, tiled_mlp=False, tiled_loss=False, offload_checkpoints=offload)
        results.append(offload_steps(model, ids, pos))
    for (la, ga), (lb, gb) in zip(*results):
        assert torch.equal(la, lb) and all(torch.equal(ga[n], gb[n]) for n in ga)
    assert offload.packed == 4 and offload.pool.allocations == 2 and offload.pool.pin


def test_patched_model_single_process_with_checkpointing():
    ukhf.register(None)
    ref = make_model("llama", "eager")
    model = make_model("llama", "ulysses")
    ukhf.patch_model(model, mlp_tile_tokens=3, loss_tile_tokens=4)
    enable_checkpointing(model)
    ids, pos = make_batch(7, 19, [9, 10])
    loss_ref = ref(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss
    loss_ref.backward()
    loss = ukhf.causal_lm_loss(model, ukhf.shard_batch(ids, None, position_ids=pos))
    loss.backward()
    assert rel_err(loss, loss_ref) < TOL
    got = {n: p.grad for n, p in model.named_parameters()}
    want = {n: p.grad for n, p in ref.named_parameters()}
    assert not _grad_errors(got, want)
    ukhf.unpatch_model(model)
    assert not record_of(model).replaced(model.model.layers[0].mlp)
    assert "forward" not in vars(model.model.layers[0].mlp) and "forward" not in vars(model)
