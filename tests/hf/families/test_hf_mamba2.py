"""The Mamba2 mixers of Bamba, Nemotron-H, Falcon-H1, GraniteMoeHybrid and Zamba2 under
sequence parallelism (ulysses_kernels/hf/families/by_heads/mamba2.py).

Fast tier (one process): the chunked scan against the step-by-step recurrence, with
initial states and several documents; the convolution with documents against each
document's own `F.conv1d`; each family's adapted mixer on a packed row of two documents
(9 + 14 tokens) against transformers' mixer run on each document alone, output and every
gradient. Slow tier: the same at SP 2, 3 and 4 (gloo), each rank holding its
`tensor_split` shard, with groups split, groups replicated (more ranks than groups) and
heads replicated (more ranks than heads); and the refusals, the same on every rank.

Precision: transformers' Mamba2 path upcasts to float32 (`.float()`, `.to(torch.float32)`
in the scan and the gated norm), which for a float64 module is a downcast. The exact
comparisons run under `hf_keeps_float64`, which makes those casts keep float64 tensors
float64, for the reference and for the adapter's call of the module's own norm (the
adapter's scan computes in float64 by itself). A float32 test runs without it.
"""

import importlib

import pytest
import torch
import torch.nn.functional as F
from family_cases import hf_keeps_float64  # noqa: F401 (the hybrid tests import it from here too)
from helpers import SLOW_SPAWN_TIMEOUT, randn, rel_err, shard

pytest.importorskip("transformers", reason="ulysses_kernels.hf needs Hugging Face transformers "
                                           "(pip install -e '.[hf]' in the checkout)")

from ulysses_kernels.hf.families.adapters import install_adapters  # noqa: E402
from ulysses_kernels.hf.families.by_heads.mamba2 import placement_problem  # noqa: E402
from ulysses_kernels.hf.families.by_heads.ssd_scan import scan_documents, ssd_scan  # noqa: E402
from ulysses_kernels.hf.families.mixers import causal_conv1d, document_starts, original_forward  # noqa: E402
from ulysses_kernels.hf.model import record_of  # noqa: E402
from ulysses_kernels.layout import split_lengths  # noqa: E402

HIDDEN, STATE, CONV, CHUNK = 64, 8, 4, 8
CU_SEQLENS = [0, 9, 23]   # two packed documents; the second spans chunks 9..16 and 17..22 of its own
TOTAL = CU_SEQLENS[-1]
TIME_STEP_LIMIT = (0.05, 0.6)   # narrower than the steps the random weights give: the clamp acts
FAMILIES = ("bamba", "nemotron_h", "falcon_h1", "falcon_h1_no_norm", "falcon_h1_norm_after_gate",
            "granitemoehybrid", "zamba2")


# ------------------------------------------------------------------------ tiny mixers

