#!/usr/bin/env bash
# Fresh machine -> results: install, build the sample corpus, run the default job on an embedded
# local Ray with all-MiniLM-L6-v2, print where the tables and the report are and one SQL answer.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/actlake quickstart "$@"
