"""Local mode: the operator's logic on a directory of YAML, no cluster.

`kvquota operator --local DIR` reads the YAML a user would `kubectl apply`, refuses
invalid objects with the messages the CRD validation gives, and writes what the
operator would below OUT: each pool's EnginePolicy (`policies/`) and each object's
status (`status/`), rewriting a file only when its content changes. DIR is only read.
`--once` renders and exits non-zero if an object is invalid or a quota not accepted;
without it the directory is watched. Details: docs/operator.md, "Local mode".
"""

from __future__ import annotations

import copy
import hashlib
import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import yaml

from engine_sidecar.contract.files import write_atomically
from engine_sidecar.contract.names import API_VERSION
from kvquota.api import ConditionType
from kvquota.paths import user_cache
from kvquota.policy.conditions import find
from kvquota.policy.plan import PoolPlan, plan_pool
from kvquota.reconcile.status import WARNING_REASONS, pool_status, tenant_status

POLICIES, STATUSES = "policies", "status"  # subdirectories of the output directory
Key = tuple[str, str, str]  # (kind, namespace, name)


def default_output(root: Path) -> Path:
    """`$XDG_CACHE_HOME/kvquota/local/<name>-<hash of the resolved input path>`: one
    directory per input, stable across runs, outside the input."""
    digest = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]
    return user_cache() / "local" / f"{root.resolve().name or 'root'}-{digest}"


@dataclass(frozen=True)
class Snapshot:
    """The input files as one scan read them: what a render reads, and what the
    watcher compares (equal snapshots mean equal content)."""

    root: Path
    files: tuple[tuple[Path, bytes], ...]  # path relative to root, content
    unreadable: tuple[tuple[Path, str], ...] = ()  # path relative to root, why


def scan(root: Path, *, skip: Path | None = None) -> Snapshot:
    """Read every YAML file below `root` (hidden paths and `skip` excluded)."""
    files, unreadable = [], []
    for path in _yaml_files(root, skip):
        try:
            files.append((path.relative_to(root), path.read_bytes()))
        except FileNotFoundError:
            continue  # deleted since it was listed: as if never seen
        except OSError as error:
            unreadable.append((path.relative_to(root), str(error)))
    return Snapshot(root, tuple(files), tuple(unreadable))


@dataclass(frozen=True)
class Document:
    path: Path  # relative to the input directory
    index: int  # position of the document in its file
    body: dict[str, Any]

    @property
    def key(self) -> Key:
        meta = self.body.get("metadata") or {}
        return (str(self.body.get("kind")), str(meta.get("namespace") or "default"),
                str(meta.get("name")))

    def where(self) -> str:
        return f"{self.path}#{self.index}"


