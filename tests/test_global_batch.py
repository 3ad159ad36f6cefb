"""The global-batch planner (ulysses_kernels/global_batch.py) on lengths alone: every
document placed exactly once, no rank over its token budget, every document at an SP size
that fits it, micro-batches of one SP size that divides the world; the balance it reaches
against a fixed layout on the two mixes of docs/global_batch.md; the cost model's shape."""

import dataclasses
import math
import random

import pytest

from ulysses_kernels import global_batch as gb


def long_tail(total, seed):
    """Lognormal lengths, median 2,048, sigma 1.0, clipped to [32, 131,072], until `total` tokens."""
    rng, out = random.Random(seed), []
    while sum(out) < total:
        out.append(int(min(131072, max(32, rng.lognormvariate(math.log(2048), 1.0)))))
    return out


def long_context_mix(total, seed):
    """80% of the tokens in documents of 1K-8K, 20% in documents of 64K-512K (log-uniform)."""
    rng, out, long_tokens = random.Random(seed), [], 0
    while sum(out) < total:
        if long_tokens < 0.2 * (sum(out) + 1):
            n = int(math.exp(rng.uniform(math.log(65536), math.log(524288))))
            long_tokens += n
        else:
            n = int(math.exp(rng.uniform(math.log(1024), math.log(8192))))
        out.append(n)
    rng.shuffle(out)
    return out


def check_plan(plan, lengths):
    assert plan.documents() == list(range(len(lengths)))   # each document exactly once
    for mb in plan.micro_batches:
        assert plan.world % mb.sp == 0 and len(mb.groups) == plan.world // mb.sp
        for docs, tokens in zip(mb.groups, mb.tokens):
            assert tokens == sum(lengths[d] for d in docs) <= mb.sp * plan.token_budget
            assert all(math.ceil(lengths[d] / mb.sp) <= plan.token_budget for d in docs)


@pytest.mark.parametrize("seed", range(20))
def test_every_document_once_within_budgets_on_random_lengths(seed):
    rng = random.Random(seed)
    world = rng.choice([1, 2, 3, 4, 6, 8, 12, 16])
    budget = rng.choice([64, 256, 1000])
    lengths = [rng.randint(1, budget * world) if rng.random() < 0.1 else rng.randint(1, budget)
               for _ in range(rng.randint(1, 200))]
    for plan in (gb.plan_global_batch(lengths, world=world, token_budget=budget),
                 gb.naive_plan(lengths, world=world, token_budget=budget),
                 gb.plan_global_batch(lengths, world=world, token_budget=budget, sp_sizes=[max(
                     gb.smallest_sp(n, budget, gb.sp_sizes_for(world)) for n in lengths)])):
        check_plan(plan, lengths)
        assert plan.makespan >= max(plan.rank_costs()) * (1 - 1e-12)
        assert max(plan.rank_costs()) >= plan.ideal * (1 - 1e-12)


def test_a_document_no_world_holds_is_refused():
    with pytest.raises(ValueError, match="a document of 1001 tokens does not fit: 4 ranks of 250 tokens hold 1000"):
        gb.plan_global_batch([10, 1001], world=4, token_budget=250)
    with pytest.raises(ValueError, match="every SP size must divide the world of 4"):
        gb.plan_global_batch([10], world=4, token_budget=250, sp_sizes=[3])


def test_short_documents_need_no_exchange_and_long_ones_get_larger_groups():
    plan = gb.plan_global_batch([512] * 8 + [8192], world=8, token_budget=1024)
    sizes = {d: mb.sp for mb in plan.micro_batches for g in mb.groups for d in g}
    assert sizes[8] == 8 and all(sizes[d] == 1 for d in range(8))
    assert gb.naive_plan([512] * 8 + [8192], world=8, token_budget=1024).micro_batches[0].sp == 8


