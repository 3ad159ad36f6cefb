"""Input checks that every rank of a group agrees on.

A rank that raises while its peers enter a collective leaves them waiting forever. So
by default every call first all-gathers a small fixed-size int64 *descriptor* of its
inputs (shapes, dtypes, devices, options, the attention variants, checksums of
`cu_seqlens` and of the sink logits). Every rank then
runs the same pure function over the same table and either all ranks proceed or all
ranks raise the same `ValueError`, which names the rank and the numbers that are wrong.
The group is left in a clean state (the only collective issued has completed), so it can
be used again after the error.

When the caller passes `seq_lens`, the exchange is skipped (no collective, no host
sync: the CUDA-graph friendly fast path) and only checks that need no peer information
run; inputs that disagree between ranks are then the caller's responsibility.
"""

import struct
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..layout import head_plan_error, split_heads_error, split_lengths
from ..variants import PLAIN, Variant, band_lengths
from .collectives import first_message, gather_ints
from .dispatch import BACKENDS

_MAGIC = 0x554C59  # "ULY": a peer that sent something else is not running this library
_KINDS = {"ulysses_attention": 1, "seq_to_heads": 2, "qkv_seq_to_heads": 3, "heads_to_seq": 4}
# Ops whose input is a head shard over the whole sequence `[B, S, H_local, D]` (every rank
# holds the same S) rather than a sequence shard `[B, S_local, H, D]`.
_WHOLE_SEQUENCE_KINDS = ("heads_to_seq",)
_KIND_NAMES = {v: k for k, v in _KINDS.items()}
_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn,
           torch.float8_e5m2, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
           torch.bool, torch.complex64, torch.complex128]
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DEVICE_TYPES = ["cpu", "cuda", "meta", "other"]

_TENSOR_FIELDS = 8  # present, ndim, 4 dims, dtype, device type
_MAX_TENSORS = 3
_HEADER = 4  # magic, kind, number of tensors, local error flag
SEQ_FIELD = _HEADER + 3  # shape[1] of the first tensor: S_local
ERROR_FIELD = 3
_CHECKSUM_MOD = (1 << 61) - 1


def _dtype_code(dtype):
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def _dtype_name(code):
    return str(_DTYPES[code]).replace("torch.", "") if code < len(_DTYPES) else "unsupported dtype"


def _is_float_code(code):
    return code < len(_DTYPES) and _DTYPES[code] in _FLOAT_DTYPES


def _device_code(device):
    return _DEVICE_TYPES.index(device.type) if device.type in _DEVICE_TYPES else 3


def _float_bits(x: Optional[float]) -> int:
    if x is None:
        return 0
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def _tensor_fields(t) -> List[int]:
    if not isinstance(t, torch.Tensor):
        return [0] * _TENSOR_FIELDS
    dims = list(t.shape[:4]) + [-1] * (4 - min(t.dim(), 4))
    return [1, t.dim()] + dims + [_dtype_code(t.dtype), _device_code(t.device)]


def cu_seqlens_summary(cu_seqlens) -> List[int]:
    """present, numel, is_integer, ndim, first, last, non_decreasing, sum, weighted sum.

    Reads the values on the host (a device sync on GPU); only called on the checked path.
    """
    if cu_seqlens is None:
        return [0] * 9
    t = cu_seqlens
    is_int = int(not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool)
    values = [int(x) for x in t.reshape(-1).tolist()] if t.numel() else []
    non_decreasing = int(all(a <= b for a, b in zip(values, values[1:])))
    total = sum(values) % _CHECKSUM_MOD
    weighted = sum((i + 1) * x for i, x in enumerate(values)) % _CHECKSUM_MOD
    first = values[0] if values else -1
    last = values[-1] if values else -1
    return [1, t.numel(), is_int, t.dim(), first, last, non_decreasing, total, weighted]