@dataclass
class Report:
    """What one render found; `ok` decides the exit code of `--once`."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # accepted, but worth a look
    lines: list[str] = field(default_factory=list)
    written: list[Path] = field(default_factory=list)
    refused_quotas: int = 0

    @property
    def ok(self) -> bool:
        return not self.errors and not self.refused_quotas


def _yaml_files(root: Path, skip: Path | None) -> list[Path]:
    """In path order. os.walk, unlike rglob, never descends into hidden directories
    (.git) and ignores a directory that vanishes during the walk."""
    found = []
    for parent, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith(".")
                   and (skip is None or Path(parent, d) != skip)]
        found += [Path(parent, f) for f in files
                  if not f.startswith(".") and f.endswith((".yaml", ".yml"))]
    return sorted(found)


def load(inputs: Snapshot, report: Report) -> list[Document]:
    """Every kvquota.dev object of the snapshot in file order. Objects of other APIs are
    skipped; one meant for ours with a kind or version our CRDs do not serve (a typo
    such as `TenantQuotas`, `kvquota.io/...`) is an error, as `kubectl apply` says."""
    from kvquota.api.validation import is_ours, kind_error

    for path, why in inputs.unreadable:
        report.errors.append(f"{path}: cannot read YAML: {why}")
    documents = []
    for path, content in inputs.files:
        try:
            bodies = list(yaml.safe_load_all(content))
        except yaml.YAMLError as error:
            report.errors.append(f"{path}: cannot read YAML: {error}")
            continue
        for index, body in enumerate(bodies):
            if not isinstance(body, dict) or not is_ours(body.get("apiVersion"),
                                                         body.get("kind")):
                continue
            document = Document(path, index, body)
            unknown = kind_error(body.get("apiVersion"), body.get("kind"))
            if unknown:
                report.errors.append(f"{document.where()}: {document.key[1]}/"
                                     f"{document.key[2]}: {unknown}")
                continue
            documents.append(document)
    return documents


def _validated(
    documents: list[Document], previous: Mapping[Key, dict[str, Any]], report: Report,
) -> dict[Key, dict[str, Any]]:
    """Objects the API server would hold: invalid ones are refused (an invalid update
    of an object seen before keeps the old object, as in a cluster)."""
    from kvquota.api.validation import describe, validate_object

    accepted: dict[Key, dict[str, Any]] = {}
    for doc in documents:
        body = copy.deepcopy(doc.body)
        body.setdefault("metadata", {}).setdefault("namespace", "default")
        if doc.key in accepted:
            report.errors.append(f"{doc.where()}: {doc.key[0]} {doc.key[1]}/{doc.key[2]} "
                                 "is defined twice")
            continue
        old = previous.get(doc.key)
        errors = validate_object(body, copy.deepcopy(old) if old else None)
        if errors:
            report.errors.append(f"{doc.where()}: {describe(body, errors)}")
            if old is not None:
                accepted[doc.key] = old
            continue
        accepted[doc.key] = body
    return accepted


def _read_status(path: Path) -> dict[str, Any] | None:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    status = data.get("status") if isinstance(data, dict) else None
    return status if isinstance(status, dict) else None


def _write_if_changed(path: Path, text: str, report: Report) -> None:
    try:
        if path.read_text() == text:
            return
    except OSError:
        pass
    write_atomically(path, text)
    report.written.append(path)


def _status_document(body: Mapping[str, Any], status: dict[str, Any]) -> str:
    meta = {k: v for k, v in (body.get("metadata") or {}).items()
            if k not in ("managedFields",)}
    document = {"apiVersion": API_VERSION, "kind": body["kind"], "metadata": meta,
                "status": status}
    return yaml.safe_dump(document, sort_keys=False, default_flow_style=False)


def _summary(kind: str, key: tuple[str, str], status: Mapping[str, Any], extra: str) -> str:
    types = ((ConditionType.ACCEPTED, ConditionType.READY) if kind == "TenantQuota"
             else (ConditionType.READY, ConditionType.OVERSUBSCRIBED))
    parts = []
    for type_ in types:
        c = find(status.get("conditions"), type_) or {}
        parts.append(f"{type_}={c.get('status')} ({c.get('reason')})")
    return f"{kind} {key[0]}/{key[1]}: {', '.join(parts)}{extra}"


def render(inputs: Snapshot, output: Path, *, replicas: int = 1,
           previous: dict[Key, dict[str, Any]] | None = None,
           now: datetime | None = None) -> Report:
    """One pass over a snapshot: validate, plan every pool, write policies and statuses
    below `output`. `previous` (the objects of the last pass) is updated in place."""
    report = Report()
    objects = _validated(load(inputs, report), previous or {}, report)
    if previous is not None:
        previous.clear()
        previous.update(objects)
    now = now or datetime.now(UTC)
    pools = {(ns, name): body for (kind, ns, name), body in objects.items()
             if kind == "InferencePool"}
    tenants: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for (kind, ns, _), body in objects.items():
        if kind == "TenantQuota":
            pool_name = ((body.get("spec") or {}).get("poolRef") or {}).get("name")
            tenants.setdefault((ns, str(pool_name)), []).append(body)

    keep: set[Path] = set()
    for pool_key in sorted(set(pools) | set(tenants)):
        plan = plan_pool(pools.get(pool_key), tenants.get(pool_key, []),
                         namespace=pool_key[0], name=pool_key[1], ready_replicas=replicas)
        keep |= _write_pool(output, plan, pools.get(pool_key), tenants.get(pool_key, []),
                            now, report)
    for directory in (output / POLICIES, output / STATUSES):
        for stale in sorted(directory.glob("*")) if directory.is_dir() else ():
            if stale not in keep and stale.suffix in (".json", ".yaml"):
                stale.unlink()
    return report


def _write_pool(output: Path, plan: PoolPlan, pool: Mapping[str, Any] | None,
                tenants: list[dict[str, Any]], now: datetime, report: Report) -> set[Path]:
    written: set[Path] = set()
    ns, name = plan.namespace, plan.name
    if pool is not None:
        policy_path = output / POLICIES / f"{ns}.{name}.json"
        if plan.policy is not None:
            _write_if_changed(policy_path, plan.policy.to_json() + "\n", report)
            written.add(policy_path)
        else:
            report.errors.append(f"InferencePool {ns}/{name}: {plan.error}")
        status_path = output / STATUSES / f"{ns}.inferencepool.{name}.yaml"
        meta = pool.get("metadata") or {}
        status = pool_status(plan, engines=None, old=_read_status(status_path),
                             generation=meta.get("generation"), now=now)
        _write_if_changed(status_path, _status_document(pool, status), report)
        written.add(status_path)
        where = f" -> {policy_path.relative_to(output)}" if plan.policy else ""
        report.lines.append(_summary("InferencePool", (ns, name), status,
                                     f", {status.get('tenants', 0)} tenants{where}"))
    for body in tenants:
        meta = body.get("metadata") or {}
        tenant = (plan.tenants or {}).get((ns, str(meta.get("name"))))
        if tenant is None:
            continue
        status_path = output / STATUSES / f"{ns}.tenantquota.{meta.get('name')}.yaml"
        status = tenant_status(tenant, plan, engines=None, old=_read_status(status_path),
                               generation=meta.get("generation"), now=now)
        _write_if_changed(status_path, _status_document(body, status), report)
        written.add(status_path)
        if tenant.accepted.reason in WARNING_REASONS:
            report.warnings.append(f"TenantQuota {ns}/{meta.get('name')} "
                                   f"({tenant.accepted.reason}): {tenant.accepted.message}")
        if tenant.accepted.status == "False":
            report.refused_quotas += 1
            report.errors.append(f"TenantQuota {ns}/{meta.get('name')} not accepted "
                                 f"({tenant.accepted.reason}): {tenant.accepted.message}")
        effective = status.get("effective") or {}
        extra = (f", guaranteed {effective.get('guaranteedBlocksPerEngine')}/engine, "
                 f"max {effective.get('maxBlocksPerEngine')}/engine") if effective else ""
        report.lines.append(_summary("TenantQuota", (ns, str(meta.get("name"))), status, extra))
    return written


def _print(report: Report, stdout: TextIO, stderr: TextIO) -> None:
    for line in report.lines:
        print(line, file=stdout)
    for warning in report.warnings:
        print(f"warning: {warning}", file=stderr)
    for error in report.errors:
        print(f"error: {error}", file=stderr)


def run_local(directory: str | Path, *, once: bool, output: str | Path | None = None,
              replicas: int = 1, interval: float = 0.5, stdout: TextIO | None = None,
              stderr: TextIO | None = None,
              wait: Callable[[float], bool] | None = None) -> int:
    """Render `directory` into `output` (default: `default_output`), and with
    `once=False` keep re-rendering until interrupted or until `wait(interval)`, called
    between scans, returns True (as `threading.Event.wait` does once set). Returns the
    exit code."""
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    root = Path(directory).resolve()
    if not root.is_dir():
        print(f"error: {root} is not a directory", file=stderr)
        return 2
    target = Path(output).resolve() if output is not None else default_output(root)
    if target == root:
        print(f"error: --out {target} is the input directory; local mode never writes "
              "into its input (choose another directory)", file=stderr)
        return 2
    print(f"local mode: reading {root}, writing {target / POLICIES}/ and "
          f"{target / STATUSES}/", file=stdout)
    skip = target if target.is_relative_to(root) else None
    previous: dict[Key, dict[str, Any]] = {}
    rendered = scan(root, skip=skip)
    report = render(rendered, target, replicas=replicas, previous=previous)
    _print(report, stdout, stderr)
    stdout.flush()
    if once:
        return 0 if report.ok else 1
    wait = wait or threading.Event().wait
    pending: Snapshot | None = None  # changed input, rendered once a scan agrees
    while not wait(interval):
        current = scan(root, skip=skip)
        if current == rendered:
            pending = None
        elif current != pending:
            pending = current
        else:
            rendered, pending = current, None
            report = render(rendered, target, replicas=replicas, previous=previous)
            print(f"-- re-rendered ({len(report.written)} files written)", file=stdout)
            _print(report, stdout, stderr)
            stdout.flush()
    return 0 if report.ok else 1
