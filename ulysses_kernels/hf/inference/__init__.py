"""Generation under sequence parallelism: the head-sharded decoding cache (cache.py) and the
prefill / decode entry points (generation.py) (docs/hf_generation.md, "How it runs")."""
