"""Hugging Face transformers integration: Ulysses sequence parallelism for HF causal LMs.

transformers is an optional dependency of the package (the `hf` extra: `pip install
--no-build-isolation -e '.[hf]'` in the checkout): `ulysses_kernels` works without it, and
importing this module without it raises an ImportError that says so.

Typical training step (every rank of an SP group holds the same full batch; each DP
group a different one)::

    import ulysses_kernels as uk
    from ulysses_kernels import hf as ukhf

    groups = uk.init_sequence_parallel(sp_size)
    ukhf.register(groups)                               # attn_implementation="ulysses"; the default context
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="ulysses")
    ukhf.patch_model(model)                              # optional: tiled MLP + tiled loss
    model = ukhf.apply_fsdp(model, groups)               # or apply_ddp, or neither
    batch = ukhf.shard_batch(input_ids, groups.sp_group, position_ids=pos)
    loss = ukhf.causal_lm_loss(model, batch, groups.sp_group)   # global mean, all ranks
    loss.backward()
    # without FSDP/DDP: ukhf.allreduce_gradients(model, groups.sp_group, groups.dp_group)

Design notes
------------
* **Attention.** `register()` adds `ulysses_attention_forward` to transformers'
  `AttentionInterface` under the name ``"ulysses"``. Every attention layer then calls
  `ulysses_kernels.ulysses_attention` on the groups of its model's context. Causal unless
  the layer says otherwise (`module.is_causal`).
* **Contexts** (`context.py`). Each model's groups, ring, backend and decoding cache live
  in its `SequenceParallelContext`, set on every submodule (`attach_context`), so two
  models on two SP groups live in one process. `register(groups)` sets the default
  context, which models without one of their own follow.
* **The guard** (`guard.py`). What the package cannot make exactly sequence-parallel (a
  token mixer that is not attention, attention written by hand, positions numbered from
  the local slice, a mask overlay) raises `NotSequenceParallelError` on every rank, the
  first time the package meets the model and at the latest during its first forward.
* **Masks.** `register()` also adds a mask function to `AttentionMaskInterface` under the
  same name, so transformers builds *no* mask tensor for this implementation: for an
  unpadded batch the mask function returns `None` (attention is causal and the document
  boundaries come from the position ids, below). A 2-D padding mask with any zero that
  reaches the model (on any rank of the group: the ranks agree through one tiny
  all-reduce, so all of them raise together instead of some hanging) raises
  `ValueError`; so do custom 4-D masks, dropout > 0 and KV caches outside `generate` /
  `prefill` (generation.py: sequence-parallel prefill and generation from a head-sharded
  cache). A mask the model overlays on the causal one is refused (the guard). Nothing is
  silently dropped. A forward of `shard_batch`'s inputs or of generation, with no mask and
  a request causal by construction, has nothing to agree on and skips that all-reduce.
* **Attention variants.** Each layer's sliding window, logit softcap and sinks
  (`attention.layer_variants`) and a value head dim of its own (MLA) go to the attention
  as they would on one device (Mistral, Qwen2, Gemma 2/3, GPT-OSS, DeepSeek-V3); Llama 4's
  chunked layers and the temperature of its NoPE layers too (`chunked.py`).
* **Padded batches** go through `shard_batch(..., attention_mask=mask)`, which unpads
  them before the model: the valid tokens of every row, one after the other, in one
  packed row, each row a document with positions from 0, no target at a row's end; the
  model gets no mask. `batch.padding` (a `PaddingInfo`) records where the tokens came
  from: `repad` / `gather_tokens` put per-token results back into `[B, S]` (`fill` at
  padding), `batch.shard_tokens` brings `[B, S]` per-token inputs to the shard, and
  `count_targets` counts the targets the loss averages over.
* **Packed documents.** Position ids restarting at 0 (any break in `p[t] = p[t-1] + 1`,
  the rule transformers itself uses) mark document boundaries; attention never crosses
  them. The robust path is `shard_batch`: it computes the *global* `cu_seqlens` once from
  the full batch before sharding and hands them (and every rank's length) to the
  attention through the model's ``**kwargs`` (keys ``ulysses_cu_seqlens`` and
  ``ulysses_seq_lens``, which HF forwards untouched to the attention function). Without
  them, the attention all-gathers the local position-id shard along the group on every
  layer (a few bytes) and derives the same boundaries, so calling the model with global
  position ids by hand also works.
* **Position ids must be global.** Each rank's `position_ids` shard must hold the global
  positions of its tokens (rank r's shard of `arange(S)` for a single document). If the
  model is called without them, HF uses `arange(S_local)` on every rank and RoPE is wrong;
  the attention warns when every shard restarts at 0 exactly at the shard boundaries.
* **Loss.** See `shard_batch` and `sequence_parallel_loss`.
* **Gradients.** Parameters are replicated inside an SP group but every rank sees only its
  slice of the tokens, so the gradient of the global loss is the SUM over SP ranks of the
  local gradients (and the MEAN over DP ranks, each of which has its own batch).
  `allreduce_gradients` does this by hand; `apply_ddp` / `apply_fsdp` configure DDP / FSDP2
  on the whole DP x SP world to reduce with SUM and divide by dp_size only.
* **Memory.** `patch_model` makes the MLPs and the LM head + cross-entropy loop over
  sequence tiles (recomputing each tile in backward), so neither the MLP intermediate
  `[S, intermediate]` nor the logits `[S, vocab]` of the whole local sequence ever exist;
  `patch_model(..., offload_checkpoints=True)` keeps the checkpointed layers' saved inputs
  in pinned host memory until the backward (`offload.py`).

Rooms (docs/architecture.md, "The Hugging Face layer"; each imports only the rooms below it):
`model.py` (what a model is made of, the refusal), `groups.py`, `context.py` (the context per
model, the forward's documents); `families/` (each family's quirks, one module per family,
grouped by mechanism: `attention/` (Llama 4, Gemma 3), `vision/`, `by_heads/`, `halo/`,
`sparse/`; a token mixer's declaration and its one protocol in `family.py`, the registry in
`adapters.py`); `core/` (`attention.py`: register, unregister, the attention function;
`guard.py`: what is refused; `masks.py`, `attach.py`, `batch.py`: `shard_batch`, `heads.py`:
exact heads, `patches.py`: register()'s process-wide changes); `inference/` (`generation.py`:
`generate`, `prefill`, `decoding`; `cache.py`: the head-sharded cache); `training/`
(`loss.py`, `router_loss.py`, `experts.py`, `tiling.py`, `patch.py`, `offload.py`,
`parallel.py`: gradient reduction, DDP, FSDP2; `trainer.py`: `SequenceParallelTrainerMixin`;
`global_batch.py`, `distributed_config.py`: SP inside transformers' `DistributedConfig`);
`rl/` (`logprobs.py`, `losses.py`, the GRPO, DPO and reward trainers' mixins).
"""

