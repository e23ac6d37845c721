"""The controller: bring a pool's ConfigMap and every status in line with its objects
and what its engines report (`reconciler`), through the Kubernetes API (`kube`) and
the engines' sidecars (`engines`); the status it writes (`status`, `sync`, `usage`)."""
