"""Experts implementations that cannot train (docs/hf_training.md, "MoE and transformers'
DistributedConfig"): transformers runs a mixture of experts' expert MLPs through the kernel
`experts_implementation` names; two of transformers 5.25's kernels have no backward. A
sequence-parallel training step on such a model would leave the experts' weights where they
were while the rest trains, so the package refuses it, with the setting to change."""

from typing import Optional

from torch import nn

from ..model import unwrap

# experts_implementation -> why it cannot train (read in transformers 5.25's integrations/deepgemm.py)
NO_BACKWARD = {
    "deepgemm": "its grouped matmuls write into buffers outside autograd, so the experts' weights get no gradient "
                "(only the router's weights do)",
    "deepgemm_megamoe": "its fused dispatch, experts and combine kernel has no backward",
}


def experts_training_problem(model: nn.Module) -> Optional[str]:
    """Why `model`'s experts cannot train (None: they can, or it has none): its config's
    `experts_implementation` is one of NO_BACKWARD's, on the model's config or a sub-config
    (a vision-language model's text config)."""
    config = getattr(unwrap(model), "config", None)
    configs = [config] + [getattr(config, name, None) for name in getattr(config, "sub_configs", None) or {}]
    for each in configs:
        kind = getattr(each, "_experts_implementation", None)
        if isinstance(kind, str) and kind in NO_BACKWARD:
            return (f"experts_implementation={kind!r} cannot train: {NO_BACKWARD[kind]}; load the model with "
                    "experts_implementation='grouped_mm' (or 'eager') to train it, and keep this one for inference")
    return None


def check_experts_train(where: str, model: nn.Module) -> None:
    """The same ValueError on every rank (every rank loads the same config) when `model`'s
    experts cannot train."""
    problem = experts_training_problem(model)
    if problem:
        raise ValueError(f"{where}: {problem}")
