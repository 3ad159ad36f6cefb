"""ulysses_kernels.monitor: what a step record says (tokens/s, every rank's peak memory, the
planner's expectation) against what the step did; the Trainer side is in
tests/hf/test_hf_deepspeed.py (test_monitor_logs_every_step)."""

import pytest
import torch
from helpers import SPAWN_TIMEOUT

from ulysses_kernels import planner
from ulysses_kernels.launch import spawn
from ulysses_kernels.monitor import StepMonitor

MIB = 1 << 20
LLAMA_LIKE = dict(model_type="llama", hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, intermediate_size=688, vocab_size=1000, tie_word_embeddings=False)


def _touch(mib: int) -> torch.Tensor:
    """mib MiB of resident memory (written, so the pages exist)."""
    return torch.ones(mib * MIB // 4, dtype=torch.float32)


def _step(monitor, allocate_mib, tokens=100, seq_len=None):
    monitor.begin()
    held = _touch(allocate_mib) if allocate_mib else None
    record = monitor.end(tokens, seq_len=seq_len)
    del held
    return record


def test_record_measures_the_step_on_cpu():
    """A step that touches 256 MiB peaks at least 200 MiB above one that touches nothing
    (the resident peak is reset at begin() where Linux allows it), and tokens/s is the
    tokens over the step's time."""
    monitor = StepMonitor(device="cpu")
    quiet = _step(monitor, 0)
    busy = _step(monitor, 256)
    after = _step(monitor, 0)
    assert [r.step for r in (quiet, busy, after)] == [1, 2, 3]
    assert busy.peak_bytes[0] - quiet.peak_bytes[0] > 200 * MIB, (quiet, busy)
    if busy.memory == "resident":   # the peak was reset: the next quiet step no longer sees the 256 MiB
        assert busy.peak_bytes[0] - after.peak_bytes[0] > 200 * MIB, (busy, after)
    assert busy.tokens == 100 and busy.seconds > 0
    assert busy.tokens_per_s == pytest.approx(100 / busy.seconds)
    assert busy.expected_activation_bytes is None   # no model, no expectation
    logs = busy.as_logs()
    assert set(logs) == {"tokens_per_s", "peak_mem_gib", "peak_mem_gib_min", "peak_mem_rank"}
    assert logs["peak_mem_rank"] == 0 and logs["peak_mem_gib"] == logs["peak_mem_gib_min"] > 0.2
    assert "100 tokens" in busy.line() and "GiB" in busy.line()


def test_shape_from_a_config_dict():
    shape = planner.shape_from_dict(LLAMA_LIKE)
    assert (shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.head_dim) == (256, 4, 8, 2, 32)
    assert (shape.intermediate, shape.vocab, shape.tied_embeddings, shape.qkv_bias) == (688, 1000, False, False)
    assert planner.shape_from_dict(dict(LLAMA_LIKE, model_type="qwen2")).qkv_bias   # Qwen2 has q/k/v biases
    assert planner.shape_from_dict(dict(LLAMA_LIKE, head_dim=64)).head_dim == 64


def test_expected_activation_follows_the_planner():
    """The expectation is the planner's largest phase at the step's length and SP size:
    it grows with the length and shrinks with the SP size (each rank holds 1/sp of it)."""
    shape = planner.shape_from_dict(LLAMA_LIKE)
    monitor = StepMonitor(shape=shape, sp_size=1, device="cpu", checkpointing=True)
    want = planner.largest_activation_bytes(planner.memory_terms(shape, planner.PlanOptions(
        seq_len=4096, gpus_per_node=1, sp_size=1, checkpointing=True)))
    assert monitor.expected_activation_bytes(4096) == want > 0
    assert monitor.expected_activation_bytes(8192) > 1.5 * want
    assert monitor.expected_activation_bytes(0) is None
    halved = StepMonitor(shape=shape, sp_size=2, device="cpu", checkpointing=True).expected_activation_bytes(4096)
    assert halved < 0.75 * want
    assert _step(monitor, 0, seq_len=4096).as_logs()["planner_activation_gib"] == float(f"{want / planner.GIB:.4g}")


def _ranks_allocate(rank, world):
    monitor = StepMonitor(device="cpu")
    _step(monitor, 0)
    record = _step(monitor, 64 * (rank + 1), tokens=10 * (rank + 1))
    return record.peak_bytes, record.as_logs()["peak_mem_rank"], record.tokens


@pytest.mark.slow
def test_every_rank_sees_every_ranks_peak():
    """World 3, rank r touching 64 (r + 1) MiB: every rank's record lists the three peaks in
    rank order (the same list on every rank) and names rank 2 as the highest; the tokens
    are what each rank passed (the caller counts the step's tokens once)."""
    results = spawn(_ranks_allocate, 3, timeout=SPAWN_TIMEOUT)
    peaks = results[0][0]
    assert len(peaks) == 3 and all(r[0] == peaks for r in results)
    assert all(r[1] == 2 for r in results)
    assert peaks[2] - peaks[0] > 100 * MIB, peaks
    assert [r[2] for r in results] == [10, 20, 30]
