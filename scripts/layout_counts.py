"""Count the package's layout (issue 49's closing note): files and lines of each part of jobs/, docstring against code
lines of the installed package (actlake/, analysis/, jobs/, storage/), and the files that name a statistic.

    python scripts/layout_counts.py [--rev REV] [STATISTIC]    # default: the working tree, attention_peak

A line is blank, a comment, a docstring's (any string statement: module, class, function and attribute docstrings)
or code. ``--rev`` reads a commit's files (``HEAD``: what is committed, whatever the working tree holds).
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOBS = ["jobs/cli.py", "jobs/extract", "jobs/train", "jobs/export", "jobs/common"]
PACKAGE = ["actlake", "analysis", "jobs", "storage"]  # actlake, actlake.analysis, actlake.jobs, actlake.storage


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def sources(part: str, rev: str | None) -> dict[str, str]:
    """path -> text of the Python files of one part (a file or a folder)."""
    if rev:
        names = [n for n in _git("ls-tree", "-r", "--name-only", rev, "--", part).split() if n.endswith(".py")]
        return {n: _git("show", f"{rev}:{n}") for n in names}
    p = ROOT / part
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*.py") if "__pycache__" not in f.parts)
    return {str(f.relative_to(ROOT)): f.read_text() for f in files}


def kinds(text: str) -> dict[str, int]:
    """{'blank', 'comment', 'docstring', 'code'} -> lines of one file."""
    doc = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            doc.update(range(node.lineno, node.end_lineno + 1))
    out = dict.fromkeys(("blank", "comment", "docstring", "code"), 0)
    for i, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        out["docstring" if i in doc else "blank" if not s else "comment" if s.startswith("#") else "code"] += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("statistic", nargs="?", default="attention_peak")
    ap.add_argument("--rev", help="a commit to read instead of the working tree")
    a = ap.parse_args()
    print(f"{'part':<16}{'files':>6}{'lines':>8}{'code':>7}{'docstr':>8}{'comment':>8}{'blank':>7}")
    for part in JOBS + ["jobs (all)"] + PACKAGE + ["package (all)"]:
        parts = PACKAGE if part == "package (all)" else ["jobs"] if part == "jobs (all)" else [part]
        texts = [t for p in parts for t in sources(p, a.rev).values()]
        t = {"lines": 0, "code": 0, "docstring": 0, "comment": 0, "blank": 0}
        for text in texts:
            for k, n in kinds(text).items():
                t[k] += n
                t["lines"] += n
        print(f"{part:<16}{len(texts):>6}{t['lines']:>8}{t['code']:>7}{t['docstring']:>8}{t['comment']:>8}{t['blank']:>7}")
    hits = _git("grep", "-l", "-w", a.statistic, *([a.rev] if a.rev else []), "--", ".").split()
    print(f"\nfiles that name {a.statistic}" + (f" at {a.rev}" if a.rev else "") + ":")
    for name in hits:
        print("  " + name.split(":", 1)[-1])


if __name__ == "__main__":
    main()
