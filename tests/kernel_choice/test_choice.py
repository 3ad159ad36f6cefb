"""The choice rule (ulysses_kernels/kernel_choice/choice.py) with injected timings: never a
candidate outside its table, the fastest at its slowest rank, the same choice on every rank
of a world 2 and of a 2 x 2 ring when the ranks' timings disagree, the memory and disk
caches and their keys, the forced choice and its error on every rank."""

import dataclasses
import json
import os
import random

import pytest
import torch
import torch.distributed as dist
from helpers import SPAWN_TIMEOUT

from ulysses_kernels import env, kernel_choice
from ulysses_kernels.kernel_choice import candidates as cands
from ulysses_kernels.kernel_choice import choice as choice_mod
from ulysses_kernels.launch import spawn

H100 = dict(device="NVIDIA H100 80GB HBM3", capability=(9, 0))
INSTALLED = ("flash2", "fa3", "fa4")


def gpu_call(**changes):
    base = dict(H100, dtype="bfloat16", head_dim=128, value_dim=128, q_heads=4, kv_heads=1, causal=True,
                alignment="square", bucket=64, grad=True)
    base.update(changes)
    return kernel_choice.Call(**base)


class FakeTimer:
    """Timings by candidate name (inf: fails); records what was timed."""

    def __init__(self, ms):
        self.ms, self.timed = dict(ms), []

    def __call__(self, name, fn):
        self.timed.append(name)
        t = self.ms.get(name, 10.0)
        if t == float("inf"):
            raise RuntimeError(f"{name}: No available kernel")
        return t


def pretend_installed(monkeypatch, names=INSTALLED):
    """The FlashAttention candidates importable (their runners are never called here)."""
    for name in names:
        candidate = kernel_choice.CANDIDATES[name]
        monkeypatch.setitem(kernel_choice.CANDIDATES, name,
                            dataclasses.replace(candidate, importable=lambda: (True, "test")))


@pytest.fixture(autouse=True)
def clean_state(tmp_path, monkeypatch):
    monkeypatch.setenv(env.CACHE_DIR.name, str(tmp_path))
    monkeypatch.delenv(env.ATTENTION.name, raising=False)
    kernel_choice.clear_memory_cache()
    choice_mod._warned.clear()
    yield
    kernel_choice.clear_memory_cache()


def choose(call, **kw):
    return kernel_choice.choose(call, device=torch.device("cpu"), can_time=True, **kw)


# ------------------------------------------------------------------ the rule

def test_the_fastest_eligible_candidate_wins(monkeypatch):
    pretend_installed(monkeypatch)
    timer = FakeTimer({"triton": 3.0, "sdpa_cudnn": 1.5, "sdpa_flash": 2.0, "fa3": 1.2, "fa4": 1.1})
    monkeypatch.setattr(choice_mod, "timer", timer)
    decision = choose(gpu_call())
    assert decision.choice == "fa4" and decision.how == "timed"
    assert set(timer.timed) == set(decision.eligible)
    assert decision.ms["fa4"] == 1.1
    assert ("torch_varlen" in decision.eligible) == cands._varlen_takes_gqa()  # GQA: torch >= 2.12


def test_never_a_candidate_outside_its_table(monkeypatch):
    """200 random classes, the ineligible candidates made the fastest: the choice is always
    one whose table covers the class (and that was timed)."""
    pretend_installed(monkeypatch)
    rng = random.Random(0)
    for _ in range(200):
        kernel_choice.clear_memory_cache()
        call = gpu_call(dtype=rng.choice(["bfloat16", "float16", "float32"]), head_dim=rng.choice([64, 96, 128, 192]),
                        kv_heads=rng.choice([1, 4]), causal=rng.random() < 0.5,
                        alignment=rng.choice(kernel_choice.ALIGNMENTS), window=rng.choice([(None, None), (64, None)]),
                        softcap=rng.choice([0.0, 30.0]), sinks=rng.random() < 0.2, packed=rng.random() < 0.3,
                        lse=rng.random() < 0.2, rows_layout=rng.random() < 0.2, deterministic=rng.random() < 0.2,
                        capability=rng.choice([(8, 0), (9, 0), (10, 0)]))
        call = dataclasses.replace(call, value_dim=call.head_dim)
        eligible, reasons = choice_mod.consider(call)
        fast_outside = {n: 0.1 for n in reasons}
        monkeypatch.setattr(choice_mod, "timer", FakeTimer({**fast_outside, "triton": 5.0}))
        decision = choose(call)
        table = kernel_choice.CANDIDATES[decision.choice].table()
        assert kernel_choice.excluded(table, call) is None, (call.text(), decision)
        assert decision.choice in eligible


