"""The Mamba1 mixers of Mamba, Falcon-Mamba, Jamba and Zamba, sequence-parallel without a
per-token exchange: the sequence halo for the convolution, state passing for the scan
(docs/hf_hybrids.md, "State passing"; halo.py, state_passing.py).

One layer, as transformers 5.24 and 5.25 compute it (its torch path): `in_proj` gives x and the
gate z (`intermediate_size` channels each); x goes through a depthwise causal convolution and
SiLU; `x_proj` maps each token's x to dt (low rank), B and C (the state size each; Falcon-Mamba
and Jamba normalise the three per token; Zamba splits the channels into Mamba heads, each with
its own x_proj and dt_proj, and interleaves x and z in `in_proj`'s output); `dt_proj` and
softplus give a step per channel; the selective scan per channel c and state n

    s_t[c, n] = exp(dt_t[c] A[c, n]) s_{t-1}[c, n] + dt_t[c] B_t[n] x_t[c],    y_t[c] = C_t . s_t[c] + D[c] x_t[c]

then `y * silu(z)` and `out_proj`.

Sequence-parallel: everything but the convolution and the scan is per token and runs on the
local shard. The convolution reads the `conv_kernel - 1` inputs before each shard (the halo);
the scan's transition is diagonal (`exp(sum_t dt_t A)` per channel and state), so each rank
scans its shard from zero, the ranks share each shard's (transition, final state) and every
rank continues from the state entering its shard (state passing). Documents restart both.
Under a ring the same runs on the ring's chunks. In generation the layer's conv history and
scan state, small, are the same on every rank (a sharded prefill chunk composes the state
leaving it), and a decode step runs on every rank.

Precision as transformers': the scan in float32 for half and single precision inputs, in the
inputs' dtype for float64 ones (where transformers' upcast would be a downcast).
"""

from typing import Optional

import torch
import torch.nn.functional as F

from ..family import STATE_PASSING, Adapter, Family
from ..mixers import causal_conv1d, conv_history
from .halo import contiguous_layout, halo_conv, training_layout
from .state_passing import layout_recurrence

MAMBA1_CLASSES = ("MambaMixer", "FalconMambaMixer", "JambaMambaMixer", "ZambaMambaMixer")


class SelectiveScan:
    """The scan as `mixer_ring.ring_recurrence` takes it: inputs (x, dt `[B, n, C]`, B, C
    `[B, n, N]`, or `[B, n, G, N]` for G groups of channels: Zamba's heads), the state
    `[B, C, N]`; a range leaves `exp(sum_t dt_t A) S + F`."""

    def __init__(self, A: torch.Tensor):
        self.A = A   # [C, N], negative

    def run(self, inputs, initial):
        x, dt, B, C = inputs
        state = initial if initial is not None else x.new_zeros(x.shape[0], x.shape[2], self.A.shape[1])
        per_channel = x.shape[2] // B.shape[2] if B.dim() == 4 else None
        out = []
        for t in range(x.shape[1]):
            b, c = (B[:, t, None], C[:, t, None]) if per_channel is None else \
                (B[:, t].repeat_interleave(per_channel, dim=1), C[:, t].repeat_interleave(per_channel, dim=1))
            state = torch.exp(dt[:, t, :, None] * self.A) * state + (dt[:, t] * x[:, t])[..., None] * b
            out.append((state * c).sum(-1))
        return (torch.stack(out, dim=1) if out else x.new_zeros(x.shape)), state

    def transition(self, inputs):
        dt = inputs[1]
        return torch.exp(dt.sum(dim=1)[..., None] * self.A)

    def identity(self, inputs):
        x = inputs[0]
        return x.new_ones(x.shape[0], x.shape[2], self.A.shape[1])

    def zero_state(self, inputs):
        x = inputs[0]
        return x.new_zeros(x.shape[0], x.shape[2], self.A.shape[1])

    def carry(self, M, state):
        return M * state


def _conv_weights(module):
    return module.conv1d.weight[:, 0, :], module.conv1d.bias if module.use_conv_bias else None


def _split_projection(module, hidden_states):
    """x and the gate z `[B, S, intermediate]` of the local tokens (Zamba interleaves them)."""
    projected = module.in_proj(hidden_states)
    if _per_head(module):
        return projected[..., 0::2], projected[..., 1::2]
    return projected.chunk(2, dim=-1)


def _per_head(module) -> bool:
    """Zamba's mixer: x_proj and dt_proj per Mamba head (B and C per head)."""
    return hasattr(module, "x_proj_weight")


