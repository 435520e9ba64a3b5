"""README stays true to the code: the config reference is generated, the two commands exist."""

from pathlib import Path

from actlake.jobs.reference import reference_blocks

ROOT = Path(__file__).resolve().parents[2]


def test_config_references_are_current():
    text = (ROOT / "README.md").read_text()
    for marker, markdown in reference_blocks().items():
        assert f"<!-- {marker}:start -->" in text, f"README lacks the {marker} block"
        block = text.split(f"<!-- {marker}:start -->")[1].split(f"<!-- {marker}:end -->")[0].strip()
        assert block == markdown.strip(), f"README {marker} is stale: run python scripts/sync_readme.py"


def test_readme_commands_exist_and_ci_calls_the_test_command():
    text = (ROOT / "README.md").read_text()
    assert "bash scripts/quickstart.sh" in text and "bash scripts/test.sh" in text
    assert (ROOT / "scripts" / "quickstart.sh").is_file() and (ROOT / "scripts" / "test.sh").is_file()
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_methods_is_in_the_repository_and_cited_there():
    assert (ROOT / "METHODS.md").is_file()
    assert "](METHODS.md)" in (ROOT / "README.md").read_text()
    for folder in ("actlake", "jobs", "analysis", "storage", "scripts", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            outside = "../shared/" + "METHODS.md"  # spelt in two parts so this file does not match
            assert outside not in path.read_text(), f"{path} cites the METHODS.md outside the repository"
