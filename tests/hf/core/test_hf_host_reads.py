"""The documented training step, `shard_batch` included, reads nothing back to the host and
runs no collective in the package's mask function (ulysses_kernels/hf/core/attention.py,
`_agreed_inputs`): after `shard_batch` every rank holds the same whole batch, so a forward
without a mask and with a plain causal request has nothing to agree on; `shard_batch` finds
the packed documents in the host array of the batch's position ids (a CPU tensor, as a data
collator returns them: `context.cu_seqlens_from_position_ids`). Counted on CPU at SP 2 (a tiny Llama,
one document and two packed documents): host reads (`Tensor.item`, `tolist`, `__bool__`,
`__int__`) whose nearest caller is package code, and the collectives the package issues.

Also: the structural recognition of transformers' causal mask functions
(`guard.never_opens_later`), which spares the probe (a host read per forward) for packed
documents and for what transformers builds while compiling; an overlay that opens later
tokens still goes to the probe and the agreement (test_hf_guard.py, test_hf_attention.py).
"""

import collections
import traceback

import pytest
import torch
from helpers import SLOW_SPAWN_TIMEOUT

pytest.importorskip("transformers", reason="ulysses_kernels.hf needs Hugging Face transformers "
                                           "(pip install -e '.[hf]' in the checkout)")

from hf_cases import make_batch, make_model  # noqa: E402

import ulysses_kernels as uk  # noqa: E402
from ulysses_kernels import hf as ukhf  # noqa: E402
from ulysses_kernels.hf.core.masks import never_opens_later  # noqa: E402
from ulysses_kernels.launch import spawn  # noqa: E402

HOST_READS = ("item", "tolist", "__bool__", "__int__")
COLLECTIVES = ("all_reduce", "all_gather", "all_to_all_single", "all_gather_into_tensor", "broadcast",
               "all_gather_object")


def _package_caller():
    """The nearest package frame of the current stack, as `file function` (no line number:
    an edit above it must not change the count's key)."""
    for frame in traceback.extract_stack()[:-2][::-1]:
        if "/ulysses_kernels/" in frame.filename:
            where = f"{frame.filename.split('/ulysses_kernels/')[-1]} {frame.name}"
            if where == "hf/core/attach.py __call__":   # the first-call check around transformers' own forward
                continue
            return where
    return None


def _counting(owner, names, counts):
    originals = {name: getattr(owner, name) for name in names}

    def wrap(name, original):
        def counted(*args, **kwargs):
            caller = _package_caller()
            if caller is not None:
                counts[f"{name} {caller}"] += 1
            return original(*args, **kwargs)
        return counted

    for name, original in originals.items():
        setattr(owner, name, wrap(name, original))
    return originals


def _step_worker(rank, world, documents):
    import torch.distributed as dist

    groups = uk.init_sequence_parallel(world)
    ukhf.register(groups)
    model = make_model("llama", "ulysses")
    ids, pos = make_batch(1, 64, documents)
    ukhf.causal_lm_loss(model, ukhf.shard_batch(ids, groups, position_ids=pos), groups).backward()   # the checks
    model.zero_grad(set_to_none=True)
    reads, collectives = collections.Counter(), collections.Counter()
    tensor_methods = _counting(torch.Tensor, HOST_READS, reads)
    dist_functions = _counting(dist, COLLECTIVES, collectives)
    try:
        batch = ukhf.shard_batch(ids, groups, position_ids=pos)   # counted too: the step's first call
        loss = ukhf.causal_lm_loss(model, batch, groups)
        loss.backward()
    finally:
        for name, original in tensor_methods.items():
            setattr(torch.Tensor, name, original)
        for name, original in dist_functions.items():
            setattr(dist, name, original)
    return dict(reads), dict(collectives)


