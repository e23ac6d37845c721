"""The HOST:PORT form every KVQuota process's listen flags take (`--listen`,
`--admin-listen`, `--webhook-listen`): the manifests and injection write them."""

from __future__ import annotations


def parse_listen(value: str, flag: str = "--listen") -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise SystemExit(f"{flag} must be HOST:PORT, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)
