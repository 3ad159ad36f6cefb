"""The Mamba2 mixers of Bamba, Nemotron-H, Falcon-H1, GraniteMoeHybrid and Zamba2,
sequence-parallel by heads (docs/hf_hybrids.md, "Hybrid models"; the shared rule: mixers.py).

One layer, as transformers 5.24 and 5.25 compute it on one device (its torch path): `in_proj`
gives the gate z, x (heads x head_dim), B and C (groups x state size) and dt (one value
per head); x|B|C go through a depthwise causal convolution and the activation; the
selective scan runs per head, head h reading group `h // (heads / groups)`:

    dt_t = clamp(softplus(dt_t + dt_bias), time_step_limit),   A = -exp(A_log)
    state_t = exp(dt_t A) state_{t-1} + dt_t x_t B_t^T,        y_t = state_t C_t + D x_t

then a gated RMSNorm over the token's heads (per group of heads) and `out_proj`.
Falcon-H1 also scales the layer's input by `ssm_in_multiplier` and the projection by its
`mup_vector`, and may gate without a norm (`mamba_rms_norm=False`). The five forwards are
otherwise the same code (the same chunked scan, convolution and casts).

Sequence-parallel: the projection runs on the local shard; x, B, C (before the
convolution) and dt go to the head layout in one exchange (heads split over the ranks,
or replicated when fewer than the ranks; groups likewise); the convolution (its weights
sliced to this rank's channels inside the forward, so gradients reach the full
parameters), dt, and the scan run over the whole sequence of the local heads, restarting
at every document boundary; the output comes back and the gated norm and `out_proj` run
on the local shard with the local gate, where every token again has all its heads.

Precision as transformers': the scan in float32 for half and single precision inputs (it
upcasts x, B, C, dt and A), in float64 for float64 ones (where transformers' upcast is a
downcast); dt's softplus in dt's own dtype; the norm is the module's own.

The scan (`ssd_scan`) is the chunked state-space-dual form of transformers' torch path,
written here with an initial state in and the final state out, once per document
(`scan_documents`).
"""

from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

from ....api import ulysses_head_parallel
from ....layout import place_heads
from ..family import BY_HEADS, Adapter, Family
from ..mixer_ring import mixer_conv, portion_pieces, ring_recurrence
from ..mixers import chunk_head_parallel, document_bounds
from .ssd_scan import ScanChunks, scan_documents

MAMBA2_CLASSES = ("BambaMixer", "NemotronHMamba2Mixer", "GraniteMoeHybridMambaLayer", "Zamba2MambaMixer", "Mamba2Mixer")
FALCON_H1_CLASSES = ("FalconH1Mixer",)

try:   # transformers is optional: the package imports without it (the adapters then never run)
    from transformers.integrations.accelerate import force_accelerate_hooks
except ImportError:   # pragma: no cover - exercised only without transformers
    def force_accelerate_hooks(*_names):
        return lambda forward: forward

_PLACEMENT_ADVICE = ("Use a sequence-parallel size its heads and groups fit (each count divisible by it, or dividing "
                     "it), or run without sequence parallelism (sp_size=1).")


# ------------------------------------------------------------------- the layer's checks

def placement_problem(module, world: int) -> Optional[str]:
    """Why this layer's heads and groups have no placement over `world` ranks (None: they
    have). A replicated head (fewer heads than ranks) is computed whole by each of its
    ranks, which return equal slices of its head_dim, so head_dim must divide evenly."""
    for count, what in ((module.num_heads, "heads"), (module.n_groups, "groups (n_groups)")):
        try:
            place_heads(count, world)
        except ValueError:
            return (f"its {count} Mamba2 {what} can be neither split over nor replicated to {world} ranks (need "
                    f"{what.split()[0]} % {world} == 0 or {world} % {what.split()[0]} == 0)")
    replicas = place_heads(module.num_heads, world).replicas
    if module.head_dim % replicas:
        return (f"its {module.num_heads} Mamba2 heads are replicated to {replicas} ranks each, whose outputs are equal "
                f"slices of the head dim {module.head_dim}, which {replicas} does not divide")
    return None