def test_ties_and_failures(monkeypatch):
    """Equal timings: the registry's order (ours first); a candidate that fails while timed is
    not considered, with one warning."""
    monkeypatch.setattr(choice_mod, "timer", FakeTimer({"triton": 1.0, "sdpa_cudnn": 1.0, "sdpa_flash": 1.0}))
    assert choose(gpu_call()).choice == "triton"
    kernel_choice.clear_memory_cache()
    monkeypatch.setattr(choice_mod, "timer", FakeTimer({"triton": 2.0, "sdpa_cudnn": float("inf"), "sdpa_flash": 3.0}))
    with pytest.warns(RuntimeWarning, match="'sdpa_cudnn' failed while timed"):
        decision = choose(gpu_call(bucket=128))
    assert decision.choice == "triton" and "sdpa_cudnn" not in decision.ms


def test_any_failure_while_timed_is_dropped_on_that_rank_and_not_kept(monkeypatch, tmp_path):
    """A library's assert or a compiler error while timed must not leave this rank before the
    group's gather (the others would wait there): the candidate is dropped, and the class is
    not written to the disk cache (the failure may be passing: out of memory mid-training)."""
    class Asserting(FakeTimer):
        def __call__(self, name, fn):
            if name == "sdpa_flash":
                raise AssertionError("head dim not supported")
            return super().__call__(name, fn)
    monkeypatch.setattr(choice_mod, "timer", Asserting({"triton": 2.0, "sdpa_cudnn": 1.0}))
    with pytest.warns(RuntimeWarning, match="'sdpa_flash' failed while timed"):
        assert choose(gpu_call()).choice == "sdpa_cudnn"
    assert not (tmp_path / "attention_choice.json").exists()


def test_a_graph_capture_reads_no_disk_cache(monkeypatch, tmp_path):
    """Inside a CUDA graph capture no gather evens out what each rank's disk holds, so the
    disk cache is not read: every rank takes the first eligible candidate."""
    monkeypatch.setattr(choice_mod, "timer", FakeTimer({"triton": 2.0, "sdpa_cudnn": 1.0}))
    assert choose(gpu_call()).choice == "sdpa_cudnn"   # timed and written to disk
    kernel_choice.clear_memory_cache()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    decision = kernel_choice.choose(gpu_call(), device=torch.device("cuda"))
    assert decision.choice == "triton" and decision.how == "untimed"


def test_the_ring_class_holds_no_rank_fact(monkeypatch):
    """A ring rank whose portion is empty derives the class of the others (a class that
    differed would make that rank gather alone on a later call)."""
    from ulysses_kernels.ring.schedule import RingSpec
    from ulysses_kernels.triton_path.block_ops import TritonBlockOps

    seen = []
    monkeypatch.setattr(kernel_choice, "choose", lambda call, **kw: seen.append(call) or
                        kernel_choice.Decision(call, "auto", ("triton",), {}, "triton", "untimed"))
    spec = RingSpec(None, 4, 3, 3, True, 0.25)
    for length in (0, 1):
        q = torch.randn(1, length, 4, 16)
        k = torch.randn(1, length, 2, 16)
        TritonBlockOps.for_call(q, k, k, spec=spec, groups=())
    assert seen[0] == seen[1] and not seen[0].empty


