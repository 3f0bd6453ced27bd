"""The official openai client against `make serve` (or a cluster's Service through port-forward).

    make serve                                  # in one terminal
    .venv/bin/python examples/openai_client.py  # in another; KVPILOT_URL overrides the address
"""
# expect: Paris

import os

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("KVPILOT_URL", "http://127.0.0.1:8000/v1"), api_key="none")
completion = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=16,
                                       temperature=0)
print(completion.choices[0].text)
stream = client.chat.completions.create(model="smollm2", stream=True, max_tokens=32,
                                        messages=[{"role": "user", "content": "Say hello."}])
print("".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))
