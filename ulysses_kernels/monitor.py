"""A per-step monitor for sequence-parallel training: tokens per second, the peak memory of
every rank, and the activation memory the planner expects for the step's length
(planner.py), so that tuning sequence lengths and chunk sizes shows its effect step by
step. The project's own loops (the demo, the examples) call `begin()` / `end()` around a
step; `hf.SequenceParallelTrainerMixin(monitor=True)` logs it through Trainer's logs.

A record covers the steps since the previous one: `end()` makes one per step;
`step_done()` (local) then `record()` (the collective) cover several, e.g. Trainer's
logging interval. Its time is the slowest rank's (the step is as slow as that rank), so
every rank's record is the same.

Peak memory is the device allocator's peak on a GPU (`torch.cuda.max_memory_allocated`,
reset at every `begin()`) and the resident set on the CPU (Linux `VmHWM`, reset at every
`begin()` through `/proc/self/clear_refs` where the kernel allows it; otherwise the
process's peak so far, and the record says so); a record holds the highest of its steps.
"""

import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from . import planner
from .distributed.collectives import gather_ints
from .distributed.groups import resolve_group

GIB = planner.GIB


@dataclass
class StepRecord:
    """The steps since the previous record, as the monitor saw them (the same on every rank)."""

    step: int                      # the last step counted
    steps: int                     # how many steps the record covers
    seconds: float                 # their time on the slowest rank (begin() to step_done(), summed)
    tokens: int                    # their tokens, each counted once (every DP group's batch)
    peak_bytes: List[int]          # per rank of the monitor's group, in rank order: the highest of the steps
    memory: str                    # what peak_bytes measures
    expected_activation_bytes: Optional[float]   # the planner's activations at the longest step (None: unknown)
    # Balanced global batches (global_batch.py; None when no step was planned): every rank's
    # planned cost over the ideal, the makespan over the ideal, the SP sizes the steps used
    plan_rank_costs: Optional[List[float]] = None
    plan_imbalance: Optional[float] = None
    plan_sp_sizes: Optional[List[int]] = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def as_logs(self) -> Dict[str, float]:
        """Scalars for Trainer's logs (memory in GiB, four significant digits)."""
        gib = lambda b: float(f"{b / GIB:.4g}")  # noqa: E731
        logs = {"tokens_per_s": round(self.tokens_per_s, 1),
                "peak_mem_gib": gib(max(self.peak_bytes)), "peak_mem_gib_min": gib(min(self.peak_bytes)),
                "peak_mem_rank": int(max(range(len(self.peak_bytes)), key=lambda r: self.peak_bytes[r]))}
        if self.expected_activation_bytes is not None:
            logs["planner_activation_gib"] = gib(self.expected_activation_bytes)
        if self.plan_rank_costs is not None:
            logs.update(plan_imbalance=round(self.plan_imbalance, 4), plan_rank_cost_max=round(max(self.plan_rank_costs), 4),
                        plan_rank_cost_min=round(min(self.plan_rank_costs), 4),
                        plan_sp_min=min(self.plan_sp_sizes), plan_sp_max=max(self.plan_sp_sizes))
        return logs

    def line(self) -> str:
        """One human-readable line."""
        peaks = " / ".join(f"{b / GIB:.3f}" for b in self.peak_bytes)
        steps = f"step {self.step}" if self.steps == 1 else f"steps {self.step - self.steps + 1}-{self.step}"
        expected = ("" if self.expected_activation_bytes is None else
                    f"; the planner's activations {self.expected_activation_bytes / GIB:.4g} GiB")
        plan = ""
        if self.plan_rank_costs is not None:
            costs = " / ".join(f"{c:.3f}" for c in self.plan_rank_costs)
            plan = (f"; planned: makespan {self.plan_imbalance:.3f}x the ideal, SP sizes "
                    f"{', '.join(map(str, self.plan_sp_sizes))}, each rank's cost over the ideal {costs}")
        return (f"{steps}: {self.tokens:,} tokens in {self.seconds:.3f} s = {self.tokens_per_s:,.0f} tok/s; "
                f"peak memory per rank ({self.memory}) {peaks} GiB{expected}{plan}")


