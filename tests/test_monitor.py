"""ulysses_kernels.monitor: what a step record says (tokens/s, every rank's peak memory, the
planner's expectation) against what the step did; the Trainer side is in
tests/hf/training/test_hf_deepspeed.py (test_monitor_logs_every_step)."""

import mmap

import pytest
import torch
from helpers import SPAWN_TIMEOUT

from ulysses_kernels import planner
from ulysses_kernels.launch import spawn
from ulysses_kernels.monitor import StepMonitor

MIB = 1 << 20
LLAMA_LIKE = dict(model_type="llama", hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, intermediate_size=688, vocab_size=1000, tie_word_embeddings=False)


def _touch(mib: int):
    """mib MiB of new resident memory: an anonymous mapping of its own, written so that the
    pages exist (a tensor could land in heap pages an earlier test left resident, and then
    the resident set would not grow)."""
    buffer = mmap.mmap(-1, mib * MIB)
    torch.frombuffer(buffer, dtype=torch.float32).fill_(1.0)
    return buffer


def _step(monitor, allocate_mib, tokens=100, seq_len=None):
    monitor.begin()
    held = _touch(allocate_mib) if allocate_mib else None
    record = monitor.end(tokens, seq_len=seq_len)
    if held is not None:
        held.close()
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


def test_expected_activation_is_the_planners_activations():
    """The expectation is what the planner's terms hold in activations at the step's peak:
    the layer inputs kept by checkpointing plus the largest peak phase (with checkpointing),
    every layer's saved activations plus the largest peak phase (without); never the
    states. It grows with the length and shrinks with the SP size."""
    shape = planner.shape_from_dict(LLAMA_LIKE)
    for checkpointing in (True, False):
        monitor = StepMonitor(shape=shape, sp_size=1, device="cpu", checkpointing=checkpointing, attention="flash")
        terms = planner.memory_terms(shape, planner.PlanOptions(seq_len=4096, gpus_per_node=1, sp_size=1,
                                                                checkpointing=checkpointing))
        kept = (terms["checkpointed layer inputs"] if checkpointing else terms["every layer's saved activations"])
        phases = [v for k, v in terms.items() if k.endswith("(peak phase)")]
        assert len(phases) == 2 and kept > 0
        want = kept + max(phases)
        assert monitor.expected_activation_bytes(4096) == pytest.approx(want, rel=1e-12)
        assert monitor.expected_activation_bytes(8192) > 1.5 * want
        halved = StepMonitor(shape=shape, sp_size=2, device="cpu", checkpointing=checkpointing, attention="flash")
        assert halved.expected_activation_bytes(4096) < 0.75 * want
    assert monitor.expected_activation_bytes(0) is None
    assert _step(monitor, 0, seq_len=4096).as_logs()["planner_activation_gib"] == float(
        f"{monitor.expected_activation_bytes(4096) / planner.GIB:.4g}")


def test_every_planner_term_has_a_kind():
    """Each of memory_terms' keys is a state, an activation kept through the step or a peak
    phase: a new term must say which (planner.STATE_TERMS / ACTIVATION_TERMS), or the
    monitor's expectation would silently leave it out."""
    shape = planner.shape_from_dict(LLAMA_LIKE)
    for checkpointing in (True, False):
        for extra in ({}, {"tiled_mlp": True, "ring_size": 2, "checkpoint_offload": checkpointing}):
            terms = planner.memory_terms(shape, planner.PlanOptions(seq_len=4096, gpus_per_node=2, sp_size=2,
                                                                    checkpointing=checkpointing, **extra))
            for key in terms:
                assert key in planner.STATE_TERMS or key in planner.ACTIVATION_TERMS or key.endswith(
                    "(peak phase)"), key


