"""Training under sequence parallelism: the exact losses, tiled MLP and loss, `patch_model`,
checkpoint offload, gradient reduction (DDP, FSDP2), and the Trainer mixin (docs/hf_training.md,
"Trainer / TRL")."""
