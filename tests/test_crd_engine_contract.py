"""The contract between the CRD's spec.engine and the daemon: EngineConfig (and ServeArgs for the daemon's own
settings) is the source of truth; the CRD must expose its fields under their camelCase names with the same
types, defaults, choices, ranges and size grammar, and the operator must hand each one to `kvpilot serve`
under the right flag. Every check derives from EngineConfig, so a drift on either side fails here."""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any

import pytest
import torch

from kvpilot import sizes
from kvpilot.daemon.args import ServeArgs, parse_serve_args
from kvpilot.daemon.engine import runner as runner_mod
from kvpilot.daemon.engine.config import QUANTIZATIONS, EngineConfig
from kvpilot.daemon.engine.models.parallel import SINGLE
from kvpilot.daemon.engine.spec_decode import config as spec_config
from kvpilot.operator import crd, lora_sources, resources
from operator_support import crd_checks as checks
from operator_support.harness import CR_PATH, cluster

# EngineConfig fields deliberately not in spec.engine, each with why. A new EngineConfig field fails
# test_every_engine_field_is_decided until it is added to the CRD or here.
NOT_IN_CRD: dict[str, str] = {
    "model": "spec.model.uri, rendered as the MODEL argument (pvc:// becomes the mounted path)",
    "served_model_name": "spec.model.name (default metadata.name), rendered as the daemon's --served-model-name",
    "quantization": "spec.model.quantization, rendered as the daemon's --quantization",
    "device": "follows resources.gpus: auto picks cuda when the pod has a GPU, else cpu",
    "num_kv_blocks": "a fixed block count for tests and benchmarks; kvCacheMemory sizes a production cache",
    "preemption_mode": "recompute suits serving; swap also needs swapSpace sized into resources.memory: extraArgs",
    "swap_space": "only used by preemption_mode swap (see there): extraArgs",
    "seed": "requests carry their own seeds; the engine-wide one is for reproducible tests: extraArgs",
    # kernel and host knobs: auto/defaults are right on every supported node; a way out when debugging
    "attention_backend": "auto picks the kernel for the device; forcing one is for debugging: extraArgs",
    "enforce_eager": "CUDA graphs are the fast path; turning them off is for debugging: extraArgs",
    "cpu_kernel": "CPU-kernel tuning, right by default; off only to compare against torch: extraArgs",
    "prepack_weights": "CPU-kernel tuning, right by default: extraArgs",
    "small_batch_gemm": "CPU-kernel tuning, decided from physical memory at start: extraArgs",
    "malloc_tuning": "glibc heap tuning for CPU pods, right by default: extraArgs",
    "populate_kv": "CPU KV-cache page mapping, right by default: extraArgs",
    "num_threads": "follows resources.cpu: the daemon sizes its threads from the pod's cgroup CPU limit",
    "tensor_parallel_size": "spec.parallelism.tensor, rendered as --tensor-parallel-size with more than one rank",
    "pipeline_parallel_size": "spec.parallelism.pipeline, rendered as --pipeline-parallel-size with more than one rank",
    "nnodes": "follows spec.parallelism and resources.gpusPerNode: a multi-node replica is a LeaderWorkerSet group, "
              "and the daemon reads LWS_GROUP_SIZE",
    "node_rank": "each pod's place in its LeaderWorkerSet group: the daemon reads LWS_WORKER_INDEX",
    "dist_init_addr": "the group leader's address: the daemon reads LWS_LEADER_ADDRESS (port 29500, the leader's "
                      "dist port)",
    "speculative_config": "spec.engine.speculative, an object with camelCase keys, rendered as the JSON of "
                          "--speculative-config (OBJECT_FIELDS; checked key by key below)",
}
# spec.engine objects standing for a dict-valued EngineConfig field, rendered as its JSON flag
OBJECT_FIELDS: dict[str, str] = {"speculative": "speculative_config"}

# spec.engine fields that are the daemon's settings (ServeArgs), not the engine's.
DAEMON_FIELDS: dict[str, str] = {"maxQueuedRequests": "max_queued_requests"}
PASSTHROUGH = {"extraArgs"}  # appended to the flags as written; the daemon's argparse judges them

