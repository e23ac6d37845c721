"""The sidecar's connection to its pool's shared ledger, as the policy names it.

Built when the policy's `poolStore` appears or changes (the password read from the
store's own mounted Secret, else from the pool's secrets directory where earlier
releases told users to put it; never logged), dropped when it goes; `run` refreshes this
sidecar's claims three times per TTL so they outlive it by at most one TTL. While
connected, a thread answers the other sidecars' requests to lean (`PoolStore.listen`),
and every round trip runs on the store's own thread (`worker.StoreThread`), never on
the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path

from engine_sidecar.contract.policy import EnginePolicy, PoolStorePolicy
from engine_sidecar.gateway.admission.rules import PoolView
from engine_sidecar.gateway.pool.admission import PoolAdmission
from engine_sidecar.gateway.pool.store import PoolStore, connect
from engine_sidecar.gateway.pool.worker import StoreThread

logger = logging.getLogger(__name__)


class PoolLink:
    def __init__(self, secrets_dir: Path | None, engine_id: str | None,
                 store_secrets_dir: Path | None = None) -> None:
        self.secrets_dir = secrets_dir
        self.store_secrets_dir = store_secrets_dir
        # One hash per sidecar: the pod name, else unique to this process.
        self.sidecar = engine_id or f"{socket.gethostname()}-{os.getpid()}"
        self._spec: tuple[str, PoolStorePolicy] | None = None
        self.admission: PoolAdmission | None = None
        self._store: PoolStore | None = None  # the admission's, listening for leans
        self._thread: StoreThread | None = None  # where its round trips run
        # What the store's answers wake: the queue's pump (the Admitter sets it).
        self.wake: Callable[[], None] = lambda: None
        # Why the policy's store is not used (its password is not mounted or readable):
        # the status reports it, so the pool's StoreDegraded condition says so.
        self.problem: str | None = None

    def for_policy(self, policy: EnginePolicy) -> PoolAdmission | None:
        """The pool-wide admission for `policy` (None: the policy names no store, or
        names one this sidecar cannot use yet: asked again, it looks for the password
        again, so a Secret mounted later takes effect with no restart)."""
        spec = (policy.pool, policy.pool_store) if policy.pool_store is not None else None
        if spec == self._spec and self.problem is None:
            return self.admission
        self._spec = spec
        self.close()
        self._store, self._thread = None, None
        self.admission = None if spec is None else self._connect(*spec)
        if spec is None:
            self.problem = None
        return self.admission

    def close(self) -> None:
        """Stop listening to the store (the app's shutdown, or a new store)."""
        if self._store is not None:
            self._store.close()
        if self._thread is not None:
            self._thread.close()

    def _connect(self, pool: str, store: PoolStorePolicy) -> PoolAdmission | None:
        password = None
        if store.password_file is not None:
            password = self._password(store.password_file)
            if password is None:
                return None
        self.problem = None
        client = connect(store.address, password, timeout_s=store.timeout_ms / 1000)
        logger.info("kvquota: pool-wide admission on the store at %s", store.address)
        # Every round trip on a thread of its own: the event loop never waits on the store.
        self._thread = StoreThread(f"kvquota-pool-io-{self.sidecar}")
        self._store = PoolStore(client, pool, self.sidecar, ttl_s=store.ttl_seconds,
                                io=self._thread)
        self._store.listen()
        return PoolAdmission(self._store, self._thread, lambda: self.wake())

    def _password(self, key: str) -> str | None:
        """The store's password from the first secrets directory that has `key`; None
        (and `problem` set, logged once) when none has it or it cannot be read."""
        dirs = [d for d in (self.store_secrets_dir, self.secrets_dir) if d is not None]
        found = [d / key for d in dirs if (d / key).is_file()]
        problem: str
        if not found:
            problem = (f"the store's password (key {key}) is not mounted: mount the Secret "
                       "spec.poolStore.passwordSecretRef names (kvquota inject "
                       "--pool-store-secret)")
        else:
            try:
                return found[0].read_text().strip()
            except OSError as error:
                problem = f"cannot read the store's password file {key} ({type(error).__name__})"
        if problem != self.problem:
            logger.error("kvquota: %s; looked in %s; pool-wide admission off until it is "
                         "there", problem, ", ".join(str(d) for d in dirs) or "no directory")
        self.problem = problem
        return None

    async def run(self, policy: Callable[[], EnginePolicy | None],
                  view: Callable[[], PoolView | None]) -> None:
        """Refresh this sidecar's claims 3x per TTL while the policy names a store."""
        while True:
            current = policy()
            admission = self.for_policy(current) if current is not None else None
            pool_view = view()
            if admission is not None and current is not None and pool_view is not None:
                admission.refresh(current, pool_view)
                await asyncio.sleep(admission.store.ttl_s / 3)
            else:
                await asyncio.sleep(1.0)
