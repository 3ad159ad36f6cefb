"""`global_batch_documents` (ulysses_kernels/hf/training/global_batch.py): the documents of a
collated batch carry exactly the tokens, positions and targets the mixin's sequence-parallel
loss gives that batch (`shard_batch` in one process), for every collator layout: padded rows
(right, left, a row of padding), packed rows with restarting positions, pre-shifted labels,
rows without a mask; images are refused."""

import pytest
import torch

pytest.importorskip("transformers")

from ulysses_kernels.hf import IGNORE_INDEX, global_batch_documents, shard_batch  # noqa: E402


def _batches():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 90, (3, 9), generator=g)
    right = torch.tensor([[1] * 9, [1] * 6 + [0] * 3, [1] * 2 + [0] * 7])
    left = right.flip(1)
    labels = ids.masked_fill(right == 0, IGNORE_INDEX)
    labels[0, :3] = IGNORE_INDEX   # a prompt without targets
    packed_ids = torch.randint(3, 90, (1, 12), generator=g)
    packed_positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]])
    packed_labels = packed_ids.clone()
    packed_labels[0, [0, 4, 7]] = IGNORE_INDEX
    shifted = torch.full_like(packed_ids, IGNORE_INDEX)
    shifted[0, :-1] = packed_ids[0, 1:]
    shifted[0, [3, 6]] = IGNORE_INDEX
    return {
        "right padding": dict(input_ids=ids, attention_mask=right, labels=labels),
        "left padding": dict(input_ids=ids, attention_mask=left, labels=ids.masked_fill(left == 0, IGNORE_INDEX)),
        "no mask": dict(input_ids=ids, labels=labels),
        "no labels": dict(input_ids=ids, attention_mask=right),
        "packed rows": dict(input_ids=packed_ids, position_ids=packed_positions, labels=packed_labels),
        "shift labels": dict(input_ids=packed_ids, position_ids=packed_positions, shift_labels=shifted),
        "two packed rows": dict(input_ids=packed_ids.expand(2, 12), position_ids=packed_positions.expand(2, 12),
                                labels=packed_labels.expand(2, 12)),
    }


@pytest.mark.parametrize("name", list(_batches()))
def test_documents_carry_what_the_sequence_parallel_loss_gives_each_token(name):
    batch = _batches()[name]
    docs = global_batch_documents(batch)
    sharded = shard_batch(batch["input_ids"], position_ids=batch.get("position_ids"),
                          labels=batch.get("shift_labels", batch.get("labels")),
                          labels_shifted="shift_labels" in batch, attention_mask=batch.get("attention_mask"))
    assert torch.equal(torch.cat([d.input_ids for d in docs]), sharded.input_ids.reshape(-1))
    assert torch.equal(torch.cat([d.positions for d in docs]), sharded.position_ids.reshape(-1))
    assert torch.equal(torch.cat([d.targets for d in docs]), sharded.labels.reshape(-1))
    for d in docs:   # each document starts at position 0 and runs on (its own rotary, its own attention)
        assert torch.equal(d.positions, torch.arange(len(d)))
    assert sum(d.label_count for d in docs) == int((sharded.labels != IGNORE_INDEX).sum())


def test_documents_are_cut_at_rows_and_restarting_positions():
    batches = _batches()
    assert [len(d) for d in global_batch_documents(batches["right padding"])] == [9, 6, 2]
    assert [len(d) for d in global_batch_documents(batches["packed rows"])] == [4, 3, 5]
    assert [len(d) for d in global_batch_documents(batches["two packed rows"])] == [4, 3, 5] * 2


def test_images_are_refused():
    batch = dict(_batches()["right padding"], pixel_values=torch.randn(1, 3, 4, 4))
    with pytest.raises(ValueError, match="balanced global batches take text documents only"):
        global_batch_documents(batch)


def test_a_document_that_does_not_start_at_position_zero_is_refused():
    """Rows that continue one stream (positions 0-7, then 8-15) are documents apart in a plain
    run; packed next to each other they would run on into one."""
    ids = torch.randint(3, 90, (2, 8), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="a document starts at position 8, not 0"):
        global_batch_documents(dict(input_ids=ids, position_ids=torch.arange(16).reshape(2, 8)))


def test_a_mixture_of_experts_with_its_router_loss_is_refused():
    """The planned route weighs each micro-batch's router loss by its tokens, Trainer and TRL
    each rank's batch: refused (before any group is built) rather than weighed otherwise."""
    import transformers

    from ulysses_kernels.hf import BalancedGlobalBatches
    from ulysses_kernels.hf.training.global_batch import GlobalBatchSteps

    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                         num_experts=4, num_experts_per_tok=2, output_router_logits=True,
                                         router_aux_loss_coef=0.01)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="not with a mixture of experts' router loss yet"):
        GlobalBatchSteps(model, BalancedGlobalBatches(token_budget=8), world=1, rank=0)
