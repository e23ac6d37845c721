"""0.1.0's path of the EnginePolicy contract, kept until 0.4.0 for code that imports
it. Importing it warns once, naming `engine_sidecar.contract.policy`."""

from engine_sidecar.contract import policy as _policy
from engine_sidecar.contract.files import write_atomically
from engine_sidecar.contract.policy import *  # noqa: F403
from engine_sidecar.contract.renamed import warn_renamed

# What 0.1.0's module held: every public name of the contract's, and the atomic write.
__all__ = [*(n for n in vars(_policy) if not n.startswith("_")), "write_atomically"]

warn_renamed("engine_sidecar.policy")
