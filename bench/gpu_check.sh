#!/usr/bin/env bash
# GPU readiness check, about 8 minutes on one H100/H200-class GPU:
#   1. Triton kernels' correctness tests (tests/test_kernels.py, interpreter tests included) and
#      the CUDA-graph bucket tests;
#   2. bench/kernels_gpu.py --quick: every Triton kernel against the torch reference at real sizes,
#      then decode attention bandwidth against the HBM roofline (--peak-tbps);
#   3. CUDA graphs on the engine: greedy outputs with graphs on == off, and the decode speedup;
#   4. the engine benchmark (bench/throughput.py --quick --skip-hf).
# Each step has its own timeout and the script goes on after a failure; the summary lists them.
# Usage: bash bench/gpu_check.sh [--peak-tbps 4.8]   (PYTHON=... to choose the interpreter)
# Outputs land in bench/results/ and, when set, in $OUT.
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
PEAK=4.8
if [ "${1:-}" = "--peak-tbps" ]; then PEAK="$2"; fi

# kvpilot is a namespace package laid out over several folders: without an install, map it.
if ! "$PY" -c "import kvpilot.kernels, kvpilot.daemon.engine" 2>/dev/null; then
  SHIM="$(mktemp -d)/kvpilot"
  mkdir -p "$SHIM"
  cp src/kvpilot/*.py "$SHIM/"
  for d in daemon kernels router; do ln -s "$PWD/$d" "$SHIM/$d"; done
  export PYTHONPATH="$(dirname "$SHIM")${PYTHONPATH:+:$PYTHONPATH}"
fi

LOG_DIR="${OUT:-bench/results}"
mkdir -p "$LOG_DIR"
declare -a SUMMARY
step() {  # step NAME TIMEOUT_S CMD...
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$LOG_DIR/gpu_check-$name.log" | tail -25
  local rc=${PIPESTATUS[0]}
  SUMMARY+=("$name: rc=$rc in $((SECONDS - t0))s")
}

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"

step kernel-tests 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_cuda_graphs.py
step kernels-gpu 150 "$PY" bench/kernels_gpu.py --quick --peak-tbps "$PEAK"
step cuda-graphs 120 "$PY" - <<'EOF'
# graphs on vs off: same greedy tokens; decode time per step for 64 running requests
import os, time
import torch
from kvpilot.daemon.engine import LLM, SamplingParams
work = [[(97 * i + 13 * j) % 40000 + 100 for j in range(16 + 5 * i)] for i in range(64)]
params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
res = {}
for flag in ("0", "1"):
    os.environ["KVPILOT_CUDA_GRAPHS"] = flag
    llm = LLM(model="builtin://smollm2-135m", dtype="float32", max_num_seqs=64)
    llm.generate([{"prompt_token_ids": work[0]}], params, use_tqdm=False)
    torch.cuda.synchronize(); t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": p} for p in work], params, use_tqdm=False)
    torch.cuda.synchronize()
    res[flag] = (time.perf_counter() - t0, [o.outputs[0].token_ids for o in out])
    print(f"graphs={flag}: {res[flag][0]:.2f}s, captured={llm.engine.runner._graphs is not None}", flush=True)  # noqa: SLF001
    del llm
same = sum(a == b for a, b in zip(res["0"][1], res["1"][1]))
print(f"identical greedy outputs: {same}/{len(work)}; speedup {res['0'][0] / res['1'][0]:.2f}x")
assert same == len(work), "CUDA graph outputs differ from eager"
EOF
step engine-bench 240 "$PY" bench/throughput.py --quick --skip-hf
[ -n "${OUT:-}" ] && cp bench/results/*.json "$OUT/" 2>/dev/null
echo "=== summary"
printf '%s\n' "${SUMMARY[@]}"
