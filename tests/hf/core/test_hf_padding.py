"""Padded batches in `shard_batch` (ulysses_kernels/hf/core/batch.py), in one process: the
unpadded layout (one packed row of every row's valid tokens, positions restarting at 0,
no target at a row's end or at padding), `repad` / `gather_tokens` / `shard_tokens`,
`count_targets`, and the masks that are refused. No transformers needed (the fast tier);
the model parity under SP is in test_hf_padding_parity.py.

Each expected layout is built row by row from the rule, independently of batch.py."""

import pytest
import torch
from helpers import rel_err

from ulysses_kernels import hf as ukhf

IGNORE = ukhf.IGNORE_INDEX


def random_ids(B, S, seed):
    return torch.randint(0, 1000, (B, S), generator=torch.Generator().manual_seed(seed))


def mask_of(spans, S):
    """A [B, S] 0/1 mask with row r's tokens at columns spans[r] = (first, end)."""
    mask = torch.zeros(len(spans), S, dtype=torch.long)
    for r, (first, end) in enumerate(spans):
        mask[r, first:end] = 1
    return mask


def expected_layout(ids, labels, spans):
    """(ids, positions, targets, cu_seqlens) of the packed row, from the rule: row after
    row, each row's valid tokens, positions 0.., target of token t its row's token t + 1
    (ignored where that label is, and at the row's last token)."""
    out_ids, out_pos, out_tgt, bounds = [], [], [], [0]
    for r, (first, end) in enumerate(spans):
        n = end - first
        if n == 0:
            continue
        out_ids += ids[r, first:end].tolist()
        out_pos += list(range(n))
        out_tgt += labels[r, first + 1:end].tolist() + [IGNORE]
        bounds.append(bounds[-1] + n)
    return out_ids, out_pos, out_tgt, bounds


CASES = {
    "right": [(0, 9), (0, 5), (0, 7)],
    "left": [(4, 9), (0, 9), (2, 9)],
    "mixed": [(2, 6), (0, 9), (0, 0), (3, 9), (0, 4)],   # both sides, none, all padding, left, right
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_padded_rows_become_one_packed_row(case):
    spans, S = CASES[case], 9
    ids = random_ids(len(spans), S, seed=len(case))
    labels = ids.clone()
    labels[0, spans[0][0] + 2] = IGNORE   # an ignored label (a prompt token) stays ignored
    batch = ukhf.shard_batch(ids, None, attention_mask=mask_of(spans, S), labels=labels)
    want_ids, want_pos, want_tgt, bounds = expected_layout(ids, labels, spans)
    assert batch.input_ids.tolist() == [want_ids]
    assert batch.position_ids.tolist() == [want_pos]
    assert batch.labels.tolist() == [want_tgt]
    assert batch.cu_seqlens.tolist() == bounds
    assert batch.seq_lens == [len(want_ids)]
    assert batch.padding.row_lengths == tuple(end - first for first, end in spans)
    assert "attention_mask" not in batch.model_inputs()
    assert batch.num_valid_tokens == ukhf.count_targets(labels, attention_mask=mask_of(spans, S))


def test_pre_shifted_labels_lose_the_target_at_each_row_end():
    """labels_shifted: labels[t] is token t's target, kept at the valid tokens but the last
    of each row (its next column is padding)."""
    spans, S = CASES["mixed"], 9
    ids = random_ids(len(spans), S, seed=4)
    shifted = random_ids(len(spans), S, seed=5)
    batch = ukhf.shard_batch(ids, None, attention_mask=mask_of(spans, S), labels=shifted, labels_shifted=True)
    want = []
    for r, (first, end) in enumerate(spans):
        if end > first:
            want += shifted[r, first:end - 1].tolist() + [IGNORE]
    assert batch.labels.tolist() == [want]


def test_given_positions_are_taken_at_the_valid_tokens():
    """Given position ids are what the model sees at the valid tokens (documents packed
    inside a row stay documents); every row starts a document even where its positions
    continue the previous row's."""
    S = 8
    spans = [(0, 6), (2, 8)]
    ids = random_ids(2, S, seed=6)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 0, 0],       # two documents, then padding
                        [0, 0, 6, 7, 8, 9, 10, 11]])    # left padding, positions from 6
    batch = ukhf.shard_batch(ids, None, attention_mask=mask_of(spans, S), position_ids=pos)
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 6, 7, 8, 9, 10, 11]]
    assert batch.cu_seqlens.tolist() == [0, 3, 6, 12]
    contiguous = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 0], [0, 0, 6, 7, 8, 9, 10, 11]])
    batch = ukhf.shard_batch(ids, None, attention_mask=mask_of(spans, S), position_ids=contiguous)
    assert batch.cu_seqlens.tolist() == [0, 6, 12]   # the row boundary, though 5 -> 6 runs on


def test_document_ends_inside_rows_can_be_masked_too():
    S = 8
    spans = [(0, 6), (1, 8)]
    ids = random_ids(2, S, seed=7)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 0, 0], [0, 0, 1, 2, 3, 4, 5, 6]])
    batch = ukhf.shard_batch(ids, None, attention_mask=mask_of(spans, S), position_ids=pos,
                             mask_document_ends=True)
    assert [i for i, t in enumerate(batch.labels[0].tolist()) if t == IGNORE] == [2, 5, 12]


