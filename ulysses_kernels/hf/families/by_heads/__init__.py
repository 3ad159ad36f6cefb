"""Token mixers made sequence-parallel by heads: an exchange to the head layout, the whole
sequence per head (Gated DeltaNet, Kimi Delta Attention, lightning attention, Mamba2 with its
scan, mLSTM)."""
