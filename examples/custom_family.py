"""Your own model made sequence-parallel in one declaration (docs/hf_custom.md): a hybrid the
package does not know, with a short convolution and a head-wise linear mixer beside Llama's
attention, plus the lines marked `# SP`.

    torchrun --nproc-per-node 2 examples/custom_family.py --steps 3

CPU (gloo) or GPUs. The model and the documents are tiny and random. The declaration says, of
each layer class that mixes tokens without attention, which mechanism it follows and which of
its methods does the mixing: `ToyShortConv.convolve` reads 3 earlier tokens (the halo),
`ToyLinearMixer.mix_heads` mixes tokens within each head (the head exchange). The attention
layers need nothing: they call transformers' attention interface.
"""

import argparse

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaMLP, LlamaRMSNorm


class ToyHybridConfig(LlamaConfig):
    model_type = "toy_hybrid"

    def __init__(self, layer_types=("short_conv", "linear_mixer", "full_attention"), conv_kernel=4, **kwargs):
        kwargs.setdefault("num_hidden_layers", len(layer_types))
        super().__init__(**kwargs)
        self.layer_types = list(layer_types)
        self.conv_kernel = conv_kernel


class ToyShortConv(nn.Module):
    """`y = C * conv(B * x)`: a depthwise causal convolution between two projections."""

    def __init__(self, config):
        super().__init__()
        width = config.hidden_size
        self.in_proj = nn.Linear(width, 3 * width, bias=False)
        self.conv = nn.Conv1d(width, width, config.conv_kernel, groups=width, padding=config.conv_kernel - 1)
        self.out_proj = nn.Linear(width, width, bias=False)

    def forward(self, hidden_states, **kwargs):
        b, c, x = self.in_proj(hidden_states).chunk(3, dim=-1)
        return self.out_proj(c * self.convolve(b * x))

    def convolve(self, x):
        """[B, S, C] -> [B, S, C], each output from its token and the `conv_kernel - 1` before it."""
        return self.conv(x.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)


class ToyLinearMixer(nn.Module):
    """Causal linear attention with a decay per head: `y_t = sum_{s<=t} decay_h^(t-s) (q_t . k_s) v_s`."""

    def __init__(self, config):
        super().__init__()
        self.heads, self.head_dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.log_decay = nn.Parameter(-torch.linspace(0.05, 0.5, self.heads))
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, **kwargs):
        B, S, _ = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(B, S, 3, self.heads, self.head_dim).unbind(2)
        return self.o_proj(self.mix_heads(q, k, v).reshape(B, S, -1))

    def mix_heads(self, q, k, v, heads=None):
        """[B, S, H, D] each -> [B, S, H, D]; `heads`: the heads given (all when None)."""
        decay = self.log_decay if heads is None else self.log_decay[heads.start:heads.stop]
        steps = torch.arange(q.shape[1], device=q.device)
        age = (steps[:, None] - steps[None, :]).to(q.dtype)
        weights = torch.where(age >= 0, torch.exp(decay[:, None, None] * age.clamp(min=0)), 0.0)
        scores = torch.einsum("bthd,bshd->bhts", q, k) * weights / self.head_dim ** 0.5
        return torch.einsum("bhts,bshd->bthd", scores, v)


class ToyBlock(GradientCheckpointingLayer):
    """A pre-norm residual block: a token mixer, then Llama's MLP (checkpointed whole by
    `gradient_checkpointing_enable()`, as transformers' decoder layers are)."""

    def __init__(self, config, mixer):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mixer = mixer
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, cache=None,
                use_cache=False, **kwargs):
        hidden_states = hidden_states + self.mixer(self.input_layernorm(hidden_states), **kwargs)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def make_layer(config, index: int, kind: str) -> nn.Module:
    if kind == "short_conv":
        return ToyBlock(config, ToyShortConv(config))
    if kind == "linear_mixer":
        return ToyBlock(config, ToyLinearMixer(config))
    return LlamaDecoderLayer(config, index)


class ToyHybridModel(LlamaModel):
    config_class = ToyHybridConfig

    def __init__(self, config):
        super().__init__(config)
        self.layers = nn.ModuleList(make_layer(config, i, kind) for i, kind in enumerate(config.layer_types))
        self.post_init()


class ToyHybridForCausalLM(LlamaForCausalLM):
    config_class = ToyHybridConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = ToyHybridModel(config)
        self.post_init()


def declare():  # SP: the one declaration
    from ulysses_kernels import hf as ukhf

    return ukhf.declare_family(
        "toy_hybrid",
        ukhf.halo(ToyShortConv, method="convolve", width=lambda layer: layer.conv.kernel_size[0] - 1),
        ukhf.by_heads(ToyLinearMixer, method="mix_heads"))


def tiny_model(attn_implementation: str, seed: int = 0, dtype=torch.float32) -> ToyHybridForCausalLM:
    """The tiny random model: 6 heads of 8 (split over 2 or 3 ranks), each layer kind twice."""
    config = ToyHybridConfig(layer_types=("short_conv", "linear_mixer", "full_attention") * 2, vocab_size=96,
                             hidden_size=48, intermediate_size=96, num_attention_heads=6, num_key_value_heads=6,
                             max_position_embeddings=1024, use_cache=False, tie_word_embeddings=False)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    return ToyHybridForCausalLM(config).to(dtype)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=256)
    args = p.parse_args(argv)

    import torch.distributed as dist

    import ulysses_kernels as uk
    from ulysses_kernels import hf as ukhf

    launched = not dist.is_initialized()   # by torchrun (else inside a test's process group)
    if launched:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count()) if torch.cuda.is_available() \
        else torch.device("cpu")
    groups = uk.init_sequence_parallel(dist.get_world_size())  # SP: every rank in one SP group
    ukhf.register(groups)                                       # SP
    declare()                                                   # SP
    model = tiny_model("ulysses").to(device)                    # SP: attn_implementation="ulysses"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)   # the same documents on every rank of the SP group
    for step in range(args.steps):
        ids = torch.randint(0, model.config.vocab_size, (1, args.seq_len), generator=generator).to(device)
        batch = ukhf.shard_batch(ids, groups.sp_group)                # SP: this rank's slice
        loss = ukhf.causal_lm_loss(model, batch, groups.sp_group)     # SP: the mean over the whole sequence
        loss.backward()
        ukhf.allreduce_gradients(model, groups.sp_group, groups.dp_group)   # SP
        optimizer.step()
        optimizer.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    if launched:
        dist.destroy_process_group()
    return loss.item()


if __name__ == "__main__":
    main()
