"""kopf handlers, one module per kind; importing this package registers them all with
kopf's default registry. They stay thin: work is done by `kvquota.reconcile.reconciler`."""

from kvquota.handlers import injection, lifecycle, pools, tenants

__all__ = ["injection", "lifecycle", "pools", "tenants"]
