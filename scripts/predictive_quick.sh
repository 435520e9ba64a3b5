#!/usr/bin/env bash
# Seed 003 on this machine, from a fresh clone: train a small Pythia-architecture LM on the sample corpus,
# extract surprisal and an activation store, train predictors for three layers, fit probes, render the report.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_DISABLE_USAGE_STATS=1
actlake corpus sample data/sample  # the shipped sample; refused when data/sample is something else
actlake train-lm configs/lm_quick.yaml
actlake run configs/predictive_extract_quick.yaml
actlake train-predictor configs/predictor_quick.yaml
