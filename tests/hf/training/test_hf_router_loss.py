"""Which load-balancing loss the package adds for a mixture of experts (ulysses_kernels/hf/
training/router_loss.py), one process, no process group: the terms are read where each
family's own forward reads them (JetMoE's `aux_loss_coef`, which the package used to miss
and so dropped its router loss; a vision-language model's text config, as Qwen3.5-MoE's
forward reads it), a coefficient of 0 adds none, and a family whose
`load_balancing_loss_func` is not the one `router_aux_loss` computes (Doge's, or any
function changed under it) is refused rather than given another loss."""

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from ulysses_kernels.hf import NotSequenceParallelError  # noqa: E402
from ulysses_kernels.hf.training import router_loss  # noqa: E402
from ulysses_kernels.hf.training.loss import router_aux_loss  # noqa: E402

TINY = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, intermediate_size=64, output_router_logits=True)
FAMILIES = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5),
    "qwen3_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, router_aux_loss_coef=0.25),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5,
                    layer_types=["full_attention"] * 2),
    # JetMoE's forward weighs its loss by `aux_loss_coef` (no router_aux_loss_coef)
    "jetmoe": dict(num_local_experts=4, num_experts_per_tok=2, aux_loss_coef=0.3, kv_channels=8,
                   num_key_value_heads=None),
}


def tiny(family, **extra):
    import transformers

    fields = {k: v for k, v in {**TINY, **FAMILIES.get(family, {}), **extra}.items() if v is not None}
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(family, **fields))


def assert_the_forwards_router_loss(model, terms):
    """The model's own loss minus its cross-entropy (a real forward) is the package's
    `router_aux_loss` with `terms`, on the forward's router logits."""
    ids = torch.randint(0, 64, (1, 11), generator=torch.Generator().manual_seed(1))
    out = model(input_ids=ids, labels=ids)
    plain = torch.nn.functional.cross_entropy(out.logits[0, :-1].float(), ids[0, 1:])
    ours = terms.coefficient * router_aux_loss(out.router_logits, terms.num_experts, terms.top_k, local=True)
    assert abs(float(out.loss - plain) - float(ours)) < 1e-5


@pytest.mark.parametrize("family,experts,coefficient", [("mixtral", 4, 0.5), ("qwen3_moe", 6, 0.25),
                                                         ("gpt_oss", 4, 0.5), ("jetmoe", 4, 0.3)])
def test_the_terms_are_the_ones_the_family_forward_reads(family, experts, coefficient):
    """And with them the package's loss is the family's own: its forward's loss minus its
    cross-entropy, on a real forward's router logits."""
    model = tiny(family)
    terms = router_loss.router_loss_of(model)
    assert terms == router_loss.RouterLoss(experts, 2, coefficient)
    assert_the_forwards_router_loss(model, terms)


def test_a_vision_language_model_reads_its_text_config():
    """Qwen3.5-MoE's ForConditionalGeneration keeps the terms on `config.text_config` only
    (its forward reads `self.config.text_config.router_aux_loss_coef`): they are read there,
    and the package's loss is the forward's own."""
    import transformers

    text = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
                num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.25,
                linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                layer_types=["linear_attention", "full_attention"])
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
                  temporal_patch_size=1, spatial_merge_size=1)
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForConditionalGeneration(
        transformers.AutoConfig.for_model("qwen3_5_moe", text_config=text, vision_config=vision))
    terms = router_loss.router_loss_of(model)
    assert terms == router_loss.RouterLoss(4, 2, 0.25)
    assert_the_forwards_router_loss(model, terms)


def test_a_zero_coefficient_adds_no_loss():
    assert router_loss.router_loss_of(tiny("qwen3_moe", router_aux_loss_coef=0.0)) is None


def test_a_family_with_another_load_balancing_loss_is_refused():
    """Doge's load_balancing_loss_func takes its keys before top-k (another loss)."""
    model = tiny("doge", num_experts=16, num_experts_per_tok=2, is_moe=True, router_aux_loss_coef=0.5)
    with pytest.raises(NotSequenceParallelError, match="DogeForCausalLM .* its load_balancing_loss_func is not "
                                                       "transformers' Switch-Transformer loss"):
        router_loss.router_loss_of(model)


def test_a_changed_loss_function_is_refused(monkeypatch):
    """The check compares values: a family whose function computed anything else (here
    twice the loss) would be refused, naming both values."""
    import sys

    model = tiny("mixtral")
    module = sys.modules[type(model).__module__]
    own = module.load_balancing_loss_func
    monkeypatch.setattr(module, "load_balancing_loss_func", lambda *args: 2 * own(*args))
    monkeypatch.setattr(router_loss, "_CHECKED", {})
    with pytest.raises(NotSequenceParallelError, match=r"\(4.1\d+ against 2.0\d+ on the same router logits\)"):
        router_loss.router_loss_of(model)
