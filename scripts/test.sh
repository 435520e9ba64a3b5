#!/usr/bin/env bash
# Fresh machine -> test results: install with test extras, install Chromium (for the report
# check) when it is missing, we may, and the tests asked for need it, then run the suite (or the tests named).
set -euo pipefail
cd "$(dirname "$0")/.."
browser=1  # only the integration tests draw the report in a browser: a run of tests/unit alone needs none
paths=0  # test paths named (options alone run the whole suite)
for arg in "$@"; do case "$arg" in -*) ;; *) paths=1 ;; esac; done
if [ "$paths" = 1 ]; then
  browser=0
  for arg in "$@"; do case "$arg" in tests/unit|tests/unit/*|-*) ;; *) browser=1 ;; esac; done
fi
if [ -n "${ACTLAKE_TEST_PLAN:-}" ]; then echo "browser=$browser"; exit 0; fi  # what it would do (its test)
bash scripts/setup.sh test,hf
if [ "$browser" = 1 ] && ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing chromium for the report test" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
export PATH="$PWD/.venv/bin:$PATH"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_DISABLE_USAGE_STATS=1
# two test processes (ACTLAKE_TEST_PROCESSES), each file kept in one of them: module fixtures (the quick
# start's run, a Ray head) are made once; each process has its own embedded Ray
exec .venv/bin/python -m pytest -q --durations=15 -n "${ACTLAKE_TEST_PROCESSES:-2}" --dist loadfile "$@"
