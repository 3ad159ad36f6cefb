"""What runs for a call class (ulysses_kernels/triton/plan.py, ulysses_kernels/explain.py,
`ulysses-kernels doctor --explain`): the launchers' own decisions recorded on meta tensors
for a GPU target, and for the interpreter the config a real launch runs."""

import pytest
import torch
from helpers import randn

from ulysses_kernels import env

pytest.importorskip("ulysses_kernels.triton")
from ulysses_kernels.triton import flash_fwd  # noqa: E402
from ulysses_kernels.triton.kernel_call import Target  # noqa: E402
from ulysses_kernels.triton.launcher import LaunchPlan, PlanNote  # noqa: E402
from ulysses_kernels.triton.plan import plan_attention  # noqa: E402

H200 = Target("cuda", interpreting=False, sm_count=132)
ONE_RANK = dict(batch=1, seqlen_q=8192, seqlen_k=8192, num_q_heads=4, num_kv_heads=1, head_dim=128)


@pytest.fixture(autouse=True)
def settings(monkeypatch):
    for var in (env.HOPPER_FEATURES, env.BWD_HEAD_SPLITS, env.TRITON_AUTOTUNE):
        monkeypatch.delenv(var.name, raising=False)
    return monkeypatch


def launches(items):
    return [item for item in items if isinstance(item, LaunchPlan)]


def note(items, topic):
    return next(item for item in items if isinstance(item, PlanNote) and item.topic == topic)


def test_default_gpu_plan():
    """bf16 causal on an H200: the forward and the atomic backward autotune around their
    measured defaults; no Hopper feature unless asked for."""
    plan = plan_attention(**ONE_RANK, causal=True, target=H200)
    (fwd,) = launches(plan.forward)
    assert (fwd.kernel, fwd.config, fwd.default, fwd.grid) == ("_flash_fwd_kernel", None, (128, 128, 8, 2), (64, 4))
    assert "autotuned" in fwd.config_why and fwd.constexprs["CAUSAL"] and fwd.constexprs["SPLIT"] == 0
    assert fwd.switches[0].on == [] and fwd.switches[0].dropped == {}
    assert note(plan.backward, "mode").choice.startswith("atomic")
    (dkdv,) = launches(plan.backward)
    assert dkdv.kernel == "_flash_bwd_dkdv_kernel" and dkdv.default == (32, 128, 8, 2) and dkdv.constexprs["DQ_ATOMIC"]
    # 64 key blocks x 1 KV head on 132 SMs: the group of 4 is split 4 ways (256 programs).
    splits = note(plan.backward, "head splits")
    assert splits.choice == "4" and "132 SMs" in splits.why and dkdv.grid == (64, 4)


def test_autotuning_off_and_deterministic(settings):
    settings.setenv(env.TRITON_AUTOTUNE.name, "0")
    plan = plan_attention(**ONE_RANK, causal=True, deterministic=True, target=H200)
    assert launches(plan.forward)[0].config == (128, 128, 8, 2)
    assert note(plan.backward, "mode").choice.startswith("two kernels")
    assert [p.kernel for p in launches(plan.backward)] == ["_flash_bwd_dkdv_kernel", "_flash_bwd_dq_kernel"]
    assert [p.config for p in launches(plan.backward)] == [(32, 64, 8, 2), (128, 64, 8, 3)]


def test_features_dropped_with_reasons(settings):
    """Each requested feature a call cannot run is listed with the reason, never dropped
    silently: softcap drops fma_scale, packed documents drop warp_specialize, fp32 inputs
    on a GPU drop all, the two-kernel backward drops dq_reduce."""
    settings.setenv(env.HOPPER_FEATURES.name, "hopper,bwd_warp_specialize")
    plan = plan_attention(**ONE_RANK, causal=True, softcap=30.0, target=H200)
    switches = launches(plan.forward)[0].switches[0]
    assert switches.on == ["desc", "warp_specialize"]
    assert "tanh" in switches.dropped["fma_scale"]
    assert "warp-specialized" in note(plan.backward, "mode").choice
    assert "no dQ atomics" in launches(plan.backward)[0].switches[0].dropped["dq_reduce"]

    documents = plan_attention(**ONE_RANK, causal=True, documents=(0, 3000, 8192), target=H200)
    forward = launches(documents.forward)[0]
    assert forward.switches[0].on == ["desc", "fma_scale"] and "packed documents" in forward.switches[0].dropped[
        "warp_specialize"]
    assert forward.default == (128, 64, 8, 3)  # the masked configs
    assert "packed documents" in note(documents.backward, "mode").why

    fp32 = plan_attention(**ONE_RANK, causal=True, dtype=torch.float32, target=H200)
    assert launches(fp32.forward)[0].switches[0].on == []
    assert set(launches(fp32.forward)[0].switches[0].dropped) == {"desc", "fma_scale", "warp_specialize"}


