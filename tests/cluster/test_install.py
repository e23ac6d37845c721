"""README's install order on a real API server: the CRDs, then the operator's manifests,
then pools and quotas; every sample and example accepted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import FIELD_MANAGER, MANIFESTS, Cluster, condition, dump, in_namespace

EXAMPLES = sorted(p for p in (MANIFESTS / "examples").iterdir()
                  if (p / "kustomization.yaml").exists())


def test_crds_are_established_as_committed(api: Cluster) -> None:
    for crd in api.kubectl.kustomize(MANIFESTS / "crds"):
        name = crd["metadata"]["name"]
        live = api.kubectl.get("crd", name)
        for type_ in ("NamesAccepted", "Established"):
            found = condition(live, type_)
            assert found and found["status"] == "True", f"{name} {type_}:\n{dump(live)}"
        served = {v["name"] for v in live["spec"]["versions"] if v["served"]}
        assert served == {v["name"] for v in crd["spec"]["versions"]}


def test_crds_reapply_is_a_no_op(api: Cluster) -> None:
    before = {c["metadata"]["name"]: c["metadata"]["resourceVersion"]
              for c in api.kubectl.items("crd") if c["metadata"]["name"].endswith(
                  ("kvquota.dev", "kopf.dev"))}
    api.kubectl.apply(str(MANIFESTS / "crds"), manager="kubectl")
    after = {c["metadata"]["name"]: c["metadata"]["resourceVersion"]
             for c in api.kubectl.items("crd") if c["metadata"]["name"] in before}
    assert after == before


def test_samples_are_accepted_with_their_defaults(api: Cluster, namespace: str) -> None:
    samples = in_namespace(api.kubectl.kustomize(MANIFESTS / "samples"), namespace)
    api.kubectl.apply(samples, manager="kubectl")
    for obj in samples:
        kind = f"{obj['kind'].lower()}s.kvquota.dev"
        live = api.kubectl.get(kind, obj["metadata"]["name"], namespace)
        assert live is not None, f"{kind}/{obj['metadata']['name']} missing after apply"
        assert live["metadata"]["generation"] == 1
        if obj["kind"] == "TenantQuota":  # the schema's defaults, filled by the server
            assert live["spec"]["kvCache"].get("aboveMax") == "Reclaimable", dump(live)
            assert live["spec"]["prefixCache"]["isolation"] == "Tenant", dump(live)
    table = api.kubectl.run("get", "kvpool,tq", "-n", namespace).stdout
    assert "demo-pool" in table and "acme" in table, table


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_is_accepted(api: Cluster, new_namespace: Callable[[str], str],
                             example: Path) -> None:
    """Server-side dry-run, each in a namespace of its own: the examples name images,
    nodes and Secrets that are not here. Kinds this server does not serve (the Gateway
    API's, or every core kind on a CRD-only server) are left out and named."""
    objects = in_namespace(api.kubectl.kustomize(example), new_namespace(example.name))
    served = [o for o in objects if api.serves_kind(o["apiVersion"], o["kind"])]
    left_out = sorted({f"{o['apiVersion']}/{o['kind']}" for o in objects if o not in served})
    if not served:
        pytest.skip(f"this server serves none of {example.name}'s kinds: {left_out}")
    api.kubectl.apply(served, manager=FIELD_MANAGER, dry_run=True)
    if left_out:
        print(f"{example.name}: not served here, not checked: {', '.join(left_out)}")