# A non-default value for every spec.engine field: what the operator must get through to the daemon.
EVERY_FIELD_SET: dict[str, Any] = {
    "blockSize": 64, "maxNumSeqs": 7, "maxNumBatchedTokens": 333, "longPrefillTokenThreshold": 99,
    "maxModelLen": 1234, "dtype": "float16", "kvCacheDtype": "bfloat16", "kvCacheMemory": "1.5Gi",
    "gpuMemoryUtilization": 0.55, "enablePrefixCaching": False, "schedulingPolicy": "priority",
    "maxQueuedRequests": 17, "extraArgs": ["--seed", "5"], "distributedTimeout": 42.5,
    "enableLora": True, "maxLoras": 3, "maxLoraRank": 32, "maxCpuLoras": 5,
    "speculative": {"method": "ngram", "numSpeculativeTokens": 3, "promptLookupMin": 1, "promptLookupMax": 4,
                    "disableByBatchSize": 2},
}

JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string"}
SIZE_FIELDS = {"kv_cache_memory"}  # ints in EngineConfig, strings of kvpilot.sizes' grammar in the CRD
META = {"name": "llm", "namespace": "ml", "uid": "u-1"}


def camel(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(w.capitalize() for w in rest)


def kebab(name: str) -> str:
    return "--" + name.replace("_", "-")


def engine_props() -> dict[str, dict[str, Any]]:
    return crd.spec_schema()["properties"]["engine"]["properties"]


ENGINE_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}
EXPOSED = sorted(n for n in ENGINE_FIELDS if n not in NOT_IN_CRD)
HINTS = typing.get_type_hints(EngineConfig)


def base_type(name: str) -> type:
    hint = HINTS[name]
    return next((t for t in typing.get_args(hint) if t is not type(None)), hint)


