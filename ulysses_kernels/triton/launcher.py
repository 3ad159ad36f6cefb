"""The launch policy of the attention kernels (docs/architecture.md, "Attention kernels"):
:class:`TunedLauncher` over a kernel's configs (``configs.CONFIGS``), the autotune key
(TUNE_KEYS, seq_bucket), whether autotuning runs (``ULYSSES_KERNELS_TRITON_AUTOTUNE``;
never in the interpreter), and what a plan records instead of launching (LaunchPlan,
PlanNote; ``plan.py``)."""

import contextlib
import math
from typing import Dict, NamedTuple, Optional, Tuple

import triton

from ..env import TRITON_AUTOTUNE, flag, interpreting

# Read once at import: decides whether kernels are wrapped in @triton.autotune.
INTERPRET_AT_IMPORT = interpreting()


def autotune_enabled() -> bool:
    """Autotuning runs only on a GPU (never in the interpreter) unless disabled by env."""
    if INTERPRET_AT_IMPORT:
        return False
    return flag(TRITON_AUTOTUNE, default=True)


# Autotune key shared by all attention kernels: retune per head dims, mask kind, variant,
# layout, GQA group and power-of-two sequence bucket. (Head counts, lengths, the GQA group
# and the window sides are runtime arguments, never specialized on: one compiled kernel
# serves every head count.) Each kernel is keyed on the names it declares.
TUNE_KEYS = ["TUNE_KEY", "HEAD_DIM", "BLOCK_D", "HEAD_DIM_V", "BLOCK_DV", "CAUSAL", "VARLEN", "SPLIT", "GROUP",
             "WINDOW", "SOFTCAP", "SINKS", "COUNT", "KV_DESC", "FMA_SCALE", "LAZY_RESCALE", "WARP_SPECIALIZE",
             "DQ_REDUCE"]


def seq_bucket(n: int) -> int:
    """Autotune key: log2 bucket of a sequence length (retune per power of two only)."""
    return max(0, int(math.ceil(math.log2(max(1, n)))))


def _zero_before_each_trial(names):
    """An autotuner pre-hook that zero-fills the named arguments (a tuple parameter: each of
    its tensors) before each trial and before the chosen run: accumulators must restart
    from zero. (Triton's own reset_to_zero takes plain tensor arguments only.)"""
    def hook(kwargs, reset_only=False):
        for name in names:
            value = kwargs[name]
            for tensor in value if isinstance(value, tuple) else (value,):
                tensor.zero_()
    return hook


class LaunchPlan(NamedTuple):
    """One kernel launch as a plan describes it (TunedLauncher with ``plan``): the kernel,
    its grid (at the config, or the default when autotuned), its config (BLOCK_M, BLOCK_N,
    num_warps, num_stages; None when autotuned), the default config and why, its features'
    Switches records and its constexprs."""

    kernel: str
    grid: Tuple[int, ...]
    config: Optional[Tuple[int, int, int, int]]
    default: Tuple[int, int, int, int]
    config_why: str
    switches: Tuple[object, ...]
    constexprs: Dict[str, object]


class PlanNote(NamedTuple):
    """A decision of a planned call that is not a launch's (the backward's mode, its head
    splits): what was decided, the choice and why."""

    topic: str
    choice: str
    why: str


def plan_autotunes(fp32_dot: bool) -> bool:
    """Whether a planned GPU launch would autotune (ULYSSES_KERNELS_TRITON_AUTOTUNE, on by
    default; never in the interpreter)."""
    return not fp32_dot and flag(TRITON_AUTOTUNE, default=True)


