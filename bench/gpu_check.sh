#!/usr/bin/env bash
# GPU readiness check on one H100/H200-class GPU, in two phases of a few minutes each:
#   kernels: the Triton kernels' unit tests compiled for the GPU (tests/test_kernels.py with
#            KVPILOT_TRITON_TEST_DEVICE=cuda), then bench/kernels_gpu.py --quick: every kernel against
#            the torch reference at real sizes, decode attention against the HBM roofline (--peak-tbps);
#   engine:  bench/gpu_engine.py: greedy tokens against the CPU's, prompt logprobs against HF transformers
#            on the same GPU, CUDA graphs off/on, throughput next to HF static batches.
# Each step has its own timeout and the script goes on after a failure; the summary lists them.
# Usage: bash bench/gpu_check.sh [kernels|engine|all] [--model M] [--peak-tbps 4.8]
#   (PYTHON=... chooses the interpreter, GPU_ENGINE_PARTS/GPU_ENGINE_ARGS: gpu_engine.py's parts and options; outputs land in bench/results/ and, when set, in $OUT)
set -u
cd "$(dirname "$0")/.."
PHASE="${1:-all}"
shift || true
MODEL="builtin://smollm2-135m"
PEAK=4.8
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --peak-tbps) PEAK="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi

# kvpilot is a namespace package laid out over several folders (pyproject's package-dir): without an
# install, map it the same way.
if ! "$PY" -c "import kvpilot.kernels, kvpilot.daemon.engine" 2>/dev/null; then
  SHIM="$(mktemp -d)/kvpilot"
  mkdir -p "$SHIM"
  cp src/kvpilot/*.py "$SHIM/"
  ln -s "$PWD/daemon" "$SHIM/daemon"
  ln -s "$PWD/kvkernels" "$SHIM/kernels"
  ln -s "$PWD/router" "$SHIM/router"
  export PYTHONPATH="$(dirname "$SHIM")${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1

LOG_DIR="${OUT:-bench/results}"
mkdir -p "$LOG_DIR"
declare -a SUMMARY
step() {  # step NAME TIMEOUT_S CMD...
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$LOG_DIR/gpu_check-$name.log" | tail -40
  local rc=${PIPESTATUS[0]}
  SUMMARY+=("$name: rc=$rc in $((SECONDS - t0))s")
}

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader || true
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"

if [ "$PHASE" = kernels ] || [ "$PHASE" = all ]; then
  step triton-tests 200 env KVPILOT_TRITON_TEST_DEVICE=cuda TRITON_INTERPRET=0 \
    "$PY" -m pytest -q -p no:cacheprovider -k test_triton_ tests/test_kernels.py
  step kernels-gpu 150 "$PY" bench/kernels_gpu.py --quick --peak-tbps "$PEAK" --out "$LOG_DIR/kernels_gpu.json"
fi
if [ "$PHASE" = engine ] || [ "$PHASE" = all ]; then
  step engine 420 "$PY" bench/gpu_engine.py --model "$MODEL" --out "$LOG_DIR" \
    --parts "${GPU_ENGINE_PARTS:-parity,logprobs,graphs,throughput}" ${GPU_ENGINE_ARGS:-}
fi
echo "=== summary"
printf '%s\n' "${SUMMARY[@]}"
