"""The offline API: generate and chat with the built-in SmolLM2-135M, no server involved.

    .venv/bin/python examples/offline.py
"""
# expect: Paris

from kvpilot.daemon.engine import LLM, SamplingParams

llm = LLM(model="builtin://smollm2-135m")
greedy = SamplingParams(temperature=0, max_tokens=16)
print(llm.generate(["The capital of France is"], greedy, use_tqdm=False)[0].outputs[0].text)
reply = llm.chat([{"role": "user", "content": "Name a colour."}], SamplingParams(max_tokens=16), use_tqdm=False)
print(reply[0].outputs[0].text)