def adapter_problem(module, world: int) -> Optional[str]:
    """Why the adapter cannot run this layer exactly on `world` Ulysses ranks (None: it
    can); the same answer on every rank (the layer's configuration and the group size)."""
    return _layer_problem(module) or placement_problem(module, world)


def _layer_problem(module) -> Optional[str]:
    """What of the layer's own configuration the adapter does not reproduce (None: all)."""
    if module.activation not in ("silu", "swish"):
        return f"its convolution activation {module.activation!r} (the adapter applies SiLU)"
    if module.intermediate_size != module.num_heads * module.head_dim or module.num_heads % module.n_groups:
        return (f"its intermediate size {module.intermediate_size} is not heads x head_dim ({module.num_heads} x "
                f"{module.head_dim}) or its heads are not a multiple of its {module.n_groups} groups")
    return None


def _check_call(module, call, hidden_states, attention_mask) -> Optional[List[int]]:
    """Refuse what the adapter cannot compute exactly beyond the protocol's refusals (the
    layer's configuration and placement: `adapter_problem`; a cache); the document bounds
    otherwise. A padding mask is refused on every rank before the layers by the model's
    mask function (attention.py), so a mask reaching a mixer with zeros is a direct call's;
    the documents are the global ones, the same on every rank."""
    name = type(module).__name__
    if attention_mask is not None and bool((attention_mask == 0).any()):
        raise ValueError(f"ulysses_kernels.hf: {name} got an attention_mask with zeros (padding); pass unpadded "
                         "(optionally packed) batches: ulysses_kernels.hf.shard_batch unpads them")
    bounds = document_bounds(call.cu_seqlens, sum(call.lens))
    if bounds is not None and hidden_states.shape[0] != 1:
        raise ValueError(f"ulysses_kernels.hf: {name}: packed documents need batch size 1, got "
                         f"{hidden_states.shape[0]}")
    return bounds


# ------------------------------------------------------------ the parts of the forward

def _split_projection(module, projected: torch.Tensor):
    """gate `[b, s, heads * head_dim]`, x `[b, s, heads, head_dim]`, B, C `[b, s, groups,
    state]` and dt `[b, s, heads, 1]` of the projection, in transformers' order
    (z | x | B | C | dt)."""
    b, s, _ = projected.shape
    inner, group_state = module.intermediate_size, module.n_groups * module.ssm_state_size
    gate, x, B, C, dt = projected.split([inner, inner, group_state, group_state, module.num_heads], dim=-1)
    return (gate, x.reshape(b, s, module.num_heads, module.head_dim),
            B.reshape(b, s, module.n_groups, module.ssm_state_size),
            C.reshape(b, s, module.n_groups, module.ssm_state_size), dt.reshape(b, s, module.num_heads, 1))


def _local_conv(module, heads: range, groups: range):
    """The convolution's weight `[C_local, K]` and bias for this rank's channels: the
    layer's channels are x (heads x head_dim), then B and C (groups x state each).
    Sliced here, in the forward, so the gradient reaches the full parameters."""
    inner, state, group_state = module.intermediate_size, module.ssm_state_size, module.n_groups * module.ssm_state_size
    spans = [(heads.start * module.head_dim, heads.stop * module.head_dim),
             (inner + groups.start * state, inner + groups.stop * state),
             (inner + group_state + groups.start * state, inner + group_state + groups.stop * state)]
    weight = module.conv1d.weight[:, 0, :]
    bias = module.conv1d.bias
    local_bias = None if bias is None else torch.cat([bias[a:b] for a, b in spans])
    return torch.cat([weight[a:b] for a, b in spans]), local_bias