def _config(family: str, heads: int, groups: int, head_dim: int):
    """A tiny config of `family` whose layer 0 is a Mamba2 mixer of `heads` x `head_dim`
    with `groups` groups, state 8, kernel 4, chunks of 8."""
    import transformers

    inner = heads * head_dim
    common = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=64)
    mamba = dict(mamba_n_heads=heads, mamba_d_head=head_dim, mamba_n_groups=groups, mamba_d_state=STATE,
                 mamba_d_conv=CONV, mamba_chunk_size=CHUNK)
    if family == "bamba":
        return transformers.BambaConfig(**common, **mamba, mamba_expand=inner // HIDDEN, attn_layer_indices=[1])
    if family == "granitemoehybrid":
        return transformers.GraniteMoeHybridConfig(**common, **mamba, mamba_expand=inner // HIDDEN,
                                                   layer_types=["mamba", "attention"])
    if family.startswith("falcon_h1"):
        return transformers.FalconH1Config(**common, **mamba, mamba_d_ssm=inner, ssm_in_multiplier=1.7,
                                           ssm_multipliers=[0.6, 1.4, 0.8, 1.25, 0.9],
                                           mamba_rms_norm=family != "falcon_h1_no_norm",
                                           mamba_norm_before_gate=family == "falcon_h1")
    if family == "nemotron_h":
        return transformers.NemotronHConfig(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=16, vocab_size=64, layers_block_type=["mamba", "attention"],
                                            mamba_num_heads=heads, mamba_head_dim=head_dim, n_groups=groups,
                                            ssm_state_size=STATE, conv_kernel=CONV, chunk_size=CHUNK)
    if family == "zamba2":
        return transformers.Zamba2Config(hidden_size=HIDDEN, num_hidden_layers=2, layers_block_type=["mamba", "mamba"],
                                         num_attention_heads=4, vocab_size=64, n_mamba_heads=heads,
                                         mamba_expand=inner // HIDDEN, mamba_ngroups=groups, mamba_d_state=STATE,
                                         mamba_d_conv=CONV, chunk_size=CHUNK)
    raise ValueError(family)


_MIXER_CLASSES = {"bamba": "BambaMixer", "nemotron_h": "NemotronHMamba2Mixer", "falcon_h1": "FalconH1Mixer",
                  "granitemoehybrid": "GraniteMoeHybridMambaLayer", "zamba2": "Zamba2MambaMixer"}


def tiny_mixer(family: str, heads: int = 8, groups: int = 2, head_dim: int = 16, dtype=torch.float64, seed: int = 0):
    """The family's mixer (layer 0), every parameter drawn from `seed` (the same on every
    rank), `time_step_limit` narrowed so that the clamp acts, adapted (its transformers
    forward kept in the model's record, `mixers.original_forward`)."""
    base = family.split("_no_norm")[0].split("_norm_after")[0]
    config = _config(family, heads, groups, head_dim)
    module = importlib.import_module(f"transformers.models.{base}.modeling_{base}")
    mixer = getattr(module, _MIXER_CLASSES[base])(config, layer_idx=0)
    if base == "falcon_h1":   # the model registers it on each layer
        mixer.register_buffer("mup_vector", module.compute_mup_vector(config), persistent=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            draw = torch.randn(p.shape, generator=g)
            if name == "A_log":
                p.copy_(torch.rand(p.shape, generator=g) * 2 - 0.5)      # A in (-e^1.5, -e^-0.5)
            elif name == "dt_bias":
                p.copy_(torch.rand(p.shape, generator=g) * 3 - 2.5)
            elif name.startswith("norm"):
                p.copy_(1 + 0.2 * draw)
            elif name.startswith("conv1d"):
                p.copy_(0.5 * draw)
            elif p.dim() == 2:
                p.copy_(draw / p.shape[1] ** 0.5)
            else:
                p.copy_(draw)
    mixer.time_step_limit = TIME_STEP_LIMIT
    mixer = mixer.to(dtype).train()
    install_adapters(mixer)
    return mixer


def inputs(dtype=torch.float64):
    """The packed row `[1, 23, 64]` and the output gradient, the same on every rank."""
    return randn(1, TOTAL, HIDDEN, dtype=dtype, seed=1), randn(1, TOTAL, HIDDEN, dtype=dtype, seed=2)


def _grads(mixer, x):
    return {"input": x.grad.detach().clone(),
            **{name: p.grad.detach().clone() for name, p in mixer.named_parameters()}}


def reference(family, heads=8, groups=2, head_dim=16, dtype=torch.float64, cu_seqlens=CU_SEQLENS):
    """transformers' mixer on each document alone: (output, {"input" and every parameter:
    gradient}) for the output gradient of `inputs`."""
    mixer = tiny_mixer(family, heads, groups, head_dim, dtype)
    hidden, grad = inputs(dtype)
    x = hidden.clone().requires_grad_(True)
    out = torch.cat([original_forward(mixer)(x[:, a:b]) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])],
                    dim=1)
    out.backward(grad)
    return out.detach(), _grads(mixer, x)


def adapted(family, heads=8, groups=2, head_dim=16, dtype=torch.float64, cu_seqlens=CU_SEQLENS):
    """The adapted mixer on the packed row in one process (no process group)."""
    mixer = tiny_mixer(family, heads, groups, head_dim, dtype)
    hidden, grad = inputs(dtype)
    x = hidden.clone().requires_grad_(True)
    documents = {} if cu_seqlens is None else {"ulysses_cu_seqlens": torch.tensor(cu_seqlens)}
    out = mixer(x, ulysses_seq_lens=[TOTAL], **documents)
    out.backward(grad)
    return out.detach(), _grads(mixer, x)