def sinks_summary(sinks) -> List[int]:
    """present, numel, the bits of the sum and of the position-weighted sum of the sink
    logits (a host read; only on the checked path)."""
    if sinks is None:
        return [0] * 4
    values = sinks.detach().double().reshape(-1).cpu()
    weights = torch.arange(1, values.numel() + 1, dtype=torch.float64)
    return [1, values.numel(), _float_bits(values.sum()), _float_bits((values * weights).sum())]


class CallOptions(NamedTuple):
    """A call's options as the descriptor records them."""

    causal: bool = False
    softmax_scale: Optional[float] = None
    backend: Optional[str] = None
    cu_seqlens: Optional[torch.Tensor] = None
    variant: Variant = PLAIN
    sinks: Optional[torch.Tensor] = None


class OptionField(NamedTuple):
    """One option in the descriptor: `width` int64 slots, `write` fills them from the call's
    CallOptions, `show` turns them back into the value ranks must agree on (printed in the
    error). One table (OPTION_FIELDS) makes both the writer and the reader."""

    name: str
    width: int
    write: Callable[[CallOptions], List[int]]
    show: Callable[[List[int]], object]


def _backend_code(backend) -> int:
    return BACKENDS.index(backend) + 1 if backend in BACKENDS else 0  # 0: auto


def _show_cu_seqlens(f) -> str:
    present, numel, _, _, _, last, _, total, weighted = f  # cu_seqlens_summary's fields
    return "None" if not present else f"{numel} entries, last {last}, checksum {total:x}:{weighted:x}"


def _show_sinks(f) -> str:
    present, numel, total, weighted = f  # sinks_summary's fields
    return "None" if not present else \
        f"{numel} logits, sum {_bits_float(total):.9g}, checksum {weighted & (2**64 - 1):x}"


OPTION_FIELDS = (
    OptionField("causal", 1, lambda o: [int(bool(o.causal))], lambda f: bool(f[0])),
    OptionField("softmax_scale", 2, lambda o: [int(o.softmax_scale is not None), _float_bits(o.softmax_scale)],
                lambda f: _bits_float(f[1]) if f[0] else None),
    OptionField("backend", 1, lambda o: [_backend_code(o.backend)], lambda f: (("auto",) + BACKENDS)[f[0]]),
    OptionField("cu_seqlens", 9, lambda o: cu_seqlens_summary(o.cu_seqlens), _show_cu_seqlens),
    OptionField("window_size", 2, lambda o: list(band_lengths(o.variant.window)), tuple),
    OptionField("softcap", 1, lambda o: [_float_bits(o.variant.softcap)], lambda f: _bits_float(f[0])),
    OptionField("sinks", 4, lambda o: sinks_summary(o.sinks), _show_sinks),
)
_OPTIONS = sum(field.width for field in OPTION_FIELDS)
DESCRIPTOR_LEN = _HEADER + _MAX_TENSORS * _TENSOR_FIELDS + _OPTIONS


def build_descriptor(kind: str, tensors: Sequence, *, local_error: bool = False, **options) -> List[int]:
    """The descriptor of one rank's call: header, tensors, then OPTION_FIELDS in order
    (options: CallOptions' fields)."""
    row = [_MAGIC, _KINDS[kind], len(tensors), int(local_error)]
    for i in range(_MAX_TENSORS):
        row += _tensor_fields(tensors[i] if i < len(tensors) else None)
    call = CallOptions(**options)
    for field in OPTION_FIELDS:
        values = field.write(call)
        assert len(values) == field.width, (field.name, values)
        row += values
    assert len(row) == DESCRIPTOR_LEN
    return row


def with_sequence_length(row: List[int], length: int) -> List[int]:
    """A copy of descriptor `row` whose tensors have sequence length `length` (the ring
    check compares ring ranks' portions with the per-rank checks)."""
    row = list(row)
    for i in range(_MAX_TENSORS):
        if row[_HEADER + i * _TENSOR_FIELDS]:
            row[_HEADER + i * _TENSOR_FIELDS + 3] = length
    return row


def error_row(kind: str, count: int) -> List[int]:
    """The descriptor of a rank that could not describe its inputs (error flag set)."""
    return [_MAGIC, _KINDS[kind], count, 1] + [0] * (DESCRIPTOR_LEN - _HEADER)


