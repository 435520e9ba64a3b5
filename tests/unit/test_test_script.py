"""scripts/test.sh installs a browser only for the tests that draw the report in one (issue 53: the unit tier
installed Debian's chromium through apt)."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("args, browser", [
    ([], 1),  # the whole suite
    (["tests/unit"], 0),
    (["tests/unit/test_rope.py", "-x", "-q"], 0),
    (["tests/unit", "tests/integration/test_report.py"], 1),
    (["tests/integration"], 1),
    (["-x", "-q"], 1),  # options alone: the whole suite
])
def test_a_browser_only_for_tests_that_need_one(args, browser):
    out = subprocess.run(["bash", "scripts/test.sh", *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "ACTLAKE_TEST_PLAN": "1"})
    assert out.returncode == 0 and out.stdout.strip() == f"browser={browser}", out.stdout + out.stderr