def _proc_status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_resident_peak() -> bool:
    """Reset the process's peak resident set (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def plan_defaults(model) -> Dict[str, object]:
    """The planner options a model shows itself: its parameters' dtype (the compute dtype)
    and whether activation checkpointing is on (transformers' `is_activation_checkpointing`)."""
    options: Dict[str, object] = {}
    param = next(iter(model.parameters()), None)
    if param is not None:
        options["dtype_bytes"] = param.element_size()
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    if isinstance(checkpointing, bool):
        options["checkpointing"] = checkpointing
    return options


def _text_config(model) -> dict:
    config = model.config
    if hasattr(config, "get_text_config"):   # multimodal configs keep the decoder's sizes there
        config = config.get_text_config()
    return config.to_dict()


class StepMonitor:
    """Measures the steps between `begin()` and `end(tokens)` (or `step_done` + `record`);
    `end` and `record` are collectives over `group` (None: the default group) that gather
    every rank's peak memory and time: call them on every rank.

    model or shape / sp_size / ring_size / options: what the planner needs for the expected
    activations (a transformers model, or anything with `.config.to_dict()`, or a
    `planner.ModelShape`; options are `planner.PlanOptions` fields such as `tiled_mlp`,
    `checkpointing`, `dtype_bytes`, `attention`; with a model, its dtype and checkpointing
    are the defaults, `plan_defaults`, and `attention` defaults to the automatic path's:
    "reference" on CPU, "flash" on a GPU); without either there is no expectation. device:
    where the step runs (None: the model's, else CUDA when available).
    """

    def __init__(self, group=None, *, model=None, shape: Optional[planner.ModelShape] = None, sp_size: int = 1,
                 ring_size: int = 1, device=None, **options):
        self.group = group
        if shape is None and model is not None:
            shape = planner.shape_from_dict(_text_config(model))
        # No expectation for a model the planner cannot count (a mixture of experts): an
        # understated one would mislead.
        self.expectation_problem = shape.dense_mlp_problem() if shape is not None else None
        self.shape = shape if self.expectation_problem is None else None
        self.sp_size, self.ring_size = sp_size, ring_size
        self.options = {**(plan_defaults(model) if model is not None else {}), **options}
        if device is None and model is not None:
            device = next(iter(model.parameters()), torch.empty(0)).device
        self.device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        # the automatic path's attention: the reference on CPU, flash kernels on a GPU (pass
        # attention= for a forced backend)
        self.options.setdefault("attention", "reference" if self.device.type == "cpu" else "flash")
        self.steps = 0
        self.last_record: Optional[StepRecord] = None   # the latest record() (e.g. of Trainer's last log)
        self._start = None
        self._resident_resets = True
        self._window()

    def _window(self) -> None:
        self._steps = self._tokens = self._peak_seen = 0
        self._seconds, self._seq_len = 0.0, None
        self._plan_costs, self._plan_makespan, self._plan_ideal, self._plan_sizes = None, 0.0, 0.0, set()

    def expected_activation_bytes(self, seq_len: int) -> Optional[float]:
        """The planner's activations at the step's peak (planner.activation_bytes) at
        `seq_len` tokens per SP group."""
        if self.shape is None or not seq_len:
            return None
        world = resolve_group(self.group)[1]
        options = planner.PlanOptions(seq_len=int(seq_len), gpus_per_node=max(world, self.sp_size),
                                      sp_size=self.sp_size, ring_size=self.ring_size, **self.options)
        return planner.activation_bytes(planner.memory_terms(self.shape, options))

    def begin(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._resident_resets = _reset_resident_peak()
        self._start = time.perf_counter()

    def _peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        kib = _proc_status_kib("VmHWM")
        if kib is None:
            import resource

            kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self._resident_resets = False
        return kib * 1024

    def step_done(self, tokens: int, seq_len: Optional[int] = None, plan=None) -> None:
        """Count the step since `begin()` (local, no collective). tokens: the step's tokens,
        each counted once; seq_len: the tokens of one SP group's micro-batch (for the
        planner's expectation); plan: the step's `GlobalBatchPlan` when it was planned
        (every rank has the same: its costs need no collective)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._seconds += time.perf_counter() - self._start if self._start is not None else 0.0
        self._start = None
        self._peak_seen = max(self._peak_seen, self._peak())
        self._tokens += int(tokens)
        if seq_len:
            self._seq_len = max(self._seq_len or 0, int(seq_len))
        self._steps += 1
        self.steps += 1
        if plan is not None:
            costs = plan.rank_costs()
            self._plan_costs = costs if self._plan_costs is None else [a + b for a, b in zip(self._plan_costs, costs)]
            self._plan_makespan += plan.makespan
            self._plan_ideal += plan.ideal
            self._plan_sizes |= set(plan.sp_sizes())

    def pending(self) -> int:
        """How many steps were counted since the previous record."""
        return self._steps

    def record(self) -> StepRecord:
        """The record of the steps counted since the previous record (collective: every
        rank of the group, the same number of times)."""
        rows = gather_ints([self._peak_seen, round(self._seconds * 1e6)], resolve_group(self.group)[0])
        if self.device.type == "cuda":
            memory = "device allocator"
        else:
            memory = "resident" if self._resident_resets else "resident, process peak so far"
        record = StepRecord(step=self.steps, steps=self._steps, seconds=max(row[1] for row in rows) / 1e6,
                            tokens=self._tokens, peak_bytes=[row[0] for row in rows], memory=memory,
                            expected_activation_bytes=self.expected_activation_bytes(self._seq_len))
        if self._plan_costs is not None and self._plan_ideal > 0:
            record.plan_rank_costs = [c / self._plan_ideal for c in self._plan_costs]
            record.plan_imbalance = self._plan_makespan / self._plan_ideal
            record.plan_sp_sizes = sorted(self._plan_sizes)
        self._window()
        self.last_record = record
        return record

    def end(self, tokens: int, seq_len: Optional[int] = None, plan=None) -> StepRecord:
        """`step_done` then `record`: the record of this one step (collective)."""
        self.step_done(tokens, seq_len, plan=plan)
        return self.record()
