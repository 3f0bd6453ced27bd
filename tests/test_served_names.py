"""Served model names (served_names.py): the short default name, its aliases, --served-model-name, and 404s."""

from __future__ import annotations

import openai
import pytest

from kvpilot.daemon.served_names import served_names
from support.daemon_process import DaemonProcess


def test_builtin_model_is_served_under_its_short_name_with_aliases():
    names = served_names("builtin://smollm2-135m")
    assert names.primary == "smollm2-135m" and names.listed == ("smollm2-135m",)
    assert names.accepted == ("smollm2-135m", "builtin://smollm2-135m", "smollm2")
    assert names.accepts("smollm2") and not names.accepts("gpt-4")


def test_served_model_name_overrides_the_default():
    names = served_names("builtin://smollm2-135m", ["mine", "other", "mine"])
    assert names.listed == ("mine", "other") and names.accepted == ("mine", "other")
    assert not names.accepts("smollm2")


def test_other_models_are_served_under_their_uri():
    names = served_names("hf://org/model")
    assert names.listed == ("hf://org/model",) and names.aliases == ()
    assert served_names("builtin://other").accepted == ("other", "builtin://other")


@pytest.fixture(scope="module")
def daemon():
    d = DaemonProcess("--max-num-seqs", "4", "--kv-cache-memory", "64MiB", "--disable-log-requests",
                      env={"KVPILOT_NUM_THREADS": "1"})
    with d:
        yield d


@pytest.mark.slow
def test_default_daemon_serves_smollm2_135m_and_accepts_the_aliases(daemon):
    client = openai.OpenAI(base_url=daemon.url("/v1"), api_key="none", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["smollm2-135m"]
    for name in ("smollm2-135m", "smollm2", "builtin://smollm2-135m"):
        r = client.completions.create(model=name, prompt="The capital of France is", max_tokens=2)
        assert r.model == "smollm2-135m" and r.usage.completion_tokens >= 1, name
    chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2)
    assert chat.model == "smollm2-135m"
    with pytest.raises(openai.NotFoundError) as ei:
        client.completions.create(model="smollm3", prompt="hi", max_tokens=1)
    err = ei.value.body
    assert err["code"] == "model_not_found" and err["param"] == "model"
    for name in ("smollm2-135m", "smollm2", "builtin://smollm2-135m"):
        assert name in err["message"], err["message"]
    status, _ = daemon.get("/v1/models/smollm2")
    assert status == 200
