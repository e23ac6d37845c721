"""Digital twin of one engine: vLLM's real scheduler and KV cache manager, no model.

`harness.SchedulerHarness` steps a stock or KVQuota scheduler with fake model outputs
on virtual time; benchmarks and tests drive it.
"""