def default_of(name: str) -> Any:
    f = ENGINE_FIELDS[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


# --- names ---------------------------------------------------------------------------------------------

def test_every_engine_field_is_decided():
    assert set(NOT_IN_CRD) <= set(ENGINE_FIELDS), f"stale NOT_IN_CRD entries: {set(NOT_IN_CRD) - set(ENGINE_FIELDS)}"
    props = engine_props()
    missing = [camel(n) for n in EXPOSED if camel(n) not in props]
    assert not missing, (f"EngineConfig fields with no spec.engine field: {missing}; add them to the CRD "
                         "(and operator/resources.py) or to NOT_IN_CRD with a reason")
    assert not [n for n in NOT_IN_CRD if camel(n) in props], "a field is both in the CRD and in NOT_IN_CRD"
    assert all(reason.strip() for reason in NOT_IN_CRD.values())


def test_every_crd_engine_field_is_known():
    expected = {camel(n) for n in EXPOSED} | set(DAEMON_FIELDS) | PASSTHROUGH | set(OBJECT_FIELDS)
    assert set(engine_props()) == expected
    assert set(OBJECT_FIELDS.values()) <= set(NOT_IN_CRD)
    serve_fields = {f.name for f in dataclasses.fields(ServeArgs)}
    assert set(DAEMON_FIELDS.values()) <= serve_fields


@pytest.mark.parametrize("prop", sorted(engine_props().keys() - PASSTHROUGH))
def test_descriptions_name_their_flag(prop):
    dest = DAEMON_FIELDS.get(prop) or OBJECT_FIELDS.get(prop) or next(n for n in EXPOSED if camel(n) == prop)
    assert f"({kebab(dest)}" in engine_props()[prop]["description"]


# --- types, defaults, choices --------------------------------------------------------------------------

@pytest.mark.parametrize("name", EXPOSED)
def test_types(name):
    node = engine_props()[camel(name)]
    if name in SIZE_FIELDS:
        assert node["type"] == "string" and node["pattern"] == sizes.SIZE_PATTERN
    else:
        assert node["type"] == JSON_TYPES[base_type(name)], name
        assert "pattern" not in node


@pytest.mark.parametrize("name", EXPOSED)
def test_defaults(name):
    """A CRD default equals the daemon's; a field whose daemon default is None (derived at start) has none."""
    node, default = engine_props()[camel(name)], default_of(name)
    if "default" in node:
        assert default is not None, f"{name}: the daemon derives it; the CRD must not fix it"
        assert node["default"] == default and type(node["default"]) is type(default), name


@pytest.mark.parametrize("name", EXPOSED)
def test_choices(name):
    node, choices = engine_props()[camel(name)], ENGINE_FIELDS[name].metadata.get("choices")
    if choices is None:
        assert "enum" not in node, name
    else:
        assert sorted(node["enum"], key=str) == sorted(choices, key=str), name


# --- ranges: the CRD (as the API server and the operator judge it) accepts exactly what the daemon does ----

def crd_accepts(engine: dict[str, Any], model: dict[str, Any] | None = None) -> bool:
    spec = {"model": {"uri": "hf://org/m", **(model or {})}, "engine": engine}
    o = {"apiVersion": "kvpilot.io/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "ok"},
         "spec": spec}
    server = checks.schema_errors(o, crd.version_schema()) == [] and \
        checks.cel_errors({**o, "spec": crd.default_spec(spec)}, crd.version_schema()) == []
    # The emulator's patterns are Python's, whose $ also passes a final newline; RE2's does not.
    props = engine_props()
    server = server and all(re.search(props[k]["pattern"].removesuffix("$") + r"\Z", v) for k, v in engine.items()
                            if "pattern" in props.get(k, {}) and isinstance(v, str))
    operator = crd.validate("ok", crd.default_spec(spec)) == []
    assert server == operator, (engine, server, operator)
    return server


def daemon_accepts(dest: str, value: Any) -> bool:
    if isinstance(value, bool):  # --x / --no-x, as the operator writes them
        argv = [kebab(dest) if value else "--no-" + kebab(dest)[2:]]
    else:
        argv = [kebab(dest), str(value)]
    try:
        parse_serve_args(argv, environ={})
    except SystemExit:
        return False
    return True


def probes(node: dict[str, Any], kind: type, choices: tuple[Any, ...] = ()) -> list[Any]:
    """Values either side of every bound the CRD or the daemon might set, and both sides' choices."""
    if kind is int:
        edges = {-(2**31), -1, 0, 1, 2, 8, 15, 16, 17, 64, 4096, 4097, 2**20, 2**20 + 1, 2**31}
        for bound in ("minimum", "maximum"):
            if bound in node:
                edges |= {node[bound] - 1, node[bound], node[bound] + 1}
        return sorted(edges | set(node.get("enum", [])) | set(choices))
    if kind is float:
        edges = {-1.0, 0.0, 1e-6, 0.05, 0.5, 0.999999, 1.0, 1.000001, 2.0, 100.0}
        for bound in ("minimum", "maximum"):
            if bound in node:
                edges |= {node[bound] - 1e-6, float(node[bound]), node[bound] + 1e-6}
        return sorted(edges)
    if kind is str:
        return sorted({*node.get("enum", []), *choices, "bogus", ""})
    return [True, False]


@pytest.mark.parametrize("name", [n for n in EXPOSED if n not in SIZE_FIELDS])
def test_ranges_and_choices_agree_value_by_value(name):
    node = engine_props()[camel(name)]
    values = probes(node, base_type(name), tuple(ENGINE_FIELDS[name].metadata.get("choices", ())))
    verdicts = [(v, crd_accepts({camel(name): v}), daemon_accepts(name, v)) for v in values]
    disagree = [v for v in verdicts if v[1] != v[2]]
    assert not disagree, f"{name}: (value, CRD accepts, daemon accepts): {disagree}"


@pytest.mark.parametrize("name", EXPOSED)
def test_integer_bounds_are_the_daemons(name):
    """Said outright for integers: the CRD's minimum is the daemon's smallest value (min ok, min-1 refused)."""
    node = engine_props()[camel(name)]
    if node["type"] != "integer" or "enum" in node:
        return
    assert "minimum" in node, f"{name}: the daemon refuses some integers; say which with a minimum"
    low = node["minimum"]
    EngineConfig(**{name: low})
    assert daemon_accepts(name, low)
    with pytest.raises(ValueError, match=name):
        EngineConfig(**{name: low - 1})
    assert not daemon_accepts(name, low - 1)
    if "maximum" in node:
        assert daemon_accepts(name, node["maximum"]) and not daemon_accepts(name, node["maximum"] + 1)


@pytest.mark.parametrize("dest", sorted(DAEMON_FIELDS.values()))
def test_daemon_fields_bounds(dest):
    prop = next(p for p, d in DAEMON_FIELDS.items() if d == dest)
    node = engine_props()[prop]
    default = next(f.default for f in dataclasses.fields(ServeArgs) if f.name == dest)
    assert node.get("default", default) == default
    for v in probes(node, int):
        assert crd_accepts({prop: v}) == daemon_accepts(dest, v), (prop, v)


@pytest.mark.parametrize("text", ["20Gi", "256MiB", "1.5G", "1k", "1Ti", "1Pi", "4096", "0", "0Gi", "1gi",
                                  "512m", "1E", "1e9", "-1Gi", "1Gi ", "1Gi\n", ".5Gi"])
def test_sizes_agree(text):
    assert crd_accepts({"kvCacheMemory": text}) == daemon_accepts("kv_cache_memory", text) == sizes.is_size(text)


# --- the operator's flags reach the daemon -------------------------------------------------------------

def rendered(engine: dict[str, Any], model: dict[str, Any] | None = None) -> ServeArgs:
    spec = crd.default_spec({"model": {"uri": "hf://org/model", **(model or {})}, "engine": engine})
    assert crd.validate("llm", spec) == []
    args = resources.daemon_args(META, spec)
    assert args[0] == "serve"
    return parse_serve_args(args[1:], environ={})


def expected_value(name: str, crd_value: Any) -> Any:
    return sizes.parse_size(crd_value) if name in SIZE_FIELDS else crd_value


def test_every_field_set_reaches_the_daemon():
    assert set(EVERY_FIELD_SET) == set(engine_props()), "give every spec.engine field a value here"
    a = rendered(EVERY_FIELD_SET)
    cfg = a.engine_config()
    for name in EXPOSED:
        want = expected_value(name, EVERY_FIELD_SET[camel(name)])
        assert want != default_of(name), f"{name}: pick a non-default value, or the test proves nothing"
        assert getattr(cfg, name) == want, name
    for prop, dest in DAEMON_FIELDS.items():
        assert getattr(a, dest) == EVERY_FIELD_SET[prop], prop
    assert cfg.seed == 5  # extraArgs
    assert a.allow_runtime_lora_updating  # enableLora: the LoRAAdapter controller loads through the routes
    assert cfg.speculative_config == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                      "prompt_lookup_max": 4, "disable_by_batch_size": 2}


