"""The Hugging Face tests mirror ulysses_kernels/hf's rooms (core/, families/, inference/,
training/, rl/); the helpers they share (tiny models, the family and trainer cases, the sweeps'
outcome tables) stay here. This folder and every room go on the path, so a test imports a
helper, or another room's test module, by its name (and a spawned rank, which gets this
process's path, finds the same modules)."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOMS = ("core", "families", "inference", "training", "rl")
for folder in [HERE, *(os.path.join(HERE, room) for room in ROOMS)]:
    if folder not in sys.path:
        sys.path.insert(0, folder)
