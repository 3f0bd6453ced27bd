"""The stricter kmock refuses EndpointSlice addresses as kube-apiserver does (loopback, link-local,
unspecified, not an IP of the addressType), and takes a pod address such as the e2e's 198.18.x."""

from __future__ import annotations

import pytest

from operator_support.emulator import endpoint_address_errors
from operator_support.harness import cluster

pytestmark = pytest.mark.timeout(60)
SLICES = "/apis/discovery.k8s.io/v1/namespaces/ml/endpointslices"


def eps(*addresses: str, kind: str = "IPv4") -> dict:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": kind,
            "metadata": {"name": "s", "labels": {"kubernetes.io/service-name": "svc"}},
            "endpoints": [{"addresses": [a], "conditions": {"ready": True}} for a in addresses],
            "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}]}


@pytest.mark.parametrize(("address", "why"), [
    ("127.0.0.2", "loopback"), ("169.254.1.1", "link-local"), ("0.0.0.0", "unspecified"),
    ("224.0.0.5", "link-local multicast"), ("::1", "IPv4 address"), ("pod-a", "valid IP"),
])
def test_refused_addresses(address: str, why: str) -> None:
    errors = endpoint_address_errors(eps(address))
    assert errors and why in errors[0], errors


def test_pod_addresses_pass() -> None:
    assert endpoint_address_errors(eps("198.18.0.2", "10.244.1.7")) == []
    assert endpoint_address_errors(eps("fd00::5", kind="IPv6")) == []


async def test_the_emulator_answers_422_on_create_and_patch(tmp_path):
    async with cluster(tmp_path) as k:
        status, body = await k.try_call("POST", SLICES, eps("127.0.0.2"))
        assert status == 422 and "loopback" in body["message"], body
        await k.call("POST", SLICES, eps("198.18.0.2"))
        status, body = await k.try_call("PATCH", f"{SLICES}/s", {"endpoints": [{"addresses": ["169.254.0.9"]}]})
        assert status == 422 and "link-local" in body["message"], body
        [s] = await k.items(SLICES)
        assert s["endpoints"][0]["addresses"] == ["198.18.0.2"]
