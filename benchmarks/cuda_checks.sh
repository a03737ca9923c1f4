#!/usr/bin/env bash
# The CUDA path on a machine with a GPU, in one go: the CUDA tests, the six-encoder step
# benchmark (dense, CoMERA eager and compiled), compiled against eager
# on four models (CUDA Graphs on) and the pretraining race at the 60M shape (dense and the
# default, eager and compiled, bf16; benchmarks/results/frontier_cuda.md). Logs go to $LOGS
# (default: a temporary folder); the compiled-vs-eager table is written to
# benchmarks/results/compiled_cuda.md as usual.
#
#     bash benchmarks/cuda_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
LOGS="${LOGS:-$(mktemp -d)}"
mkdir -p "$LOGS"
nvidia-smi -L
"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
echo "== CUDA tests"
timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_compile_cuda.py 2>&1 \
    | tee "$LOGS/cuda_tests.log" | tail -25
echo "== step benchmark"
timeout 200 "$PY" benchmarks/step.py --batches 32 --threads 8 --timeout 120 \
    --rows dense-eager,comera-eager,comera-compiled 2>&1 \
    | tee "$LOGS/step.log" | tail -25
echo "== compiled against eager"
timeout 240 "$PY" benchmarks/compiled.py --device cuda --threads 8 --steps 10 \
    --models llama,gpt2,sdpa-encoder,encoder --results-name compiled_cuda 2>&1 \
    | tee "$LOGS/compiled.log" | tail -25
cp benchmarks/results/compiled_cuda.md "$LOGS/" 2>/dev/null || true
echo "== pretraining race at the 60M shape (bf16)"
timeout 480 "$PY" benchmarks/frontier.py --gpu 2>&1 | tee "$LOGS/frontier.log" | tail -25
cp benchmarks/results/frontier_cuda.md "$LOGS/" 2>/dev/null || true
