"""The scheduler plugin: runs inside vLLM's EngineCore (`--scheduler-cls`).

`scheduler.TenantAwareScheduler` is vLLM's Scheduler plus tiers, KV leases and
tenant-aware preemption; it hands each hooked call to `tenant_plugin.TenantPlugin`,
whose parts import no vLLM (docs/scheduler-plugin.md lists them). `vllm_compat`,
`vllm_engine` and `allocation_hook` hold every private vLLM touchpoint; `preflight`
checks an image before the engine starts. `kvquota install-plugin` copies this
package, `contract/` and 0.1.0's paths (`engine_sidecar.scheduler`, `.preflight`,
`.policy`) only.
"""
