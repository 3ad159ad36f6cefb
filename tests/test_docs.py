"""The repository explains itself: every `docs/<file>.md, "<Section>"` that the code cites
names an existing heading, the environment-variable table (docs/env.md) is the one the
package generates from its own definitions and lists every variable the code reads, and
the README stays a front page."""

import os
import re
import subprocess
import sys
from pathlib import Path

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


def test_kernel_table_is_generated_from_the_capability_tables():
    from ulysses_kernels.kernel_choice import explain

    assert (ROOT / "docs" / "kernels.md").read_text() == explain.markdown() + "\n", \
        "docs/kernels.md is stale: ulysses-kernels kernels > docs/kernels.md"


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
    assert "ulysses-kernels demo" in readme and 'pytest -n 2 -m "not slow"' in readme
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
    citing = ["docs/architecture.md", "ulysses_kernels/triton/configs.py", "ulysses_kernels/triton/scores.py"]
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


@pytest.mark.slow
def test_the_readme_use_snippet_runs_as_pasted(tmp_path):
    """The README's "Use" script, copied as it is, under torchrun with 2 CPU ranks (gloo)."""
    import socket

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Use"):]
    script = section[section.index("```python\n") + len("```python\n"):section.index("\n```\n")]
    (tmp_path / "use.py").write_text(script)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(port), str(tmp_path / "use.py")],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: out (1, 2048, 32, 128), q.grad (1, 2048, 32, 128)" in proc.stdout, proc.stdout


def _architecture_tree():
    """{folder ('' for the package's top level): the file-name patterns its entry names} of
    docs/architecture.md's package tree."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text[text.index("```\nulysses_kernels/\n") + 4:]
    block = block[:block.index("```")]
    entries, folder = {}, None
    for line in block.splitlines()[1:]:
        if not line.startswith("  "):
            break   # csrc/, tests/, bench/: outside the package
        head = line[2:].split(" ", 1)[0] if not line.startswith("   ") else None
        if head:
            folder = head.rstrip("/") if head.endswith("/") else ""
            if folder == "":
                entries.setdefault("", set()).update(re.findall(r"[\w*]+\.py", head + " " + line))
                continue
        entries.setdefault(folder, set()).update(re.findall(r"[\w*]+\.py", line))
    return entries


def test_every_package_file_is_in_the_architecture_tree():
    """docs/architecture.md's tree names every module of the package (a glob like
    flash_bwd*.py counts): a new file without its line fails here."""
    import fnmatch

    tree = _architecture_tree()
    missing = []
    for path in sorted((ROOT / "ulysses_kernels").rglob("*.py")):
        relative = path.relative_to(ROOT / "ulysses_kernels")
        if path.name in ("__init__.py", "_build_info.py") and relative.parent != Path("."):
            continue
        if path.name == "_build_info.py":
            continue
        folder = "" if relative.parent == Path(".") else str(relative.parent)
        if not any(fnmatch.fnmatch(path.name, pattern) for pattern in tree.get(folder, ())):
            missing.append(str(relative))
    assert not missing, f"docs/architecture.md's tree does not name {missing}"
