"""The webhook's self-signed serving certificate, as the API server sees it.

The operator (kopf, against KMock, whose MutatingWebhookConfiguration is the one in
manifests/base) issues a certificate for the webhook Service's DNS name, publishes its
CA as the configuration's caBundle, and renews it: the new CA is published next to the
old one before the server switches, so a client that trusts the bundle it last read
keeps connecting. The lifetime is shortened to seconds here; the rule is the same.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from kvquota.inject.webhook import CONFIGURATION, HANDLER_ID, WebhookConfig
from kvquota.runtime import OperatorConfig
from kvquota_lab.emulator import OperatorRunner, serve

from .conftest import admission_review, load, pod_of
from .test_webhook import WAIT, _free_port

REPO = Path(__file__).resolve().parents[2]
HOSTNAME = "kvquota-webhook.kvquota-system.svc"  # what the API server dials
MWC_PATH = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
# Renewed when 10 s are left: the steps before the renewal take well under the 20 s
# until then even on 2 busy cores (kopf is already serving when the clock starts).
LIFETIME = datetime.timedelta(seconds=30)


@pytest.fixture
async def tls_webhook(tmp_path: Path) -> AsyncIterator[tuple[str, int, aiohttp.ClientSession]]:
    (configuration, _service) = yaml.safe_load_all(
        (REPO / "manifests/base/webhook.yaml").read_text())
    port = _free_port()
    async with serve() as (_server, api_url), aiohttp.ClientSession() as session:
        async with session.post(api_url + MWC_PATH, json=configuration) as response:
            assert response.status < 300, await response.text()
        config = OperatorConfig(api_server=api_url, poll_interval=5.0, webhook=WebhookConfig(
            addr="127.0.0.1", port=port, work_dir=tmp_path / "certs", lifetime=LIFETIME,
            renew_check_seconds=0.2))
        runner = OperatorRunner(config)
        await runner.start(WAIT)
        try:
            yield api_url, port, session
        finally:
            await runner.stop(WAIT)


async def _bundle(api_url: str, session: aiohttp.ClientSession) -> bytes:
    async with session.get(f"{api_url}{MWC_PATH}/{CONFIGURATION}") as response:
        body: dict[str, Any] = await response.json()
    (webhook,) = body["webhooks"]
    return base64.b64decode(webhook["clientConfig"].get("caBundle") or "")


async def _wait(probe: Any, what: str) -> Any:
    deadline = asyncio.get_running_loop().time() + WAIT
    while asyncio.get_running_loop().time() < deadline:
        if value := await probe():
            return value
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


async def _served_cert(port: int, bundle: bytes) -> bytes | None:
    """The certificate the webhook serves, if a client trusting `bundle` accepts it for
    the Service's name (None while it is not listening yet)."""
    context = ssl.create_default_context(cadata=bundle.decode())
    try:
        _reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context,
                                                        server_hostname=HOSTNAME)
    except (ConnectionRefusedError, ConnectionResetError):
        return None
    der: bytes = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    writer.close()
    return der


async def test_the_api_server_trusts_the_webhook_across_a_renewal(
    tls_webhook: tuple[str, int, aiohttp.ClientSession],
) -> None:
    api_url, port, session = tls_webhook
    first = await _wait(lambda: _bundle(api_url, session), "a published caBundle")
    served = await _wait(lambda: _served_cert(port, first), "the webhook serving TLS")

    # An AdmissionReview over TLS, verified against the bundle as published now.
    context = ssl.create_default_context(cadata=(await _bundle(api_url, session)).decode())
    url = f"https://127.0.0.1:{port}/{HANDLER_ID}"
    async with session.post(url, json=admission_review(pod_of(load("plain-deployment.yaml"))),
                            ssl=context, server_hostname=HOSTNAME) as response:
        assert response.status == 200
        assert (await response.json())["response"]["allowed"] is True

    async def renewed() -> bytes | None:
        bundle = await _bundle(api_url, session)
        return bundle if bundle != first else None

    second = await _wait(renewed, "a renewed caBundle")
    assert second.endswith(first)  # the new CA, then the previous one
    assert second.count(b"BEGIN CERTIFICATE") == 2

    async def switched() -> bytes | None:
        cert = await _served_cert(port, second)
        return cert if cert is not None and cert != served else None

    await _wait(switched, "the server switching to the renewed certificate")
    # A client still holding only the old bundle no longer matches the new server cert,
    # which is why the bundle is published first.
    with pytest.raises(ssl.SSLCertVerificationError):
        await _served_cert(port, first)