class _Row:
    """Named access to one rank's descriptor."""

    def __init__(self, rank: int, values: List[int]):
        self.rank = rank
        self.v = values

    @property
    def magic(self):
        return self.v[0]

    @property
    def kind(self):
        return self.v[1]

    @property
    def local_error(self):
        return self.v[3]

    def tensor(self, i) -> Dict:
        f = self.v[_HEADER + i * _TENSOR_FIELDS: _HEADER + (i + 1) * _TENSOR_FIELDS]
        ndim = f[1]
        return {"present": f[0], "ndim": ndim, "shape": tuple(f[2:2 + min(ndim, 4)]),
                "dtype": f[6], "device": f[7]}

    def option(self, name: str) -> List[int]:
        """The slots of OPTION_FIELDS' field `name`."""
        start = _HEADER + _MAX_TENSORS * _TENSOR_FIELDS
        for field in OPTION_FIELDS:
            if field.name == name:
                return self.v[start:start + field.width]
            start += field.width
        raise KeyError(name)


def _shape_str(t):
    s = "(" + ", ".join(str(x) for x in t["shape"])
    return s + (", ...)" if t["ndim"] > 4 else ")")


def _disagreement(rows, what, key):
    values = [key(r) for r in rows]
    if len(set(values)) > 1:
        listing = ", ".join(f"rank {r.rank}: {val}" for r, val in zip(rows, values))
        return f"ranks disagree on {what} ({listing})"
    return None


def check_table(kind: str, table: List[List[int]], names: Sequence[str], *,
                same_length: bool = True, head_world: Optional[int] = None,
                lengths_check: Callable[[List[int]], Optional[str]] = None,
                documents: bool = True) -> Optional[str]:
    """Validate the gathered descriptors of all ranks; the same answer on every rank.

    Returns an error message (without the function-name prefix) or None. The ring check
    of the Ulysses x Ring hybrid (ring/validate.py) reuses it with the heads checked
    against the Ulysses degree `head_world`, its own `lengths_check`, and `documents`
    (the cu_seqlens check) only once the global length is known.
    """
    rows = [_Row(r, list(v)) for r, v in enumerate(table)]
    world = len(rows)
    for r in rows:
        if r.magic != _MAGIC:
            return f"rank {r.rank} sent an unrecognised descriptor (is it running ulysses_kernels?)"
    err = _disagreement(rows, "which operation they are calling",
                        lambda r: _KIND_NAMES.get(r.kind, f"unknown op {r.kind}"))
    if err:
        return err

    # Per-rank shape checks: each tensor is [B, S_local, H, D] ([B, S, H_local, D] for
    # the whole-sequence kinds).
    for r in rows:
        for i, name in enumerate(names):
            t = r.tensor(i)
            if not t["present"]:
                return f"rank {r.rank}: {name} is not a tensor"
            if t["ndim"] != 4:
                layout = ("[batch, seq, heads_local, head_dim]" if kind in _WHOLE_SEQUENCE_KINDS
                          else "[batch, seq_local, heads, head_dim]")
                return f"rank {r.rank}: {name} must be 4-D {layout}, got shape {_shape_str(t)}"
            if not _is_float_code(t["dtype"]):
                return (f"rank {r.rank}: {name} has dtype {_dtype_name(t['dtype'])}; supported: "
                        "float16, bfloat16, float32, float64")
        first = r.tensor(0)
        for i, name in enumerate(names[1:], start=1):
            t = r.tensor(i)
            if t["dtype"] != first["dtype"]:
                return (f"rank {r.rank}: dtypes differ: {names[0]} is {_dtype_name(first['dtype'])}, "
                        f"{name} is {_dtype_name(t['dtype'])}")
            if t["device"] != first["device"]:
                return (f"rank {r.rank}: devices differ: {names[0]} is on "
                        f"{_DEVICE_TYPES[first['device']]}, {name} is on {_DEVICE_TYPES[t['device']]}")
            b0, s0, _, d0 = first["shape"]
            b, s, _, d = t["shape"]
            if b != b0 or (same_length and s != s0):
                return (f"rank {r.rank}: {name} has batch x seq_local {b} x {s} but {names[0]} has "
                        f"{b0} x {s0}")
            if d != d0 and not (len(names) == 3 and i == 2):  # v may have a head dim of its own
                return f"rank {r.rank}: head dims differ: {names[0]} has {d0}, {name} has {d}"
        if len(names) == 3:
            k, v = r.tensor(1), r.tensor(2)
            if k["shape"][2] != v["shape"][2]:
                return (f"rank {r.rank}: key and value head counts differ "
                        f"({k['shape'][2]} vs {v['shape'][2]})")

    # Cross-rank agreement.
    checks = [("batch size", lambda r: r.tensor(0)["shape"][0]),
              ("head dim", lambda r: r.tensor(0)["shape"][3]),
              ("dtype", lambda r: _dtype_name(r.tensor(0)["dtype"])),
              ("device type", lambda r: _DEVICE_TYPES[r.tensor(0)["device"]])]
    for i, name in enumerate(names):
        checks.append((f"the number of {name} heads", lambda r, i=i: r.tensor(i)["shape"][2]))
    if len(names) == 3:
        checks.append(("the value head dim", lambda r: r.tensor(2)["shape"][3]))
    checks += [(field.name, lambda r, field=field: field.show(r.option(field.name))) for field in OPTION_FIELDS]
    for what, key in checks:
        err = _disagreement(rows, what, key)
        if err:
            return err

    if kind in _WHOLE_SEQUENCE_KINDS:
        return _disagreement(rows, "the sequence length", lambda r: r.tensor(0)["shape"][1])

    # Heads against the group size.
    heads = [rows[0].tensor(i)["shape"][2] for i in range(len(names))]
    if len(names) == 3:
        err = head_plan_error(head_world or world, heads[0], heads[1])
    else:
        err = split_heads_error(heads[0], head_world or world)
    if err:
        return err

    # Local lengths must be the tensor_split of the global length.
    lengths = [r.tensor(0)["shape"][1] for r in rows]
    err = (lengths_check or lengths_error)(lengths)
    if err or not documents:
        return err

    return cu_seqlens_error(rows[0].option("cu_seqlens"), sum(lengths), rows[0].tensor(0)["shape"][0])


