"""Per-token log-probabilities and entropy under sequence parallelism, tile by tile through
the LM head (docs/hf_rl.md, "RL"): what RL losses (GRPO, DPO, distillation) consume, without
`[tokens, vocab]` float32 logits for the whole shard.

The model runs its backbone on this rank's shard (`batch.model_inputs()`); the LM head, the
model's own final logit processing (Gemma 2's final softcap), the temperature, the log-softmax
and the entropy run over tiles of `tile_tokens` positions (`tiling._TiledFunction`: each
tile is recomputed in the backward, so the logits of one tile exist at a time). The call
goes through the model's own `__call__` (a DDP / FSDP wrapper included, which must see the
forward): the model's forward is swapped for the tiled one for that call only.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from ...planner import loss_tile_tokens as default_loss_tile
from ..core.attach import sequence_parallel_model
from ..core.batch import IGNORE_INDEX, SequenceParallelBatch
from ..model import forward_replaced, unwrap
from ..training.loss import at_least_float32
from ..training.tiling import _named_params, _TiledFunction

# Final logit transforms of some families that the tiled head does not apply (it refuses them).
_UNSUPPORTED_SCALES = ("logit_scale", "logits_scaling", "output_multiplier", "lm_head_multiplier")


# The per-token fields `token_fields` computes (TRL's fused LM head's names).
TOKEN_FIELDS = ("log_probs", "entropy", "mean_logits", "is_top1")


def token_logprobs(model, batch: SequenceParallelBatch, groups=None, *, temperature: float = 1.0,
                   with_entropy: bool = False, tile_tokens: Optional[int] = None):
    """The log-probability of each `batch.labels` target under `model` at `temperature`, laid
    out like `batch.labels` (this rank's shard; 0 where the label is `-100`); with
    `with_entropy=True`, the tuple `(logp, entropy)`, the entropy of each position's
    distribution (also 0 where the label is -100). float32 (float64 for a float64 model),
    differentiable with respect to the model's parameters.

    Every rank of the SP group calls it with its shard of the same `shard_batch` batch.
    `[B, S_local]` per-token values of the whole batch go to the shards with
    `batch.shard_tokens` and back with `gather_tokens`. Logits are `lm_head(h)`, then the
    model's final softcap (Gemma 2), then divided by `temperature` (TRL's order), computed
    in float32 over tiles of `tile_tokens` positions (default: about 16M logits per tile).
    """
    fields = ("log_probs", "entropy") if with_entropy else ("log_probs",)
    out = token_fields(model, batch, groups, fields=fields, temperature=temperature, tile_tokens=tile_tokens)
    return (out["log_probs"], out["entropy"]) if with_entropy else out["log_probs"]


def token_fields(model, batch: SequenceParallelBatch, groups=None, *, fields=("log_probs",),
                 temperature: float = 1.0, tile_tokens: Optional[int] = None) -> dict:
    """`token_logprobs` for any of TOKEN_FIELDS, one tiled pass: {field: `[B, S_local]`}, 0
    where the label is -100. `mean_logits`: the mean of the position's (softcapped,
    temperature-scaled) logits over the vocabulary; `is_top1`: whether the label is the
    most likely token (bool). Only `log_probs` and `entropy` carry gradients."""
    unknown = [f for f in fields if f not in TOKEN_FIELDS]
    if unknown or "log_probs" not in fields:
        raise ValueError(f"token_fields: fields must include 'log_probs' and come from {TOKEN_FIELDS}, got {fields}")
    if not temperature > 0:
        raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature}")
    sequence_parallel_model(model, groups)   # the first time: the model's context and its checks (guard.py)
    inner = unwrap(model)
    config = getattr(inner, "config", None)
    if hasattr(config, "get_text_config"):   # a VLM's final logit settings are its text config's
        config = config.get_text_config()
    for name in _UNSUPPORTED_SCALES:
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise ValueError(f"token_logprobs: config.{name} (a final logit scale) is not applied by the tiled "
                             "LM head")
    head = inner.get_output_embeddings()
    if head is None:
        raise ValueError("token_logprobs: the model has no output embeddings (LM head)")
    vocab = getattr(config, "vocab_size", None) or head.weight.shape[0]
    fields = tuple(f for f in TOKEN_FIELDS if f in fields)
    request = dict(labels=batch.labels, temperature=float(temperature), fields=fields,
                   tile=int(tile_tokens or default_loss_tile(vocab)),
                   softcap=getattr(config, "final_logit_softcapping", None))
    with _tiled_head_forward(inner, request):
        out = model(**batch.model_inputs())
    found = {f: out[..., i] for i, f in enumerate(fields)}
    if "is_top1" in found:
        found["is_top1"] = found["is_top1"].detach() > 0.5
    if "mean_logits" in found:
        found["mean_logits"] = found["mean_logits"].detach()
    return found


def _tiled_head_forward(inner, request):
    """`inner.forward` runs the backbone and the tiled head for one call; restored after."""
    return forward_replaced(inner, lambda self, *args, **kwargs: _backbone_then_head(self, request, args, kwargs),
                            reads_labels=True)


def _backbone_then_head(model, request, args, kwargs):
    kwargs.pop("labels", None)
    kwargs.pop("logits_to_keep", None)
    backbone = getattr(model, model.base_model_prefix)
    out = backbone(*args, **kwargs)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return tiled_token_fields(hidden, model.get_output_embeddings(), request["labels"],
                              temperature=request["temperature"], fields=request["fields"],
                              tile_tokens=request["tile"], final_logit_softcapping=request["softcap"])


def tiled_token_fields(hidden: torch.Tensor, lm_head, labels: torch.Tensor, *, temperature: float = 1.0,
                       fields=("log_probs",), tile_tokens: int, ignore_index: int = IGNORE_INDEX,
                       final_logit_softcapping: Optional[float] = None) -> torch.Tensor:
    """`[B, S, len(fields)]`: the `fields` (TOKEN_FIELDS' order) of `labels` under
    `lm_head(hidden)`, over tiles of `tile_tokens` positions, each recomputed in the backward."""
    names, params = _named_params(lm_head)
    run = _head_run(lm_head, temperature, fields, ignore_index, final_logit_softcapping)
    return _TiledFunction.apply(run, lm_head, names, max(1, int(tile_tokens)), "cat", hidden,
                                labels.to(hidden.device), *params)


def _head_run(lm_head, temperature, fields, ignore_index, softcap):
    def run(h, labels):
        logits = at_least_float32(lm_head(h))
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        if temperature != 1.0:
            logits = logits / temperature
        logp_all = F.log_softmax(logits, dim=-1)
        ignored = labels == ignore_index
        target = labels.masked_fill(ignored, 0).unsqueeze(-1)
        found = {"log_probs": lambda: logp_all.gather(-1, target).squeeze(-1),
                 "entropy": lambda: -(logp_all.exp() * logp_all).sum(-1),
                 "mean_logits": lambda: logits.detach().mean(-1),
                 "is_top1": lambda: (logits.detach().argmax(-1) == target.squeeze(-1)).to(logits.dtype)}
        return torch.stack([found[f]().masked_fill(ignored, 0.0) for f in fields], dim=-1)
    return run
