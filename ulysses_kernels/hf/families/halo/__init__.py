"""Token mixers made sequence-parallel along the sequence: the halo (each rank reads the last
tokens of the rank before it; halo.py) and, for recurrences, state passing (state_passing.py):
short convolutions, ZAYA's CCA, Qwen4-Exp's n-gram layer, Mamba1, RG-LRU, RWKV, the Inklings."""
