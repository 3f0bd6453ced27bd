"""Where adapters are inside a daemon pod, and what the pod template gets for them (operator/lora_sources.py,
rendered through operator/resources.py)."""

from __future__ import annotations

import pytest

from kvpilot.operator import crd, lora_sources, resources
from kvpilot.operator.lora_sources import Location, PodLoRA, Sources

META = {"name": "llm", "namespace": "ml", "uid": "u-1"}


@pytest.mark.parametrize("uri, location", [
    ("hf://org/sql-lora", Location("hf://org/sql-lora")),
    ("hf://org/sql-lora@v2", Location("hf://org/sql-lora@v2")),
    ("pvc://adapters", Location("/adapters/pvc/adapters", "/adapters/pvc/adapters", "adapters")),
    ("pvc://adapters/", Location("/adapters/pvc/adapters", "/adapters/pvc/adapters", "adapters")),
    ("pvc://adapters/team/sql", Location("/adapters/pvc/adapters/team/sql", "/adapters/pvc/adapters", "adapters")),
    ("pvc://adapters//team/./sql/", Location("/adapters/pvc/adapters/team/sql", "/adapters/pvc/adapters", "adapters")),
    ("file:///opt/adapters/sql", Location("/opt/adapters/sql", "/opt/adapters/sql")),
    ("file:///opt/adapters/sql/", Location("/opt/adapters/sql", "/opt/adapters/sql")),
])
def test_locate(uri, location):
    assert lora_sources.locate(uri) == location


def test_a_path_never_names_anything_outside_its_own_root():
    loc = lora_sources.locate("pvc://adapters/../../etc")  # the CRD refuses it; normalised all the same
    assert loc.lora_path == "/adapters/etc" and not lora_sources.covered(loc, [loc.root])


def test_sources_are_sorted_and_unique():
    found = lora_sources.sources(["pvc://b/x", "hf://org/a", "file:///opt/z", "pvc://a/y", "pvc://b/w"])
    assert found == Sources(claims=("a", "b"), roots=("/adapters/pvc/a", "/adapters/pvc/b", "/opt/z"))
    assert lora_sources.sources(["hf://org/a"]) == lora_sources.NO_SOURCES


@pytest.mark.parametrize("path, roots, ok", [
    ("/adapters/pvc/a/sql", ["/adapters/pvc/a"], True),
    ("/adapters/pvc/a", ["/adapters/pvc/a"], True),
    ("/adapters/pvc/ab/sql", ["/adapters/pvc/a"], False),  # a prefix of the name is not a parent folder
    ("/opt/sql", [], False),
])
def test_covered(path, roots, ok):
    assert lora_sources.covered(Location(path, path), roots) is ok
    assert lora_sources.covered(Location("hf://org/x"), [])  # the daemon's own download


def spec(**engine):
    return crd.default_spec({"model": {"uri": "hf://org/m"}, "engine": engine})


def test_the_pod_template_gets_the_claims_and_the_roots():
    found = lora_sources.sources(["pvc://adapters/sql", "file:///opt/chat", "hf://org/x"])
    dep = resources.render_deployment(META, spec(enableLora=True, maxLoras=2, maxCpuLoras=4), 1, found)
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert {"name": "lora-adapters", "persistentVolumeClaim": {"claimName": "adapters", "readOnly": True}} \
        in pod["volumes"]
    assert {"name": "lora-adapters", "mountPath": "/adapters/pvc/adapters", "readOnly": True} in c["volumeMounts"]
    args = c["args"]
    tail = args[args.index("--enable-lora"):]
    assert tail == ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--max-cpu-loras", "4",
                    "--allow-runtime-lora-updating", "--lora-root", "/adapters/pvc/adapters",
                    "--lora-root", "/opt/chat"]
    assert lora_sources.pod_lora(pod) == PodLoRA(True, ("/adapters/pvc/adapters", "/opt/chat"))


def test_extra_args_still_come_last():
    args = resources.daemon_args(META, spec(enableLora=True, extraArgs=["--seed", "1"]), lora_sources.NO_SOURCES)
    assert args[-2:] == ["--seed", "1"] and "--allow-runtime-lora-updating" in args


def test_without_enable_lora_the_template_is_what_it_was():
    """Adapters naming a base without LoRA change nothing in it: no roll of pods that cannot use them."""
    found = lora_sources.sources(["pvc://adapters/sql"])
    assert resources.render_deployment(META, spec(), 2, found) == resources.render_deployment(META, spec(), 2)


def test_a_long_claim_name_gets_a_volume_name_that_is_a_label():
    claim = "c" * 70
    name = lora_sources.volume_name(claim)
    assert len(name) <= 63 and name.startswith("lora-") and name != lora_sources.volume_name("d" * 70)


@pytest.mark.parametrize("args, lora", [
    (["serve", "m"], PodLoRA(False)),
    (["serve", "m", "--enable-lora"], PodLoRA(False)),  # loads at start only: no runtime routes
    (["serve", "m", "--enable-lora", "--allow-runtime-lora-updating"], PodLoRA(True)),
    (["--enable-lora", "--allow-runtime-lora-updating", "--lora-root", "/b", "--lora-root=/a"], PodLoRA(True, ("/a", "/b"))),
])
def test_pod_lora_reads_the_daemons_args(args, lora):
    assert lora_sources.pod_lora({"containers": [{"name": "daemon", "args": args}]}) == lora
    assert lora_sources.pod_lora(None) == PodLoRA(False)
