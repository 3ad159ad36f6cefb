"""Liger's kernels beside the sequence-parallel mixins (docs/hf_training.md, "LoRA, Liger and
resuming at another layout"): which of them compose, and the refusal of the others."""


def check_liger(mixin: str, args) -> None:
    """`use_liger_kernel=True` (TrainingArguments, TRL's configs): Liger's layer kernels (RMSNorm,
    SwiGLU, RoPE, ...) compute each token on its own, so they are exact under sequence
    parallelism and compose with the mixins; its fused linear cross-entropy (Liger's default;
    TRL's SFT, GRPO and DPO trainers turn it off themselves) replaces the model's forward and
    its cross-entropy replaces the loss function, both of which the mixins compute
    sequence-parallel (the tiled LM head, the token-weighted loss). Those are refused, with the
    setting to change; read after the trainer's own __init__ (which may change the config),
    the same on every rank."""
    if not getattr(args, "use_liger_kernel", False):
        return
    config = dict(getattr(args, "liger_kernel_config", None) or {})
    on = [name for name, default in (("fused_linear_cross_entropy", True), ("cross_entropy", False))
          if config.get(name, default)]
    if on:
        raise ValueError(f"{mixin}: use_liger_kernel=True with Liger's {' and '.join(on)} is not supported: it "
                         "replaces the loss the mixin computes sequence-parallel. Keep Liger's layer kernels with "
                         "liger_kernel_config={'fused_linear_cross_entropy': False, 'cross_entropy': False} (they "
                         "are exact under sequence parallelism), or turn use_liger_kernel off.")
