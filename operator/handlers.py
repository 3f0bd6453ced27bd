"""Thin kopf handlers: wire the CRD, reconcile, the autoscaling loop and the API together.

- create/update/resume -> one idempotent reconcile (server-side apply of the Deployment, Services, PDBs and,
  with spec.router, the router's objects or an InferencePool);
- an index of the InferenceDeployments feeds one autoscaling loop, started at startup (loop.py);
- an index of the LoRAAdapters feeds the LoRA loop (lora_loop.py), which loads adapters on the daemons.
No handler needs kopf's finalizer (no daemons, timers or on.delete): deleting an InferenceDeployment never
waits for the operator, and its children go by owner-reference garbage collection. LoRAAdapters carry a
finalizer of the LoRA loop's own (lora_plan.FINALIZER): unloading them needs the operator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import kopf

from kvpilot.operator import kube, lora_loop, metrics, peering
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.finalizers import strip_legacy_finalizers
from kvpilot.operator.loop import AutoscalingLoop, index_entry
from kvpilot.operator.names import GROUP, LORA_PLURAL, PLURAL, VERSION
from kvpilot.operator.reconcile import Degraded, NotReady, reconcile
from kvpilot.operator.tick import Cr


@kopf.on.login()
def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    return kube.login(settings)


@kopf.index(GROUP, VERSION, PLURAL)
def infd_index(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {(namespace, name): index_entry(body)}


@kopf.index(GROUP, VERSION, LORA_PLURAL)
def lora_index(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {(namespace, name): lora_loop.index_entry(body)}


def _peering_check(settings: kopf.OperatorSettings, client: kube.KubeClient,
                   config: OperatorConfig) -> Callable[[], Awaitable[bool]] | None:
    if settings.peering.standalone:
        return None

    async def paused() -> bool:
        return await peering.paused(client, settings.peering.name, settings.peering.priority, config.namespaces)
    return paused


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger,
                  infd_index: kopf.Index, lora_index: kopf.Index, **_: Any) -> None:
    # Progress and diff-base live in our own annotations; status stays ours alone.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.WARNING
    config: OperatorConfig = memo.get("config") or OperatorConfig.from_env()
    memo.config = config
    memo.kube = kube.KubeClient.from_kopf(settings)
    memo.http = aiohttp.ClientSession()
    memo.locks = {}  # (namespace, name) -> asyncio.Lock, shared by reconcile and the loop
    memo.metrics_server = None
    if config.metrics_port > 0:
        memo.metrics_server = metrics.serve(config.metrics_port, config.metrics_host)
        logger.info("operator metrics on port %d", config.metrics_port)
    # Before the first watch, so that the resume handlers see the objects without it. Not fatal: kopf also
    # drops its finalizer from objects that no handler needs it for, only one event later.
    try:
        await strip_legacy_finalizers(memo.kube, config.namespaces, logger)
    except (kube.KubeApiError, aiohttp.ClientError, TimeoutError) as e:
        logger.warning("could not remove the old kopf finalizers at startup: %s", e)
    loop = AutoscalingLoop(client=memo.kube, http=memo.http, index=infd_index, locks=memo.locks,
                           scrape_timeout=config.scrape_timeout, period=config.loop_period,
                           logger=logging.getLogger("kvpilot.operator.autoscaling"),
                           paused=_peering_check(settings, memo.kube, config))
    memo.loop_task = asyncio.create_task(loop.run(), name="kvpilot autoscaling loop")
    adapters = lora_loop.LoRALoop(client=memo.kube, http=memo.http, adapters=lora_index, bases=infd_index,
                                  locks=memo.locks, logger=logging.getLogger("kvpilot.operator.lora"),
                                  period=config.lora_period, timeout=config.scrape_timeout,
                                  load_timeout=config.lora_load_timeout,
                                  paused=_peering_check(settings, memo.kube, config))
    memo.lora_task = asyncio.create_task(adapters.run(), name="kvpilot LoRA loop")


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    for task in (memo.get("loop_task"), memo.get("lora_task")):
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    await memo.kube.close()
    await memo.http.close()
    if memo.metrics_server is not None:
        server, thread = memo.metrics_server
        server.shutdown()
        thread.join(timeout=5)


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
async def reconcile_handler(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    cr = Cr.from_body(body)
    try:
        async with memo.locks.setdefault(cr.key, asyncio.Lock()):
            await reconcile(memo.kube, cr, logger, status=dict(body.get("status") or {}))
    except NotReady as e:
        raise kopf.TemporaryError(str(e), delay=2) from e
    except Degraded as e:  # the status says it; try again now and then, e.g. for a CRD installed later
        raise kopf.TemporaryError(str(e), delay=120) from e
    except (kube.KubeApiError, aiohttp.ClientError, TimeoutError) as e:
        metrics.RECONCILES.labels(*cr.key, "error").inc()
        raise kopf.TemporaryError(f"API call failed: {e}", delay=5) from e
