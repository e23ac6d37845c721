"""The injection webhook, served by the real operator (kopf) against the KMock emulator.

Each real-world spec's pod is posted to kopf's webhook server as the API server posts
an AdmissionReview; kopf runs our handler and answers with a JSON patch, which is
applied as the API server would apply it. The result must validate against the
Kubernetes schemas, start vLLM with the plugin flags exactly once (vLLM's own parser),
and equal what `kvquota inject` makes of the same pod.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import jsonpatch
import pytest
from prometheus_client import REGISTRY

from kvquota.inject.objects import inject_object
from kvquota.inject.pod import INJECTED_ANNOTATION, REPLACED_ANNOTATION
from kvquota.inject.webhook import HANDLER_ID, WebhookConfig
from kvquota.runtime import OperatorConfig
from kvquota_lab.emulator import OperatorRunner, serve

from .checks import check_injected_pod
from .conftest import INJECTED, REFUSED, admission_review, load, pod_of

WAIT = 60.0  # bound of any wait on the operator (2 shared cores); a wait ends when met


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


POOL_MODEL = "demo-model"  # spec.model of the pool the fixture pods name (demo-pool)


@pytest.fixture
async def webhook_url() -> AsyncIterator[str]:
    port = _free_port()
    async with serve() as (_server, api_url), aiohttp.ClientSession() as session:
        pool = {"apiVersion": "kvquota.dev/v1alpha1", "kind": "InferencePool",
                "metadata": {"name": "demo-pool", "namespace": "default"},
                "spec": {"selector": {"matchLabels": {"kvquota.dev/pool": "demo-pool"}},
                         "model": POOL_MODEL}}
        async with session.post(
                f"{api_url}/apis/kvquota.dev/v1alpha1/namespaces/default/inferencepools",
                json=pool) as created:
            assert created.status < 400, await created.text()
        config = OperatorConfig(api_server=api_url, poll_interval=5.0, webhook=WebhookConfig(
            addr="127.0.0.1", port=port, insecure=True))
        runner = OperatorRunner(config)
        await runner.start(WAIT)
        try:
            yield f"http://127.0.0.1:{port}/{HANDLER_ID}"
        finally:
            await runner.stop(WAIT)


async def _review(url: str, pod: dict[str, Any]) -> dict[str, Any]:
    """POST an AdmissionReview; retried only while kopf's server is not listening yet."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.post(url, json=admission_review(pod)) as response:
                    assert response.status == 200, await response.text()
                    answer: dict[str, Any] = (await response.json())["response"]
                    return answer
            except aiohttp.ClientConnectorError:
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(0.1)


def _webhook_calls(result: str) -> float:
    labels = {"kind": "Pod", "operation": "CREATE", "result": result}
    return REGISTRY.get_sample_value("kvquota_operator_webhook_calls_total", labels) or 0.0


def _patched(pod: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    assert answer["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(answer["patch"]))
    result: dict[str, Any] = jsonpatch.apply_patch(pod, ops)
    return result


@pytest.mark.parametrize("name", INJECTED)
async def test_real_world_pods_are_injected_through_kopf(
    webhook_url: str, vllm_parser: argparse.ArgumentParser, name: str,
) -> None:
    pod = pod_of(load(name))
    answer = await _review(webhook_url, pod)
    assert answer["allowed"] is True, answer.get("status")
    injected = _patched(pod, answer)
    served = check_injected_pod(injected, vllm_parser).served_model_name
    # The pool's model name, unless the pod serves its own (the llm-d and KServe specs).
    own = any("served-model-name" in str(token) for container in pod["spec"]["containers"]
              for token in [*(container.get("command") or []), *(container.get("args") or [])])
    assert (served == [POOL_MODEL]) is not own
    # the webhook and `kvquota inject` agree
    assert injected == inject_object(pod, served_model_name=POOL_MODEL)
    assert injected["metadata"]["annotations"][INJECTED_ANNOTATION]
    # Injected twice (another webhook re-invoking us): nothing changes.
    again = await _review(webhook_url, injected)
    assert again["allowed"] is True and "patch" not in again


async def test_a_replaced_policy_is_recorded_and_warned_about(webhook_url: str) -> None:
    pod = pod_of(load("plain-deployment.yaml"))
    answer = await _review(webhook_url, pod)
    injected = _patched(pod, answer)
    record = injected["metadata"]["annotations"][REPLACED_ANNOTATION]
    assert "--scheduling-policy fcfs -> priority" in record
    assert any("fcfs -> priority" in w for w in answer.get("warnings", []))


@pytest.mark.parametrize("name", sorted(REFUSED))
async def test_pods_that_cannot_be_injected_are_refused_with_the_reason(
    webhook_url: str, name: str,
) -> None:
    pod = pod_of(load(name))
    denied = _webhook_calls("denied")
    answer = await _review(webhook_url, pod)
    assert answer["allowed"] is False
    assert _webhook_calls("denied") == denied + 1  # the operator's metrics count it
    message = answer["status"]["message"]
    assert REFUSED[name] in message
    meta = pod["metadata"]
    assert f"{meta['namespace']}/{meta.get('name') or meta['generateName']}" in message
    assert answer["status"]["code"] == 400


async def test_a_pod_without_the_pool_label_is_left_alone(webhook_url: str) -> None:
    pod = pod_of(load("plain-deployment.yaml"))
    del pod["metadata"]["labels"]["kvquota.dev/pool"]
    answer = await _review(webhook_url, pod)
    assert answer["allowed"] is True and "patch" not in answer