def assert_matches(got, want, tol, where=""):
    (out, grads), (want_out, want_grads) = got, want
    assert rel_err(out, want_out) < tol, (where, "output", rel_err(out, want_out))
    for name, g in want_grads.items():
        assert rel_err(grads[name], g) < tol, (where, name, rel_err(grads[name], g))


# ------------------------------------------------------------------- the scan's rules

def sequential_scan(x, dt, A, B, C, state):
    """The recurrence one position at a time, in float64: state_t = exp(dt_t A) state_{t-1}
    + dt_t x_t B_t^T, y_t = state_t C_t."""
    ys = []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        state = state * decay + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        ys.append((state * C[:, t, :, None, :]).sum(-1))
    return (torch.stack(ys, dim=1) if ys else x.new_zeros(x.shape)), state


def _scan_inputs(b, L, h=3, p=4, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    dt = torch.rand(b, L, h, generator=g, dtype=torch.float64) * 0.7
    A = -torch.rand(h, generator=g, dtype=torch.float64) * 3
    return draw(b, L, h, p), dt, A, draw(b, L, h, n), draw(b, L, h, n), draw(b, h, p, n)


@pytest.mark.parametrize("chunk_size", [1, 4, 8, 64])
def test_the_chunked_scan_is_the_recurrence(chunk_size):
    x, dt, A, B, C, state = _scan_inputs(2, 21)
    y, final = ssd_scan(x, dt, A, B, C, chunk_size, state)
    want_y, want_final = sequential_scan(x, dt, A, B, C, state)
    assert rel_err(y, want_y) < 1e-13 and rel_err(final, want_final) < 1e-13
    y0, _ = ssd_scan(x, dt, A, B, C, chunk_size)   # no initial state: zeros
    assert rel_err(y0, sequential_scan(x, dt, A, B, C, torch.zeros_like(state))[0]) < 1e-13


def test_the_scan_restarts_at_every_document():
    """Documents of 5, 0, 7 and 9 tokens (one empty), each from its own initial state: the
    output and the final state of each document are the recurrence's on that document."""
    bounds = [0, 5, 5, 12, 21]
    x, dt, A, B, C, _ = _scan_inputs(1, 21, seed=1)
    initial = _scan_inputs(4, 1, seed=2)[5]
    y, finals = scan_documents(x, dt, A, B, C, 4, bounds, initial)
    assert finals.shape == (4, 3, 4, 5)
    for index, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        want_y, want_final = sequential_scan(*(t[:, a:b] for t in (x, dt)), A, B[:, a:b], C[:, a:b],
                                             initial[index:index + 1])
        assert rel_err(finals[index], want_final[0]) < 1e-13, index
        if b > a:
            assert rel_err(y[:, a:b], want_y) < 1e-13, index


def test_the_convolution_restarts_at_every_document():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 23, 6, generator=g, dtype=torch.float64)
    weight = torch.randn(6, CONV, generator=g, dtype=torch.float64)
    bias = torch.randn(6, generator=g, dtype=torch.float64)
    starts = document_starts(torch.tensor(CU_SEQLENS), TOTAL, x.device)
    got = causal_conv1d(x, weight, bias, starts, "silu")
    for a, b in zip(CU_SEQLENS[:-1], CU_SEQLENS[1:]):
        part = x[:, a:b].transpose(1, 2)
        want = F.silu(F.conv1d(part, weight[:, None], bias, padding=CONV - 1, groups=6)[:, :, :b - a]).transpose(1, 2)
        assert rel_err(got[:, a:b], want) < 1e-14


def test_head_counts_without_a_placement_are_named():
    from types import SimpleNamespace

    layer = SimpleNamespace(num_heads=12, n_groups=2, head_dim=16)
    assert placement_problem(layer, 2) is None and placement_problem(layer, 4) is None
    assert "2 Mamba2 groups (n_groups)" in placement_problem(layer, 3)
    assert "12 Mamba2 heads" in placement_problem(layer, 8)
    assert placement_problem(SimpleNamespace(num_heads=2, n_groups=1, head_dim=16), 4) is None   # heads replicated
    assert "head dim 15" in placement_problem(SimpleNamespace(num_heads=2, n_groups=1, head_dim=15), 4)


# ------------------------------------------------------------- the mixers, one process

