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
    for info in pkgutil.walk_packages(families.__path__, prefix=f"{families.__name__}."):
        module = importlib.import_module(info.name)
        if hasattr(module, "FAMILY"):
            found[info.name.rsplit(".", 1)[-1]] = module
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
    one = Adapter(("X",), "short_conv", lambda *a: None, "halo", generation=lambda *a: None)
    with pytest.raises(ValueError, match="X is adapted twice"):
        adapters._registry([Family("a", (one,)), Family("b", (one,))])
    with pytest.raises(ValueError, match="mechanism 'convolution' is none of"):
        Adapter(("Y",), "short_conv", lambda *a: None, "convolution", generation=lambda *a: None)


def test_no_family_fact_is_set_on_a_function():
    """No `f.runs_on_a_ring = ...`, `f.prepare_cache = ...` (or any attribute) assigned to a
    function in hf/families: the facts are the declarations' fields."""
    assigned = []
    for path in sorted(FAMILIES_DIR.rglob("*.py")):
        tree = ast.parse(path.read_text())
        functions = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                            and target.value.id in functions:
                        assigned.append(f"{path.name}:{node.lineno} {target.value.id}.{target.attr}")
    assert not assigned, assigned


def test_the_families_are_grouped_by_mechanism():
    """hf/families/: at most 10 entries at its top (the shared pieces and one folder per
    mechanism), no module over 400 lines, and every family module in the folder of its
    adapters' mechanism (the mixed Inklings: halo, beside their attention by heads)."""
    top = sorted(p.name for p in FAMILIES_DIR.iterdir() if p.name != "__pycache__")
    assert len(top) <= 10, top
    long = {str(p.relative_to(FAMILIES_DIR)): n for p in FAMILIES_DIR.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
    folder = {"by heads": "by_heads", "halo": "halo", "halo + state passing": "halo", "sparse attention": "sparse"}
    for name, module in _family_modules().items():
        where = module.__name__.split(".")[-2]
        mechanisms = {a.mechanism for a in module.FAMILY.adapters} - {"over depth"}
        assert where in {folder[m] for m in mechanisms}, (name, where, mechanisms)


def test_the_docs_name_every_adapted_class():
    """Every class the registry adapts is named in docs/hf_hybrids.md's table (the token
    mixers) or docs/hf_families.md's sparse attention sections, so a family added to the
    registry without its line in the docs fails here."""
    docs = "".join((ROOT / "docs" / name).read_text() for name in ("hf_hybrids.md", "hf_families.md"))
    assert [name for name in adapters.ADAPTERS if f"`{name}`" not in docs] == []


def test_the_protocol_is_written_once():
    """`token_mixer_call`, `check_cache_outside_generation` and `attention_calls +=` appear in
    family.py's protocol and nowhere else in hf/families: no family module opens its forwards
    with the protocol (78 occurrences before family.py held it), and an adapter
    without its generation forward (which the protocol dispatches to) is refused."""
    import re

    pattern = re.compile(r"token_mixer_call\(|check_cache_outside_generation\(|attention_calls \+= ")
    found = {str(p.relative_to(FAMILIES_DIR)): n for p in FAMILIES_DIR.rglob("*.py")
             if (n := sum(bool(pattern.search(line)) and not line.lstrip().startswith("def ")
                          for line in p.read_text().splitlines()))}
    assert set(found) == {"family.py"}, found
    with pytest.raises(ValueError, match="no generation forward declared"):
        Adapter(("Z",), "short_conv", lambda *a: None, "halo")


# Adapted classes whose families have test modules of their own (tiny configs with their own
# overrides), beside the hybrid tests' family lists.
TESTED_ELSEWHERE = {
    "DeepseekV32Attention": "test_hf_dsa.py", "GlmMoeDsaAttention": "test_hf_dsa.py", "AXK2Attention": "test_hf_dsa.py",
    "HYV4Attention": "test_hf_dsa.py", "Dots3NoteTextAttention": "test_hf_dsa.py",
    "MiniMaxM3VLAttention": "test_hf_block_sparse.py", "DeepseekV4Attention": "test_hf_compressed.py",
    "Qwen4ExpTextPLELayer": "test_hf_qsa.py",
}


@pytest.mark.slow   # builds the hybrid tests' tiny models
def test_the_hybrid_tests_cover_the_registry_and_its_ring_flags():
    """The tiny models of test_hf_hybrid.py's family lists hold every adapted class (but those
    tested in their own modules, TESTED_ELSEWHERE, whose files exist); the ring tests'
    (RING_FAMILIES) hold a class of every adapter declared `runs_on_a_ring`, and no class of
    an adapter that is not (so a declaration's ring flag is the one the ring tests run)."""
    import test_hf_hybrid as hybrid
    from tiny_models import build_tiny_model

    families = set(hybrid.RING_FAMILIES + hybrid.INKLING_FAMILIES + hybrid.XLSTM_FAMILIES + ("qwen4_exp_text",))
    models = {family: build_tiny_model(family, "eager") for family in sorted(families)}
    held = {family: {type(m).__name__ for m in model.modules()} & set(adapters.ADAPTERS)
            for family, model in models.items()}
    _check_the_planner_reads_each_model_as_its_family(models, held)
    covered = set().union(*held.values())
    assert set(adapters.ADAPTERS) - covered == set(TESTED_ELSEWHERE)
    assert all((ROOT / "tests" / "hf" / "families" / name).exists() for name in TESTED_ELSEWHERE.values())
    on_ring = set().union(*(held[family] for family in hybrid.RING_FAMILIES))
    assert all(adapters.ADAPTERS[name].runs_on_a_ring for name in on_ring)
    flagged = {id(a): a for a in adapters.ADAPTERS.values() if a.runs_on_a_ring}
    assert all(set(a.classes) & on_ring for a in flagged.values()), [a.classes for a in flagged.values()
                                                                     if not set(a.classes) & on_ring]



def test_the_planner_has_a_mixer_shape_for_every_family():
    """planner.MIXER_SHAPES holds one shape per `planner_shape` the families declare and no
    other; every entry of MIXER_MODEL_TYPES is a model type of a family of that shape; every
    family declares its model types."""
    from ulysses_kernels.planner import MIXER_MODEL_TYPES, MIXER_SHAPES

    assert set(MIXER_SHAPES) == {f.planner_shape for f in adapters.FAMILIES} - {None}
    declared = {(model_type, f.planner_shape) for f in adapters.FAMILIES for model_type in f.model_types}
    assert set(MIXER_MODEL_TYPES.items()) <= declared, set(MIXER_MODEL_TYPES.items()) - declared
    assert all(family.model_types for family in adapters.FAMILIES)


def _check_the_planner_reads_each_model_as_its_family(models, held):
    """Each tiny hybrid model holds classes of the families that declare its model type
    (`Family.model_types`) only, and its config, read by the planner (`planner.mixer_shape_kind`:
    its model type, else its fields), names the `planner_shape` those families declare (the
    planner's tables and the declarations agree on every model type the tests build)."""
    from ulysses_kernels.planner import language_model_config, mixer_shape_kind

    family_of = {name: family for family in adapters.FAMILIES for name in family.classes}
    for model_type, model in models.items():
        families = {family_of[name] for name in held[model_type]}
        declaring = {family for family in adapters.FAMILIES if model_type in family.model_types}
        assert families and families <= declaring, (model_type, families, declaring)
        shapes = {family.planner_shape for family in families} - {None}
        kind = mixer_shape_kind(language_model_config(model.config.to_dict()))
        assert shapes == {kind}, (model_type, shapes, kind)
