"""A users' own model made sequence-parallel in one declaration (docs/hf_custom.md;
ulysses_kernels/hf/families/by_heads/declared.py, halo/declared.py): examples/custom_family.py's
hybrid (a short convolution and a head-wise linear mixer beside Llama's attention, none of it
known to the package), declared in the example and nowhere else, one training step at SP 2 and
SP 3 (uneven shards: 23 = 8 + 8 + 7) on one document and on two packed documents, against one
process running each document on its own in float64: the loss and every gradient.

And what a declaration must not let through, each the same error on every rank: the model
undeclared (the guard), a method declared by heads that ignores which heads it holds, a halo
narrower than what the method reads, a method that is not causal, a declared method the
layer's forward never calls, and generation; a class declared twice, and the declaration taken
back.
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
from ulysses_kernels.hf.families.adapters import ADAPTERS, DECLARED  # noqa: E402
from ulysses_kernels.launch import spawn  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
TOLERANCE = 1e-10   # float64 on both sides


def _example():
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import custom_family

    return custom_family


def _sp_worker(rank, world):
    import ulysses_kernels as uk

    example = _example()
    groups = uk.init_sequence_parallel(world)
    ukhf.register(groups)
    example.declare()
    model = example.tiny_model("ulysses", dtype=torch.float64)
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
    finally:
        ukhf.undeclare_family("toy_hybrid")
    assert ADAPTERS == before and "toy_hybrid" not in DECLARED


def _mutated_worker(rank, world, mutation):
    import ulysses_kernels as uk
    from ulysses_kernels.hf import NotSequenceParallelError

    example = _example()
    groups = uk.init_sequence_parallel(world)
    ukhf.register(groups)
    mix_heads, convolve = example.ToyLinearMixer.mix_heads, example.ToyShortConv.convolve
    if mutation == "heads ignored":   # the decays of heads 0.. whatever heads the method holds
        example.ToyLinearMixer.mix_heads = lambda self, q, k, v, heads=None: mix_heads(self, q, k, v,
                                                                                       heads=range(q.shape[2]))
    if mutation == "not causal":      # reads the tokens after each token too
        example.ToyShortConv.convolve = lambda self, x: convolve(self, x) + convolve(self, x.flip(1)).flip(1)
    width = 1 if mutation == "halo too narrow" else 3
    method = "mix_heads_never_called" if mutation == "method not called" else "mix_heads"
    example.ToyLinearMixer.mix_heads_never_called = mix_heads
    declarations = () if mutation == "undeclared" else (
        ukhf.by_heads(example.ToyLinearMixer, method=method),
        ukhf.halo(example.ToyShortConv, method="convolve", width=width))
    if declarations:
        ukhf.declare_family("toy_hybrid", *declarations)
    model = example.tiny_model("ulysses", dtype=torch.float64)
    try:
        sp_step(model, None, groups.sp_group)
    except NotSequenceParallelError as error:
        return str(error)
    return "ran"


@pytest.mark.slow
@pytest.mark.parametrize("mutation,message", [
    ("undeclared", "config.layer_types has layers of kind 'linear_mixer', 'short_conv'"),
    ("heads ignored", "ToyLinearMixer.mix_heads on heads 3..5 alone gives another result than over all heads"),
    ("halo too narrow", "ToyShortConv.convolve reads more than its declared width of 1 earlier inputs"),
    ("not causal", "ToyShortConv.convolve is not causal"),
    ("method not called", "ToyLinearMixer's forward did not call mix_heads_never_called"),
])
def test_a_wrong_declaration_is_refused_on_every_rank(mutation, message):
    """What a declaration gets wrong refuses the model, the same message on both ranks."""
    messages = spawn(_mutated_worker, 2, args=(mutation,), timeout=SPAWN_TIMEOUT)
    print(f"{mutation}: {messages[0]}")
    assert messages[0] == messages[1] and message in messages[0], messages


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
