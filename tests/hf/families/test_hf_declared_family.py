"""A users' own model made sequence-parallel in one declaration (docs/hf_custom.md;
ulysses_kernels/hf/families/by_heads/declared.py, halo/declared.py): examples/custom_family.py's
hybrid (a short convolution and a head-wise linear mixer beside Llama's attention, none of it
known to the package), declared in the example and nowhere else, one training step at SP 2 and
SP 3 (uneven shards: 23 = 8 + 8 + 7) on one document and on two packed documents, against one
process running each document on its own in float64: the loss and every gradient.

And what a declaration must not let through, each the same error on every rank (MUTATIONS):
the model undeclared (the guard); a method declared by heads that ignores which heads it
holds, also when its per-head parameters are equal (their gradients go astray) or frozen and
equal until set through `.data` (the probe runs again on new values); a halo narrower
than what the method reads (a plain and a dilated convolution); a method that is not causal,
or starts from a learned token instead of zeros; a declared method the layer's forward never
calls; a convolution of the layer run outside its declared method; the method checkpointed by
itself (recomputed outside the layer's forward); and generation. A class declared twice, and
the declaration taken back (modules adapted under it keep their adapter).
"""

import sys
from pathlib import Path

import pytest
import torch
from helpers import SLOW_SPAWN_TIMEOUT, SPAWN_TIMEOUT

pytest.importorskip("transformers", reason="ulysses_kernels.hf needs Hugging Face transformers "
                                           "(pip install -e '.[hf]' in the checkout)")

from sweep import DOCUMENTS, largest_error, reference_step, sp_step  # noqa: E402

from ulysses_kernels import hf as ukhf  # noqa: E402
from ulysses_kernels.hf.families.adapters import (  # noqa: E402
    ADAPTERS,
    DECLARED,
    adapted_kind,
    install_adapters,
    uninstall_adapters,
)
from ulysses_kernels.launch import spawn  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
TOLERANCE = 1e-10   # float64 on both sides


def _example():
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import custom_family

    return custom_family


def _sp_worker(rank, world, checkpointing=None):
    import ulysses_kernels as uk

    example = _example()
    groups = uk.init_sequence_parallel(world)
    ukhf.register(groups)
    example.declare()
    model = example.tiny_model("ulysses", dtype=torch.float64)
    if checkpointing is not None:   # every block recomputed in the backward, the probes not again
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=checkpointing))
        model.train()
    out = {}
    for case, documents in DOCUMENTS.items():
        model.zero_grad(set_to_none=True)
        out[case] = sp_step(model, documents, groups.sp_group)
    return out


def _references():
    from family_cases import register_exact_eager

    model = _example().tiny_model(register_exact_eager(), dtype=torch.float64)
    out = {}
    for case, documents in DOCUMENTS.items():
        model.zero_grad(set_to_none=True)
        out[case] = reference_step(model, documents)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_the_declared_model_trains_as_on_one_process(world):
    """The example's model at SP `world`, its one declaration, against one process."""
    reference = _references()
    for rank, steps in enumerate(spawn(_sp_worker, world, timeout=SLOW_SPAWN_TIMEOUT)):
        for case, step in steps.items():
            error, where = largest_error(step, reference[case])
            print(f"SP {world} rank {rank}, {case}: worst rel err {error:.1e} ({where})")
            assert error < TOLERANCE, (world, rank, case, where, error)


@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [False, True])
def test_the_declared_model_trains_with_activation_checkpointing(reentrant):
    """transformers' gradient checkpointing of every block (the declared layers recomputed in the
    backward, non-reentrant: the same tensors saved as in the forward, which the probes' own
    must not add to) at SP 2, against one process."""
    reference = _references()
    for rank, steps in enumerate(spawn(_sp_worker, 2, args=(reentrant,), timeout=SLOW_SPAWN_TIMEOUT)):
        for case, step in steps.items():
            error, where = largest_error(step, reference[case])
            assert error < TOLERANCE, (reentrant, rank, case, where, error)


def test_the_declaration_adapts_only_the_declared_classes():
    """The declaration registers its two classes (and nothing is left after it is taken back)."""
    example = _example()
    before = dict(ADAPTERS)
    family = example.declare()
    try:
        assert set(family.classes) == {"ToyShortConv", "ToyLinearMixer"}
        assert set(ADAPTERS) - set(before) == set(family.classes)
        assert example.declare().classes == family.classes   # declared again: replaced, not doubled
        with pytest.raises(ValueError, match="adapted twice"):
            ukhf.declare_family("another", ukhf.halo(example.ToyShortConv, method="convolve", width=3))
        with pytest.raises(ValueError, match="family of the package's own"):
            ukhf.declare_family("short_conv", ukhf.halo(example.ToyShortConv, method="convolve", width=3))
        with pytest.raises(ValueError, match="no method"):
            ukhf.by_heads(example.ToyLinearMixer, method="mix").members(example.ToyLinearMixer)
        model = example.tiny_model("sdpa")
        adapted = install_adapters(model)
        assert sorted(adapted_kind(m) for m in adapted) == ["declared by heads"] * 2 + ["declared halo"] * 2
    finally:
        ukhf.undeclare_family("toy_hybrid")
    assert ADAPTERS == before and "toy_hybrid" not in DECLARED
    # modules adapted under the declaration keep their adapter until they are taken off
    assert sorted(adapted_kind(m) for m in adapted) == ["declared by heads"] * 2 + ["declared halo"] * 2
    uninstall_adapters(model)
    assert not any(adapted_kind(m) for m in model.modules())


