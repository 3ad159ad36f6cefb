"""The torch and Triton releases the package is tested on (docs/build.md, "Supported torch
releases").

The rule: `pyproject.toml` admits exactly the minors named here (`torch>=2.11,<2.16`,
`triton>=3.6,<3.10`), and CI runs the suite on each end of the range, so every minor a user
can install without `--no-deps` has been run (tests/test_setup.py holds the three together):
the full suite on the pinned torch (`.ci/constraints.txt`), the fast tier and every kernel,
fused, ring and Triton-path CPU test on torch 2.11.0 (with its Triton 3.6) and on torch
2.15.0 (`.ci/constraints-torch2.11.txt`, `.ci/constraints-torch2.15.txt`).

`problems()` is what `ulysses-kernels doctor` warns about: a torch or Triton outside the range
(the GPU image's, a cluster's pin) still imports and runs, but nothing checked it.
"""

from typing import List, Optional, Tuple

# The oldest and the newest tested minor of each; CI's legs run both ends.
TESTED_TORCH: Tuple[str, str] = ("2.11", "2.15")
TESTED_TRITON: Tuple[str, str] = ("3.6", "3.9")


def minor(version: str) -> Tuple[int, int]:
    """(major, minor) of a version string such as '2.11.0+cu130' or '3.6.0'."""
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def _outside(name: str, version: Optional[str], tested: Tuple[str, str]) -> Optional[str]:
    if version is None:
        return None
    lo, hi = minor(tested[0]), minor(tested[1])
    if lo <= minor(version) <= hi:
        return None
    return (f"{name} {version} is outside the tested range {tested[0]} to {tested[1]}: it may work, "
            "but no test has run on it (docs/build.md, \"Supported torch releases\")")


def problems(torch_version: str, triton_version: Optional[str]) -> List[str]:
    """Warnings for a torch or Triton outside the tested range (empty when both are inside;
    `triton_version` None: Triton is not installed, which the doctor reports on its own)."""
    found = [_outside("torch", torch_version, TESTED_TORCH), _outside("Triton", triton_version, TESTED_TRITON)]
    return [p for p in found if p is not None]