def test_buffer_layout_and_forced_head_splits(settings):
    """Batch 2 in a 4-block all-to-all buffer reads affine tiles (SPLIT 1); forced head
    splits are stated with their variable."""
    settings.setenv(env.BWD_HEAD_SPLITS.name, "2")
    plan = plan_attention(batch=2, seqlen_q=8192, seqlen_k=8192, num_q_heads=8, num_kv_heads=2, head_dim=128,
                          causal=True, seq_splits=4, target=H200)
    assert launches(plan.forward)[0].constexprs["SPLIT"] == 1
    assert note(plan.backward, "head splits") == PlanNote("head splits", "2", f"{env.BWD_HEAD_SPLITS.name}=2")


def test_plan_is_cached_per_call_class_and_settings(settings):
    first = plan_attention(**ONE_RANK, causal=True, target=H200)
    assert plan_attention(**ONE_RANK, causal=True, target=H200) is first
    settings.setenv(env.HOPPER_FEATURES.name, "desc")
    assert launches(plan_attention(**ONE_RANK, causal=True, target=H200).forward)[0].switches[0].on == ["desc"]


@pytest.mark.skipif(not env.interpreting(), reason="needs TRITON_INTERPRET=1")
def test_interpreter_plan_is_what_a_launch_runs(monkeypatch):
    """On this machine (the interpreter) the plan's config is the one the real launch ran."""
    ran = []
    real = flash_fwd._launch.__call__

    def spy(*args, **kwargs):
        ran.append(real(*args, **kwargs))
        return ran[-1]

    monkeypatch.setattr(flash_fwd, "_launch", type("Spy", (), {"__call__": staticmethod(spy)})())
    import ulysses_kernels.triton as uk_triton

    q, k, v = randn(1, 40, 2, 16, seed=1), randn(1, 40, 1, 16, seed=2), randn(1, 40, 1, 16, seed=3)
    uk_triton.flash_attention_forward(q, k, v, causal=True, softmax_scale=None)
    monkeypatch.undo()
    plan = plan_attention(batch=1, seqlen_q=40, seqlen_k=40, num_q_heads=2, num_kv_heads=1, head_dim=16,
                          dtype=torch.float32, causal=True, target=Target("cpu", interpreting=True))
    assert launches(plan.forward)[0].config == ran[0] == (32, 16, 4, 1)


@pytest.mark.parametrize("argv, expected", [
    ([], ["per rank", "path here", "fused chunks", "forward kernel", "backward mode", "backward head splits"]),
    (["--batch", "2", "--seq-len", "32768", "--world", "4", "--softcap", "30"], ["SPLIT 1", "SOFTCAP"]),
    (["--seq-len", "65536", "--heads", "64", "--world", "8", "--window", "4096", "0", "--sinks"],
     ["WINDOW, SINKS", "not causal"]),
])
def test_doctor_explain(argv, expected, capsys):
    from ulysses_kernels.cli import main

    assert main(["doctor", "--explain", *argv]) == 0
    out = capsys.readouterr().out
    for text in expected:
        assert text in out, (text, out)


def test_doctor_explain_refuses_a_bad_call(capsys, settings):
    from ulysses_kernels.cli import main

    assert main(["doctor", "--explain", "--heads", "6", "--kv-heads", "6", "--world", "4"]) == 2
    assert "must be divisible by the sequence-parallel size (4)" in capsys.readouterr().err
    settings.setenv(env.HOPPER_FEATURES.name, "turbo")
    assert main(["doctor", "--explain"]) == 2
    assert "unknown kernel feature" in capsys.readouterr().err


def test_autotuner_reset_zeroes_every_tensor_of_a_tuple_parameter():
    """The atomic backward's autotuner restarts its accumulators (the `grads` tuple) from
    zero before each trial: every tensor of the tuple, and plain tensor arguments too."""
    from ulysses_kernels.triton.launcher import _zero_before_each_trial

    grads, acc = (randn(2, 3, seed=4), randn(3, seed=5)), randn(4, seed=6)
    _zero_before_each_trial(["grads", "acc"])({"grads": grads, "acc": acc, "other": 1})
    assert all(bool((t == 0).all()) for t in (*grads, acc))
