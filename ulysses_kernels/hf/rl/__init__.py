"""Reinforcement learning under sequence parallelism: per-token log-probabilities, the GRPO and
DPO losses, and TRL's GRPO, DPO and reward trainer mixins (docs/hf_rl.md, "RL")."""
