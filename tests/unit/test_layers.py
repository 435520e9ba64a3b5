"""Imports point down the layers (README "Architecture"): import-linter's contracts in pyproject.toml, run on
the package as it is installed (``jobs/`` as ``actlake/jobs`` and so on), and shown to fail when an import
points up."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"actlake": "actlake", "jobs": "actlake/jobs", "analysis": "actlake/analysis", "storage": "actlake/storage"}
"""Repository folder -> its place in the installed package (pyproject.toml's package-dir)."""


def _package_tree(dest: Path) -> Path:
    for folder, place in FOLDERS.items():
        shutil.copytree(ROOT / folder, dest / place, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def _lint(tree: Path) -> subprocess.CompletedProcess:
    lint = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([str(lint), "--no-cache"], cwd=tree, env=env, capture_output=True, text=True, timeout=120)


def _plant(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n\ndef _planted():\n    {line}\n")


def test_the_import_contracts_hold(tmp_path):
    import tomllib

    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert {folder: pkg.replace(".", "/") for pkg, folder in package_dir.items()} == FOLDERS
    out = _lint(_package_tree(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "5 kept, 0 broken" in out.stdout


@pytest.mark.parametrize("where,line,contract", [
    ("actlake/config.py", "from actlake.jobs import cli", "Layers: jobs"),
    ("actlake/analysis/stats.py", "from actlake.storage import manifest", "Layers: jobs"),
    ("actlake/analysis/engine/grid.py", "from actlake.analysis.attention_mass import AttentionMass", "The engine imports no analysis"),
    ("actlake/analysis/protocol.py", "from actlake.analysis.registry import builtin", "Inside analysis"),
    ("actlake/jobs/train/lm/loop.py", "from actlake.jobs.train.synthetic import config", "The training jobs share"),
    ("actlake/jobs/extract/run.py", "from actlake.jobs.train import training", "Inside jobs"),
    ("actlake/jobs/train/training.py", "from actlake.jobs.extract import plan", "Inside jobs"),
    ("actlake/jobs/common/page.py", "from actlake.jobs.extract import report", "Inside jobs"),
    ("actlake/jobs/extract/report.py", "from actlake.jobs import cli", "Inside jobs"),
])
def test_an_upward_import_breaks_a_contract_naming_it(where, line, contract, tmp_path):
    _plant(_package_tree(tmp_path) / where, line)
    out = _lint(tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    broken = [ln for ln in out.stdout.splitlines() if "BROKEN" in ln]  # an upward import may break more than one
    assert any(b.startswith(contract) for b in broken), out.stdout
    module = where.removesuffix(".py").replace("/", ".")
    assert module in out.stdout, out.stdout