def test_a_bare_spec_runs_the_daemons_defaults():
    """Unset fields are either defaulted to the daemon's value or left out of the flags."""
    a = rendered({})
    cfg = a.engine_config()
    for name in EXPOSED:
        assert getattr(cfg, name) == default_of(name), name
    for dest in DAEMON_FIELDS.values():
        assert getattr(a, dest) == getattr(ServeArgs(), dest)
    for dest in OBJECT_FIELDS.values():
        assert getattr(cfg, dest) is None, dest
    assert not a.allow_runtime_lora_updating and a.lora_root == []


# --- engine.enableLora: the daemon's runtime-loading routes and its roots, which the operator manages ----

def lora_args(engine: dict[str, Any], uris: list[str]) -> ServeArgs:
    spec = crd.default_spec({"model": {"uri": "hf://org/model"}, "engine": engine})
    args = resources.daemon_args(META, spec, lora_sources.sources(uris))
    return parse_serve_args(args[1:], environ={})


def test_enable_lora_opens_the_runtime_routes_and_the_adapters_roots():
    uris = ["pvc://adapters/team/sql", "file:///opt/lora/chat", "hf://org/summary", "pvc://adapters/other"]
    a = lora_args({"enableLora": True}, uris)
    assert a.engine_config().enable_lora and a.allow_runtime_lora_updating
    # One root per claim (its mount point) and per file:// folder; hf:// adapters need none.
    assert a.lora_root == ["/adapters/pvc/adapters", "/opt/lora/chat"]
    cfg = a.engine_config()
    assert (cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras) == (1, 16, None)  # the daemon's defaults


