"""What a pool's policy is, computed purely from its objects: admission of each quota
(`plan`), each tenant's resolved settings (`resolve`), the EnginePolicy (`render`),
and the conditions they want on status (`conditions`). No Kubernetes calls: the
operator and local mode run the same code."""