def test_unpadded_batches_are_unchanged():
    """An all-ones mask (B 1 or 2) gives exactly the batch without a mask: rows kept."""
    for B in (1, 2):
        ids = random_ids(B, 7, seed=8 + B)
        plain = ukhf.shard_batch(ids, None)
        masked = ukhf.shard_batch(ids, None, attention_mask=torch.ones(B, 7, dtype=torch.long))
        for name in ("input_ids", "position_ids", "labels"):
            assert torch.equal(getattr(plain, name), getattr(masked, name)), name
        assert masked.padding is None and masked.cu_seqlens is None and masked.input_ids.shape == (B, 7)


def test_repad_shard_tokens_and_gather_tokens_round_trip():
    """Per-token values [B, S, H] packed (shard_tokens), then put back (repad, gather_tokens
    at world 1) are the values at the valid tokens and `fill` at padding; repad's gradient
    reaches exactly the packed values."""
    spans, S = CASES["mixed"], 9
    mask = mask_of(spans, S)
    batch = ukhf.shard_batch(random_ids(len(spans), S, seed=10), None, attention_mask=mask)
    values = torch.randn(len(spans), S, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    packed = batch.shard_tokens(values)
    assert packed.shape == (1, sum(batch.padding.row_lengths), 3)
    want = torch.where(mask.bool()[..., None], values, torch.full_like(values, -7.0))
    for back in (ukhf.repad(packed, batch, fill=-7.0), ukhf.repad(packed, batch.padding, fill=-7.0),
                 ukhf.gather_tokens(packed, batch, None, fill=-7.0)):
        assert back.shape == values.shape and rel_err(back, want) == 0.0
    leaf = packed.clone().requires_grad_(True)
    weights = torch.randn(values.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(12))
    (ukhf.repad(leaf, batch) * weights).sum().backward()
    assert rel_err(leaf.grad, batch.shard_tokens(weights)) == 0.0
    plain = ukhf.shard_batch(random_ids(2, 5, seed=13), None)   # nothing unpadded: as it is
    rows = values[:2, :5]
    assert ukhf.repad(rows, plain) is rows
    with pytest.raises(ValueError, match="packed row"):
        ukhf.repad(packed[:, :-1], batch)


def test_packed_loss_is_the_mean_over_every_rows_valid_targets():
    """The loss over the packed row equals the single-device mean over the valid targets
    of the rows, each on its own (the per-row losses weighted by their target counts):
    a context-free "model" (logits = a random table at the token) makes it exact."""
    spans, S, vocab = CASES["mixed"], 9, 1000
    ids = random_ids(len(spans), S, seed=14)
    table = torch.randn(vocab, 17, dtype=torch.float64, generator=torch.Generator().manual_seed(15))
    head = torch.randn(17, vocab, dtype=torch.float64, generator=torch.Generator().manual_seed(16))
    batch = ukhf.shard_batch(ids, None, attention_mask=mask_of(spans, S))
    got = ukhf.sequence_parallel_loss(table[batch.input_ids] @ head, batch.labels)
    total, count = 0.0, 0
    for r, (first, end) in enumerate(spans):
        if end - first < 2:
            continue
        row = ids[r, first:end]
        logits = table[row] @ head
        total = total + torch.nn.functional.cross_entropy(logits[:-1], row[1:], reduction="sum")
        count += end - first - 1
    assert rel_err(got, total / count) < 1e-12


@pytest.mark.parametrize("mask, match", [
    (torch.ones(3, 9), "shape"),
    (torch.ones(2, 9, 9), "shape"),
    (torch.tensor([[1, 1, 2, 1, 1, 1, 1, 0, 0]] * 2), "only 1"),
    (torch.tensor([[1.0, 0.5, 1, 1, 1, 1, 1, 1, 1]] * 2), "only 1"),
    (torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1, 0], [1] * 9]), "row 0 has padding between its tokens \\(column 2\\)"),
    (torch.zeros(2, 9, dtype=torch.long), "every row"),
], ids=["wrong-shape", "3-d", "value-2", "value-half", "hole", "no-token"])
def test_bad_masks_are_refused(mask, match):
    with pytest.raises(ValueError, match=match):
        ukhf.shard_batch(random_ids(2, 9, seed=17), None, attention_mask=mask)


def test_count_targets_matches_the_collators_count_with_right_padding():
    """Right padding with labels -100 at the padding (DataCollatorForLanguageModeling):
    the targets are Trainer's own count, labels[:, 1:] != -100."""
    spans, S = CASES["right"], 9
    mask = mask_of(spans, S)
    labels = random_ids(len(spans), S, seed=18).masked_fill(mask == 0, IGNORE)
    assert ukhf.count_targets(labels, attention_mask=mask) == int((labels[:, 1:] != IGNORE).sum())
    assert ukhf.count_targets(labels) == int((labels[:, 1:] != IGNORE).sum())
