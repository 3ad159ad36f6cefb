"""The Ulysses x Ring hybrid, shared by every path (docs/architecture.md, "Ulysses x Ring"):

- `layout.py`: the zigzag sequence layout (pure arithmetic);
- `plan.py`: the block plan of each ring step (pure arithmetic);
- `shard.py`: sharding and gathering in that layout (`shard_sequence` / `gather_sequence`
  with `ring_group=`);
- `validate.py`: the checked metadata exchange over the Ulysses x Ring grid;
- `merge.py`: THE log-sum-exp merge of attention partials (torch);
- `schedule.py`: the ring loop (forward, backward, transfers) and the hybrid call on a
  path (`ulysses_ring_attention`).
"""
