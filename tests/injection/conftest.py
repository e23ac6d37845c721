"""Fixtures for injection tests: the real-world pod specs,
and AdmissionReviews as the API server sends them for the pods those specs create."""

from __future__ import annotations

import copy
import uuid
from pathlib import Path
from typing import Any

import yaml

FIXTURES = Path(__file__).parent / "fixtures"
# Injected: the four install methods. Refused: what cannot be injected, and why.
INJECTED = ["production-stack.yaml", "llm-d-decode.yaml", "kserve-predictor-pod.yaml",
            "vllm-docs-deployment.yaml", "plain-deployment.yaml"]
REFUSED = {
    "refused-custom-scheduler.yaml": "already sets --scheduler-cls",
    "refused-not-vllm.yaml": "no container runs vLLM's OpenAI server",
}


def load(name: str) -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load((FIXTURES / name).read_text())
    return obj


def pod_of(obj: dict[str, Any]) -> dict[str, Any]:
    """The Pod a workload's controller would create (what the webhook is asked about)."""
    if obj["kind"] == "Pod":
        return copy.deepcopy(obj)
    template = copy.deepcopy(obj["spec"]["template"])
    metadata = {**template.get("metadata", {}), "namespace": obj["metadata"]["namespace"],
                "generateName": f"{obj['metadata']['name']}-7d9f8c6b5-"}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]}


def admission_review(pod: dict[str, Any]) -> dict[str, Any]:
    """An AdmissionReview for creating `pod`, as the API server posts it to a webhook."""
    pod_kind = {"group": "", "version": "v1", "kind": "Pod"}
    pods = {"group": "", "version": "v1", "resource": "pods"}
    return {
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()), "kind": pod_kind, "resource": pods,
            "requestKind": pod_kind, "requestResource": pods,
            "name": pod["metadata"].get("name", ""),
            "namespace": pod["metadata"].get("namespace", "default"),
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller",
                         "groups": ["system:serviceaccounts"]},
            "object": pod, "oldObject": None, "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }
