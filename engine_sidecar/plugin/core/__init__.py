"""The plugin's parts, composed over the engine they steer, still without vLLM.

`tenant_plugin.TenantPlugin` composes them; each reaches vLLM's scheduler only through
`engine_port.Engine`, which `engine_sidecar.plugin.vllm_engine` implements (and
tests/plugin/fake_engine.py, in memory).
"""