# mutation -> what every rank must say (the test below)
MUTATIONS = {
    "undeclared": "config.layer_types has layers of kind 'linear_mixer', 'short_conv'",
    "heads ignored": "ToyLinearMixer.mix_heads on heads 3..5 alone gives another result than over all heads",
    "heads ignored, decays equal": "ToyLinearMixer.mix_heads on each rank's heads alone gives its parameters other "
                                   "gradients than over all heads",
    "heads ignored, frozen decays equal until set through .data": "ToyLinearMixer.mix_heads on heads 3..5 alone "
                                                                  "gives another result",
    "halo too narrow": "ToyShortConv.convolve reads more than its declared width of 1 earlier inputs",
    "dilated convolution": "ToyShortConv.convolve reads more than its declared width of 3 earlier inputs",
    "not causal": "ToyShortConv.convolve is not causal",
    "learned start": "ToyShortConv.convolve does not read zeros as its history before the first token",
    "method not called": "ToyLinearMixer's forward did not call mix_heads_never_called",
    "convolution outside the method": "ToyLinearMixer.v_conv is a convolution or token shift along the sequence "
                                      "(Conv1d, kernel (3,)), run outside mix_heads",
    "method checkpointed alone": "a declared method of ToyLinearMixer was called outside the layer's forward",
}


def _mutate(example, mutation):
    """Change the example's classes as `mutation` says; returns (declarations, model)."""
    from torch import nn

    mixer, conv = example.ToyLinearMixer, example.ToyShortConv
    mix_heads, convolve, mixer_forward = mixer.mix_heads, conv.convolve, mixer.forward
    if mutation.startswith("heads ignored"):   # the decays of heads 0.. whatever heads the method holds
        mixer.mix_heads = lambda self, q, k, v, heads=None: mix_heads(self, q, k, v, heads=range(q.shape[2]))
    if mutation == "not causal":      # reads the tokens after each token too
        conv.convolve = lambda self, x: convolve(self, x) + convolve(self, x.flip(1)).flip(1)
    if mutation == "learned start":   # a token shift from a start of its own, not zeros
        conv.convolve = lambda self, x: convolve(self, x) + torch.cat([torch.ones_like(x[:, :1]), x[:, :-1]], dim=1)
    if mutation == "convolution outside the method":   # a convolution of v in the forward, not in mix_heads
        def forward(self, hidden_states, **kwargs):
            B, S, _ = hidden_states.shape
            q, k, v = self.qkv(hidden_states).view(B, S, 3, self.heads, self.head_dim).unbind(2)
            v = self.v_conv(v.reshape(B, S, -1).transpose(1, 2))[..., :S].transpose(1, 2).reshape(v.shape)
            return self.o_proj(self.mix_heads(q, k, v).reshape(B, S, -1))
        mixer.forward = forward
    if mutation == "method checkpointed alone":   # recomputed in the backward, outside the layer's forward
        def forward(self, hidden_states, **kwargs):
            B, S, _ = hidden_states.shape
            q, k, v = self.qkv(hidden_states).view(B, S, 3, self.heads, self.head_dim).unbind(2)
            core = torch.utils.checkpoint.checkpoint(self.mix_heads, q, k, v, use_reentrant=True)
            return self.o_proj(core.reshape(B, S, -1))
        mixer.forward = forward
    mixer.mix_heads_never_called = mix_heads
    width = 1 if mutation == "halo too narrow" else (lambda layer: layer.conv.kernel_size[0] - 1)
    method = "mix_heads_never_called" if mutation == "method not called" else "mix_heads"
    declarations = () if mutation == "undeclared" else (ukhf.by_heads(mixer, method=method),
                                                       ukhf.halo(conv, method="convolve", width=width))
    model = example.tiny_model("ulysses", dtype=torch.float64)
    for module in model.modules():
        if mutation == "dilated convolution" and isinstance(module, conv):   # reads 3 x 3 tokens back
            module.conv = nn.Conv1d(48, 48, 4, groups=48, padding=9, dilation=3, dtype=torch.float64)
        if mutation == "convolution outside the method" and isinstance(module, mixer):
            module.v_conv = nn.Conv1d(48, 48, 3, groups=48, padding=2, dtype=torch.float64)
        if mutation.startswith("heads ignored, ") and isinstance(module, mixer):
            with torch.no_grad():
                module.log_decay.fill_(-0.1)
            module.log_decay.requires_grad_("frozen" not in mutation)
    restore = dict(mix_heads=mix_heads, convolve=convolve, forward=mixer_forward)
    return declarations, model, restore


