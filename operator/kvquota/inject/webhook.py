"""The injection webhook's server: kopf's WebhookServer with our certificates.

Three ways to get a serving certificate (`WebhookConfig`):
- `cert_dir` (cert-manager, `manifests/components/webhook-cert-manager`): tls.crt and
  tls.key from a mounted Secret; kopf re-reads them when cert-manager renews them, and
  cert-manager's CA injector keeps the webhook configuration's caBundle current.
- self-signed (the default, `manifests/base`): `kvquota.inject.certs` issues and
  renews them; this module publishes each new CA in the configuration's caBundle.
- `insecure`: plain HTTP, for embedding (tests) only; no API server calls plain HTTP.

The MutatingWebhookConfiguration itself is a static manifest, not kopf-managed: kopf
would rewrite it without the namespaceSelector that keeps system namespaces out.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import logging
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_sidecar.contract.names import GROUP
from kvquota.inject.certs import CA_FILE, CERT_FILE, KEY_FILE, ServingCert, issue, service_names
from kvquota.inject.pod import InjectionOptions

logger = logging.getLogger(__name__)

CONFIGURATION = "kvquota-sidecar-injector"  # manifests/base/webhook.yaml
WEBHOOK_NAME = f"inject.{GROUP}"
HANDLER_ID = "inject-sidecar"  # kopf appends it to the URL path
CaPublisher = Callable[[bytes], Awaitable[None]]


@dataclass
class WebhookConfig:
    addr: str = "0.0.0.0"
    port: int = 9443  # 0: any free port (embedding)
    host: str | None = None  # how the API server reaches us, for kopf's client config
    cert_dir: Path | None = None  # cert-manager's Secret, mounted
    insecure: bool = False
    service: str = "kvquota-webhook"
    namespace: str = "kvquota-system"
    configuration: str = CONFIGURATION
    renew_check_seconds: float = 3600.0
    lifetime: datetime.timedelta = datetime.timedelta(days=30)
    options: InjectionOptions = field(default_factory=InjectionOptions)
    # Where the self-signed pair is written (kopf's server loads files); default: a
    # private temporary directory.
    work_dir: Path | None = None


PUBLISH_RETRY_S = 30.0


class InjectionServer:
    """What `settings.admission.server` runs: yields kopf's client configs."""

    def __init__(self, config: WebhookConfig, publish_ca: CaPublisher | None) -> None:
        self.config = config
        self.publish_ca = publish_ca
        self.port: int | None = None  # the bound port, once serving
        self.current: ServingCert | None = None
        self.published = False  # the API server trusts `current`

    def _server(self, cert_dir: Path | None) -> Any:
        import kopf

        config = self.config
        common: dict[str, Any] = {"addr": config.addr, "port": config.port or _free_port(),
                                  "host": config.host}
        self.port = common["port"]
        if config.insecure:
            return kopf.WebhookServer(insecure=True, **common)
        assert cert_dir is not None
        ca = cert_dir / CA_FILE
        return kopf.WebhookServer(
            certfile=cert_dir / CERT_FILE, pkeyfile=cert_dir / KEY_FILE,
            cafile=ca if ca.exists() else None,
            file_check_interval=min(10.0, config.renew_check_seconds), **common)

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:
        config = self.config
        renewal: asyncio.Task[None] | None = None
        with contextlib.ExitStack() as stack:
            cert_dir = config.cert_dir
            if not config.insecure and cert_dir is None:
                cert_dir = config.work_dir or Path(stack.enter_context(
                    tempfile.TemporaryDirectory(prefix="kvquota-webhook-")))
                await self._renew(cert_dir)
                renewal = asyncio.create_task(self._keep_renewing(cert_dir))
            try:
                async for client_config in self._server(cert_dir)(fn):
                    yield client_config
            finally:
                if renewal is not None:
                    renewal.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await renewal

    async def _renew(self, cert_dir: Path) -> None:
        config = self.config
        fresh = issue(service_names(config.service, config.namespace), lifetime=config.lifetime)
        bundle = fresh.ca_pem + (self.current.ca_pem if self.current else b"")
        if self.publish_ca is not None:
            try:
                await self.publish_ca(bundle)  # trusted before it is served
            except Exception:
                if self.current is not None:
                    raise  # keep serving the trusted one
                # At start: serve anyway (the API server refuses an untrusted webhook,
                # so labelled pods wait, as with the operator down), never stop the
                # operator's reconciles for it, and publish again soon.
                self.published = False
                logger.exception("publishing the webhook CA failed; injection waits for it "
                                 "(retry in %.0f s)", PUBLISH_RETRY_S)
                fresh.write(cert_dir)
                self.current = fresh
                return
        self.published = True
        fresh.write(cert_dir)
        self.current = fresh
        logger.info("webhook serving certificate issued, valid until %s",
                    fresh.not_after.isoformat())

    async def _keep_renewing(self, cert_dir: Path) -> None:
        while True:
            await asyncio.sleep(self.config.renew_check_seconds if self.published
                                else min(self.config.renew_check_seconds, PUBLISH_RETRY_S))
            current = self.current
            if current is None or not self.published or current.due(
                    datetime.datetime.now(datetime.UTC)):
                try:
                    await self._renew(cert_dir)
                except Exception:  # keep serving the current one; retry at the next check
                    logger.exception("renewing the webhook certificate failed")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ca_publisher(api_server: str | None, configuration: str = CONFIGURATION) -> CaPublisher:
    """Set the caBundle of our webhook in its MutatingWebhookConfiguration: a JSON patch
    at the webhook's index, guarded by a `test` of its name (a merge patch would
    replace the whole `webhooks` list)."""

    async def publish(bundle: bytes) -> None:
        import kubernetes.client

        from kvquota.reconcile.kube import FIELD_MANAGER, api_client

        api = kubernetes.client.AdmissionregistrationV1Api(api_client(api_server))
        timeout = (5.0, 30.0)
        current = await asyncio.to_thread(
            api.read_mutating_webhook_configuration, configuration, _request_timeout=timeout)
        names = [w.name for w in current.webhooks or []]
        if WEBHOOK_NAME not in names:
            raise RuntimeError(f"MutatingWebhookConfiguration {configuration} has no webhook "
                               f"{WEBHOOK_NAME} (apply manifests/base)")
        at = names.index(WEBHOOK_NAME)
        patch = [
            {"op": "test", "path": f"/webhooks/{at}/name", "value": WEBHOOK_NAME},
            {"op": "add", "path": f"/webhooks/{at}/clientConfig/caBundle",
             "value": base64.b64encode(bundle).decode("ascii")},
        ]
        await asyncio.to_thread(api.patch_mutating_webhook_configuration, configuration,
                                patch, field_manager=FIELD_MANAGER, _request_timeout=timeout)

    return publish


def configure_admission(settings: Any, config: WebhookConfig | None, api_server: str | None
                        ) -> InjectionServer:
    """kopf settings for the webhook; without a config, plain HTTP on loopback (an
    embedding that did not ask for a webhook still needs a server: kopf refuses to run
    admission handlers without one)."""
    config = config or WebhookConfig(addr="127.0.0.1", port=0, insecure=True)
    publish = None if (config.insecure or config.cert_dir) else ca_publisher(
        api_server, config.configuration)
    server = InjectionServer(config, publish)
    settings.admission.server = server
    settings.admission.managed = None
    return server
