"""MkDocs hook: stage the package as it is installed (``jobs/`` as ``actlake/jobs`` …) under
``build/docs-src``, where mkdocstrings reads the API reference's docstrings (the repository keeps the
subpackages in top-level folders, which a source reader cannot map). Runs when MkDocs loads it, before
the handlers look for the package."""

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"actlake": "actlake", "jobs": "actlake/jobs", "analysis": "actlake/analysis", "storage": "actlake/storage"}
DEST = ROOT / "build" / "docs-src"

shutil.rmtree(DEST, ignore_errors=True)
for folder, place in FOLDERS.items():
    shutil.copytree(ROOT / folder, DEST / place, ignore=shutil.ignore_patterns("__pycache__"))
