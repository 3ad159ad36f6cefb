"""Environment variables: the one parser of boolean switches (and of numbers and choices).

Every boolean environment variable of the package (and `TRITON_INTERPRET`, which Triton
itself reads) goes through `flag`, so "false" means off everywhere and a typo is an error
that names the variable instead of a silent guess. The accepted spellings are Triton's
own (`triton.knobs` reads "1", "true", "yes", "on", "y" as true).

This module imports nothing from the package: setup.py loads it by path before the
package is installed.
"""

import os

_TRUE = ("1", "true", "yes", "on", "y")
_FALSE = ("0", "false", "no", "off", "n")


def flag(name: str, default: bool = False) -> bool:
    """The value of the boolean environment variable `name` (`default` when unset or empty).

    Raises ValueError for a value that is neither true nor false, naming the variable.
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean: use one of {', '.join(_TRUE)} "
                     f"or {', '.join(_FALSE)}")


def number(name: str, default: float) -> float:
    """The value of the numeric environment variable `name` (`default` when unset or empty)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


def choice(name: str, allowed, default: str) -> str:
    """The value of the environment variable `name`, one of `allowed` (lower-cased;
    `default` when unset or empty). Raises ValueError naming the variable and the choices."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if raw.lower() not in allowed:
        raise ValueError(f"{name}={raw!r} is not one of {', '.join(allowed)}")
    return raw.lower()


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (`TRITON_INTERPRET`): on CPU tensors."""
    return flag("TRITON_INTERPRET")
