"""The generated reference pages match the code (regenerate: python scripts/gen_docs.py), and
the project's own text carries no development history or paths outside the repository."""

import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_generated_reference_pages_are_up_to_date():
    p = subprocess.run([sys.executable, "scripts/gen_docs.py", "--check"], cwd=ROOT, capture_output=True, text=True, check=False, timeout=120)
    assert p.returncode == 0, p.stderr


def test_the_configuration_reference_lists_every_field():
    from hybrid_rl.config import Config

    page = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    todo, n = [Config], 0
    while todo:
        cls = todo.pop()
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                todo.append(tp)
            elif typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
                todo.append(typing.get_args(tp)[0])
            if cls is not Config:
                n += 1
                assert f"| `{f.name}` |" in page, f.name
    assert page.count("\n| `") == n


# What the project's text must not say of itself (development history, other people's machines and
# files). Spelled in parts so that this file does not match its own patterns.
WORDS = ["sess" + r"ion [0-9]", "iss" + r"ue ?#?[0-9]", "iss" + "ue14", r"\.\./sha" + "red", "device" + " call", "le" + "nt (gpu|machine)"]
HISTORY = re.compile("|".join(WORDS), re.IGNORECASE)


def test_no_development_history_in_the_project_text():
    roots = ["README.md", "CHANGELOG.md", "mkdocs.yml", "docs", "hybrid_rl", "conf", "benchmarks", "tests", "recipes", "scripts"]
    # The project's own files: tracked or not ignored (not site/, benchmarks/.deps/ and the like,
    # which hold generated pages and third-party packages)
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *roots], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\n")  # fmt: skip
    files = [ROOT / f for f in listed if f and (ROOT / f).is_file()]
    assert len(files) > 100, files
    offenders = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}"
        for p in files
        if p.suffix in (".md", ".py", ".yaml", ".yml", ".sh", ".sbatch", ".txt")
        for i, line in enumerate(p.read_text(errors="ignore").splitlines(), 1)
        if HISTORY.search(line)
    ]
    assert not offenders, "\n".join(offenders[:40])