def test_without_enable_lora_no_lora_flag_reaches_the_daemon():
    """Not even the roots of adapters that name the base: the daemon would refuse them without
    --enable-lora, and a base without LoRA keeps its pod template (no roll on operator upgrades)."""
    spec = crd.default_spec({"model": {"uri": "hf://org/model"}, "engine": {"maxLoras": 4}})
    args = resources.daemon_args(META, spec, lora_sources.sources(["file:///opt/lora/chat"]))
    assert not [x for x in args if "lora" in x]
    a = lora_args({"maxLoras": 4}, ["file:///opt/lora/chat"])
    assert not a.engine_config().enable_lora and not a.allow_runtime_lora_updating and a.lora_root == []


@pytest.mark.parametrize("max_loras, max_cpu_loras", [(1, 1), (2, 1), (4, 4), (4, 3), (3, 9)])
def test_max_cpu_loras_against_max_loras_agrees_with_the_daemon(max_loras, max_cpu_loras):
    """The cross-field rule (CEL and the operator's mirror) is the daemon's own check."""
    engine = {"enableLora": True, "maxLoras": max_loras, "maxCpuLoras": max_cpu_loras}
    try:
        parse_serve_args(["--enable-lora", "--max-loras", str(max_loras), "--max-cpu-loras", str(max_cpu_loras)],
                         environ={})
        daemon = True
    except SystemExit:
        daemon = False
    assert crd_accepts(engine) == daemon == (max_cpu_loras >= max_loras)
    if not daemon:
        spec = crd.default_spec({"model": {"uri": "hf://org/m"}, "engine": engine})
        assert "engine.maxCpuLoras must be >= engine.maxLoras" in crd.validate("ok", spec)


# --- spec.model.quantization: the daemon's --quantization -----------------------------------------------

def quantization_node() -> dict[str, Any]:
    return crd.spec_schema()["properties"]["model"]["properties"]["quantization"]


def test_model_quantization_is_the_engines_choice():
    """The enum is EngineConfig's QUANTIZATIONS, no more and no fewer; no default, so omitted leaves the
    daemon to run the weights as the checkpoint stores them."""
    node = quantization_node()
    assert ENGINE_FIELDS["quantization"].metadata["choices"] == QUANTIZATIONS
    assert node["type"] == "string" and "default" not in node
    assert len(node["enum"]) == len(set(node["enum"])) and set(node["enum"]) == set(QUANTIZATIONS)
    assert "(--quantization" in node["description"] and "Omitted" in node["description"]
    assert "quantization" not in crd.default_spec({"model": {"uri": "hf://org/m"}})["model"]


@pytest.mark.parametrize("value", sorted({*QUANTIZATIONS, *quantization_node()["enum"], "int8", "bogus", "GGUF", ""}))
def test_model_quantization_agrees_with_the_daemon_value_by_value(value):
    assert crd_accepts({}, {"quantization": value}) == daemon_accepts("quantization", value), value


@pytest.mark.parametrize("value", QUANTIZATIONS)
def test_model_quantization_reaches_the_daemon(value):
    args = resources.daemon_args(META, crd.default_spec({"model": {"uri": "hf://org/m", "quantization": value}}))
    assert args[args.index("--quantization") + 1] == value and args.count("--quantization") == 1
    assert rendered({}, {"quantization": value}).engine_config().quantization == value


def test_no_model_quantization_renders_no_flag():
    assert "--quantization" not in resources.daemon_args(META, crd.default_spec({"model": {"uri": "hf://org/m"}}))
    assert rendered({}).engine_config().quantization is None  # the checkpoint's own