def test_cpu_and_capture_are_untimed(monkeypatch):
    timer = FakeTimer({})
    monkeypatch.setattr(choice_mod, "timer", timer)
    cpu_call = gpu_call(device="cpu", capability=(0, 0), grad=False)
    assert choose(cpu_call).choice == "triton" and timer.timed == []
    decision = kernel_choice.choose(gpu_call(), device=torch.device("cpu"), can_time=False)  # e.g. a graph capture
    assert decision.choice == "triton" and decision.how == "untimed" and timer.timed == []


# ------------------------------------------------------------------ caches

def test_memory_then_disk_cache_and_their_keys(monkeypatch, tmp_path):
    timer = FakeTimer({"triton": 2.0, "sdpa_cudnn": 1.0, "sdpa_flash": 3.0})
    monkeypatch.setattr(choice_mod, "timer", timer)
    first = choose(gpu_call())
    n = len(timer.timed)
    assert first.choice == "sdpa_cudnn" and n == len(first.eligible) >= 3
    assert choose(gpu_call()).choice == "sdpa_cudnn" and len(timer.timed) == n  # memory: not timed again
    entries = json.load(open(tmp_path / "attention_choice.json"))["choices"]
    (key, entry), = entries.items()
    assert key.startswith(gpu_call().text() + f" | {','.join(first.eligible)} | ulysses_kernels ")
    assert " torch " in key and " cudnn " not in key or torch.cuda.is_available()
    assert entry["choice"] == "sdpa_cudnn" and entry["ms"]["triton"] == 2.0 and entry["ms"]["sdpa_cudnn"] == 1.0
    kernel_choice.clear_memory_cache()
    decision = choose(gpu_call())  # a new process: the disk entry, no timing
    assert decision.choice == "sdpa_cudnn" and decision.how == "cached" and len(timer.timed) == n
    kernel_choice.clear_memory_cache()
    monkeypatch.setattr(choice_mod, "versions", lambda names: "torch 9.9 (another install)")
    assert choose(gpu_call()).choice == "sdpa_cudnn" and len(timer.timed) == 2 * n  # new versions: timed again
    assert choose(gpu_call(bucket=128)).how == "timed" and len(timer.timed) == 3 * n  # another class


def test_corrupt_or_unwritable_cache(monkeypatch, tmp_path):
    (tmp_path / "attention_choice.json").write_text("{not json")
    monkeypatch.setattr(choice_mod, "timer", FakeTimer({"sdpa_flash": 0.5}))
    assert choose(gpu_call()).choice == "sdpa_flash"
    assert len(json.load(open(tmp_path / "attention_choice.json"))["choices"]) == 1  # rewritten
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv(env.CACHE_DIR.name, str(blocked / "sub"))
    kernel_choice.clear_memory_cache()
    with pytest.warns(RuntimeWarning, match="could not write the attention choice cache"):
        assert choose(gpu_call()).choice == "sdpa_flash"


# ------------------------------------------------------------------ forcing

def test_forced_candidates_and_families(monkeypatch):
    pretend_installed(monkeypatch)
    timer = FakeTimer({"sdpa_cudnn": 2.0, "sdpa_flash": 1.0, "fa3": 0.5})
    monkeypatch.setattr(choice_mod, "timer", timer)
    monkeypatch.setenv(env.ATTENTION.name, "sdpa_cudnn")
    assert choose(gpu_call()).choice == "sdpa_cudnn" and choose(gpu_call()).how == "forced"
    monkeypatch.setenv(env.ATTENTION.name, "sdpa")  # a family: the fastest member
    assert choose(gpu_call()).choice == "sdpa_flash"
    monkeypatch.setenv(env.ATTENTION.name, "flash")
    assert choose(gpu_call()).choice == "fa3"
    monkeypatch.setenv(env.ATTENTION.name, "triton")
    assert choose(gpu_call()).choice == "triton" and timer.timed.count("triton") == 0