def _convolve(module, x, B, C, heads: range, groups: range, bounds, state: Optional[dict] = None, portion=None):
    """x, B, C after the depthwise causal convolution and the activation, over the whole
    sequence of the local heads and groups (zero history at every document start; with
    generation's `state`, after its conv history, which is then replaced; with a ring
    `portion`, over its two chunks after the inputs before them, mixer_ring.py)."""
    b, S = x.shape[:2]
    weight, bias = _local_conv(module, heads, groups)
    mixed = torch.cat([x.reshape(b, S, -1), B.reshape(b, S, -1), C.reshape(b, S, -1)], dim=-1)
    mixed = mixer_conv(mixed, weight, bias, module.activation, cu_seqlens=bounds, state=state, portion=portion)
    x, B, C = mixed.split([x.shape[2] * x.shape[3], B.shape[2] * B.shape[3], C.shape[2] * C.shape[3]], dim=-1)
    return x.reshape(b, S, -1, module.head_dim), B.reshape(b, S, -1, module.ssm_state_size), \
        C.reshape(b, S, -1, module.ssm_state_size)


def _step(module, dt: torch.Tensor, heads: range) -> torch.Tensor:
    """dt `[b, S, h_local]` -> the discretisation step, as transformers: softplus of dt plus
    its bias in dt's dtype, clamped to `time_step_limit` (Nemotron-H and Zamba2: from
    `time_step_min`, no upper limit)."""
    low, high = module.time_step_limit
    dt = F.softplus(dt + module.dt_bias[heads.start:heads.stop].to(dt.dtype))
    return torch.clamp(dt, min=low, max=high)


