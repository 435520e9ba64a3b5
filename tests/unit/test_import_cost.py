"""The commands a user runs most and waits on least load no torch, transformers or Ray: ``actlake --help``, each
command's ``--help``, and ``actlake sql`` itself (a query over a run: tests/integration/test_sql_security.py). The
package imports them inside the functions that need them; this test holds that, in place of a comment at each."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "transformers", "ray")


def test_help_and_sql_load_no_torch_transformers_or_ray():
    code = ("import contextlib, io, sys\n"
            "from actlake.jobs.cli import main\n"
            "for argv in (['--help'], ['sql', '--help'], ['run', '--help'], ['report', '--help'], ['train-lm', '--help']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "        main(argv)\n"
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