def lengths_error(lengths: List[int]) -> Optional[str]:
    expected = split_lengths(sum(lengths), len(lengths))
    if list(lengths) != expected:
        return (f"local sequence lengths {list(lengths)} are not the torch.tensor_split of the "
                f"global length {sum(lengths)} over {len(lengths)} ranks (expected {expected})")
    return None


def cu_seqlens_error(summary: List[int], global_len: int, batch: int) -> Optional[str]:
    present, numel, is_int, ndim, first, last, non_decreasing = summary[:7]
    if not present:
        return None
    if not is_int or ndim != 1:
        return "cu_seqlens must be a 1-D integer tensor of document boundaries"
    if batch != 1:
        return f"cu_seqlens (packed documents) needs batch size 1, got {batch}"
    if numel < 2:
        return f"cu_seqlens must have at least 2 entries (0 and the global length), got {numel}"
    if first != 0 or last != global_len:
        return (f"cu_seqlens must start at 0 and end at the global sequence length {global_len}; "
                f"got first={first}, last={last}")
    if not non_decreasing:
        return "cu_seqlens must be non-decreasing (document lengths >= 0)"
    return None


def exchange_and_check(kind: str, group, names: Sequence[str], tensors: Sequence, *,
                       local_errors: Sequence[str] = (), **options) -> List[int]:
    """All-gather descriptors, validate, and return every rank's local sequence length.

    Raises the same ValueError on every rank of the group if anything is wrong. For the
    whole-sequence kinds (heads_to_seq) every entry is the common sequence length.
    """
    lens, err = gather_and_check(kind, group, names, tensors, local_errors=local_errors, **options)
    if err:
        raise ValueError(f"{kind}: {err}")
    return lens


