"""The way in of every request that needs a tenant: policy, caller, body, and
the parsing and vetting of what admission reads from it."""
