"""The guard (ulysses_kernels/hf/core/guard.py): what the package cannot make exactly
sequence-parallel raises `NotSequenceParallelError`, at the first place the package
meets the model (an entry point, or the model's first forward), the same on every rank.

One process (fast tier): each rule on real tiny transformers models (tiny_models.py) and
on stand-ins; bloom and GPT-NeoX-Japanese, which build their own attention (and would run
non-causal with the package's mask function), refused on one process too; a Llama whose
layer stops calling the attention function refused at that layer's end; Gemma 3 with
`token_type_ids` (bidirectional image blocks) refused. Two ranks (slow): the same errors
on both, through `causal_lm_loss`, `generate` and a plain forward, and nothing hangs.
"""

import re
from pathlib import Path

import pytest
import torch
from helpers import SPAWN_TIMEOUT, raised

pytest.importorskip("transformers", reason="ulysses_kernels.hf needs Hugging Face transformers "
                                           "(pip install -e '.[hf]' in the checkout)")

from tiny_models import build_tiny_model, tiny_config  # noqa: E402
from torch import nn  # noqa: E402

from ulysses_kernels import hf as ukhf  # noqa: E402
from ulysses_kernels.hf.core import guard, masks  # noqa: E402
from ulysses_kernels.hf.model import anatomy_of  # noqa: E402
from ulysses_kernels.launch import spawn  # noqa: E402


