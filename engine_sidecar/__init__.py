"""Engine side of KVQuota: the admission sidecar and the in-engine scheduler plugin.

`engine_sidecar.policy` is the contract the operator renders; nothing here imports the
operator (`kvquota`).
"""