@pytest.mark.slow   # builds a transformers model
def test_model_sets_the_planner_defaults():
    """With a model, its parameters' dtype and its activation checkpointing are the planner
    options (explicit options win); a multimodal config's text sizes are the shape."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**{k: v for k, v in LLAMA_LIKE.items() if k != "model_type"})
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    assert StepMonitor(model=model).options == {"dtype_bytes": 2, "checkpointing": False, "attention": "reference"}
    model.activation_checkpointing_enable()
    assert StepMonitor(model=model, dtype_bytes=4, attention="flash").options == {
        "dtype_bytes": 4, "checkpointing": True, "attention": "flash"}

    class Multimodal:   # a config whose decoder sizes sit in its text config (as Gemma 3's)
        def get_text_config(self):
            return config

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config, self.inner = Multimodal(), model

    assert StepMonitor(model=Wrapper()).shape == planner.shape_from_dict(config.to_dict())


def test_a_record_covers_the_steps_since_the_last():
    """step_done() counts locally; record() covers every step since the previous record:
    the tokens summed, the time summed, the highest peak of the steps; pending() says how
    many there are."""
    monitor = StepMonitor(device="cpu")
    for mib in (0, 256, 0):
        monitor.begin()
        held = _touch(mib) if mib else None
        monitor.step_done(50, seq_len=10)
        del held
    assert monitor.pending() == 3
    record = monitor.record()
    assert monitor.pending() == 0 and monitor.last_record is record
    assert (record.step, record.steps, record.tokens) == (3, 3, 150)
    quiet = _step(monitor, 0)
    assert (quiet.step, quiet.steps) == (4, 1) and "step 4:" in quiet.line() and "steps 1-3:" in record.line()
    assert record.peak_bytes[0] - quiet.peak_bytes[0] > 200 * MIB or quiet.memory != "resident", (record, quiet)


def test_without_a_peak_reset_the_record_says_so(monkeypatch):
    """Where Linux refuses the reset of the resident peak, the record says what it holds."""
    import ulysses_kernels.monitor as monitor_module

    monkeypatch.setattr(monitor_module, "_reset_resident_peak", lambda: False)
    assert _step(StepMonitor(device="cpu"), 0).memory == "resident, process peak so far"


@pytest.mark.gpu
def test_record_measures_the_step_on_the_gpu():
    """On a GPU the peak is the allocator's, reset at begin(): a step that allocates 256 MiB
    reads at least 256 MiB above a quiet one."""
    monitor = StepMonitor(device="cuda")
    monitor.begin()
    quiet = monitor.end(1)
    monitor.begin()
    held = torch.ones(256 * MIB // 4, device="cuda")
    busy = monitor.end(1)
    del held
    assert busy.memory == "device allocator"
    assert busy.peak_bytes[0] - quiet.peak_bytes[0] >= 256 * MIB, (quiet, busy)


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


def test_no_expectation_for_a_model_the_planner_cannot_count():
    """A mixture-of-experts model: the monitor measures but expects nothing (the planner's
    dense count would understate it) and says why."""
    shape = planner.shape_from_dict(dict(LLAMA_LIKE, num_local_experts=8))
    monitor = StepMonitor(shape=shape)
    assert monitor.shape is None and "mixture-of-experts models (8 routed experts" in monitor.expectation_problem
    assert monitor.expected_activation_bytes(4096) is None
    assert StepMonitor(shape=planner.shape_from_dict(LLAMA_LIKE)).expectation_problem is None


def test_a_planned_step_records_each_ranks_cost_the_imbalance_and_the_sp_sizes():
    """Balanced global batches (global_batch.py): the record of planned steps holds every
    rank's cost over the ideal, the makespan over the ideal and the SP sizes, summed over
    the steps it covers; a record without planned steps holds none."""
    from ulysses_kernels import global_batch as gb

    plans = [gb.plan_global_batch([300, 40, 50, 60, 700], world=4, token_budget=200),
             gb.plan_global_batch([30, 20, 10, 90], world=4, token_budget=200)]
    monitor = StepMonitor(device="cpu")
    for plan in plans:
        monitor.begin()
        monitor.step_done(100, plan=plan)
    record = monitor.record()
    ideal = sum(p.ideal for p in plans)
    want = [sum(p.rank_costs()[r] for p in plans) / ideal for r in range(4)]
    assert record.plan_rank_costs == pytest.approx(want, rel=1e-12)
    assert record.plan_imbalance == pytest.approx(sum(p.makespan for p in plans) / ideal, rel=1e-12)
    assert record.plan_sp_sizes == sorted(set(plans[0].sp_sizes()) | set(plans[1].sp_sizes()))
    logs = record.as_logs()
    assert logs["plan_sp_max"] == 4 and logs["plan_rank_cost_max"] == round(max(want), 4)
    assert "planned: makespan" in record.line() and " / ".join(f"{c:.3f}" for c in want) in record.line()
    monitor.begin()
    assert monitor.end(10).plan_rank_costs is None and "plan_imbalance" not in monitor.last_record.as_logs()