def test_a_forced_kernel_that_cannot_compute_the_call_raises(monkeypatch):
    monkeypatch.setenv(env.ATTENTION.name, "sdpa_cudnn")
    with pytest.raises(ValueError, match=r"ULYSSES_KERNELS_ATTENTION=sdpa_cudnn cannot compute this attention "
                                         r"call .*causal-short_queries.*causal masks and windows only where square"):
        choose(gpu_call(alignment="short_queries"))
    monkeypatch.setenv(env.ATTENTION.name, "fa3")
    with pytest.raises(ValueError, match="fa3: not installed here"):
        choose(gpu_call())
    monkeypatch.setenv(env.ATTENTION.name, "cudnn")
    with pytest.raises(ValueError, match="ULYSSES_KERNELS_ATTENTION='cudnn' is not one of auto, triton"):
        choose(gpu_call())


# ------------------------------------------------------------------ agreement over ranks

def agreement_worker(rank, world, ring):
    """Each rank's timings disagree; with `ring`, a 2 x 2 mesh: SP groups {0,1}, {2,3}, ring
    groups {0,2}, {1,3}. Returns the choice, its agreed timings and the forced error."""
    os.environ[env.CACHE_DIR.name] = os.path.join(os.environ["KC_CACHE"], str(rank))
    kernel_choice.clear_memory_cache()
    for name in INSTALLED:
        kernel_choice.CANDIDATES[name] = dataclasses.replace(kernel_choice.CANDIDATES[name],
                                                             importable=lambda: (True, "test"))
    if rank == 1:  # this rank lacks FA4: nobody may choose it
        kernel_choice.CANDIDATES["fa4"] = dataclasses.replace(kernel_choice.CANDIDATES["fa4"],
                                                              importable=lambda: (False, "missing here"))
    per_rank = [{"triton": 3.0, "sdpa_cudnn": 1.0, "fa3": 2.5, "fa4": 0.1},
                {"triton": 3.0, "sdpa_cudnn": 4.0, "fa3": 2.0},
                {"triton": 2.0, "sdpa_cudnn": 1.0, "fa3": 1.0},
                {"triton": 2.5, "sdpa_cudnn": 1.0, "fa3": 2.9}][rank]
    choice_mod.timer = FakeTimer(per_rank)
    if ring:
        sp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
        ring_group = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
        groups = (sp, ring_group)
    else:
        groups = (None,)  # the default group
    decision = kernel_choice.choose(gpu_call(), groups=groups, device=torch.device("cpu"), can_time=True)
    again = kernel_choice.choose(gpu_call(), groups=groups, device=torch.device("cpu"), can_time=True)
    os.environ[env.ATTENTION.name] = "sdpa_cudnn"
    try:
        kernel_choice.choose(gpu_call(alignment="short_queries"), groups=groups, device=torch.device("cpu"))
        error = None
    except ValueError as exc:
        error = str(exc)
    return dict(choice=decision.choice, ms=decision.ms, eligible=decision.eligible, again=again.choice,
                error=error, fa4=decision.reasons.get("fa4"))


@pytest.mark.slow
@pytest.mark.parametrize("world,ring", [(2, False), (4, True)], ids=["world2", "ring2x2"])
def test_every_rank_agrees_when_timings_disagree(world, ring, tmp_path, monkeypatch):
    monkeypatch.setenv("KC_CACHE", str(tmp_path))
    results = spawn(agreement_worker, world, args=(ring,), timeout=SPAWN_TIMEOUT)
    choices = {r["choice"] for r in results}
    assert len(choices) == 1, results
    # world 2: max over ranks: triton 3, sdpa_cudnn 4, fa3 2.5 (fa4 missing on rank 1) -> fa3.
    # 2 x 2: triton 3, sdpa_cudnn 4, fa3 2.9 -> fa3 as well, though no rank alone would pick it.
    assert choices == {"fa3"}
    assert all(r["again"] == "fa3" for r in results)
    assert all("fa4" not in r["eligible"] and "rank 1: not installed here" in r["fa4"] for r in results)
    assert len({json.dumps(r["ms"], sort_keys=True) for r in results}) == 1
    errors = {r["error"] for r in results}
    assert len(errors) == 1 and "cannot compute this attention call" in errors.pop()
