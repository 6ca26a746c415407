"""The user-facing documents: README size, the set-up commands CI runs, and every file the docs cite exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "CHANGELOG.md", ROOT / "eval" / "README.md"]


def test_readme_stays_short():
    assert (ROOT / "README.md").stat().st_size <= 20_000


def test_ci_runs_the_readme_test_command_as_written():
    readme = (ROOT / "README.md").read_text()
    commands = [line for line in readme.splitlines() if line.startswith("python3 -m venv")]
    assert len(commands) == 2, commands  # the demo command and the test command
    test_command = [c for c in commands if c.endswith("python -m pytest -q")]
    assert len(test_command) == 1
    assert test_command[0] in (ROOT / ".ci" / "run").read_text().splitlines()


def test_cited_result_files_and_scripts_exist():
    folders = "benchmarks|eval|examples|docs|tests|kivi_cache|kernels"
    pattern = re.compile(rf"\b((?:{folders})/[\w./-]+\.(?:json|png|py|sh|md|ipynb|yaml))")
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for path in set(pattern.findall(text)):
            if not (ROOT / path).exists() and not (doc.parent / path).exists():
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    # result files cited by bare name in a table are looked up in the results folders
    for doc in DOCS:
        for name in set(re.findall(r"`([\w.-]+_(?:cpu|h100|h200)_\d{4}-\d\d-\d\d\.json)`", doc.read_text())):
            if not any((ROOT / d / name).exists() for d in ("benchmarks/results", "eval/results")):
                missing.append(f"{doc.relative_to(ROOT)}: {name}")
    assert not missing, missing


def test_no_development_history_in_the_documents():
    for doc in DOCS:
        text = doc.read_text()
        assert not re.search(r"\bsessions?\b|NOTES\.md", text, re.IGNORECASE), doc
