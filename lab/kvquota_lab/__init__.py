"""The KVQuota lab: everything that measures or demonstrates the product, none of it
shipped in an image.

- `demo`, `workload`, `burst`, `loadgen`, `engine_state`, `verdict`, `summary`: the
  noisy-neighbour demo (`kvquota demo`) and its load;
- `tinymodel`, `processes`, `stack`, `cpu_offload`: local vLLM CPU engines and sidecars
  with a generated model (`kvquota tiny-model`);
- `twin/`, `bench/`: the digital twin and `kvquota bench`;
- `perf/`: the sidecar's latency and admission-CPU harnesses (`python -m
  kvquota_lab.perf.sidecar`);
- `emulator`, `emulator_process`, `bench_operator`: the operator against the KMock
  Kubernetes API emulator, in a thread or a process, and its benchmark.

Installed with the `lab` extra; the product CLI (`kvquota.cli`) lists the lab's
commands only when this package is importable.
"""