@pytest.mark.parametrize("family", FAMILIES)
def test_a_packed_row_is_its_documents_one_by_one(family):
    with hf_keeps_float64():
        assert_matches(adapted(family), reference(family), 1e-10, family)


@pytest.mark.parametrize("family", ["bamba", "falcon_h1_no_norm"])
def test_one_document_is_transformers_mixer(family):
    """Without documents (the plain convolution path), groups of 4 heads."""
    with hf_keeps_float64():
        assert_matches(adapted(family, cu_seqlens=None), reference(family, cu_seqlens=[0, TOTAL]), 1e-10, family)


@pytest.mark.parametrize("family", ["nemotron_h", "falcon_h1"])
def test_float32_follows_transformers_casts(family):
    """In float32, without the float64 patch: transformers' own casts on both sides."""
    assert_matches(adapted(family, dtype=torch.float32), reference(family, dtype=torch.float32), 2e-6, family)


def test_rows_without_documents_are_transformers_batch():
    """Two rows, one document each (`ulysses_cu_seqlens` absent): the batch as transformers
    runs it; with documents, more than one row is refused."""
    mixer = tiny_mixer("granitemoehybrid", heads=8, groups=1)
    rows = randn(2, 11, HIDDEN, dtype=torch.float64, seed=3)
    with hf_keeps_float64():
        assert rel_err(mixer(rows, ulysses_seq_lens=[11]), original_forward(mixer)(rows)) < 1e-12
    with pytest.raises(ValueError, match="packed documents need batch size 1"):
        mixer(rows, ulysses_seq_lens=[11], ulysses_cu_seqlens=torch.tensor([0, 4, 11]))


def test_one_rank_with_a_cache_runs_transformers_forward():
    """With a cache (`cache` or its old name `cache_params`) on one rank: transformers'
    forward, which fills it; packed documents with a cache are refused."""
    mixer = tiny_mixer("bamba")
    calls = []
    record_of(mixer).mark(mixer, "own_forward", lambda *args, **kwargs: calls.append(kwargs) or "hf")
    assert mixer(inputs()[0], cache_params="a cache", ulysses_seq_lens=[TOTAL]) == "hf"
    assert calls[0]["cache"] == "a cache"
    with pytest.raises(ValueError, match="a cache and packed documents"):   # one state per row, not per document
        mixer(inputs()[0], cache="a cache", ulysses_seq_lens=[TOTAL], ulysses_cu_seqlens=torch.tensor(CU_SEQLENS))


def test_a_padding_mask_is_refused():
    mask = torch.ones(1, TOTAL, dtype=torch.long)
    mixer = tiny_mixer("zamba2")
    assert mixer(inputs()[0], attention_mask=mask, ulysses_seq_lens=[TOTAL]).shape == (1, TOTAL, HIDDEN)
    mask[0, :3] = 0
    with pytest.raises(ValueError, match="attention_mask with zeros"):
        mixer(inputs()[0], attention_mask=mask, ulysses_seq_lens=[TOTAL])


# ---------------------------------------------------------------- the mixers, P ranks

# world -> (family, heads, groups, head_dim): every family at every world, with groups split
# (groups % P == 0), groups replicated (P % groups == 0, more ranks than groups) and, at
# SP 4, heads replicated (Nemotron-H with 2 heads: each head on 2 ranks, 1 group on 4)
SP_CASES = {
    2: [("bamba", 12, 2, 16), ("nemotron_h", 12, 1, 16), ("falcon_h1", 12, 2, 16), ("falcon_h1_no_norm", 12, 1, 16),
        ("granitemoehybrid", 8, 2, 16), ("zamba2", 12, 2, 16)],
    3: [("bamba", 12, 3, 16), ("nemotron_h", 12, 1, 16), ("falcon_h1", 12, 3, 16), ("falcon_h1_no_norm", 12, 1, 16),
        ("granitemoehybrid", 12, 1, 16), ("zamba2", 12, 3, 16)],
    4: [("bamba", 12, 2, 16), ("nemotron_h", 2, 1, 16), ("falcon_h1", 12, 2, 16), ("falcon_h1_no_norm", 12, 1, 16),
        ("granitemoehybrid", 8, 2, 16), ("zamba2", 12, 1, 16)],
}
BAD_GROUPS = {2: 3, 3: 2, 4: 3}   # n_groups with no placement at that world (12 heads)


