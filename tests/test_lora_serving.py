"""Multi-LoRA serving in the daemon: the flags, the adapter registry (names, path confinement, all or
nothing), the load/unload routes, `model` selecting an adapter, /v1/models and vllm:lora_requests_info.

The fast tests run the registry on the engine thread of an AsyncEngine with a stand-in engine. The rest
start real daemons on loopback with SmolLM2 and PEFT adapters made here with random weights, and talk to
them through the official openai client.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.common.model_source import resolve_model_path
from kvpilot.daemon import lora_source
from kvpilot.daemon.args import parse_serve_args
from kvpilot.daemon.async_engine import AsyncEngine
from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.llm_engine import EngineStats
from kvpilot.daemon.engine.lora import LoRAAdapterError, LoRANotFound
from kvpilot.daemon.errors import LoRAAlreadyLoaded, LoRANameInvalid, LoRAPathNotAllowed
from kvpilot.daemon.lora_modules import LoRAModulePath
from kvpilot.daemon.lora_registry import LoRARegistry, check_adapter_name
from kvpilot.daemon.lora_source import real_roots, resolve_adapter_source
from kvpilot.daemon.metrics import DaemonMetrics
from kvpilot.daemon.served_names import ServedNames
from kvpilot.daemon.server import build_app, start_engine
from support.daemon_process import DaemonProcess
from support.lora_adapters import write_adapter
from support.lora_daemon import FakeLoRAEngine, Skeleton, write_raw_adapter

KEY = "lora-key"
NAME = "smollm2"
PROMPT = "The capital of France is"
ONE_THREAD = {"KVPILOT_NUM_THREADS": "1"}
BASE = ServedNames(("smollm2",), ("builtin://smollm2-135m",))


# ---- flags -------------------------------------------------------------------------------------------------


def test_lora_flags_in_vllm_forms():
    args = parse_serve_args(["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "3",
                             "--lora-modules", "sql=/a/sql", '{"name": "chat", "path": "hf://org/chat", '
                             '"base_model_name": "smol"}', "--lora-root", "/a", "--lora-root", "/b c"], environ={})
    engine = args.engine
    assert (engine.enable_lora, engine.max_loras, engine.max_lora_rank, engine.max_cpu_loras) == (True, 2, 8, 3)
    assert args.lora_modules == [LoRAModulePath("sql", "/a/sql"), LoRAModulePath("chat", "hf://org/chat", "smol")]
    assert args.lora_root == ["/a", "/b c"] and not args.allow_runtime_lora_updating
    env = {"KVPILOT_ENABLE_LORA": "1", "KVPILOT_LORA_MODULES": '["x=/x", {"name": "y", "path": "/y z"}]',
           "KVPILOT_LORA_ROOT": f"/a{os.pathsep}/b c", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    args = parse_serve_args([], environ=env)
    assert args.lora_modules == [LoRAModulePath("x", "/x"), LoRAModulePath("y", "/y z")]
    assert args.lora_root == ["/a", "/b c"] and args.allow_runtime_lora_updating  # vLLM's variable counts
    assert not parse_serve_args(["--no-allow-runtime-lora-updating"], environ=env).allow_runtime_lora_updating
    assert parse_serve_args([], environ={"KVPILOT_ENABLE_LORA": "1", "KVPILOT_LORA_MODULES": "p=/p q=/q"}
                            ).lora_modules == [LoRAModulePath("p", "/p"), LoRAModulePath("q", "/q")]


@pytest.mark.parametrize(("argv", "environ", "said"), [
    (["--lora-modules", "sql=/a/sql"], {}, "--lora-modules: LoRA serving needs --enable-lora"),
    (["--allow-runtime-lora-updating"], {}, "--allow-runtime-lora-updating: LoRA serving needs --enable-lora"),
    ([], {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}, "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true: LoRA serving"),
    (["--enable-lora", "--lora-modules", "{not json"], {}, "neither name=path nor a JSON object"),
    (["--enable-lora", "--lora-modules", '{"name": "a", "path": "/p", "rank": 4}'], {}, "unknown field(s) ['rank']"),
])
def test_bad_lora_flags_stop_the_start(argv, environ, said, capsys):
    with pytest.raises(SystemExit):
        parse_serve_args(argv, environ=environ)
    assert said in capsys.readouterr().err


# ---- names and paths ---------------------------------------------------------------------------------------


def test_adapter_names():
    for good in ("sql", "org/sql-lora", "ft:smol:acme::v2", "a.b_c@3"):
        assert check_adapter_name(good, BASE) == good
    for bad in ("", "x" * 257, "../etc", "a/../b", "/abs", "a//b", "a/", ".", "a\x00b", "a b", "a,b", "smollm2",
                "builtin://smollm2-135m", 7):
        with pytest.raises(LoRANameInvalid):
            check_adapter_name(bad, BASE)


def test_local_paths_stay_inside_the_roots(tmp_path: Path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a").mkdir(parents=True)
    (outside / "b").mkdir(parents=True)
    (root / "link").symlink_to(outside / "b")
    (tmp_path / "root-sibling").mkdir()
    roots = real_roots([str(root)])
    assert resolve_adapter_source(str(root / "a"), roots) == str((root / "a").resolve())
    assert resolve_adapter_source(f"file://{root}/a", roots) == str((root / "a").resolve())
    for escape in (str(outside / "b"), str(root / "link"), f"{root}/../outside/b", f"file://{outside}/b",
                   str(tmp_path / "root-sibling"), f"{outside}/never-made"):
        with pytest.raises(LoRAPathNotAllowed, match="outside the allowed adapter roots"):
            resolve_adapter_source(escape, roots)
    with pytest.raises(LoRAPathNotAllowed, match="start the server with --lora-root"):
        resolve_adapter_source(str(root / "a"), ())
    for malformed in ("", "a\x00b", "s3://bucket/a", "file://host/a", "hf://just-a-name", "hf://o/../x"):
        with pytest.raises(LoRAPathNotAllowed):
            resolve_adapter_source(malformed, roots)
    with pytest.raises(LoRAAdapterError, match="no adapter folder"):
        resolve_adapter_source(str(root / "missing"), roots)
    assert resolve_adapter_source(str(outside / "b"), None) == str((outside / "b").resolve())  # --lora-modules


def test_hf_adapters_download_into_kvpilots_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import huggingface_hub

    calls = []

    def snapshot_download(repo_id, **kw):
        calls.append((repo_id, kw))
        return str(tmp_path / "snapshot")

    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert resolve_adapter_source("hf://org/sql-lora@v1", ()) == str(tmp_path / "snapshot")  # needs no root
    (repo, kw), = calls
    assert repo == "org/sql-lora" and kw["revision"] == "v1"
    assert kw["cache_dir"] == str(tmp_path / "cache" / "lora-adapters") == str(lora_source.adapter_cache_dir())
    assert "adapter_model.safetensors" in kw["allow_patterns"] and "*.safetensors" not in kw["allow_patterns"]

    def offline(repo_id, **kw):
        raise OSError("not in the local cache")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(LoRAAdapterError, match="cannot get 'org/sql-lora' from the Hugging Face Hub"):
        resolve_adapter_source("hf://org/sql-lora", ())


# ---- the registry on the engine thread (a stand-in engine) ---------------------------------------------------


async def test_registry_loads_on_the_engine_thread_all_or_nothing(tmp_path: Path):
    for name in ("a", "b", "bad"):
        (tmp_path / name).mkdir()
    fake: list[FakeLoRAEngine] = []

    def factory(config):
        fake.append(FakeLoRAEngine(config, load_seconds=0.3))
        return fake[0]

    engine = AsyncEngine(EngineConfig(enable_lora=True), engine_factory=factory)
    await engine.start()
    try:
        reg = LoRARegistry(engine, BASE, [str(tmp_path)])
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        a = await reg.load("a", str(tmp_path / "a"))
        ticker.cancel()
        assert ticks >= 10, "a 0.3 s load must not hold up the event loop"
        assert fake[0].call_threads == ["kvpilot-engine"] and reg.get("a") == a.request
        # a name is held while its load runs: the second load of it is refused, not run twice
        first = asyncio.create_task(reg.load("b", str(tmp_path / "b")))
        await asyncio.sleep(0)
        with pytest.raises(LoRAAlreadyLoaded, match="'b' has already been loaded"):
            await reg.load("b", str(tmp_path / "b"))
        b = await first
        with pytest.raises(LoRAAdapterError, match="bad weights"):
            await reg.load("c", str(tmp_path / "bad"))
        assert [x.name for x in reg.adapters] == ["a", "b"] and reg.get("c") is None
        c = await reg.load("c", str(tmp_path / "a"))  # the failed name is free again; its id is not reused
        assert (a.request.lora_int_id, b.request.lora_int_id, c.request.lora_int_id) == (1, 2, 4)
        assert await reg.unload(lora_int_id=2) == b and 2 not in fake[0].loras
        with pytest.raises(LoRANotFound, match="'b' cannot be found"):
            await reg.unload("b")
        with pytest.raises(LoRANotFound, match="has id 1, not 4"):
            await reg.unload("a", 4)
        assert [x.name for x in reg.adapters] == ["a", "c"] and sorted(fake[0].loras) == [1, 4]
    finally:
        await engine.shutdown()


def test_lora_metric_carries_the_engines_adapters():
    m = DaemonMetrics("smol")
    stats = EngineStats(kv_cache_usage=0.0, kv_cache_token_usage=0.0, num_running=2, num_waiting=1,
                        num_preempted_total=0, prefix_cache_queries_total=0, prefix_cache_hits_total=0,
                        prompt_tokens_total=0, generation_tokens_total=0, num_total_blocks=8, num_free_blocks=8,
                        kv_cache_waste=0.0, max_loras=2, lora_running=("sql", "chat"), lora_waiting=("docs",))
    m.stats_fn = lambda: stats
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    (sample,) = fams["vllm:lora_requests_info"].samples
    assert sample.labels == {"max_lora": "2", "running_lora_adapters": "sql,chat", "waiting_lora_adapters": "docs"}
    assert abs(sample.value - time.time()) < 60


async def test_ready_waits_for_the_startup_adapters(tmp_path: Path):
    (tmp_path / "a").mkdir()
    (tmp_path / "bad").mkdir()
    args = parse_serve_args(["--enable-lora", "--lora-modules", f"a={tmp_path / 'a'}"], environ={})
    engine = AsyncEngine(args.engine_config(), engine_factory=lambda c: FakeLoRAEngine(c, load_seconds=0.5))
    app = build_app(args, engine)
    try:
        async with TestClient(TestServer(app)) as client:
            starting = asyncio.create_task(start_engine(app))
            while not engine.ready:
                await asyncio.sleep(0.01)
            r = await client.get("/ready")  # the model is in, its adapter not yet
            assert r.status == 503 and (await r.json())["status"] == "loading_adapters"
            await starting
            assert (await client.get("/ready")).status == 200
            models = (await (await client.get("/v1/models")).json())["data"]
            assert [(m["id"], m["parent"]) for m in models] == [("smollm2-135m", None), ("a", "smollm2-135m")]
    finally:
        await engine.shutdown()
    args = parse_serve_args(["--enable-lora", "--lora-modules", f"b={tmp_path / 'bad'}"], environ={})
    engine = AsyncEngine(args.engine_config(), engine_factory=FakeLoRAEngine)
    try:
        with pytest.raises(RuntimeError, match=r"--lora-modules b=.*/bad: .*bad weights"):
            await start_engine(build_app(args, engine))
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("runtime", [False, True])
async def test_update_routes_exist_only_when_allowed(runtime: bool):
    argv = ["--enable-lora", "--api-key", KEY] + (["--allow-runtime-lora-updating"] if runtime else [])
    app = build_app(parse_serve_args(argv, environ={}))  # the engine is never started: routes only
    async with TestClient(TestServer(app)) as client:
        auth = {"Authorization": f"Bearer {KEY}"}
        for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            r = await client.post(route, json={"lora_name": "a", "lora_path": "/a"}, headers=auth)
            body = await r.json()
            if runtime:  # there, but the model is still loading; and behind the API key like all of /v1
                assert r.status == 503 and body["error"]["code"] == "model_loading"
                assert (await client.post(route, json={"lora_name": "a"})).status == 401
            else:
                assert r.status == 404 and body["error"]["code"] == "not_found"


# ---- a real daemon -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """PEFT folders for SmolLM2: `boot` outside the runtime root (the operator's --lora-modules), `same` (its
    twin) and `other` inside it, and one of each kind of bad adapter."""
    skel = Skeleton.of(resolve_model_path(f"builtin://{NAME}-135m"))
    tmp = tmp_path_factory.mktemp("lora")
    root, outside = tmp / "root", tmp / "outside"
    boot = write_adapter(outside / "boot", skel, rank=8, seed=1)
    write_adapter(root / "same", skel, rank=8, seed=1)
    write_adapter(root / "other", skel, rank=4, seed=2, targets=("q_proj", "v_proj"))
    write_adapter(root / "rank32", skel, rank=32, targets=("q_proj",))
    wider = Skeleton({**skel.config, "hidden_size": 640})
    write_adapter(root / "shape", wider, rank=4, targets=("q_proj",))
    hidden, vocab = skel.config["hidden_size"], skel.config["vocab_size"]
    write_raw_adapter(root / "lm_head", {"r": 4, "lora_alpha": 8, "target_modules": ["lm_head"]},
                      {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, hidden),
                       "base_model.model.lm_head.lora_B.weight": torch.zeros(vocab, 4)})
    (root / "no_weights").mkdir()
    (root / "no_weights" / "adapter_config.json").write_text((root / "same" / "adapter_config.json").read_text())
    (root / "escape").symlink_to(boot)
    return SimpleNamespace(root=root, outside=outside, boot=boot)


@pytest.fixture(scope="module")
def daemon(adapters):
    d = DaemonProcess("--api-key", KEY, "--served-model-name", NAME, "--enable-lora", "--max-loras", "1",
                      "--max-lora-rank", "16", "--allow-runtime-lora-updating", "--lora-root", str(adapters.root),
                      "--lora-modules", f"boot={adapters.boot}", "--max-num-seqs", "4", "--kv-cache-memory", "64MiB",
                      env=ONE_THREAD)
    with d:
        yield d


@pytest.fixture(scope="module")
def client(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url("/v1"), api_key=KEY, max_retries=0, timeout=120)


def load(client: openai.OpenAI, name: str, path: str | Path) -> str:
    return client.post("/load_lora_adapter", body={"lora_name": name, "lora_path": str(path)}, cast_to=str)


def unload(client: openai.OpenAI, **body) -> str:
    return client.post("/unload_lora_adapter", body=body, cast_to=str)


def greedy(client: openai.OpenAI, model: str) -> tuple[str, str]:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    return out.model, out.choices[0].text


def lora_info(daemon: DaemonProcess) -> dict[str, str]:
    return metrics(daemon)["vllm:lora_requests_info"].samples[0].labels


def metrics(daemon: DaemonProcess) -> dict:
    status, body = daemon.get("/metrics")
    assert status == 200
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def assert_idle(daemon: DaemonProcess, timeout: float = 20.0) -> None:
    """Every KV block back in the pool and no adapter in the batch or waiting: nothing leaked."""
    deadline = time.monotonic() + timeout
    while True:
        fams = metrics(daemon)
        usage = fams["vllm:kv_cache_usage_perc"].samples[0].value
        running = fams["vllm:num_requests_running"].samples[0].value + fams["vllm:num_requests_waiting"].samples[0].value
        info = fams["vllm:lora_requests_info"].samples[0].labels
        if usage == 0 and running == 0 and info["running_lora_adapters"] == info["waiting_lora_adapters"] == "":
            return
        assert time.monotonic() < deadline, f"not idle: usage {usage}, requests {running}, {info}"
        time.sleep(0.1)


def model_ids(client: openai.OpenAI) -> list[str]:
    return [m.id for m in client.models.list().data]



@pytest.mark.slow
def test_startup_adapter_is_listed_and_selected(client, adapters):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [NAME, "boot"]
    boot = cards["boot"].model_dump()
    assert boot["parent"] == NAME and boot["root"] == str(adapters.boot) and boot["object"] == "model"
    assert cards[NAME].model_dump()["parent"] is None
    base_model, base_text = greedy(client, NAME)
    boot_model, boot_text = greedy(client, "boot")
    assert (base_model, boot_model) == (NAME, "boot")  # a response names the adapter it ran with, as vLLM's
    assert boot_text != base_text, "the adapter must change what the model writes"
    assert client.models.retrieve("boot").model_dump()["parent"] == NAME


@pytest.mark.slow
def test_runtime_load_generate_and_unload(client, daemon, adapters):
    assert load(client, "same", adapters.root / "same") == "Success: LoRA adapter 'same' added successfully."
    assert model_ids(client) == [NAME, "boot", "same"]
    # the runtime twin of the startup adapter (same weights) writes the same tokens
    assert greedy(client, "same") == ("same", greedy(client, "boot")[1])
    chat = {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 6, "temperature": 0.0,
            "extra_body": {"ignore_eos": True}}
    chunks = list(client.chat.completions.create(model="same", stream=True, **chat))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert {c.model for c in chunks} == {"same"}
    assert streamed == client.chat.completions.create(model="boot", **chat).choices[0].message.content
    assert streamed != client.chat.completions.create(model=NAME, **chat).choices[0].message.content
    assert unload(client, lora_name="same") == "Success: LoRA adapter 'same' removed successfully."
    assert model_ids(client) == [NAME, "boot"]
    with pytest.raises(openai.NotFoundError) as err:
        greedy(client, "same")
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as err:
        unload(client, lora_name="same")
    assert err.value.body["message"] == "The lora adapter 'same' cannot be found." and err.value.code == "lora_not_found"
    assert_idle(daemon)


BAD_LOADS = [  # (lora_name, lora_path relative to the root unless absolute, what the 400 says)
    ("boot", "same", "The lora adapter 'boot' has already been loaded."),
    (NAME, "same", "is a name of the base model"),
    ("", "same", "lora_name must be a non-empty string"),
    ("x" * 300, "same", "at most 256"),
    ("../escape", "same", "is not allowed"),
    ("/etc/adapter", "same", "is not allowed"),
    ("nul\x00name", "same", "is not allowed"),
    ("outside", "{outside}/boot", "outside the allowed adapter roots"),
    ("dotdot", "{root}/../outside/boot", "outside the allowed adapter roots"),
    ("symlink", "escape", "outside the allowed adapter roots"),
    ("scheme", "s3://bucket/adapter", "unknown scheme 's3://'"),
    ("missing", "never-made", "no adapter folder there"),
    ("no_weights", "no_weights", "no adapter weights"),
    ("rank32", "rank32", "rank 32 is above max_lora_rank (16)"),
    ("shape", "shape", "input features"),
    ("lm_head", "lm_head", "is not supported"),
]


@pytest.mark.slow
def test_bad_loads_get_400_and_leave_nothing(client, daemon, adapters):
    before = model_ids(client)
    for name, path, said in BAD_LOADS:
        full = path.format(root=adapters.root, outside=adapters.outside)
        full = full if "://" in full or full.startswith("/") else str(adapters.root / full)
        with pytest.raises(openai.BadRequestError) as err:
            load(client, name, full)
        assert said in err.value.body["message"], (name, err.value.body)
        assert err.value.body["type"] == "invalid_request_error" and err.value.param in ("lora_name", "lora_path")
    for body, said in (({"lora_name": "a"}, "'lora_path' is required"),
                       ({"lora_name": "a", "lora_path": 3}, "'lora_path' must be a string")):
        with pytest.raises(openai.BadRequestError, match=said):
            client.post("/load_lora_adapter", body=body, cast_to=str)
    with pytest.raises(openai.BadRequestError, match="either 'lora_name' or 'lora_int_id'"):
        unload(client)
    with pytest.raises(openai.NotFoundError, match="No lora adapter has id 999"):
        unload(client, lora_int_id=999)
    assert model_ids(client) == before, "a refused load must register nothing"
    for name in ("rank32", "missing", "outside"):
        with pytest.raises(openai.NotFoundError):
            greedy(client, name)
    # the refused names are free: a good adapter loads under one of them
    assert load(client, "rank32", adapters.root / "other").startswith("Success")
    assert unload(client, lora_name="rank32").startswith("Success")
    assert_idle(daemon)


@pytest.mark.slow
def test_metric_shows_the_running_and_waiting_adapters(client, daemon, adapters):
    load(client, "other", adapters.root / "other")
    try:
        long = {"prompt": PROMPT, "max_tokens": 400, "stream": True, "extra_body": {"ignore_eos": True}}
        running = client.completions.create(model="boot", **long)
        next(iter(running))  # it is in the batch, holding the one adapter slot (--max-loras 1)
        waiting = client.completions.create(model="other", **long)  # answered at acceptance: its headers
        deadline = time.monotonic() + 20
        while (info := lora_info(daemon))["waiting_lora_adapters"] != "other":
            assert time.monotonic() < deadline, info
            time.sleep(0.05)
        assert info == {"max_lora": "1", "running_lora_adapters": "boot", "waiting_lora_adapters": "other"}
        running.close()  # the client goes away: its blocks free, the other adapter gets the slot
        while lora_info(daemon)["running_lora_adapters"] != "other":
            assert time.monotonic() < deadline, lora_info(daemon)
            time.sleep(0.05)
        waiting.close()
        assert_idle(daemon)
    finally:
        unload(client, lora_name="other")


@pytest.mark.slow
def test_a_bad_startup_adapter_stops_the_start(adapters):
    d = DaemonProcess("--enable-lora", "--max-lora-rank", "16", "--lora-modules", f"big={adapters.root / 'rank32'}",
                      "--kv-cache-memory", "32MiB", env=ONE_THREAD)
    try:
        with pytest.raises(RuntimeError, match="daemon exited with 1"):
            d.start(timeout=120)
        failed = [r for r in d.log_records() if r.get("msg") == "model failed to load; exiting"]
        assert failed and f"--lora-modules big={adapters.root / 'rank32'}" in failed[0]["error"]
        assert "rank 32 is above max_lora_rank (16)" in failed[0]["error"]
    finally:
        d.stop()