class TunedLauncher:
    """Launch policy of one kernel over its ``configs.ConfigSet`` (the one table,
    ``configs.CONFIGS``): on a GPU with autotuning enabled the kernel is autotuned over the
    candidates of its head dim (pruned per launch by the rule of :meth:`choose`); otherwise
    the default runs; in the interpreter the small ``interpret_blocks`` keep tests fast.
    :meth:`forced` runs one config on the GPU inside a ``with`` block (benchmark sweeps).
    """

    def __init__(self, kernel, config_set, reset_to_zero=None):
        self.kernel = kernel
        self.config_set = config_set
        self.configs = config_set.plain
        self.masked_configs = config_set.masked
        self.feature_configs = {"WARP_SPECIALIZE": config_set.warp_specialize} if config_set.warp_specialize else {}
        self.fp32_configs = config_set.fp32
        self.interpret_blocks = config_set.interpret_blocks
        self._forced = None
        self.tuned = None
        if autotune_enabled():
            keys = [k for k in TUNE_KEYS if k in kernel.arg_names]
            zero = _zero_before_each_trial(reset_to_zero) if reset_to_zero else None
            self.tuned = triton.autotune(configs=self._all_configs(), key=keys,
                                         prune_configs_by={"early_config_prune": self._prune}, pre_hook=zero)(kernel)

    @contextlib.contextmanager
    def forced(self, config):
        """Launches inside the block run ``config`` (a (BLOCK_M, BLOCK_N, warps, stages)
        tuple) on the GPU, whatever the tables and the autotuner say; the interpreter and
        fp32 inputs keep their own. For benchmark sweeps; restored on exit."""
        previous, self._forced = self._forced, tuple(config)
        try:
            yield
        finally:
            self._forced = previous

    def _candidates(self, block_d: int):
        return self.configs.get(block_d, self.configs[128])

    def _feature_candidates(self, block_d: int, meta):
        """The candidates of the first feature ``meta`` turns on, or None."""
        for name, table in self.feature_configs.items():
            if meta.get(name):
                return table.get(block_d, table[128])
        return None

    def _all_configs(self):
        seen, out = set(), []
        tables = [self.configs, self.masked_configs, *self.feature_configs.values()]
        for candidates in [c for table in tables for c in table.values()]:
            for cfg in candidates:
                if cfg not in seen:
                    seen.add(cfg)
                    bm, bn, w, s = cfg
                    out.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s))
        return out

    def _prune(self, configs, named_args, **kwargs):
        # Triton calls early_config_prune(configs, named_args, **kwargs) (3.6 .. 3.9):
        # named_args holds the positional arguments, kwargs the constexpr keywords.
        def arg(name):
            return kwargs.get(name, named_args.get(name))

        bd = max(arg("BLOCK_D"), arg("BLOCK_DV") or 0)  # the configs of the wider head dim
        allowed = self._allowed(bd, {name: arg(name) for name in (*self.feature_configs, "VARLEN", "SPLIT", "WINDOW")})
        keep = [c for c in configs
                if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in allowed]
        return keep or configs[:1]

    @staticmethod
    def masked(meta) -> bool:
        """Whether a launch with these constexprs takes the masked configs."""
        return bool(meta.get("VARLEN") or meta.get("SPLIT") == 2 or meta.get("WINDOW"))

    def default(self, block_d: int, masked: bool = False, meta=None):
        """The config a launch runs without autotuning; ``meta``: its constexprs (for the
        feature configs)."""
        featured = self._feature_candidates(block_d, meta or {})
        if featured is not None:
            return featured[0]
        if masked and block_d in self.masked_configs:
            return self.masked_configs[block_d][0]
        return self._candidates(block_d)[0]

    def tuned_configs(self):
        """{autotune key: chosen config} so far (empty when autotuning is off)."""
        if self.tuned is None:
            return {}
        return {str(k): str(v) for k, v in getattr(self.tuned, "cache", {}).items()}

    def choose(self, block_d: int, meta, *, fp32_dot: bool, fp32_inputs: bool, autotune: bool):
        """(config or None when the autotuner chooses, why): the one rule of which config a
        launch runs. A counting launch (COUNT) never autotunes: every trial would add its
        visits."""
        if fp32_dot:
            return (*self.interpret_blocks, 4, 1), "the interpreter's small tiles"
        if fp32_inputs and self.fp32_configs:
            return self.fp32_configs.get(block_d, self.fp32_configs[128]), "fp32 inputs: the one tf32x3 config"
        if self._forced is not None:
            return self._forced, "forced by a benchmark (TunedLauncher.forced)"
        default = self.default(block_d, self.masked(meta), meta)
        if autotune and not meta.get("COUNT"):
            return None, (f"autotuned once per call class over {len(self._allowed(block_d, meta))} candidates; "
                          f"{TRITON_AUTOTUNE.name}=0 runs the default")
        if self._feature_candidates(block_d, meta) is not None:
            return default, "the default of the enabled feature's configs"
        if self.masked(meta) and block_d in self.masked_configs:
            return default, "the masked default (documents, per-token layout or window)"
        return default, "the default"

    def _allowed(self, block_d: int, meta):
        allowed = self._feature_candidates(block_d, meta)
        if allowed is None:
            allowed = list(self._candidates(block_d)) + (self.masked_configs.get(block_d, [])
                                                         if self.masked(meta) else [])
        return allowed

    def __call__(self, grid, args, meta, block_d: int, fp32_dot: bool, fp32_inputs: bool = False, *,
                 plan=None, switches=()):
        """grid(BLOCK_M, BLOCK_N) -> launch grid. block_d: the wider padded head dim (q/k or
        v). Returns the (BLOCK_M, BLOCK_N, num_warps, num_stages) it ran, None when the
        autotuner chose. ``plan`` (a list): append this launch's LaunchPlan (with the
        ``switches`` records of its features) and launch nothing."""
        autotune = self.tuned is not None if plan is None else plan_autotunes(fp32_dot)
        config, why = self.choose(block_d, meta, fp32_dot=fp32_dot, fp32_inputs=fp32_inputs, autotune=autotune)
        if plan is not None:
            default = self.default(block_d, self.masked(meta), meta)
            shown = config or default
            plan.append(LaunchPlan(kernel=getattr(self.kernel, "fn", self.kernel).__name__,
                                   grid=tuple(grid(*shown[:2])), config=config, default=default, config_why=why,
                                   switches=tuple(switches),
                                   constexprs={k: v for k, v in meta.items() if k not in ("FP32_DOT", "PRECISION")}))
            return config
        if config is None:
            self.tuned[lambda META: grid(META["BLOCK_M"], META["BLOCK_N"])](*args, **meta)
            return None
        bm, bn, w, s = config
        self.kernel[grid(bm, bn)](*args, **meta, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
        return bm, bn, w, s