def _sp_step(case, rank, world):
    """One case's adapted mixer on this rank's shard: the gathered output, the parameter
    gradients summed over the ranks and the gathered input gradient."""
    import torch.distributed as dist

    from ulysses_kernels import gather_sequence

    mixer = tiny_mixer(*case)
    hidden, grad = inputs()
    lens = split_lengths(TOTAL, world)
    x = shard(hidden, world, rank).requires_grad_(True)
    with hf_keeps_float64():
        out = mixer(x, ulysses_seq_lens=lens, ulysses_cu_seqlens=torch.tensor(CU_SEQLENS))
        out.backward(shard(grad, world, rank))
    grads = _grads(mixer, x)
    for name, g in grads.items():
        if name != "input":
            dist.all_reduce(g)
    grads["input"] = gather_sequence(grads["input"], seq_lens=lens)
    return gather_sequence(out.detach(), seq_lens=lens), grads


def _refused(call):
    try:
        call()
    except ValueError as error:
        return f"{type(error).__name__}: {error}"
    return None


def sp_mixers(rank, world):
    """Every case of SP_CASES[world], then the refusals (each raised before any exchange,
    so the group stays usable: a last case runs after them)."""
    import ulysses_kernels as uk
    from ulysses_kernels import hf as ukhf

    ukhf.set_sequence_parallel_group(None)
    lens = split_lengths(TOTAL, world)
    out = {case: _sp_step(case, rank, world) for case in SP_CASES[world]}
    local = shard(inputs()[0], world, rank)
    bad = tiny_mixer("nemotron_h", 12, BAD_GROUPS[world], 16)
    out["bad groups"] = _refused(lambda: bad(local, ulysses_seq_lens=lens))
    good = tiny_mixer("bamba", 12, 1 if world == 3 else 2, 16)
    out["cache"] = _refused(lambda: good(local, cache="a cache", ulysses_seq_lens=lens))
    if world == 4:
        ukhf.register(uk.init_sequence_parallel(world, ring_size=2))
        out["ring"] = _refused(lambda: good(local, ulysses_seq_lens=split_lengths(TOTAL, 2)))   # not the zigzag
        ukhf.set_sequence_parallel_group(None)
    out["after"] = _sp_step(SP_CASES[world][0], rank, world)
    return out


_RESULTS = {}


def _spawned(world):
    from ulysses_kernels.launch import spawn

    if world not in _RESULTS:
        try:
            _RESULTS[world] = spawn(sp_mixers, world, timeout=SLOW_SPAWN_TIMEOUT, start_method="forkserver",
                                    preload=["torch", "transformers", "ulysses_kernels.hf"])
        except Exception as error:  # every test of this world reports the same failure
            _RESULTS[world] = error
    if isinstance(_RESULTS[world], Exception):
        raise _RESULTS[world]
    return _RESULTS[world]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_rank_trains_like_one_device(world):
    per_rank = _spawned(world)
    for case in SP_CASES[world]:
        family, heads, groups, head_dim = case
        with hf_keeps_float64():
            want = reference(family, heads, groups, head_dim)
        for rank, results in enumerate(per_rank):
            assert_matches(results[case], want, 1e-9, (world, rank, case))
            if case == SP_CASES[world][0]:
                assert_matches(results["after"], want, 1e-9, (world, rank, "after the refusals"))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_refusals_are_the_same_on_every_rank(world):
    per_rank = _spawned(world)
    cases = ["bad groups", "cache"] + (["ring"] if world == 4 else [])
    for case in cases:
        messages = {results[case] for results in per_rank}
        assert len(messages) == 1 and None not in messages, (case, messages)
    bad = per_rank[0]["bad groups"]
    assert f"{BAD_GROUPS[world]} Mamba2 groups (n_groups)" in bad and f"to {world} ranks" in bad, bad
    assert "NotSequenceParallelError" in bad
    assert "outside ulysses_kernels.hf.generate" in per_rank[0]["cache"]
    if world == 4:   # a ring runs (tests/hf/families/test_hf_hybrid.py); lengths that are not its layout are refused
        assert "ring" in per_rank[0]["ring"] and "zigzag" in per_rank[0]["ring"]
