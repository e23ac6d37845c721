"""0.1.0's path of the pre-flight check, kept until 0.4.0: pods injected by 0.1.0 run
`python3 -m engine_sidecar.preflight --strict` in their `kvquota-check-plugin` init
container. Warns once, naming `engine_sidecar.plugin.preflight`, then runs it."""

from engine_sidecar.contract.renamed import warn_renamed
from engine_sidecar.plugin.preflight import main

__all__ = ["main"]

warn_renamed("engine_sidecar.preflight")

if __name__ == "__main__":
    raise SystemExit(main())