def _after_conv(module, x):
    """The scan's inputs (compute dtype) from the convolved x: dt after `dt_proj`, its bias and
    softplus; B and C (normalised where the layer does; per head for Zamba); A."""
    compute = torch.promote_types(x.dtype, torch.float32)
    sizes = [module.time_step_rank, module.ssm_state_size, module.ssm_state_size]
    if _per_head(module):
        heads = x.reshape(*x.shape[:2], module.n_mamba_heads, module.mamba_head_dim)
        time_step, B, C = torch.split(torch.einsum("bshd,hkd->bshk", heads, module.x_proj_weight), sizes, dim=-1)
        dt = torch.einsum("bshr,hdr->bshd", time_step, module.dt_proj_weight).flatten(2)
        bias = module.dt_proj_bias.reshape(-1)
    else:
        time_step, B, C = torch.split(module.x_proj(x), sizes, dim=-1)
        if hasattr(module, "dt_layernorm"):   # Falcon-Mamba, Jamba
            time_step, B, C = module.dt_layernorm(time_step), module.b_layernorm(B), module.c_layernorm(C)
        dt, bias = time_step @ module.dt_proj.weight.t(), module.dt_proj.bias
    dt = F.softplus(dt.to(compute) + bias.to(compute))
    A = -torch.exp(module.A_log.reshape(-1, module.ssm_state_size).to(compute))
    return x.to(compute), dt, B.to(compute), C.to(compute), A


def _output(module, x, y, z, dtype):
    y = (y + module.D.reshape(-1).to(y.dtype) * x) * F.silu(z.to(y.dtype))
    return module.out_proj(y.to(dtype))


def generation_forward(module, hidden_states, cache, **_):
    """A forward inside `generate` / `prefill`: the layer continues from its conv history and
    scan state, the same on every rank, which it then replaces."""
    state = cache.mixer_state(module.layer_idx, hidden_states.shape[1])
    x, z = _split_projection(module, hidden_states)
    weight, bias = _conv_weights(module)
    before = state.get("conv")
    if cache.chunk_lens is not None:   # a prefill chunk split along the sequence
        layout = contiguous_layout(cache.ulysses, cache.chunk_lens)
        x, state["conv"] = halo_conv(x, weight, bias, layout, activation=module.activation, before=before)
        x, dt, B, C, A = _after_conv(module, x)
        y, state["ssm"] = layout_recurrence(SelectiveScan(A), [x, dt, B, C], layout, None,
                                            initial=state.get("ssm"), with_final=True)
    else:                              # every rank holds the chunk whole
        state["conv"] = conv_history(before, x, weight.shape[-1])
        x = causal_conv1d(x, weight, bias, None, module.activation, history=before)
        x, dt, B, C, A = _after_conv(module, x)
        y, state["ssm"] = SelectiveScan(A).run([x, dt, B, C], state.get("ssm"))
    state["conv"], state["ssm"] = state["conv"].detach(), state["ssm"].detach()
    return _output(module, x, y, z, hidden_states.dtype)


def mamba1_forward(self, call, hidden_states: torch.Tensor, attention_mask=None, **_):
    """The layer's forward over the sequence (the module doc; the protocol around it:
    family.py)."""
    if attention_mask is not None and bool((attention_mask == 0).any()):
        raise ValueError(f"ulysses_kernels.hf: {type(self).__name__} got an attention_mask with zeros (padding); pass "
                         "unpadded (optionally packed) batches: ulysses_kernels.hf.shard_batch unpads them")
    layout = training_layout(call.context, call.lens)
    x, z = _split_projection(self, hidden_states)
    weight, bias = _conv_weights(self)
    x, _ = halo_conv(x, weight, bias, layout, cu_seqlens=call.cu_seqlens, activation=self.activation)
    x, dt, B, C, A = _after_conv(self, x)
    y = layout_recurrence(SelectiveScan(A), [x, dt, B, C], layout, call.cu_seqlens)
    return _output(self, x, y, z, hidden_states.dtype)




def placement_problem(module, world: int) -> Optional[str]:
    """Nothing of the layer is placed by heads: any SP size runs it."""
    return None


# the halo and the state passing follow the ring's chunks
FAMILY = Family("mamba1", (Adapter(MAMBA1_CLASSES, "mamba1", mamba1_forward, STATE_PASSING, problem=placement_problem,
                                   runs_on_a_ring=True, generation=generation_forward,
                                   cache_kept="its conv and scan states are kept there only"),),
                model_types=("mamba", "falcon_mamba", "jamba", "zamba"),
                planner_shape="mamba1")
