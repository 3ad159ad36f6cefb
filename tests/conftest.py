import os
import sys

import torch

# Triton kernels run in the interpreter on machines without a GPU; this must be set before
# triton is imported anywhere. On a GPU machine the real kernels run.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Worker functions for multi-process tests live in tests/_dist_cases.py; spawned children
# import them by module name, so keep this folder importable.
sys.path.insert(0, os.path.dirname(__file__))
