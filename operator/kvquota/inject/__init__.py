"""Sidecar injection: turn the pod of any vLLM install into a KVQuota engine.

One pure core (`inject_pod`) serves both the operator's mutating admission webhook
(`kvquota.handlers.injection`) and the offline `kvquota inject` command, so a pod
injected at admission and one injected in a GitOps repository are the same pod.

- `vllm_argv`: find the vLLM container and edit its command line, wherever its flags
  are (`command`, `args` or both; `vllm serve` or `python -m vllm.entrypoints...`).
- `pod`: the containers, volumes, ports, probes and annotations added to a pod spec.
- `objects`: Pods, Deployments, StatefulSets (and other pod-template owners) in YAML.
"""

from kvquota.inject.pod import InjectionOptions, InjectionRefused, inject_pod

__all__ = ["InjectionOptions", "InjectionRefused", "inject_pod"]
