"""Rotary position embedding in the Hugging Face (Llama) convention, and its adjoint.

x `[B, S, H, D]`, cos/sin broadcastable to `[B, S, D]` (what transformers' rotary
embedding modules return): y = x * cos + rotate_half(x) * sin with
rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]). The map is linear in x; its adjoint
(used by hand-written backward passes) is dy * cos + rotate_half^T(dy * sin) with
rotate_half^T(z) = cat(z[..., D/2:], -z[..., :D/2]).
"""

import torch


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def _rotate_half_adjoint(z):
    h = z.shape[-1] // 2
    return torch.cat([z[..., h:], -z[..., :h]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    return x * cos + _rotate_half(x) * sin


def apply_rotary_adjoint(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return dy * cos + _rotate_half_adjoint(dy * sin)


def position_embeddings_error(position_embeddings, batch: int, seq: int, head_dim: int, device):
    """Why (cos, sin) cannot be applied to `[batch, seq, H, head_dim]` on `device`, or None."""
    if position_embeddings is None:
        return None
    try:
        cos, sin = position_embeddings
    except (TypeError, ValueError):
        return "position_embeddings must be a pair (cos, sin)"
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[0] not in (1, batch) \
                or t.shape[1] != seq or t.shape[2] != head_dim:
            return (f"position_embeddings {name} must be [{batch} or 1, {seq}, {head_dim}], got "
                    f"{tuple(getattr(t, 'shape', ()))}")
        if t.device != device:
            return f"position_embeddings {name} is on {t.device} but x is on {device}"
    if head_dim % 2:
        return f"rotary embeddings need an even head dim, got {head_dim}"
    return None
