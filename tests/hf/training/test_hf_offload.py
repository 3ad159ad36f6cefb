"""ulysses_kernels.hf.offload on a plain torch model with checkpointed blocks (no
transformers needed, so the GPU image runs it too): exact results, host buffers reused
across steps, and on a GPU the device memory it frees."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ulysses_kernels.hf.training.offload import CheckpointOffload, enable_checkpoint_offload


class Block(nn.Module):
    """Checkpoints its own forward, as transformers' layers do: module hooks stay outside."""

    def __init__(self, width):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def _inner(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))

    def forward(self, x):
        return checkpoint(self._inner, x, use_reentrant=False)


def _model(width, layers, device):
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width) for _ in range(layers)]).to(device)


def _steps(model, x, steps=2):
    out = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        out.append((loss.detach().clone(), [p.grad.clone() for p in model.parameters()]))
    return out


def _same(a, b):
    return all(torch.equal(la, lb) and all(torch.equal(x, y) for x, y in zip(ga, gb)) for (la, ga), (lb, gb) in zip(a, b))


def test_offload_plain_torch_blocks_exact_and_pooled():
    x = torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(1))
    reference = _steps(_model(32, 4, "cpu"), x)
    model = _model(32, 4, "cpu")
    offload = CheckpointOffload(device_type="cpu", min_bytes=0)  # host/device roles simulated on CPU
    handles = enable_checkpoint_offload(list(model), offload)
    assert _same(reference, _steps(model, x))
    assert offload.packed == 6 and offload.pool.allocations == 3  # 3 of 4 blocks, 2 steps; step 2 reuses
    for h in handles:
        h.remove()
    _steps(model, x, steps=1)
    assert offload.packed == 6


def test_default_offload_is_a_no_op_on_cpu_tensors():
    x = torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(2))
    model = _model(32, 3, "cpu")
    offload = CheckpointOffload()  # device_type "cuda": CPU tensors pass through
    enable_checkpoint_offload(list(model), offload)
    assert _same(_steps(_model(32, 3, "cpu"), x), _steps(model, x)) and offload.packed == 0


def test_reading_an_offloaded_input_twice_raises():
    x = torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(3), requires_grad=True)
    model = _model(32, 2, "cpu")
    enable_checkpoint_offload(list(model), CheckpointOffload(device_type="cpu", min_bytes=0))
    loss = model(x).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="read twice"):
        loss.backward()


@pytest.mark.gpu
def test_offload_gpu_exact_pinned_and_frees_device_memory():
    """bf16 blocks on the GPU: bitwise the same results, pinned reusable host buffers, and a
    peak at least half of the offloaded inputs' bytes lower."""
    width, layers = 1024, 6
    x = torch.randn(4, 4096, width, device="cuda", dtype=torch.bfloat16)
    peaks, results, offload = [], [], None
    for use in (False, True):
        model = _model(width, layers, "cuda").to(torch.bfloat16)
        if use:
            offload = CheckpointOffload()
            enable_checkpoint_offload(list(model), offload)
        _steps(model, x, steps=1)  # warm-up: host buffers, allocator caches
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        results.append(_steps(model, x, steps=1))
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
        del model
    assert _same(*results)
    assert offload.pool.pin and offload.pool.allocations == layers - 1  # reused on the second step
    offloaded = (layers - 1) * x.numel() * x.element_size()
    assert peaks[0] - peaks[1] >= offloaded // 2, (peaks, offloaded)