def _mutated_worker(rank, world):
    """Every mutation in turn on this rank: {mutation: the refusal's message, or "ran"}."""
    import ulysses_kernels as uk
    from ulysses_kernels.hf import NotSequenceParallelError

    example = _example()
    groups = uk.init_sequence_parallel(world)
    ukhf.register(groups)
    said = {}
    for mutation in MUTATIONS:
        declarations, model, restore = _mutate(example, mutation)
        if declarations:
            ukhf.declare_family("toy_hybrid", *declarations)
        try:
            sp_step(model, None, groups.sp_group)
            if "through .data" in mutation:   # the decays set apart the way a hand-written loop may
                for module in model.modules():
                    if isinstance(module, example.ToyLinearMixer):
                        module.log_decay.data.copy_(-torch.linspace(0.05, 0.5, 6, dtype=torch.float64))
                sp_step(model, None, groups.sp_group)
            said[mutation] = "ran"
        except NotSequenceParallelError as error:
            said[mutation] = str(error)
        finally:
            ukhf.undeclare_family("toy_hybrid")
            example.ToyLinearMixer.mix_heads, example.ToyLinearMixer.forward = restore["mix_heads"], restore["forward"]
            example.ToyShortConv.convolve = restore["convolve"]
    return said


@pytest.mark.slow
def test_a_wrong_declaration_is_refused_on_every_rank():
    """What a declaration (or the layer around its method) gets wrong refuses the model, the
    same message on both ranks (MUTATIONS)."""
    said = spawn(_mutated_worker, 2, timeout=SPAWN_TIMEOUT)
    for mutation, message in MUTATIONS.items():
        print(f"{mutation}: {said[0][mutation]}")
        assert said[0][mutation] == said[1][mutation] and message in said[0][mutation], (mutation, said)


def _generation_worker(rank, world):
    import ulysses_kernels as uk
    from ulysses_kernels.hf import NotSequenceParallelError

    example = _example()
    groups = uk.init_sequence_parallel(world)
    ukhf.register(groups)
    example.declare()
    model = example.tiny_model("ulysses", dtype=torch.float64)
    try:
        ukhf.generate(model, torch.arange(8)[None], groups.sp_group, max_new_tokens=2)
    except NotSequenceParallelError as error:
        return str(error)
    return "generated"


@pytest.mark.slow
def test_generation_of_a_declared_model_is_refused_on_every_rank():
    messages = spawn(_generation_worker, 2, timeout=SPAWN_TIMEOUT)
    assert messages[0] == messages[1] and "a layer of a users' declaration" in messages[0], messages


def _example_worker(rank, world):
    return _example().main(["--steps", "2", "--seq-len", "40"])


@pytest.mark.slow
def test_the_example_trains_at_sp_2():
    """examples/custom_family.py's main() in the spawned group (what torchrun runs): both ranks
    end with the same loss."""
    losses = spawn(_example_worker, 2, timeout=SPAWN_TIMEOUT)
    assert losses[0] == losses[1] and 0 < losses[0] < 10, losses


def test_declared_attention_passes_the_guard_by_its_name():
    """An attention class whose name reads as another mixer ("Retention") and whose forward
    reaches the interface through its base is refused by name, and passes once declared."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    from ulysses_kernels.hf.core.guard import module_problem
    from ulysses_kernels.hf.model import anatomy_of

    class ToyRetention(LlamaAttention):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    _example()
    from _tiny import tiny_model  # examples/_tiny.py: a tiny Llama

    model = tiny_model("sdpa")
    model.model.layers[1].self_attn.__class__ = ToyRetention
    assert "a token mixer that is not attention (ToyRetention)" in module_problem(anatomy_of(model))
    ukhf.declare_family("toy_retention", ukhf.interface_attention(ToyRetention))
    try:
        assert "ToyRetention" not in (module_problem(anatomy_of(model)) or "")
    finally:
        ukhf.undeclare_family("toy_retention")
    assert "ToyRetention" in module_problem(anatomy_of(model))


def test_a_declared_layer_watches_its_own_modules_only():
    """The modules a declared layer's forward watches (mixers._watched): its own convolutions,
    not those inside another adapted layer it holds, whose adapter answers for them."""
    from torch import nn

    from ulysses_kernels.hf.families.mixers import _watched

    example = _example()
    example.declare()
    try:
        outer = nn.Module()
        outer.own = nn.Conv1d(48, 48, 3, padding=2)
        outer.inner = example.ToyShortConv(example.tiny_model("sdpa").config)
        install_adapters(outer)
        assert adapted_kind(outer.inner) == "declared halo"
        assert [name for name, _, _ in _watched(outer)] == ["own"]
        assert [name for name, _, _ in _watched(outer.inner)] == ["conv"]
    finally:
        ukhf.undeclare_family("toy_hybrid")
