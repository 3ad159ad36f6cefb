"""What the paths share to move tensors between sequence and head shards
(docs/architecture.md, "Layout rules"):

- `buffers.py`: the send/receive buffer layouts of the all-to-all and the raw exchanges
  over them (torch ops + `all_to_all_single`);
- `heads.py`: the sequence <-> head exchanges as autograd functions (the reference and
  Triton paths' exchange, and the public `seq_to_heads` / `heads_to_seq` /
  `qkv_seq_to_heads`);
- `sequence.py`: differentiable sharding and gathering along the sequence
  (`shard_sequence` / `gather_sequence`).
"""
