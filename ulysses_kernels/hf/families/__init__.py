"""One model family's quirks per module (docs/architecture.md, "The Hugging Face layer"):
Llama 4's chunks and temperature (llama4.py), vision-language models (vision.py, vision_shard.py,
gemma3.py), and the token mixers that are not attention, adapted by heads or along the ring
(adapters.py: the registry, written out, and installing it; mixers.py: the shared pieces;
gated_deltanet.py, mamba2.py with ssd_scan.py; mixer_ring.py).

A new family goes here, as one module: it may read the context, the groups and the model's
make-up (the rooms below), never the core, training, generation or RL (the rooms above);
what the core must know of it, it asks through the family's own functions.
"""
