"""The chunked state-space-dual scan of the Mamba2 mixers (mamba2.py): transformers' torch
path written with an initial state in and the final state out (`ssd_scan`), run once per
document (`scan_documents`), and its chunking into pieces for the ring (`ScanChunks`)."""

from typing import List, Optional

import torch
import torch.nn.functional as F


def segment_sum(a: torch.Tensor) -> torch.Tensor:
    """`[..., T]` -> `[..., T, T]`: entry (i, j) is `a[j+1] + ... + a[i]` for j <= i (the
    log decay from position j to i), -inf above the diagonal. Summed by a masked cumsum,
    not as a difference of two cumsums, so no cancellation over long chunks."""
    T = a.shape[-1]
    a = a[..., None].expand(*a.shape, T)                                   # [..., i, j] = a[i]
    below = torch.tril(torch.ones(T, T, dtype=torch.bool, device=a.device), diagonal=-1)
    sums = torch.cumsum(a.masked_fill(~below, 0), dim=-2)
    keep = torch.tril(torch.ones(T, T, dtype=torch.bool, device=a.device))
    return sums.masked_fill(~keep, float("-inf"))


def _chunks(t: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """`[b, L, ...]` -> `[b, c, chunk_size, ...]`, zero-padded at the end (a padded position
    has dt = 0: it neither decays nor feeds the state)."""
    pad = (-t.shape[1]) % chunk_size
    if pad:
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
    return t.reshape(t.shape[0], -1, chunk_size, *t.shape[2:])


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             chunk_size: int, initial_state: Optional[torch.Tensor] = None):
    """The selective scan of one sequence per row, in chunks (the state-space dual form):

        state_t = exp(dt_t A) state_{t-1} + dt_t x_t B_t^T,   y_t = state_t C_t

    x `[b, L, h, p]`, dt `[b, L, h]` (the step after softplus and clamp), A `[h]`, B, C
    `[b, L, h, n]` (each head's own), initial_state `[b, h, p, n]` (None: zeros). Returns
    y `[b, L, h, p]` (without the D skip) and the final state `[b, h, p, n]`, in the inputs'
    dtype. Within a chunk the output is a masked quadratic form; across chunks the state
    is passed on, so the cost is linear in L."""
    b, L, h, p = x.shape
    xdt = _chunks(x * dt[..., None], chunk_size)                           # [b, c, T, h, p]
    Bc, Cc = _chunks(B, chunk_size), _chunks(C, chunk_size)                # [b, c, T, h, n]
    log_decay = _chunks(dt * A, chunk_size).permute(0, 3, 1, 2)            # [b, h, c, T]
    cumulative = torch.cumsum(log_decay, dim=-1)

    # 1. within each chunk: y_i += sum_{j <= i} (C_i . B_j) exp(a_{j+1} + ... + a_i) dt_j x_j
    scores = torch.einsum("bcihn,bcjhn->bhcij", Cc, Bc) * torch.exp(segment_sum(log_decay))
    y = torch.einsum("bhcij,bcjhp->bcihp", scores, xdt)

    # 2. what each chunk adds to the state at its end
    to_end = torch.exp(cumulative[..., -1:] - cumulative)                  # [b, h, c, T]
    added = torch.einsum("bcjhn,bhcj,bcjhp->bchpn", Bc, to_end, xdt)

    # 3. the state entering each chunk: the initial state and every earlier chunk's
    #    addition, decayed over the chunks in between
    start = torch.zeros_like(added[:, 0]) if initial_state is None else initial_state.to(added.dtype)
    states = torch.cat([start[:, None], added], dim=1)                     # [b, c+1, h, p, n]
    across = torch.exp(segment_sum(F.pad(cumulative[..., -1], (1, 0))))   # [b, h, c+1, c+1]
    states = torch.einsum("bhzc,bchpn->bzhpn", across, states)
    entering, final = states[:, :-1], states[:, -1]

    # 4. each position reads the entering state, decayed to it
    y = y + torch.einsum("bcihn,bchpn,bhci->bcihp", Cc, entering, torch.exp(cumulative))
    return y.reshape(b, -1, h, p)[:, :L], final


def scan_documents(x, dt, A, B, C, chunk_size: int, bounds: Optional[List[int]] = None,
                   initial_states: Optional[torch.Tensor] = None):
    """`ssd_scan` restarting at every document of a packed row (batch 1; `bounds` from
    `document_bounds`), each document from its own initial state (`initial_states`
    `[documents, h, p, n]`, None: zeros). Returns y `[1, L, h, p]` and the final state of
    every document `[documents, h, p, n]`; without `bounds`, `ssd_scan` of every row."""
    if bounds is None:
        return ssd_scan(x, dt, A, B, C, chunk_size, initial_states)
    outputs, finals = [], []
    for index, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        initial = None if initial_states is None else initial_states[index:index + 1]
        if stop == start:   # an empty document: its state is where it started
            finals.append(initial if initial is not None else x.new_zeros(1, x.shape[2], x.shape[3], B.shape[3]))
            continue
        y, final = ssd_scan(x[:, start:stop], dt[:, start:stop], A, B[:, start:stop], C[:, start:stop], chunk_size,
                            initial)
        outputs.append(y)
        finals.append(final)
    return torch.cat(outputs, dim=1), torch.cat(finals, dim=0)


class ScanChunks:
    """The selective scan as `mixer_ring.ring_recurrence` takes it: linear in its state
    `[b, h, p, n]`, which leaves a chunk as `exp(sum_t dt_t A) S + F` (a decay per head)."""

    def __init__(self, A: torch.Tensor, D: torch.Tensor, chunk_size: int):
        self.A, self.D, self.chunk_size = A, D, chunk_size

    def run(self, inputs, initial):
        x, dt, B, C = inputs
        y, final = ssd_scan(x, dt, self.A, B, C, self.chunk_size, initial)
        return y + self.D[:, None] * x, final

    def transition(self, inputs):
        dt = inputs[1]
        return torch.exp((dt * self.A).sum(dim=1))   # [b, h]

    def identity(self, inputs):
        dt = inputs[1]
        return torch.ones(dt.shape[0], dt.shape[2], dtype=dt.dtype, device=dt.device)

    def zero_state(self, inputs):
        x, B = inputs[0], inputs[2]
        return x.new_zeros(x.shape[0], x.shape[2], x.shape[3], B.shape[3])

    def carry(self, M, state):
        return M[..., None, None] * state
