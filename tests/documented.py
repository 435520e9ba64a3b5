"""The command blocks of the README and the docs: every ```bash / ```python block a reader is told to run
carries ``<!-- command: ID -->`` on the line before it (a test runs it as printed, by that ID) or a
visible line starting ``*Not run by the tests`` saying why."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(bash|python)\n(.*?)^```$", re.S | re.M)
MARK = re.compile(r"<!-- command: ([a-z0-9-]+) -->")


def blocks() -> list[tuple[Path, int, str, str, str | None]]:
    """(page, line, language, text, ID or None) of every bash and python block; ID None: marked not run."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            before = [ln for ln in text[:m.start()].splitlines() if ln.strip()][-1:] or [""]
            mark = MARK.fullmatch(before[0].strip())
            if mark is None and not before[0].startswith("*Not run by the tests"):
                raise AssertionError(f"{page.relative_to(ROOT)}:{line}: a {m.group(1)} block without "
                                     "<!-- command: ID --> or a '*Not run by the tests: why*' line before it")
            out.append((page, line, m.group(1), m.group(2), mark.group(1) if mark else None))
    return out


def command(ident: str) -> str:
    """The text of block ``ident`` (the same wherever it is shown)."""
    texts = {text for _, _, _, text, i in blocks() if i == ident}
    assert len(texts) == 1, f"command {ident!r}: {len(texts)} different blocks"
    return texts.pop()


BIN = Path(sys.executable).parent
"""The virtual environment's bin folder (of the Python running the tests)."""


def new_shell_env() -> dict:
    """A new terminal's environment: the venv's folder off the PATH, no venv active."""
    path = ":".join(p for p in os.environ.get("PATH", "/usr/bin:/bin").split(":") if Path(p) != BIN)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    return env | {"PATH": path or "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                  "RAY_DISABLE_USAGE_STATS": "1"}


def new_shell(script: str, timeout: int = 900, **kwargs) -> subprocess.CompletedProcess:
    """``script`` in bash (``set -euo pipefail``) in a new terminal's environment, from the repository's folder
    unless ``cwd`` says otherwise; asserts it exits 0, showing the ends of its output if not."""
    done = subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], cwd=kwargs.pop("cwd", ROOT),
                          env=new_shell_env(), capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode == 0, f"{script}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
    return done
