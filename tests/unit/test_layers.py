"""Imports point down the layers (README "Architecture"): a module imports only from its own layer or below.

Every ``import``/``from`` of ``actlake...`` counts, at module level and inside functions. The layers, lowest
first, are ``LAYERS``; a module belongs to the layer of the longest prefix that names it. The three training
jobs (``actlake.jobs.lm``, ``.predictor``, ``.synthetic``) share ``actlake.jobs.training`` and
``actlake.jobs.ray_env`` but do not import each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# package -> folder, as pyproject.toml's [tool.setuptools.package-dir] maps them
PACKAGE_DIRS = {"actlake": "actlake", "actlake.jobs": "jobs", "actlake.analysis": "analysis",
                "actlake.storage": "storage"}

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("ground", ("actlake.errors", "actlake.fs", "actlake.sizes", "actlake.hashing", "actlake.categories", "actlake.architectures",
                "actlake.config", "actlake.config_base", "actlake.train_config", "actlake.corpus", "actlake.batching",
                "actlake.model")),
    ("analysis", ("actlake.analysis",)),
    ("storage", ("actlake.storage",)),
    ("report", ("actlake.report",)),
    ("jobs", ("actlake.jobs",)),
    ("top", ("actlake", "actlake.cli", "actlake.reference")),
]
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}
TRAINING_JOBS = ("actlake.jobs.lm", "actlake.jobs.predictor", "actlake.jobs.synthetic")


def layer_of(module: str) -> str | None:
    """The layer of ``module``: the one with the longest prefix naming it (``actlake`` alone is the top)."""
    best, best_len = None, -1
    for name, prefixes in LAYERS:
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len and (p != "actlake" or module == p):
                best, best_len = name, len(p)
    return best


def _job_of(module: str) -> str | None:
    return next((j for j in TRAINING_JOBS if module == j or module.startswith(j + ".")), None)


def imported_modules(module: str, source: str, is_package: bool = False, known: set[str] = frozenset()) -> list[tuple[str, int]]:
    """(actlake module imported, line) for every import in ``source``, module- and function-level; relative
    imports resolved against ``module``; ``from pkg import name`` counts as ``pkg.name`` when that is a module."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "actlake"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            if base.split(".")[0] != "actlake":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub if sub in known else base, node.lineno))
    return out


def violations(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Messages for every import that points up a layer (or between training jobs) in ``sources``:
    module name -> (source text, is a package ``__init__``)."""
    known = set(sources)
    bad = []
    for module, (source, is_package) in sorted(sources.items()):
        mine = layer_of(module)
        if mine is None:
            bad.append(f"{module} belongs to no layer: add it to LAYERS in tests/unit/test_layers.py")
            continue
        for target, line in sorted(set(imported_modules(module, source, is_package, known)), key=lambda t: t[1]):
            theirs = layer_of(target)
            if theirs is None:
                bad.append(f"{module}:{line} imports {target}, which belongs to no layer")
            elif RANK[theirs] > RANK[mine]:
                bad.append(f"{module}:{line} (layer {mine}) imports {target} (layer {theirs}): "
                           f"a module may import only from its own layer or below")
            elif _job_of(module) and _job_of(target) and _job_of(module) != _job_of(target):
                bad.append(f"{module}:{line} (job {_job_of(module)}) imports {target} (job {_job_of(target)}): "
                           f"training jobs share actlake.jobs.training, not each other's modules")
    return bad


def package_sources() -> dict[str, tuple[str, bool]]:
    """Every module of the installed package, by name, read from the repository folders."""
    out = {}
    for pkg, folder in PACKAGE_DIRS.items():
        base = ROOT / folder
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("")
            parts = list(rel.parts)
            if any(p.startswith(".") or p == "__pycache__" for p in parts):
                continue
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            name = ".".join([pkg] + parts)
            out[name] = (path.read_text(), is_package)
    return out


def test_every_import_points_down_the_layers():
    sources = package_sources()
    assert {"actlake.config", "actlake.jobs.training", "actlake.analysis.protocol", "actlake.storage.sql",
            "actlake.report", "actlake.cli", "actlake.jobs.predictor.loop"} <= set(sources)
    bad = violations(sources)
    assert not bad, "imports against the layers:\n  " + "\n  ".join(bad)


@pytest.mark.parametrize("module,layer", [
    ("actlake", "top"), ("actlake.cli", "top"), ("actlake.reference", "top"), ("actlake.config", "ground"),
    ("actlake.corpus.readers", "ground"), ("actlake.analysis.dim_moments", "analysis"),
    ("actlake.storage.sql", "storage"), ("actlake.report", "report"), ("actlake.jobs.synthetic.report", "jobs"),
    ("actlake.unknown", None),
])
def test_layer_of(module, layer):
    assert layer_of(module) == layer


def test_checker_flags_an_upward_import_inside_a_function():
    src = "import os\n\ndef f():\n    from actlake.jobs.lm.config import LMConfig\n    return LMConfig\n"
    bad = violations({"actlake.config": (src, False), "actlake.jobs.lm.config": ("", False)})
    assert len(bad) == 1
    assert "actlake.config:4 (layer ground) imports actlake.jobs.lm.config (layer jobs)" in bad[0]


def test_checker_resolves_relative_and_from_package_imports():
    sources = {"actlake.analysis.x": ("from ..storage import sql\n", False),
               "actlake.storage.sql": ("", False),
               "actlake.storage": ("from . import sql\n", True),
               "actlake.jobs.lm.loop": ("from actlake.jobs.predictor import model\n", False),
               "actlake.jobs.predictor.model": ("from .. import training\nimport actlake\n", False),
               "actlake.jobs.training": ("", False)}
    bad = violations(sources)
    assert any(b.startswith("actlake.analysis.x:1 (layer analysis) imports actlake.storage.sql (layer storage)")
               for b in bad)
    assert any("actlake.jobs.lm.loop:1 (job actlake.jobs.lm) imports actlake.jobs.predictor.model" in b for b in bad)
    assert any("actlake.jobs.predictor.model:2 (layer jobs) imports actlake (layer top)" in b for b in bad)
    assert len(bad) == 3, bad


def test_checker_flags_a_module_outside_every_layer():
    assert violations({"actlake.newthing": ("", False)}) == [
        "actlake.newthing belongs to no layer: add it to LAYERS in tests/unit/test_layers.py"]