from ..extensions import HF_INSTALL_HINT

try:
    import transformers  # noqa: F401 - every module below builds on it
except ImportError as _error:
    raise ImportError(f"ulysses_kernels.hf needs Hugging Face transformers: {HF_INSTALL_HINT}") from _error

from .context import SequenceParallelContext, context_of, cu_seqlens_from_position_ids
from .core.attach import ATTN_IMPLEMENTATION, attach_context
from .core.attention import (
    get_sequence_parallel_group,
    register,
    set_sequence_parallel_group,
    ulysses_attention_forward,
    unregister,
)
from .core.batch import (
    IGNORE_INDEX,
    PaddingInfo,
    SequenceParallelBatch,
    count_targets,
    gather_tokens,
    repad,
    shard_batch,
)
from .core.masks import ulysses_mask_function
from .core.patches import process_patches
from .families.adapters import declare_family, undeclare_family
from .families.by_heads.declared import by_heads
from .families.family import interface_attention
from .families.halo.declared import halo
from .inference.generation import decoding, generate, make_cache, prefill
from .model import NotSequenceParallelError
from .rl.dpo_trainer import SequenceParallelDPOMixin
from .rl.grpo_trainer import SequenceParallelGRPOMixin
from .rl.logprobs import token_logprobs
from .rl.losses import dpo_loss, grpo_loss, row_sums
from .rl.reward_trainer import SequenceParallelRewardMixin
from .training.distributed_config import sequence_parallel_groups
from .training.global_batch import (
    BalancedGlobalBatches,
    DynamicSequenceParallel,
    global_batch_documents,
    train_global_batch,
)
from .training.loss import (
    causal_lm_loss,
    global_mean_from_sum,
    gradient_for_world_average,
    loss_for_world_average,
    sequence_parallel_loss,
)
from .training.offload import CheckpointOffload, HostBufferPool
from .training.parallel import allreduce_gradients, apply_ddp, apply_fsdp
from .training.patch import patch_model, unpatch_model
from .training.tiling import tiled_cross_entropy_sum, tiled_mlp
from .training.trainer import SequenceParallelTrainerMixin

__all__ = [
    "ATTN_IMPLEMENTATION", "IGNORE_INDEX", "register", "unregister", "process_patches", "SequenceParallelContext", "attach_context", "context_of",
    "NotSequenceParallelError", "set_sequence_parallel_group", "get_sequence_parallel_group",
    "ulysses_attention_forward", "ulysses_mask_function", "cu_seqlens_from_position_ids",
    "SequenceParallelBatch", "shard_batch", "PaddingInfo", "repad", "gather_tokens", "count_targets",
    "SequenceParallelTrainerMixin", "SequenceParallelGRPOMixin", "SequenceParallelDPOMixin",
    "SequenceParallelRewardMixin", "generate", "prefill", "make_cache", "decoding", "sequence_parallel_loss", "global_mean_from_sum",
    "causal_lm_loss", "loss_for_world_average", "gradient_for_world_average", "allreduce_gradients", "apply_ddp", "apply_fsdp",
    "tiled_mlp", "tiled_cross_entropy_sum", "patch_model", "unpatch_model", "CheckpointOffload", "HostBufferPool",
    "token_logprobs", "row_sums", "grpo_loss", "dpo_loss", "DynamicSequenceParallel", "train_global_batch",
    "BalancedGlobalBatches", "global_batch_documents", "sequence_parallel_groups",
    "declare_family", "undeclare_family", "by_heads", "halo", "interface_attention",
]
