"""The model families' quirks, one module per family, grouped by mechanism
(docs/architecture.md, "The Hugging Face layer"):

- attention/: attention families with quirks of their own (Llama 4's chunks and temperature,
  Gemma 3's image blocks);
- vision/: vision-language models (the towers, the merge, the image tokens' shard);
- by_heads/, halo/, sparse/: the token mixers that are not attention, made exact by an
  exchange to the head layout, by the sequence halo (and state passing), or by a key selection
  over the whole sequence.

Below them, what they share: family.py (a family's declaration, `Family` and `Adapter`, each
token-mixer module ending with one `FAMILY`; and the one protocol an adapted forward follows,
`protocol_forward`), mixers.py (the head exchange's side), mixer_ring.py (a mixer on a ring's
chunks); above them, adapters.py (the registry derived from the declarations, installing it
and checking it). The layers are enforced (pyproject.toml, "The
families").

A new family goes into its mechanism's folder, as one module with its `FAMILY`, added to
adapters.FAMILIES: it may read the context, the groups and the model's make-up (the rooms
below), never the core, training, generation or RL (the rooms above); what the core must know
of it, it asks through the family's declaration and functions.
"""