def gather_and_check(kind: str, group, names: Sequence[str], tensors: Sequence, *,
                     local_errors: Sequence[str] = (), documents: bool = True,
                     **options) -> Tuple[List[int], Optional[str]]:
    """`exchange_and_check` without the raise: (every rank's local length, the error
    every rank of the group found, or None)."""
    local_errors = list(local_errors)
    try:
        row = build_descriptor(kind, tensors, local_error=bool(local_errors), **options)
    except Exception as exc:  # never raise before the collective: peers would hang
        local_errors.append(f"could not describe the inputs: {type(exc).__name__}: {exc}")
        row = error_row(kind, len(tensors))
    table = gather_ints(row, group)
    if any(r[ERROR_FIELD] for r in table):
        # Some rank found a problem its descriptor cannot express: share the messages.
        first, message = first_message(local_errors[0] if local_errors else None, group)
        return [], f"rank {first}: {message}"
    err = check_table(kind, table, names, documents=documents)
    return [r[SEQ_FIELD] for r in table], err


def check_single(kind: str, names: Sequence[str], tensors: Sequence, *, same_length: bool = True,
                 **options) -> None:
    """The checks of `exchange_and_check` for a single process (nothing to exchange)."""
    err = check_table(kind, [build_descriptor(kind, tensors, **options)], names, same_length=same_length)
    if err:
        raise ValueError(f"{kind}: {err}")


def checked_lengths(kind: str, group, world: int, rank: int, x, seq_lens, names: Sequence[str],
                    tensors: Sequence, **options) -> List[int]:
    """Every rank's local length of the sequence shards `tensors` (x the first): the checked
    exchange by default, the trusted `seq_lens` (checks that need no peer) otherwise."""
    if seq_lens is None:
        if group is None:  # single process: nothing to exchange
            check_single(kind, names, tensors, **options)
            return [x.shape[1]]
        return exchange_and_check(kind, group, names, tensors, **options)
    seq_lens = [int(n) for n in seq_lens]
    if len(seq_lens) != world:
        raise ValueError(f"{kind}: seq_lens has {len(seq_lens)} entries but the group has {world} ranks")
    if seq_lens[rank] != x.shape[1]:
        raise ValueError(f"{kind}: seq_lens[{rank}] = {seq_lens[rank]} but this rank's local length is {x.shape[1]}")
    err = lengths_error(seq_lens)
    if err:
        raise ValueError(f"{kind}: {err}")
    return seq_lens


def shape_error(q, k, v) -> Optional[str]:
    """Why q/k/v cannot be single-device attention inputs `[B, S, H, D]` (None: they can)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            return f"{name} must be a 4-D tensor [batch, seq, heads, head_dim]"
    if k.shape[:3] != v.shape[:3]:
        return f"k and v differ in batch, sequence or heads: {tuple(k.shape)} vs {tuple(v.shape)}"
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        return f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim"
    if q.shape[2] % k.shape[2] != 0:
        return f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})"
    return None


def trusted_attention_lengths(seq_lens, world: int, rank: int, q, k, v) -> List[int]:
    """ulysses_attention's fast path: the checks that need no peer (the caller vouches for
    cross-rank agreement by passing seq_lens)."""
    lens = [int(n) for n in seq_lens]
    err = None
    if len(lens) != world:
        err = f"seq_lens has {len(lens)} entries but the group has {world} ranks"
    elif shape_error(q, k, v):
        err = shape_error(q, k, v)
    elif not (q.shape[1] == k.shape[1] == lens[rank]):
        err = (f"seq_lens[{rank}] = {lens[rank]} but this rank's q/k local lengths are "
               f"{q.shape[1]}/{k.shape[1]}")
    else:
        err = lengths_error(lens) or head_plan_error(world, q.shape[2], k.shape[2])
    if err:
        raise ValueError(f"ulysses_attention: {err}")
    return lens