def _scan_local_heads(module, x, B, C, dt, heads: range, groups: range, bounds, state: Optional[dict] = None,
                      portion=None):
    """y `[b, S, h_local, head_dim]` of the local heads, in the compute dtype (at least
    float32, as transformers' upcast): the scan of every document plus the D skip; with
    generation's `state`, from its recurrent state, which is then replaced; with a ring
    `portion`, the state passed across the ring's chunks (mixer_ring.py)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    local = slice(heads.start, heads.stop)
    per_group = module.num_heads // module.n_groups
    group_of_head = torch.tensor([h // per_group - groups.start for h in heads], device=x.device)
    x = x.to(compute)
    A = -torch.exp(module.A_log[local].to(compute))
    if portion is not None:
        pieces = portion_pieces(portion, [x, dt.to(compute), B.to(compute).index_select(2, group_of_head),
                                          C.to(compute).index_select(2, group_of_head)])
        return ring_recurrence(ScanChunks(A, module.D[local].to(compute), module.chunk_size), pieces, portion, bounds)
    initial = state.get("recurrent") if state is not None else None
    y, final = scan_documents(x, dt.to(compute), A, B.to(compute).index_select(2, group_of_head),
                              C.to(compute).index_select(2, group_of_head), module.chunk_size, bounds, initial)
    if state is not None:
        state["recurrent"] = final
    return y + module.D[local].to(compute)[:, None] * x


def _output_slice(y: torch.Tensor, heads) -> torch.Tensor:
    """This rank's 1/P of the output channels `[b, S, 1, heads * head_dim / P]`: its heads
    (split), or its slice of the head it shares with its replicas (replicated heads: each
    replica computes the whole head, rank r returns slice `r % replicas` of it), so the
    return exchange puts the slices of all ranks in channel order."""
    b, S = y.shape[:2]
    y = y.reshape(b, S, -1)
    replicas = heads.placements["x"].replicas
    if replicas > 1:
        width = y.shape[-1] // replicas
        piece = heads.rank % replicas
        y = y[..., piece * width:(piece + 1) * width]
    return y.unsqueeze(2)


def _heads_forward(module, bounds, state: Optional[dict] = None, portion=None) -> Callable:
    """The per-head part of the layer over the whole sequence of this rank's heads (with
    generation's `state`: continuing from the local heads' conv history and recurrent
    state; with a ring `portion`: over its two chunks, mixer_ring.py)."""
    def run(local, heads):
        head_range, group_range = heads.heads("x"), heads.heads("B")
        x, B, C = _convolve(module, local["x"], local["B"], local["C"], head_range, group_range, bounds, state, portion)
        dt = _step(module, local["dt"][..., 0], head_range)
        y = _scan_local_heads(module, x, B, C, dt, head_range, group_range, bounds, state, portion)
        return _output_slice(y, heads)
    return run


def _sequence_forward(module, call, hidden_states, attention_mask, project: Callable, gated_norm: Callable):
    """The layer's forward over the sequence, by heads (the module doc; the protocol around
    it: family.py); `project` maps the local hidden states to the projection, `gated_norm(y,
    gate)` the scan's output to `out_proj`'s input."""
    bounds = _check_call(module, call, hidden_states, attention_mask)
    b, s_local, _ = hidden_states.shape
    gate, x, B, C, dt = _split_projection(module, project(hidden_states))
    y = ulysses_head_parallel(_heads_forward(module, bounds, portion=call.portion), {"x": x, "B": B, "C": C, "dt": dt},
                              call.group, seq_lens=call.ulysses_lens)
    y = gated_norm(y.reshape(b, s_local, module.intermediate_size), gate)
    return module.out_proj(y.to(hidden_states.dtype))


def _generation_forward(module, hidden_states, cache, project: Callable, gated_norm: Callable):
    """A forward inside `generate` / `prefill` (hf/inference/cache.py's chunks): the layer continues
    from the states of this rank's heads, kept on the cache."""
    b, T, _ = hidden_states.shape
    state = cache.mixer_state(module.layer_idx, T)
    gate, x, B, C, dt = _split_projection(module, project(hidden_states))
    y = chunk_head_parallel(_heads_forward(module, None, state), {"x": x, "B": B, "C": C, "dt": dt}, cache)
    y = gated_norm(y.reshape(b, T, module.intermediate_size), gate)
    return module.out_proj(y.to(hidden_states.dtype))


# ---------------------------------------------------------------------------- adapters

def _mamba2_parts(module):
    """Bamba, Nemotron-H, GraniteMoeHybrid and Zamba2 (the same forward in transformers): the
    projection and the gated norm, the layer's own."""
    return module.in_proj, module.norm


def _falcon_h1_parts(module):
    """Falcon-H1: the input scaled by `ssm_in_multiplier`, the projection by the `mup_vector`
    (one multiplier per section z, x, B, C, dt), and the gate applied by the norm
    (`mamba_rms_norm`) or as `y * silu(z)` without one."""
    def project(h):
        return module.in_proj(h * module.ssm_in_multiplier) * module.mup_vector

    def gated_norm(y, gate):
        return module.norm(y, gate) if module.mamba_rms_norm else y * F.silu(gate)
    return project, gated_norm


def _adapter(classes, parts) -> Adapter:
    """The adapter of `classes`, whose projection and gated norm are `parts(module)`. Both
    forwards read conv1d's weights directly (not through its forward): its accelerate hooks
    (device_map, offloading) are fired around them, as transformers' own forward does."""
    @force_accelerate_hooks("conv1d")
    def forward(self, call, hidden_states: torch.Tensor, attention_mask=None, **_):
        return _sequence_forward(self, call, hidden_states, attention_mask, *parts(self))

    @force_accelerate_hooks("conv1d")
    def generation(self, hidden_states: torch.Tensor, cache, **_):
        return _generation_forward(self, hidden_states, cache, *parts(self))

    return Adapter(classes, "mamba2", forward, BY_HEADS, problem=adapter_problem, runs_on_a_ring=True,
                   generation=generation, cache_kept="its conv and recurrent states are sharded by heads there only",
                   placement_advice=_PLACEMENT_ADVICE)


# The protocol (family.py) refuses the layer's configuration and placement (`adapter_problem`,
# with the placement advice) and a cache outside generation; mixer_ring.py passes their
# state across the ring's chunks.
FAMILY = Family("mamba2", (_adapter(MAMBA2_CLASSES, _mamba2_parts), _adapter(FALCON_H1_CLASSES, _falcon_h1_parts)),
                model_types=("bamba", "nemotron_h", "falcon_h1", "granitemoehybrid", "zamba2", "mamba2"),
                planner_shape="mamba2")
