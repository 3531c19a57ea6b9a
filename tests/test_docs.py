"""The documents a user reads stay references: the engine-argument reference is what the config's
help strings generate, README.md and BENCHMARKS.md keep to their budgets, and every path they
cite exists."""
from __future__ import annotations

import fnmatch
import re
import runpy
from pathlib import Path

ROOT = Path(__file__).parents[1]
README_LINES, BENCHMARKS_LINES = 250, 600


def test_the_engine_argument_reference_is_what_the_config_generates():
    generate = runpy.run_path(str(ROOT / "docs" / "generate.py"))
    assert (ROOT / "docs" / "engine_args.md").read_text() == generate["render"](), \
        "docs/engine_args.md is stale: run `.venv/bin/python docs/generate.py`"


def test_readme_and_benchmarks_keep_to_their_budgets():
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_LINES
    assert len((ROOT / "BENCHMARKS.md").read_text().splitlines()) <= BENCHMARKS_LINES


def test_every_file_the_documents_cite_exists():
    cited = set()
    for doc in [ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md")]:
        cited |= {(doc, m) for m in re.findall(r"`((?:engine|serve_app|benchmarks|configs|docs|tests|k8s|cluster)"
                                               r"/[\w./-]+\.(?:py|md|yaml|cpp|sh))`", doc.read_text())}
    missing = sorted(f"{doc.name}: {path}" for doc, path in cited if not (ROOT / path).exists())
    assert not missing, missing


def test_every_result_file_kept_is_cited():
    """benchmarks/results/ keeps only the figures BENCHMARKS.md cites (a citation may name a set
    of files with `*`), and every citation names files that are there."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    patterns = set(re.findall(r"benchmarks/results/[\w.*/-]+\.(?:json|txt|png|log|md)", text))
    kept = {str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks" / "results").rglob("*") if p.is_file()}
    missing = sorted(p for p in patterns if not fnmatch.filter(kept, p))
    uncited = sorted(f for f in kept if not any(fnmatch.fnmatch(f, p) for p in patterns))
    assert not missing, f"cited but not in benchmarks/results/: {missing}"
    assert not uncited, f"in benchmarks/results/ but not cited: {uncited}"


SOURCES = ("engine", "serve_app", "benchmarks", "cluster", "k8s", "configs", "docs", "tests")
CITING = {".py", ".cpp", ".h", ".cu", ".md", ".yaml", ".sh"}


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _sections(doc: Path) -> tuple[set[str], set[str]]:
    """A document's headings, as written (lower case) and as anchors."""
    titles = {m.strip().lower() for m in re.findall(r"^#+ (.+)$", doc.read_text(), re.MULTILINE)}
    return titles, {_slug(t) for t in titles}


def _citing_files() -> list[Path]:
    files = [p for d in SOURCES for p in (ROOT / d).rglob("*") if p.suffix in CITING and p.is_file()]
    return files + sorted(ROOT.glob("*.md"))


def test_every_document_section_cited_exists():
    """A citation of a section (`BENCHMARKS.md, "Serving over HTTP"`, a link to `engine.md#lora-adapters`,
    a document's name then `§` and a number) names a document of this repository and a heading it has."""
    docs = {p.name: p for p in [*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md")]}
    broken = []
    for path in _citing_files():
        text = path.read_text(errors="replace")
        where = str(path.relative_to(ROOT))
        for target, anchor in re.findall(r"\]\(([\w./-]*?\.md)?#([\w-]+)\)", text):
            doc = (path.parent / target).resolve() if target else path
            if not doc.exists() or anchor not in _sections(doc)[1]:
                broken.append(f"{where}: {target}#{anchor}")
        for name, title in re.findall(r"\b(\w+\.md),? \"([^\"]+)\"", text):
            if name not in docs or title.lower() not in _sections(docs[name])[0]:
                broken.append(f'{where}: {name}, "{title}"')
        for name, number in re.findall(r"\b(\w+\.md) §\s*(\d+)", text):
            if name not in docs or not any(t.startswith(f"{number}.") for t in _sections(docs[name])[0]):
                broken.append(f"{where}: {name} §{number}")
    assert not broken, broken
