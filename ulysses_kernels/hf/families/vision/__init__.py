"""Vision-language models: the towers and the merge (vision.py), the image tokens' shard
(vision_shard.py)."""
