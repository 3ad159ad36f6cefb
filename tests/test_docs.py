"""The repository explains itself: every `docs/<file>.md, "<Section>"` that the code cites
names an existing heading, the environment-variable table (docs/env.md) is the one the
package generates from its own definitions and lists every variable the code reads, and
the README stays a front page."""

import os
import re
import subprocess
import sys

import pytest
from helpers import ROOT

from ulysses_kernels import env

CODE_SUFFIXES = (".py", ".cu", ".cpp", ".h", ".sh", ".toml")
CITATION = re.compile(r'docs/([A-Za-z0-9_]+\.md),\s*"([^"]+)"')


def _tracked(*suffixes):
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    untracked = subprocess.run(["git", "ls-files", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.split()
    return [ROOT / f for f in files + untracked if f.endswith(suffixes) and (ROOT / f).exists()]


def _headings(doc):
    return {line.lstrip("#").strip() for line in (ROOT / "docs" / doc).read_text().splitlines()
            if line.startswith("#")}


def test_every_docs_citation_names_an_existing_heading():
    citations, missing = 0, []
    for path in _tracked(*CODE_SUFFIXES):
        text = path.read_text(errors="replace")
        # a citation may wrap over two comment or docstring lines
        text = re.sub(r'\n\s*(#|//|\*)?\s*', " ", text)
        for doc, section in CITATION.findall(text):
            citations += 1
            if not (ROOT / "docs" / doc).exists():
                missing.append(f"{path.relative_to(ROOT)}: docs/{doc} does not exist")
            elif section not in _headings(doc):
                missing.append(f'{path.relative_to(ROOT)}: docs/{doc} has no heading "{section}"')
    assert citations > 20  # the pattern still finds the citations
    assert not missing, "\n".join(sorted(set(missing)))


MARKDOWN_CITATION = re.compile(r'\]\(((?:docs/)?[\w.-]+\.md)\),? "([^"]+)"')


def test_every_markdown_citation_names_an_existing_heading():
    """The manual's own citations (`[status.md](status.md), "Limits"`, in the README and
    docs/) name headings that exist: a page rewritten by a generator cannot drop one."""
    citations, missing = 0, []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"\n\s*", " ", path.read_text())
        for doc, section in MARKDOWN_CITATION.findall(text):
            citations += 1
            target = ROOT / "docs" / os.path.basename(doc)
            if not target.exists():
                missing.append(f"{path.relative_to(ROOT)}: {doc} does not exist")
            elif section not in _headings(target.name):
                missing.append(f'{path.relative_to(ROOT)}: {doc} has no heading "{section}"')
    assert citations > 20  # the pattern still finds the citations
    assert not missing, "\n".join(sorted(set(missing)))


def test_env_table_is_generated_from_the_package():
    want = env.markdown()
    assert (ROOT / "docs" / "env.md").read_text() == want, \
        "docs/env.md is stale: ulysses-kernels env > docs/env.md"
    out = subprocess.run([sys.executable, "-m", "ulysses_kernels.cli", "env"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout == want, out.stderr[-2000:]


def test_every_variable_the_code_reads_is_declared():
    """Every ULYSSES_KERNELS_* / GPU_CHECK_* name in the code is one of env.VARIABLES, and
    every declared variable is read somewhere (by its name, or through its definition,
    `env.NUM_CHUNKS`): the table and the code cannot drift apart."""
    declared = {v.name for v in env.VARIABLES}
    by_attribute = {attr: v.name for attr, v in vars(env).items() if isinstance(v, env.Variable)}
    pattern = re.compile(r"\b(ULYSSES_KERNELS_[A-Z0-9_]+|GPU_CHECK_[A-Z0-9_]+|TRITON_INTERPRET)\b")
    attribute = re.compile(r"\benv\.([A-Z][A-Z0-9_]+)\b|^from \.\.env import (.+)$", re.M)
    used = {}
    for path in _tracked(".py", ".cu", ".cpp", ".h", ".sh", "run"):
        if path.name == "env.py" and path.parent.name == "ulysses_kernels":
            continue
        text = path.read_text(errors="replace")
        names = set(pattern.findall(text))
        for attr, imported in attribute.findall(text):
            for a in [attr] + [x.strip() for x in imported.split("#")[0].split(",") if x.strip()]:
                if a in by_attribute:
                    names.add(by_attribute[a])
        for name in names:
            used.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    test_only = {"ULYSSES_KERNELS_TEST_SWITCH"}  # tests/test_env.py's own throwaway name
    undeclared = sorted(set(used) - declared - test_only)
    assert not undeclared, {n: sorted(used[n]) for n in undeclared}
    unread = sorted(declared - set(used))
    assert not unread, f"declared in env.py but read nowhere: {unread}"


@pytest.mark.parametrize("var", env.VARIABLES, ids=lambda v: v.name)
def test_each_variable_is_described(var):
    assert var.kind in ("flag", "number", "integer", "choice", "path", "text")
    assert var.meaning.endswith(".") and var.default and var.read_by
    assert (ROOT / var.read_by.split()[0].split(",")[0].replace("*", "")).exists() or "*" in var.read_by, var.read_by
    if var.kind == "choice":
        assert var.default in var.choices


def test_readme_is_a_front_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "ulysses-kernels demo" in readme and 'pytest -m "not slow"' in readme
    for doc in re.findall(r"\(docs/([a-z_]+\.md)", readme):
        assert (ROOT / "docs" / doc).exists(), doc


def test_status_page_is_generated_and_its_citations_resolve():
    """docs/status.md's "Kernel builds" section is the sass report's (bench/sass_report.py
    --status writes only between its markers; the status table and the limits are written
    by hand), linked from docs/architecture.md; every `status.md` row the docs and the
    kernels' comments cite (by kernel, and layout when named; `*` a wildcard) is a row of it."""
    import fnmatch

    status = open(os.path.join(ROOT, "docs", "status.md")).read()
    assert status.startswith("# Status and limits") and {"Limits", "Kernel builds (generated)"} <= _headings("status.md")
    begin = status.index("<!-- begin: generated by python bench/sass_report.py --status docs/status.md")
    generated = status[begin:status.index("<!-- end: generated -->", begin)]
    rows = {tuple(cell.strip() for cell in line.split("|")[1:3]) for line in generated.splitlines()
            if line.startswith("| ") and not line.startswith("| kernel")}
    assert len(rows) > 50
    assert "](status.md)" in open(os.path.join(ROOT, "docs", "architecture.md")).read()
    citing = ["docs/architecture.md", "ulysses_kernels/triton/configs.py", "ulysses_kernels/triton/_common.py"]
    cited = []
    for path in citing:
        text = open(os.path.join(ROOT, path)).read()
        for match in re.finditer(r"status\.md([^)]*)\)", text):
            items = re.findall(r"`([^`]+)`", match.group(1).replace("\n", " "))
            cited += [(path, item) for item in items if re.fullmatch(r"[a-z_]+[\w@+*]*( [\w/=+.]+)?", item)]
    assert len(cited) >= 10, cited
    for path, item in cited:
        name, _, layout = item.partition(" ")
        assert any(fnmatch.fnmatch(r[0], name) and (not layout or r[1] == layout) for r in rows), (path, item)
