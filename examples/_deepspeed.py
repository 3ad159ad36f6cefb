"""Shared by the examples that run DeepSpeed with Trainer (train_trainer.py, sft_trl.py)
and by their tests: the ZeRO config, the CPU set-up accelerate leaves out, and what a run
reports about DeepSpeed (docs/deepspeed.md)."""


def trainer_config(stage: int) -> dict:
    """A DeepSpeed config for `TrainingArguments(deepspeed=...)`: ZeRO `stage`, the batch
    sizes and clipping taken from the arguments ("auto"); every parameter partitioned
    under ZeRO-3, however small (a tiny model's would all stay whole)."""
    return {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}


def communicator_on_cpu(args) -> None:
    """Call after `TrainingArguments` and before the model. With `use_cpu`, accelerate does
    not set up DeepSpeed's communicator (on GPUs it does), so zero.Init would size ZeRO-3
    for one process; this adopts the process group TrainingArguments created."""
    if args.deepspeed and args.use_cpu:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")


def built_under_zero_init(model) -> bool:
    """True when DeepSpeed ZeRO-3 partitioned the model as it was built (zero.Init)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def describe(trainer, zero_init: bool) -> str:
    """"DeepSpeed ZeRO-3, built under zero.Init", "DeepSpeed ZeRO-2" or "no DeepSpeed"."""
    if not trainer.is_deepspeed_enabled:
        return "no DeepSpeed"
    return f"DeepSpeed ZeRO-{trainer.accelerator.deepspeed_plugin.zero_stage}" + (
        ", built under zero.Init" if zero_init else "")
