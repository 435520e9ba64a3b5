"""Count the package's layout (issue 49's closing note): files and lines of each part of jobs/, docstring against code
lines of the installed package (actlake/, analysis/, jobs/, storage/), and the files that name a statistic.

    python scripts/layout_counts.py [STATISTIC]    # default attention_peak

A line is blank, a comment, a docstring's (any string statement: module, class, function and attribute docstrings)
or code. Read from the working tree, so run it at a clean checkout for a committed state's numbers.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOBS = ["jobs/cli.py", "jobs/extract", "jobs/train", "jobs/export", "jobs/common"]
PACKAGE = ["actlake", "analysis", "jobs", "storage"]  # actlake.analysis, actlake.jobs, actlake.storage (pyproject)


def _files(part: str) -> list[Path]:
    p = ROOT / part
    return [p] if p.is_file() else sorted(f for f in p.rglob("*.py") if "__pycache__" not in f.parts)


def kinds(path: Path) -> dict[str, int]:
    """{'blank', 'comment', 'docstring', 'code'} -> lines of one file."""
    text = path.read_text()
    lines = text.splitlines()
    doc = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            doc.update(range(node.lineno, node.end_lineno + 1))
    out = dict.fromkeys(("blank", "comment", "docstring", "code"), 0)
    for i, line in enumerate(lines, 1):
        s = line.strip()
        kind = "docstring" if i in doc else "blank" if not s else "comment" if s.startswith("#") else "code"
        out[kind] += 1
    return out


def total(files: list[Path]) -> dict[str, int]:
    out = {"files": len(files), "lines": 0}
    for f in files:
        for k, n in kinds(f).items():
            out[k] = out.get(k, 0) + n
            out["lines"] += n
    return out


def main() -> None:
    stat = sys.argv[1] if len(sys.argv) > 1 else "attention_peak"
    print(f"{'part':<16}{'files':>6}{'lines':>8}{'code':>7}{'docstr':>8}{'comment':>8}{'blank':>7}")
    for part in JOBS + ["jobs (all)"] + PACKAGE + ["package (all)"]:
        files = (_files("jobs") if part == "jobs (all)" else
                 [f for p in PACKAGE for f in _files(p)] if part == "package (all)" else _files(part))
        t = total(files)
        print(f"{part:<16}{t['files']:>6}{t['lines']:>8}{t['code']:>7}{t['docstring']:>8}{t['comment']:>8}{t['blank']:>7}")
    names = subprocess.run(["git", "grep", "-l", "-w", stat, "--", "."], cwd=ROOT, capture_output=True, text=True).stdout
    print(f"\nfiles (tracked) that name {stat}:")
    for name in names.split():
        print("  " + name)


if __name__ == "__main__":
    main()
