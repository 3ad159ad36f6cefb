"""The token-mixer families as declarations (ulysses_kernels/hf/families/family.py): every
family module declares one `FAMILY`, the registry (`adapters.FAMILIES`, `ADAPTERS`) is derived
from them and from nothing else, each transformers class is claimed once, every adapter
names a known mechanism, and no family fact hangs on a function as an attribute (the
registry reads `runs_on_a_ring`, `own_cache` and `prepare_cache` from the declarations)."""

import ast
import importlib
import pkgutil

import pytest

from helpers import ROOT

pytest.importorskip("transformers")

from ulysses_kernels.hf import families  # noqa: E402
from ulysses_kernels.hf.families import adapters  # noqa: E402
from ulysses_kernels.hf.families.family import MECHANISMS, Adapter, Family  # noqa: E402

FAMILIES_DIR = ROOT / "ulysses_kernels" / "hf" / "families"


def _family_modules():
    """Every module of hf/families that declares a FAMILY."""
    found = {}
    for info in pkgutil.iter_modules(families.__path__):
        module = importlib.import_module(f"{families.__name__}.{info.name}")
        if hasattr(module, "FAMILY"):
            found[info.name] = module
    return found


def test_the_registry_is_every_declared_family_and_nothing_else():
    declared = _family_modules()
    assert {f.name for f in adapters.FAMILIES} == set(declared), "a FAMILY missing from adapters.FAMILIES"
    assert all(isinstance(m.FAMILY, Family) and m.FAMILY.name == name for name, m in declared.items())
    claimed = [name for family in adapters.FAMILIES for name in family.classes]
    assert len(claimed) == len(set(claimed)) and set(claimed) == set(adapters.ADAPTERS)
    for family in adapters.FAMILIES:
        for adapter in family.adapters:
            assert isinstance(adapter, Adapter) and adapter.mechanism in MECHANISMS
            assert all(adapters.ADAPTERS[name] is adapter for name in adapter.classes)


def test_a_class_claimed_twice_or_an_unknown_mechanism_is_refused():
    one = Adapter(("X",), "short_conv", lambda *a: None, "halo")
    with pytest.raises(ValueError, match="X is adapted twice"):
        adapters._registry([Family("a", (one,)), Family("b", (one,))])
    with pytest.raises(ValueError, match="mechanism 'convolution' is none of"):
        Adapter(("Y",), "short_conv", lambda *a: None, "convolution")


def test_no_family_fact_is_set_on_a_function():
    """No `f.runs_on_a_ring = ...`, `f.prepare_cache = ...` (or any attribute) assigned to a
    function in hf/families: the facts are the declarations' fields."""
    assigned = []
    for path in sorted(FAMILIES_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        functions = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                            and target.value.id in functions:
                        assigned.append(f"{path.name}:{node.lineno} {target.value.id}.{target.attr}")
    assert not assigned, assigned
