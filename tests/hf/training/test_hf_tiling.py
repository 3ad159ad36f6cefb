"""The tiled MLP and the tiled LM head + loss (ulysses_kernels/hf/training/tiling.py) against the plain
modules: outputs and gradients."""

import pytest
import torch
from helpers import rel_err
from hf_cases import make_config

from ulysses_kernels import hf as ukhf

pytestmark = pytest.mark.slow  # imports transformers

def _mlp():
    cfg = make_config("llama")
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    return LlamaMLP(cfg)


@pytest.mark.parametrize("tile", [1, 4, 7, 64])
def test_tiled_mlp_matches_plain(tile):
    mlp = _mlp()
    x = torch.randn(2, 23, 64, requires_grad=True)
    gy = torch.randn(2, 23, 64)
    y = mlp(x)
    y.backward(gy)
    ref = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    yt = ukhf.tiled_mlp(mlp, x, tile)
    yt.backward(gy)
    assert rel_err(yt, y) < 1e-6
    got = [x.grad] + [p.grad for p in mlp.parameters()]
    for a, b in zip(got, ref):
        assert rel_err(a, b) < 1e-6


@pytest.mark.parametrize("tile", [1, 5, 64])
def test_tiled_cross_entropy_matches_plain(tile):
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 97, bias=False)
    h = torch.randn(2, 19, 64, requires_grad=True)
    labels = torch.randint(0, 97, (2, 19))
    labels[0, :4] = -100
    logits = head(h).float()
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 97), labels.reshape(-1), reduction="sum")
    ref.backward()
    rh, rw = h.grad.clone(), head.weight.grad.clone()
    h.grad = None
    head.weight.grad = None
    got = ukhf.tiled_cross_entropy_sum(h, head, labels, tile_tokens=tile)
    (got * 0.5).backward()
    assert rel_err(got, ref) < 1e-6
    assert rel_err(h.grad, rh * 0.5) < 1e-6
    assert rel_err(head.weight.grad, rw * 0.5) < 1e-6


