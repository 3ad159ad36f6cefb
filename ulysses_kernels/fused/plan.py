"""The chunk plan of the fused pipeline (docs/architecture.md, "Fused path").

Chunk c owns local query heads `[c*Hqc, (c+1)*Hqc)` of every destination
(`Hqc = Hl_q / C`); a KV head travels with the first chunk whose query heads use it and
its gradient with the last. C must divide Hl_q and either Hqc is a multiple of the local
GQA group g = Hl_q / Hl_kv (each chunk has its own KV heads) or g a multiple of Hqc
(several chunks share one KV head; its dK/dV are accumulated in fp32 across them). The
count is automatic (by bytes moved per rank) or set by `num_chunks=` /
`ULYSSES_KERNELS_NUM_CHUNKS`; an invalid request is lowered to the largest valid count.
Pure arithmetic: no tensor, no device.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional

from .. import env


@dataclass(frozen=True)
class Chunk:
    q_off: int      # first local query head of this chunk
    q_cnt: int
    kv_off: int     # KV heads sent with this chunk (forward): [kv_off, kv_off + kv_cnt)
    kv_cnt: int
    kv_src: int     # chunk whose receive buffer holds the KV heads this chunk's attention uses
    kv_lo: int      # ... at this index among that chunk's KV heads
    kv_use: int     # number of KV heads this chunk's attention uses
    g_off: int      # KV heads whose gradients are complete after this chunk (backward)
    g_cnt: int
    shared: bool    # this chunk's KV head is shared with other chunks (accumulate dK/dV)

    @property
    def channels(self) -> int:
        return self.q_cnt + 2 * self.kv_cnt

    @property
    def grad_channels(self) -> int:
        return self.q_cnt + 2 * self.g_cnt


def _valid_chunks(hl_q: int, hl_kv: int, c: int) -> bool:
    if c < 1 or hl_q % c:
        return False
    hqc, g = hl_q // c, hl_q // hl_kv
    return hqc % g == 0 or g % hqc == 0


def valid_num_chunks(hl_q: int, hl_kv: int, requested: int) -> int:
    """Largest valid chunk count <= requested (1 is always valid)."""
    for c in range(min(max(1, int(requested)), hl_q), 0, -1):
        if _valid_chunks(hl_q, hl_kv, c):
            return c
    return 1


def plan_chunks(hl_q: int, hl_kv: int, num_chunks: int) -> List[Chunk]:
    """Chunk plan for Hl_q local query heads and Hl_kv local KV heads (see module doc)."""
    if hl_q % hl_kv:
        raise ValueError(f"local query heads {hl_q} not a multiple of local KV heads {hl_kv}")
    c_total = valid_num_chunks(hl_q, hl_kv, num_chunks)
    hqc, g = hl_q // c_total, hl_q // hl_kv
    first = [(k * g) // hqc for k in range(hl_kv)]            # chunk that sends KV head k
    last = [((k + 1) * g - 1) // hqc for k in range(hl_kv)]   # chunk after which dK/dV are done
    sent_lo: Dict[int, int] = {}
    for k in range(hl_kv):
        sent_lo.setdefault(first[k], k)
    plan = []
    for c in range(c_total):
        qs, qe = c * hqc, (c + 1) * hqc
        need_lo, need_hi = qs // g, (qe - 1) // g + 1
        sent = [k for k in range(hl_kv) if first[k] == c]
        done = [k for k in range(hl_kv) if last[k] == c]
        src = first[need_lo]
        assert all(first[k] == src for k in range(need_lo, need_hi)), "chunk plan: KV heads span chunks"
        plan.append(Chunk(q_off=qs, q_cnt=hqc,
                          kv_off=sent[0] if sent else 0, kv_cnt=len(sent),
                          kv_src=src, kv_lo=need_lo - sent_lo[src], kv_use=need_hi - need_lo,
                          g_off=done[0] if done else 0, g_cnt=len(done),
                          shared=hqc < g))
    return plan


def auto_num_chunks(world: int, hl_q: int, hl_kv: int, recv_bytes: int) -> int:
    """Chunks for overlap: none at P == 1 (nothing to hide) or for small exchanges."""
    if world == 1 or recv_bytes < (8 << 20):
        return 1
    want = 2 if recv_bytes < (64 << 20) else 4
    return valid_num_chunks(hl_q, hl_kv, want)


def resolve_num_chunks(num_chunks: Optional[int], world: int, hl_q: int, hl_kv: int, recv_bytes: int) -> int:
    if num_chunks is None:
        num_chunks = env.integer(env.NUM_CHUNKS, 0)
    if num_chunks <= 0:
        return auto_num_chunks(world, hl_q, hl_kv, recv_bytes)
    return valid_num_chunks(hl_q, hl_kv, num_chunks)
