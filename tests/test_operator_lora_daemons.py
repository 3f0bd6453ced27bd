"""The operator's calls to the daemons' LoRA routes (operator/lora_daemons.py), against FakeDaemon and a
port where nothing listens."""

from __future__ import annotations

import aiohttp
import pytest

from kvpilot.operator import lora_daemons
from kvpilot.operator.lora_daemons import DaemonError
from operator_support.daemons import FakeDaemon
from operator_support.harness import free_port

pytestmark = pytest.mark.timeout(30)


def test_error_message_reads_the_openai_error_body():
    body = '{"error": {"message": "rank 64 is above 16", "type": "invalid_request_error", "param": null, "code": null}}'
    assert lora_daemons.error_message(400, body) == "rank 64 is above 16"
    assert lora_daemons.error_message(502, "Bad Gateway\n") == "HTTP 502: Bad Gateway"
    assert lora_daemons.error_message(500, "") == "HTTP 500"


async def test_load_list_unload():
    async with FakeDaemon("127.0.0.71") as d, aiohttp.ClientSession() as http:
        url = f"http://{d.host}:{d.port}"
        assert await lora_daemons.served_adapters(http, url, 2) == frozenset()  # the base has no parent
        await lora_daemons.load(http, url, "sql", "/adapters/pvc/a/sql", 2)
        assert await lora_daemons.served_adapters(http, url, 2) == {"sql"}
        with pytest.raises(DaemonError) as e:
            await lora_daemons.load(http, url, "sql", "/adapters/pvc/a/sql", 2)
        assert (e.value.reason, e.value.status) == ("DaemonRefused", 400) and "already been loaded" in str(e.value)
        await lora_daemons.unload(http, url, "sql", 2)
        await lora_daemons.unload(http, url, "sql", 2)  # a 404: not loaded, which is what unload wants
        assert d.loaded == {}
        d.models_fail = True
        with pytest.raises(DaemonError) as e:
            await lora_daemons.served_adapters(http, url, 2)
        assert e.value.reason == "DaemonError"


async def test_a_pod_that_does_not_answer():
    async with aiohttp.ClientSession() as http:
        with pytest.raises(DaemonError) as e:
            await lora_daemons.load(http, f"http://127.0.0.1:{free_port()}", "sql", "hf://org/sql", 2)
        assert e.value.reason == "DaemonUnreachable" and e.value.status == 0
