"""The fused path's chunk plan (ulysses_kernels.fused.plan): which heads each chunk moves,
and how many chunks a call uses. Pure arithmetic."""

import pytest

from ulysses_kernels import env, fused
from ulysses_kernels.fused.plan import auto_num_chunks


@pytest.mark.parametrize("hl_q,hl_kv", [(1, 1), (4, 4), (4, 2), (4, 1), (8, 2), (6, 3), (6, 1), (12, 4), (16, 1)])
def test_chunk_plan_covers_every_head_once(hl_q, hl_kv):
    g = hl_q // hl_kv
    for requested in range(1, hl_q + 2):
        plan = fused.plan_chunks(hl_q, hl_kv, requested)
        assert 1 <= len(plan) <= max(1, min(requested, hl_q))
        q_heads = [h for c in plan for h in range(c.q_off, c.q_off + c.q_cnt)]
        assert q_heads == list(range(hl_q))
        sent = [h for c in plan for h in range(c.kv_off, c.kv_off + c.kv_cnt)]
        done = [h for c in plan for h in range(c.g_off, c.g_off + c.g_cnt)]
        assert sent == list(range(hl_kv)) and done == list(range(hl_kv))
        for i, c in enumerate(plan):
            src = plan[c.kv_src]
            assert c.kv_src <= i
            assert 0 <= c.kv_lo and c.kv_lo + c.kv_use <= src.kv_cnt
            used = range(src.kv_off + c.kv_lo, src.kv_off + c.kv_lo + c.kv_use)
            # every query head of the chunk reads KV head h // g, and it is in `used`
            assert all(h // g in used for h in range(c.q_off, c.q_off + c.q_cnt))
            if not c.shared:
                assert c.kv_src == i and (c.g_off, c.g_cnt) == (c.kv_off, c.kv_cnt)


def test_num_chunks_env_and_argument(monkeypatch):
    monkeypatch.setenv(env.NUM_CHUNKS.name, "4")
    assert fused.resolve_num_chunks(None, 2, 8, 2, 1) == 4
    assert fused.resolve_num_chunks(2, 2, 8, 2, 1) == 2      # argument beats env
    assert fused.resolve_num_chunks(3, 2, 8, 2, 1) == 2      # lowered to a valid count
    monkeypatch.setenv(env.NUM_CHUNKS.name, "x")
    with pytest.raises(ValueError, match=env.NUM_CHUNKS.name):
        fused.resolve_num_chunks(None, 2, 8, 2, 1)
    monkeypatch.delenv(env.NUM_CHUNKS.name)
    assert fused.resolve_num_chunks(None, 1, 8, 2, 1 << 30) == 1   # world 1: nothing to overlap
    assert fused.resolve_num_chunks(None, 8, 8, 1, 1 << 30) == 4


def test_auto_num_chunks_by_bytes():
    assert auto_num_chunks(1, 8, 2, 1 << 30) == 1            # world 1: nothing to overlap
    assert auto_num_chunks(4, 8, 2, (8 << 20) - 1) == 1      # a small exchange is not split
    assert auto_num_chunks(4, 8, 2, 8 << 20) == 2
    assert auto_num_chunks(4, 8, 2, 64 << 20) == 4
    assert auto_num_chunks(4, 2, 2, 64 << 20) == 2           # lowered to a valid count
    assert fused.resolve_num_chunks(0, 4, 8, 2, 64 << 20) == 4  # 0 or less: automatic


@pytest.mark.parametrize("hl_q,hl_kv,requested,expected", [
    (8, 2, 3, 2), (6, 3, 4, 3), (6, 1, 5, 3), (12, 4, 5, 4), (4, 4, 100, 4), (1, 1, 9, 1), (6, 2, 4, 2)])
def test_valid_num_chunks_is_the_largest_valid_count(hl_q, hl_kv, requested, expected):
    assert fused.valid_num_chunks(hl_q, hl_kv, requested) == expected
    assert len(fused.plan_chunks(hl_q, hl_kv, requested)) == expected


def test_plan_rejects_kv_heads_that_do_not_divide():
    with pytest.raises(ValueError, match="local query heads 6 not a multiple of local KV heads 4"):
        fused.plan_chunks(6, 4, 1)
