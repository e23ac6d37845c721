"""The sidecar's perf harnesses (commands that print numbers, not tests):

- `python -m kvquota_lab.perf.sidecar`: latency added per request and per streamed token;
- `python -m kvquota_lab.perf.sidecar admission`: CPU of one admission decision;
- `python -m kvquota_lab.perf.sidecar huge`: huge prompts, another tenant's TTFT.
"""
