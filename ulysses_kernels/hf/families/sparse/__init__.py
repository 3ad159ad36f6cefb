"""Sparse attention: a key selection computed over the whole sequence (selection.py), DeepSeek
Sparse Attention (dsa.py, dsa_indexer.py), MiniMax-M3's block-sparse, Qwen4-Exp's QSA,
DeepSeek-V4's compressed attention."""
