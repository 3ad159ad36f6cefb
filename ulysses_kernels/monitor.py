"""A per-step monitor for sequence-parallel training: tokens per second, the peak memory of
every rank, and the largest activation the planner expected for the step's length
(planner.py), so that tuning sequence lengths and chunk sizes shows its effect step by
step. The project's own loops (the demo, the examples) call `begin()` / `end()` around a
step; `hf.SequenceParallelTrainerMixin(monitor=True)` logs it through Trainer's logs.

Peak memory is the device allocator's peak on a GPU (`torch.cuda.max_memory_allocated`,
reset at every step) and the resident set on the CPU (Linux `VmHWM`, reset at every step
through `/proc/self/clear_refs` where the kernel allows it; otherwise the process's peak
so far, and the record says so).
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
    """One step as the monitor saw it (the same on every rank)."""

    step: int
    seconds: float
    tokens: int                    # the step's tokens, each counted once (every DP group's batch)
    peak_bytes: List[int]          # per rank of the monitor's group, in rank order
    memory: str                    # what peak_bytes measures
    expected_activation_bytes: Optional[float]   # the planner's largest activation of this step (None: unknown)

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
        return logs

    def line(self) -> str:
        """One human-readable line."""
        peaks = " / ".join(f"{b / GIB:.3f}" for b in self.peak_bytes)
        expected = ("" if self.expected_activation_bytes is None else
                    f"; the planner's largest activation {self.expected_activation_bytes / GIB:.4g} GiB")
        return (f"step {self.step}: {self.tokens:,} tokens in {self.seconds:.3f} s = {self.tokens_per_s:,.0f} tok/s; "
                f"peak memory per rank ({self.memory}) {peaks} GiB{expected}")


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


class StepMonitor:
    """Measures every step between `begin()` and `end(tokens)`; `end` is a collective over
    `group` (None: the default group) that gathers every rank's peak memory.

    model or shape / sp_size / ring_size / options: what the planner needs for the expected
    activation (a transformers model, or anything with `.config.to_dict()`, or a
    `planner.ModelShape`; options are `planner.PlanOptions` fields such as `tiled_mlp`,
    `checkpointing`, `attention`); without either there is no expectation. device: where
    the step runs (None: the model's, else CUDA when available).
    """

    def __init__(self, group=None, *, model=None, shape: Optional[planner.ModelShape] = None, sp_size: int = 1,
                 ring_size: int = 1, device=None, **options):
        self.group = group
        if shape is None and model is not None:
            shape = planner.shape_from_dict(model.config.to_dict())
        self.shape = shape
        self.sp_size, self.ring_size, self.options = sp_size, ring_size, options
        if device is None and model is not None:
            device = next(iter(model.parameters()), torch.empty(0)).device
        self.device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        self.steps = 0
        self._start = None
        self._resident_resets = True

    def expected_activation_bytes(self, seq_len: int) -> Optional[float]:
        """The planner's largest activation (planner.largest_activation_bytes) at `seq_len`
        tokens per SP group."""
        if self.shape is None or not seq_len:
            return None
        world = resolve_group(self.group)[1]
        options = planner.PlanOptions(seq_len=int(seq_len), gpus_per_node=max(world, self.sp_size),
                                      sp_size=self.sp_size, ring_size=self.ring_size, **self.options)
        return planner.largest_activation_bytes(planner.memory_terms(self.shape, options))

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

    def end(self, tokens: int, seq_len: Optional[int] = None) -> StepRecord:
        """The record of the step since `begin()` (collective: every rank of the group).
        tokens: the step's tokens, each counted once; seq_len: the tokens of one SP group's
        micro-batch (for the planner's expectation)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - self._start if self._start is not None else 0.0
        peaks = [row[0] for row in gather_ints([self._peak()], resolve_group(self.group)[0])]
        if self.device.type == "cuda":
            memory = "device allocator"
        else:
            memory = "resident" if self._resident_resets else "resident, process peak so far"
        self.steps += 1
        return StepRecord(step=self.steps, seconds=seconds, tokens=int(tokens), peak_bytes=peaks, memory=memory,
                          expected_activation_bytes=self.expected_activation_bytes(seq_len))