@pytest.mark.timeout(60)
async def test_the_emulated_server_rejects_an_unknown_quantization(tmp_path):
    """Applied as a client would: the strict emulator (schema validation on) refuses int8 on create and on
    update, and keeps a valid value as written."""
    def cr(quantization: str) -> dict[str, Any]:
        return {"apiVersion": "kvpilot.io/v1alpha1", "kind": "InferenceDeployment",
                "metadata": {"name": "llm", "namespace": "ml"},
                "spec": {"model": {"uri": "hf://org/m", "quantization": quantization}}}

    async with cluster(tmp_path, validate=True) as k:
        status, body = await k.try_call("POST", CR_PATH.format(ns="ml"), cr("int8"))
        assert status == 422 and "spec.model.quantization" in body["message"], body
        assert await k.cr("ml", "llm") is None
        created = await k.create_cr("ml", cr("fp8"))
        assert created["spec"]["model"]["quantization"] == "fp8"
        status, body = await k.try_call("PATCH", f"{CR_PATH.format(ns='ml')}/llm",
                                        {"spec": {"model": {"quantization": "int8"}}})
        assert status == 422 and "spec.model.quantization" in body["message"], body
        assert (await k.cr("ml", "llm"))["spec"]["model"]["quantization"] == "fp8"


# --- spec.engine.speculative: the daemon's --speculative-config -------------------------------------------

def speculative_node() -> dict[str, Any]:
    return engine_props()["speculative"]


def test_speculative_keys_are_vllms():
    """Each camelCase key stands for one speculative_config key (vLLM's names), and names it in its description
    or the object's; the method enum is the engine's."""
    node = speculative_node()
    assert set(node["properties"]) == set(resources.SPECULATIVE_KEYS)
    assert set(resources.SPECULATIVE_KEYS.values()) == set(spec_config._KEYS)
    for prop, key in resources.SPECULATIVE_KEYS.items():
        assert camel(key) == prop
        assert f"({key})" in node["properties"][prop]["description"] or prop == "method", prop
    assert node["properties"]["method"]["enum"] == list(spec_config.METHODS)
    assert "(--speculative-config" in node["description"] and "default" not in node


def spec_daemon_accepts(value: dict[str, Any]) -> bool:
    """The daemon's verdict on the JSON the operator renders for this spec.engine.speculative."""
    return daemon_accepts("speculative_config", resources.speculative_config_json(value))


NGRAM = {"method": "ngram", "numSpeculativeTokens": 4}
DRAFT = {"method": "draft_model", "numSpeculativeTokens": 3, "model": "self:4"}


@pytest.mark.parametrize("value", [
    NGRAM, DRAFT, {**DRAFT, "model": "hf://org/draft"}, {**DRAFT, "model": "builtin://smollm2-135m"},
    {**NGRAM, "numSpeculativeTokens": 0}, {**NGRAM, "numSpeculativeTokens": 1}, {**NGRAM, "numSpeculativeTokens": -1},
    {**NGRAM, "promptLookupMin": 3, "promptLookupMax": 3}, {**NGRAM, "promptLookupMin": 4, "promptLookupMax": 3},
    {**NGRAM, "promptLookupMin": 0}, {**NGRAM, "promptLookupMax": 0}, {**NGRAM, "promptLookupMax": 1},
    {**NGRAM, "promptLookupMin": 7}, {**NGRAM, "disableByBatchSize": 0}, {**NGRAM, "disableByBatchSize": 1},
    {**NGRAM, "method": "eagle"}, {**NGRAM, "method": "bogus"}, {**NGRAM, "model": "self:2"},
    {**DRAFT, "model": "self:0"}, {**DRAFT, "model": "self:x"}, {**DRAFT, "model": "self:12"},
    {**DRAFT, "promptLookupMax": 3}, {k: v for k, v in DRAFT.items() if k != "model"},
])
def test_speculative_values_agree_with_the_daemon(value):
    assert crd_accepts({"speculative": value}) == spec_daemon_accepts(value), value


def test_speculative_crd_refuses_what_the_pod_cannot_load():
    """Stricter than the daemon on purpose: a pvc:// or local draft is not mounted in the pod."""
    for model in ("pvc://claim/draft", "/models/draft", "file:///d"):
        assert not crd_accepts({"speculative": {**DRAFT, "model": model}}), model


