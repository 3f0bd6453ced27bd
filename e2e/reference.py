"""Greedy outputs of the offline `LLM` for every job of the workload, as JSON (to the file named by the
first argument, else stdout).

Run as a script in its own process (`python e2e/reference.py`), so the test process never loads torch and
its event loop (which serves the API emulator) is never blocked by the model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Runs by path; its own folder is importable, the repo root is not needed.
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    import workload as w

    from kvpilot.daemon.engine import LLM, SamplingParams

    llm = LLM(model=w.MODEL_URI, dtype=w.DTYPE, block_size=w.BLOCK_SIZE, max_model_len=w.MAX_MODEL_LEN,
              max_num_seqs=len(w.all_jobs()), num_threads=1, num_kv_blocks=len(w.all_jobs()) * 6)  # room for all at once: no preemption
    jobs = w.all_jobs()
    outs = llm.generate([j.prompt for j in jobs],
                        [SamplingParams(temperature=0.0, max_tokens=j.max_tokens) for j in jobs], use_tqdm=False)
    result = {j.key: {"text": o.outputs[0].text, "finish_reason": o.outputs[0].finish_reason,
                      "prompt_tokens": len(o.prompt_token_ids), "tokens": len(o.outputs[0].token_ids)}
              for j, o in zip(jobs, outs, strict=True)}
    if len(sys.argv) > 1:
        tmp = Path(sys.argv[1] + ".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(sys.argv[1])  # whole or absent, never half written
    else:
        json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