@pytest.mark.slow
@pytest.mark.parametrize("documents", [None, [20, 44]], ids=["one document", "two packed documents"])
def test_a_trusted_training_step_reads_nothing_back_in_package_code(documents):
    per_rank = spawn(_step_worker, 2, args=(documents,), timeout=SLOW_SPAWN_TIMEOUT, start_method="forkserver",
                     preload=["torch", "transformers", "ulysses_kernels.hf"])
    for rank, (reads, collectives) in enumerate(per_rank):
        # transformers' own reads inside the model forward are attributed to the caller, causal_lm_loss
        own = {k: v for k, v in reads.items() if "causal_lm_loss" not in k}
        assert own == {}, (rank, reads)   # shard_batch's packed-document detection included
        # 2 layers x (q|k|v forward, output forward, and their two backward exchanges), the loss's sum
        assert collectives == {"all_to_all_single distributed/collectives.py all_to_all": 8,
                               "all_reduce hf/groups.py sum_over_group": 1}, (rank, collectives)


def test_transformers_causal_mask_functions_are_recognised_by_construction():
    from transformers import masking_utils as mu

    positions = torch.tensor([[0, 1, 2, 0, 1]])
    packed = mu.packed_sequence_mask_function(torch.tensor([[0, 0, 0, 1, 1]]))
    causal = [
        mu.causal_mask_function,
        mu.sliding_window_causal_mask_function(4),
        mu.chunked_causal_mask_function(8, torch.zeros(1, dtype=torch.long)),
        mu.and_masks(mu.causal_mask_function, mu.padding_mask_function(torch.ones(1, 5, dtype=torch.bool))),
        mu.add_offsets_to_mask_function(mu.causal_mask_function, 3, 3),
        mu.and_masks(mu.remap_positions_for_packed_sequence(mu.causal_mask_function, positions), packed),
    ]
    opening = [
        mu.bidirectional_mask_function,
        mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(torch.tensor([[0, 0, -1, 1, 1]]))),
        mu.remap_positions_for_packed_sequence(mu.causal_mask_function, positions),   # no packed intersection
        mu.and_masks(mu.or_masks(mu.remap_positions_for_packed_sequence(mu.causal_mask_function, positions),
                                 mu.blockwise_overlay(torch.tensor([[0, 0, -1, 1, 1]]))), packed),
        lambda b, h, q, kv: kv <= q,   # causal, but not transformers' own: the probe decides
    ]
    assert [never_opens_later(f) for f in causal] == [True] * len(causal)
    assert [never_opens_later(f) for f in opening] == [False] * len(opening)
    # the recognition agrees with evaluating the functions above the diagonal
    q = torch.arange(4)
    for f in causal:
        assert not bool(torch.as_tensor(f(torch.zeros_like(q), torch.zeros_like(q), q, q + 1)).any())


def _untrusted_worker(rank, world, layers):
    """A forward called the untrusted way (the model's own `input_ids` and global
    `position_ids`, no shard_batch keys): the collectives outside the exchanges."""
    import torch.distributed as dist

    groups = uk.init_sequence_parallel(world)
    ukhf.register(groups)
    model = make_model("llama", "ulysses", num_hidden_layers=layers)
    ids, pos = make_batch(1, 64, [20, 44])
    batch = ukhf.shard_batch(ids, groups, position_ids=pos)
    model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)   # the checks
    collectives = collections.Counter()
    dist_functions = _counting(dist, COLLECTIVES, collectives)
    try:
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
    finally:
        for name, original in dist_functions.items():
            setattr(dist, name, original)
    trusted = model(**batch.model_inputs()).logits
    return {k: v for k, v in collectives.items() if not k.startswith("all_to_all_single")}, \
        float((logits - trusted).abs().max())


@pytest.mark.slow
def test_the_untrusted_path_derives_lengths_once_per_forward():
    """Its lengths and documents come from one all-gather of the position ids per forward,
    and the first layer checks the inputs across the ranks for all of them, whatever the depth
    (three collectives per layer before), with the trusted path's result."""
    by_depth = {}
    for layers in (2, 4):
        per_rank = spawn(_untrusted_worker, 2, args=(layers,), timeout=SLOW_SPAWN_TIMEOUT,
                         start_method="forkserver", preload=["torch", "transformers", "ulysses_kernels.hf"])
        for collectives, difference in per_rank:
            assert difference <= 1e-6, (layers, difference)
        by_depth[layers] = per_rank[0][0]
    assert by_depth[2] == by_depth[4], by_depth
    # per forward: the lengths and the positions' gather, the first layer's cross-rank check,
    # the mask function's agreement
    assert sum(by_depth[2].values()) == 4, by_depth


