"""The scheduler plugin: runs inside vLLM's EngineCore (`--scheduler-cls`).

`scheduler.TenantAwareScheduler` is vLLM's Scheduler plus tiers, KV leases and
tenant-aware preemption; `tenant_policy` is its vLLM-free logic; `vllm_compat` holds
every private vLLM touchpoint; `policy_watch` and `stats_publisher` read the policy
and publish stats through the shared files; `preflight` checks an image before the
engine starts. `kvquota install-plugin` copies this package, `contract/` and 0.1.0's
paths (`engine_sidecar.scheduler`, `.preflight`, `.policy`) only.
"""