@pytest.mark.parametrize("value", [NGRAM, DRAFT, EVERY_FIELD_SET["speculative"]])
def test_speculative_reaches_the_daemon(value):
    args = resources.daemon_args(META, crd.default_spec({"model": {"uri": "hf://org/m"}, "engine": {"speculative": value}}))
    assert args.count("--speculative-config") == 1
    cfg = rendered({"speculative": value}).engine_config()
    assert cfg.speculative_config == {resources.SPECULATIVE_KEYS[k]: v for k, v in value.items()}
    assert cfg.speculative.num_speculative_tokens == value["numSpeculativeTokens"]


def test_no_speculative_renders_no_flag():
    assert "--speculative-config" not in resources.daemon_args(META, crd.default_spec({"model": {"uri": "hf://org/m"}}))


# --- kvCacheMemory on GPUs: a cap beside gpuMemoryUtilization -------------------------------------------

GiB = 1 << 30


@pytest.mark.parametrize("free, cap, budget, bound", [
    (70 * GiB, None, 60 * GiB, "gpu_memory_utilization"),  # 0.9 * 80 - 10 used - 2 reserved
    (70 * GiB, 20 * GiB, 20 * GiB, "kv_cache_memory"),      # the cap binds
    (70 * GiB, 100 * GiB, 60 * GiB, "gpu_memory_utilization"),  # a cap above what the fraction leaves claims no more
    (5 * GiB, 20 * GiB, 0, "gpu_memory_utilization"),       # others hold the GPU: nothing left, whatever the cap
])
def test_gpu_kv_budget(free, cap, budget, bound):
    got, source = runner_mod.gpu_kv_budget(free=free, total=80 * GiB, gpu_memory_utilization=0.9,
                                           reserved=2 * GiB, kv_cache_memory=cap)
    assert got == budget
    assert source.startswith(bound + "=")  # the startup log names the setting that sized the cache


def fake_cuda_runner(config: EngineConfig) -> runner_mod.ModelRunner:
    """A ModelRunner as num_blocks_for_budget sees it on a GPU, without one: the arithmetic and the
    wiring of the config, with torch.cuda.mem_get_info patched by the caller."""
    r = object.__new__(runner_mod.ModelRunner)
    model = types.SimpleNamespace(hidden_size=64, config=types.SimpleNamespace(intermediate_size=256),
                                  parameters=lambda: iter(()), buffers=lambda: iter(()))
    r.config, r.model, r.device, r.dtype, r.kv_dtype = config, model, torch.device("cuda", 0), torch.float16, torch.float16
    r.block_size, r.num_layers, r.num_kv_heads, r.head_dim, r.vocab_size = config.block_size, 2, 2, 64, 1000
    r.loaded = types.SimpleNamespace(max_model_len=1024)
    r.parallel = SINGLE  # one rank: the budget is the whole GPU's
    return r


@pytest.mark.parametrize("cap", [None, 64 << 20, 1 << 40])
def test_num_blocks_for_budget_on_a_gpu_honours_kv_cache_memory(monkeypatch, cap):
    total, free = 8 * GiB, 7 * GiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_: (free, total))
    cfg = EngineConfig(kv_cache_memory=cap, gpu_memory_utilization=0.5, max_num_batched_tokens=256, max_num_seqs=8)
    r = fake_cuda_runner(cfg)
    per_block = r.kv_bytes_per_block
    elem = 2
    reserved = 256 * (7 * 64 + 3 * 256) * elem + 8 * 1000 * (4 + elem) * 2
    left = int(total * 0.5) - (total - free) - reserved
    assert r.num_blocks_for_budget() == math.floor(min(left, cap or left) / per_block)


def test_kv_cache_memory_help_and_description_say_gpu_cap():
    assert "GPU" in ENGINE_FIELDS["kv_cache_memory"].metadata["help"]
    assert "gpuMemoryUtilization" in engine_props()["kvCacheMemory"]["description"]