def _compiled_worker(rank, world):
    """The trusted forward under torch.compile: graphs and breaks (`torch._dynamo.explain`),
    and one step through the compiled model (aot_eager: the traced forward and its backward)
    against eager."""
    import torch._dynamo as dynamo

    groups = uk.init_sequence_parallel(world)
    ukhf.register(groups)
    model = make_model("llama", "ulysses")
    ids, pos = make_batch(1, 64, [20, 44])
    batch = ukhf.shard_batch(ids, groups, position_ids=pos)
    eager_loss = ukhf.causal_lm_loss(model, batch, groups)   # also the first forward's checks
    eager_loss.backward()
    eager = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    explanation = dynamo.explain(lambda **kw: model(**kw).logits)(**batch.model_inputs())
    dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    loss = ukhf.sequence_parallel_loss(compiled(**batch.model_inputs()).logits, batch.labels, groups)
    loss.backward()
    worst = max(float((p.grad - eager[n]).norm() / eager[n].norm().clamp(min=1e-30)) for n, p in model.named_parameters())
    return explanation.graph_count, explanation.graph_break_count, float((loss - eager_loss).abs()), worst


@pytest.mark.slow
def test_the_trusted_forward_compiles_into_one_graph():
    per_rank = spawn(_compiled_worker, 2, timeout=SLOW_SPAWN_TIMEOUT, start_method="forkserver",
                     preload=["torch", "transformers", "ulysses_kernels.hf"])
    for rank, (graphs, breaks, loss_difference, gradient_error) in enumerate(per_rank):
        assert (graphs, breaks) == (1, 0), (rank, graphs, breaks)
        assert loss_difference < 1e-6 and gradient_error < 1e-5, (rank, loss_difference, gradient_error)


def _decode_worker(rank, world):
    """`ukhf.generate`'s collectives by caller for 3 and 6 new tokens: the decode steps carry
    transformers' all-ones attention mask, built by every rank's lockstep loop from the
    agreed prompt."""
    import torch.distributed as dist
    from hf_cases import gen_model, gen_prompt

    groups = uk.init_sequence_parallel(world)
    ukhf.register(groups)
    model = gen_model("llama", "ulysses", {})
    ids = gen_prompt(3, 21, B=1)
    ukhf.generate(model, ids, max_new_tokens=2, do_sample=False)     # the first call's checks
    counts, outputs = {}, []
    for new_tokens in (3, 6):
        collectives = collections.Counter()
        dist_functions = _counting(dist, COLLECTIVES, collectives)
        try:
            outputs.append(ukhf.generate(model, ids, max_new_tokens=new_tokens, do_sample=False))
        finally:
            for name, original in dist_functions.items():
                setattr(dist, name, original)
        counts[new_tokens] = collectives
    return counts, outputs


@pytest.mark.slow
def test_decode_steps_run_no_mask_agreement():
    """A decode step's only collective is its layers' gather of the heads' outputs (2 layers):
    no agreement on transformers' all-ones mask (an all-reduce), nothing else per step."""
    per_rank = spawn(_decode_worker, 2, timeout=SLOW_SPAWN_TIMEOUT, start_method="forkserver",
                     preload=["torch", "transformers", "ulysses_kernels.hf"])
    (counts, outputs), (_, other) = per_rank
    assert all(torch.equal(a, b) for a, b in zip(outputs, other))
    assert not any(k.startswith("all_reduce") for k in counts[6]), counts
    assert counts[6] - counts[3] == {"all_gather distributed/collectives.py all_gather_tensor": 2 * 3}, counts
