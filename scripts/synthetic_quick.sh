#!/usr/bin/env bash
# Seed 004 on this machine, from a fresh clone: train a small transformer on three Mess3 factors with
# Ray Train, analyse its checkpoints (dimension, belief R², subspace overlaps) and render the report.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 RAY_DISABLE_USAGE_STATS=1
actlake train-synthetic configs/synthetic_quick.yaml