def _ids(S=23, seed=0):
    return torch.randint(3, 90, (1, S), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def registered():
    """register() on one process (no process group: SP 1)."""
    ukhf.register(None)
    yield


# ----------------------------------------------------------------------------- configs

def test_layer_kinds_other_than_attention_are_refused():
    assert guard.config_problem(tiny_config("llama")) is None
    assert guard.config_problem(tiny_config("llama4_text")) is None   # chunked layers: implemented
    assert "linear_attention" in guard.config_problem(tiny_config("qwen3_next"))
    assert "'conv'" in guard.config_problem(tiny_config("lfm2"))
    assert "'hybrid'" in guard.config_problem(tiny_config("falcon_h1"))
    assert "indexed_attention" in guard.config_problem(tiny_config("deepseek_v32"))
    assert guard.config_problem(tiny_config("dory")) is None   # 'mlp' layers are per token


def test_config_fields_the_attention_would_drop_are_refused():
    config = tiny_config("llama")
    config.is_causal = False
    assert "bidirectional" in guard.config_problem(config)
    config = tiny_config("llama")
    config.attention_chunk_size = 8   # chunks, but no layer says it is chunked
    assert "attention_chunk_size" in guard.config_problem(config)
    config = tiny_config("llama")
    config.index_topk = 16
    assert "indexer" in guard.config_problem(config)


# ----------------------------------------------------------------------------- modules

def test_mixer_names_are_matched_as_whole_words():
    for name in ("MambaMixer", "Qwen3NextGatedDeltaNet", "xLSTMBlock", "Lfm2ShortConv", "RecurrentGemmaRglru",
                 "MiniMaxLightningAttention", "DeepseekV32Indexer", "KimiDeltaAttention"):
        assert guard._names_a_mixer(name), name
    for name in ("GptOssMLP", "SeedOssMLP", "LlamaAttention", "Conv1D", "Gemma3DecoderLayer"):
        assert not guard._names_a_mixer(name), name


class _Layer(nn.Module):
    def __init__(self, extra):
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.extra = extra


class _Stack(nn.Module):
    def __init__(self, extra):
        super().__init__()
        self.layers = nn.ModuleList([_Layer(nn.Identity()), _Layer(extra)])


def test_sequence_mixing_modules_inside_the_layers_are_refused():
    assert guard.module_problem(anatomy_of(_Stack(nn.Linear(8, 8)))) is None
    assert guard.module_problem(anatomy_of(_Stack(nn.Conv1d(8, 8, kernel_size=1)))) is None   # per token
    assert "convolution or token shift along the sequence" in guard.module_problem(anatomy_of(_Stack(nn.Conv1d(8, 8, kernel_size=4))))
    assert "decoder layer 1, extra" in guard.module_problem(anatomy_of(_Stack(nn.Conv1d(8, 8, kernel_size=4, groups=8))))
    assert "recurrent module (GRU)" in guard.module_problem(anatomy_of(_Stack(nn.GRU(8, 8))))
    # a token shift (RWKV's `time_shift`): the previous token, by padding the sequence
    assert "ZeroPad2d, padding (0, 0, 1, -1)" in guard.module_problem(anatomy_of(_Stack(nn.ZeroPad2d((0, 0, 1, -1)))))
    assert guard.module_problem(anatomy_of(_Stack(nn.ZeroPad2d((1, 1, 0, 0))))) is None   # along the channels


def test_a_short_convolution_inside_the_attention_is_found():
    """Inkling 2 convolves its keys and values along the sequence (a depthwise conv in the
    k / v projection, not adapted yet): the module rule finds it even where the layer kinds
    would not tell."""
    from tiny_models import causal_lm_class

    model = causal_lm_class("inkling2_text")._from_config(tiny_config("inkling2_text"))
    assert "self_attn.k_proj.sconv.conv1d holds a convolution or token shift along the sequence" \
        in guard.module_problem(anatomy_of(model))


def test_models_that_number_positions_themselves_are_refused():
    assert guard.position_problem(anatomy_of(build_tiny_model("llama", "eager"))) is None
    assert "takes no position_ids" in guard.position_problem(anatomy_of(build_tiny_model("bart", "eager")))
    assert "padding index" in guard.position_problem(anatomy_of(build_tiny_model("roberta", "eager")))


def test_hand_written_attention_is_refused_before_its_forward():
    assert guard.interface_problem(anatomy_of(build_tiny_model("llama", "eager"))) is None
    assert "written by hand" in guard.interface_problem(anatomy_of(build_tiny_model("bloom", "eager")))


# ------------------------------------------------------------------- first forward, SP 1

@pytest.mark.parametrize("family", ["bloom", "gpt_neox_japanese"])
def test_families_that_ignore_the_attention_function_are_refused_on_one_process(registered, family):
    """With the package's mask function they would attend non-causally even on one device."""
    model = build_tiny_model(family, "ulysses")
    with pytest.raises(ukhf.NotSequenceParallelError, match="written by hand"):
        model(input_ids=_ids(), use_cache=False)


def test_a_layer_that_stops_calling_the_attention_function_is_refused(registered):
    """The call check (guard.install_call_checks): layer 1's attention replaced by one that
    computes its own output raises at that layer's end, naming it, during the first
    forward; the unchanged model runs."""
    model = build_tiny_model("llama", "ulysses")
    model(input_ids=_ids(), use_cache=False)
    broken = build_tiny_model("llama", "ulysses")

    class OwnAttention(nn.Module):
        def forward(self, hidden_states, **kwargs):
            return hidden_states.cumsum(dim=1), None   # mixes tokens without the attention function

    broken.model.layers[1].self_attn = OwnAttention()
    with pytest.raises(ukhf.NotSequenceParallelError, match="decoder layer 1 .*LlamaDecoderLayer.* without calling"):
        broken(input_ids=_ids(), use_cache=False)


def test_gemma3_image_blocks_are_refused(registered):
    """token_type_ids open image tokens both ways (transformers' blockwise overlay): refused;
    the same model on text alone runs."""
    model = build_tiny_model("gemma3", "ulysses")
    model(input_ids=_ids(), use_cache=False)
    token_types = torch.zeros(1, 23, dtype=torch.long)
    token_types[:, 5:9] = 1
    with pytest.raises(ukhf.NotSequenceParallelError, match="attend to later tokens"):
        model(input_ids=_ids(), token_type_ids=token_types, use_cache=False)


def test_a_mask_request_from_an_unknown_model_is_checked_by_its_config(registered):
    """The mask function called outside any model's forward (no model to find) still refuses
    a config it cannot honour, and lets a plain one through."""
    from ulysses_kernels.hf.core.masks import ulysses_mask_function

    with pytest.raises(ukhf.NotSequenceParallelError, match="model_type 'qwen3_next'.*linear_attention"):
        ulysses_mask_function(config=tiny_config("qwen3_next"))
    assert ulysses_mask_function(config=tiny_config("llama")) is None


def test_a_mask_overlay_is_refused():
    assert "overlays its own mask function" in masks.mask_request_problem(dict(use_vmap=True))
    assert masks.mask_request_problem(dict(allow_is_bidirectional_skip=True, use_vmap=False)) is None
    causal = dict(allow_is_causal_skip=False, batch_size=1, q_length=6, kv_length=6,
                  mask_function=lambda b, h, q, kv: kv <= q)
    assert masks.mask_request_problem(causal) is None
    opened = dict(causal, mask_function=lambda b, h, q, kv: (kv <= q) | ((q == 2) & (kv == 3)))
    assert "later tokens" in masks.mask_request_problem(opened)


def test_a_model_whose_attention_is_not_ulysses_is_refused_on_more_ranks_only():
    """causal_lm_loss of a model loaded with attn_implementation="sdpa" is fine on one
    process (SP 1) and is refused on more (slow test below)."""
    from ulysses_kernels.hf.core.attach import uses_ulysses_attention

    assert not uses_ulysses_attention(build_tiny_model("llama", "sdpa"))
    assert uses_ulysses_attention(build_tiny_model("llama", "ulysses"))


# ------------------------------------------------------------------- attention tables

def _own_attention_tables():
    """{family: table} of the installed transformers' causal LM modeling files that keep an
    attention-class table keyed by attn_implementation."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    root = Path(transformers.__file__).parent / "models"
    found = {}
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        folder = model_type.replace("-", "_")
        for path in (root / folder).glob("modeling_*.py"):
            for table in re.findall(r"^(\w+_ATTENTION_CLASSES)\s*=\s*\{", path.read_text(), flags=re.M):
                found[folder] = table
    return found


def test_every_causal_lm_family_with_its_own_attention_table_is_known():
    """OWN_ATTENTION_TABLES covers every causal LM family whose modeling file keeps an
    attention-class table keyed by attn_implementation (a KeyError at load otherwise); an
    entry the installed transformers lacks is one an earlier supported version has
    (falcon's, until 5.24)."""
    import transformers
    from packaging.version import Version

    found = _own_attention_tables()
    assert found.items() <= guard.OWN_ATTENTION_TABLES.items()
    former = {"falcon"} if Version(transformers.__version__) >= Version("5.25") else set()
    assert set(guard.OWN_ATTENTION_TABLES) - set(found) == former


@pytest.mark.parametrize("family", sorted(guard.OWN_ATTENTION_TABLES))
def test_families_with_their_own_attention_table_are_refused_at_load(registered, family):
    if family not in _own_attention_tables():
        pytest.skip(f"{family} has no attention table of its own in this transformers (the sweep covers it)")
    with pytest.raises(ukhf.NotSequenceParallelError, match="table of its own"):
        build_tiny_model(family, "ulysses")


# ------------------------------------------------------------------- two ranks

def _refusals(rank, world):
    """Each refusal on this rank: {case: message or None}."""
    import ulysses_kernels as uk

    groups = uk.init_sequence_parallel(world)
    ukhf.register(groups)
    out = {}

    def attempt(case, call):
        out[case] = raised(call, ukhf.NotSequenceParallelError)

    batch = ukhf.shard_batch(_ids(), groups)
    attempt("kolibri1_1 loss", lambda: ukhf.causal_lm_loss(build_tiny_model("kolibri1_1", "ulysses"), batch,
                                                                 groups))
    qwen3_next = build_tiny_model("qwen3_next", "ulysses")
    attempt("qwen3_next with a cache", lambda: qwen3_next(**dict(batch.model_inputs(), use_cache=True)))
    attempt("bloom forward", lambda: build_tiny_model("bloom", "ulysses")(**batch.model_inputs()))
    # dots3's sliding-window layers exchange heads (its DSA layers keep their queries on their shard)
    dots3 = build_tiny_model("dots3_note_text", "ulysses", overrides=dict(num_attention_heads=3, num_key_value_heads=3))
    attempt("dots3 sliding heads", lambda: ukhf.causal_lm_loss(dots3, batch, groups))
    attempt("sdpa loss", lambda: ukhf.causal_lm_loss(build_tiny_model("llama", "sdpa"), batch, groups))
    token_types = torch.zeros(1, 23, dtype=torch.long)
    token_types[:, 2:5] = 1   # image tokens on rank 0's shard only
    gemma = build_tiny_model("gemma3", "ulysses")
    attempt("gemma3 image blocks", lambda: gemma(**batch.model_inputs(), token_type_ids=batch.shard_tokens(token_types)))
    # a question-answering head on right-padded rows of unequal lengths, the documented calls
    rows = torch.randint(1, 50, (3, 11), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(rows)
    mask[0, 7:] = 0
    mask[2, 4:] = 0
    padded = ukhf.shard_batch(rows.masked_fill(mask == 0, 0), groups, attention_mask=mask)
    attempt("question answering forward", lambda: _head_model("llama", "QuestionAnswering")(**padded.model_inputs()))
    # met at its first call with shard_batch's inputs: another attention implementation on 2 ranks
    attempt("sdpa forward", lambda: build_tiny_model("llama", "sdpa")(**batch.model_inputs()))
    # the exact sequence-classification head, called without the rows of the batch
    rowless = {k: v for k, v in padded.model_inputs().items() if k != "ulysses_rows"}
    attempt("scores without rows", lambda: _head_model("llama", "SequenceClassification")(**rowless))
    ok = build_tiny_model("llama", "ulysses")
    out["llama after"] = float(ukhf.causal_lm_loss(ok, batch, groups))   # the group stays usable
    return out


@pytest.mark.slow
def test_refusals_are_the_same_on_every_rank():
    per_rank = spawn(_refusals, 2, timeout=SPAWN_TIMEOUT, start_method="forkserver",
                     preload=["torch", "transformers", "ulysses_kernels.hf"])
    cases = [c for c in per_rank[0] if c != "llama after"]
    for case in cases:
        messages = [r[case] for r in per_rank]
        assert messages[0] is not None, case
        assert messages[0] == messages[1], (case, messages)
    assert "indexed_attention" in per_rank[0]["kolibri1_1 loss"]
    assert "outside ulysses_kernels.hf.generate" in per_rank[0]["qwen3_next with a cache"]
    assert "written by hand" in per_rank[0]["bloom forward"]
    assert "query heads (3) must be divisible by the sequence-parallel size (2)" in per_rank[0]["dots3 sliding heads"]
    assert "'sdpa'" in per_rank[0]["sdpa loss"]
    assert "later tokens" in per_rank[0]["gemma3 image blocks"]
    assert "its head (LlamaForQuestionAnswering) pools over the sequence" in per_rank[0]["question answering forward"]
    assert "its attention implementation is 'sdpa'" in per_rank[0]["sdpa forward"]
    assert "did not say which row each token" in per_rank[0]["scores without rows"]
    assert per_rank[0]["llama after"] == per_rank[1]["llama after"]


# ------------------------------------------------------------------------ heads

def _head_model(family, head, base=None):
    """The family's tiny model with the transformers head class `<base>For<head>` (`base`:
    the causal LM's class name without `ForCausalLM`)."""
    import transformers
    from tiny_models import tiny_config

    config = tiny_config(family)
    config.pad_token_id = 0
    base = base or type(build_tiny_model(family, "sdpa")).__name__.replace("ForCausalLM", "")
    model_class = getattr(transformers, f"{base}For{head}")
    return model_class._from_config(config, attn_implementation="ulysses").double()


def test_heads_that_pool_over_the_sequence_are_refused(registered):
    """A head that pools over the sequence (a span's ends) would pool each rank's slice:
    refused where the package meets the model, not computed locally. transformers' generic
    sequence-classification head is made exact by register() (heads.py); a family's own
    sequence-classification class is refused."""
    model = _head_model("llama", "QuestionAnswering")
    with pytest.raises(ukhf.NotSequenceParallelError, match="its head \\(LlamaForQuestionAnswering\\) pools over"):
        ukhf.attach_context(model)
    assert guard.head_problem(anatomy_of(_head_model("llama", "SequenceClassification"))) is None   # heads.py
    assert "pools over the sequence" in guard.head_problem(anatomy_of(_head_model("gpt2", "SequenceClassification", "GPT2")))
    assert guard.head_problem(anatomy_of(_head_model("llama", "TokenClassification"))) is None   # per token: exact


def test_a_head_that_drops_the_positions_is_refused(registered):
    """Falcon's token-classification head does not pass position_ids on to its base model,
    which would number each rank's tokens from 0: refused at the forward, where the given
    positions fail to reach the model that numbers them (a causal LM head passes them)."""
    if "falcon" in _own_attention_tables():   # transformers 5.24: refused at load already
        with pytest.raises(ukhf.NotSequenceParallelError, match="table of its own"):
            _head_model("falcon", "TokenClassification")
        return
    model = _head_model("falcon", "TokenClassification")
    ukhf.attach_context(model)
    ids = torch.randint(1, 50, (1, 9))
    with pytest.raises(ukhf.NotSequenceParallelError, match="position_ids given to the model did not reach FalconModel"):
        model(input_ids=ids, position_ids=torch.arange(9).unsqueeze(0))
    model(input_ids=ids)   # no positions given: nothing to lose
    causal = build_tiny_model("llama", "ulysses")
    ukhf.attach_context(causal)
    causal(input_ids=ids, position_ids=torch.arange(9).unsqueeze(0), use_cache=False)


def test_a_pooler_in_the_text_model_is_refused(registered):
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, is_decoder=True)
    assert "BertPooler" in guard.head_problem(anatomy_of(BertModel(config)))
    assert guard.head_problem(anatomy_of(BertModel(config, add_pooling_layer=False))) is None


def test_keywords_the_attention_function_would_ignore():
    """A sparse attention's key selection is refused wherever it comes from; any other
    keyword with a value is refused when the model's layers added it on the way down, and
    passes when it was an input of the model's forward (a collator's extra field)."""
    from ulysses_kernels.hf.core.attention import ignored_keyword_problem

    assert ignored_keyword_problem(dict(position_ids=1, use_cache=False, sliding_window=4, s_aux=None)) is None
    assert ignored_keyword_problem(dict(indices=1, block_indices=2), {"indices"}) == "block_indices=, indices="
    assert ignored_keyword_problem(dict(compressed_keys=1)) == "compressed_keys="
    assert ignored_keyword_problem(dict(second_per_grid_ts=1), {"second_per_grid_ts"}) is None
    assert ignored_keyword_problem(dict(second_per_grid_ts=None)) is None
