"""Attention families with quirks of their own: Llama 4's chunks and temperature (llama4.py),
Gemma 3's image blocks (gemma3.py)."""