def test_the_makespan_is_when_the_last_rank_is_done():
    """Groups never wait for each other; the ranks of a group start it together."""
    plan = gb.GlobalBatchPlan(world=4, token_budget=100, ideal=1.0)
    plan.micro_batches = [gb.MicroBatch(1, [[0], [], [1], []], [10, 0, 10, 0], [3.0, 0.0, 1.0, 0.0]),
                          gb.MicroBatch(2, [[2], [3]], [10, 10], [1.0, 2.0]),
                          gb.MicroBatch(4, [[4]], [10], [0.5])]
    # ranks 0 and 1 start their pair at 3 (rank 0 busy until then), ranks 2 and 3 at 1; all
    # four start the last group at max(4, 3) = 4
    assert plan.makespan == 4.5
    assert plan.rank_costs() == [4.5, 1.5, 3.5, 2.5]


@pytest.mark.parametrize("world", [4, 8, 64])
def test_with_sizes_that_divide_one_another_no_rank_waits(world):
    """The largest SP size first: the step lasts as long as its busiest rank's cost."""
    lengths = long_context_mix(1 << 20, world)
    plan = gb.plan_global_batch(lengths, world=world, token_budget=524288 // world)
    assert [mb.sp for mb in plan.micro_batches] == sorted((mb.sp for mb in plan.micro_batches), reverse=True)
    assert plan.makespan == pytest.approx(max(plan.rank_costs()), rel=1e-12)


def test_cost_model():
    cost = gb.LLAMA3_8B
    assert cost(4096, 1) > 2 * cost(2048, 1)                  # attention is quadratic
    assert cost(4096, 2) < cost(4096, 1)                      # a group divides the work
    assert cost(100, 2) - (cost(100, 1) / 2) > 0              # and pays an exchange
    n = 1 << 16
    attention = cost.attention_per_pair * n * (n + 1) / 2
    work = attention + cost.linear_per_token * n
    # Ulysses across the nodes (no ring in the model): its exchange costs more a byte there
    ulysses_only = dataclasses.replace(cost, kv_per_token=None)
    inside, across = ulysses_only(n, 8), ulysses_only(n, 16)
    assert across - work / 16 > (inside - work / 8) * 2
    # with the ring: Ulysses inside each node of 8 and a ring of 2 across, whose transfers
    # hide behind the block attention of a long document, not behind a short one's
    ulysses_part = cost.exchange_per_token * n / 16 * 7 / 8
    assert cost(n, 16) == pytest.approx(work / 16 + ulysses_part, rel=1e-12)
    short = 2048
    short_work = (cost.attention_per_pair * short * (short + 1) / 2 + cost.linear_per_token * short) / 16
    passed = cost.kv_per_token * cost.across_nodes * short / 16
    assert cost(short, 16) > short_work + cost.exchange_per_token * short / 16 * 7 / 8
    assert cost(short, 16) == pytest.approx(short_work + cost.exchange_per_token * short / 16 * 7 / 8 + passed
                                            - cost.attention_per_pair * short * (short + 1) / 2 / 16, rel=1e-12)


@pytest.mark.parametrize("mix,total,world,goal", [
    (long_tail, 1 << 20, 8, 1.10), (long_tail, 1 << 20, 64, 1.10),
    (long_context_mix, 4 << 20, 8, 1.10), (long_context_mix, 4 << 20, 64, 1.10),
])
def test_balance_against_a_fixed_layout(mix, total, world, goal):
    """docs/global_batch.md's table, one seed: the planner's makespan over the ideal, and the
    naive fixed layout's, at a token budget of 64K a rank (bench/plan_global_batches.py runs
    more seeds)."""
    lengths = mix(total, 0)
    plan = gb.plan_global_batch(lengths, world=world, token_budget=65536)
    naive = gb.naive_plan(lengths, world=world, token_budget=65536)
    check_plan(plan, lengths)
    assert plan.imbalance < goal and plan.imbalance <= naive.imbalance, (plan.imbalance, naive.imbalance)
