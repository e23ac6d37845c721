#!/usr/bin/env bash
# Create the kind cluster with a GPU worker, install the NVIDIA device plugin, build and
# load the KVQuota images, and deploy the operator, the sample pool/tenants and one GPU
# engine. Idempotent: re-running reuses the cluster and re-applies the manifests.
#
# Host prerequisites (see README.md): an NVIDIA driver, docker with the NVIDIA container
# toolkit as its default runtime and accept-nvidia-visible-devices-as-volume-mounts=true,
# kind, kubectl, helm, openssl.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "${HERE}/.." && pwd)"
WORK="${HERE}/.work"
CLUSTER="${KIND_CLUSTER_NAME:-kvquota}"
KIND_IMAGE="${KIND_IMAGE:-kindest/node:v1.32.2}"
DEVICE_PLUGIN_VERSION="${DEVICE_PLUGIN_VERSION:-0.17.1}"
NAMESPACE=default
OPERATOR_IMAGE=ghcr.io/kvquota/operator:v0.1.0
SIDECAR_IMAGE=ghcr.io/kvquota/sidecar:v0.1.0
WORKER="${CLUSTER}-worker"

say() { printf '\n==> %s\n' "$*"; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

for tool in docker kind kubectl helm openssl; do
  command -v "${tool}" >/dev/null || die "${tool} is not installed"
done
if ! { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null; }; then
  die "no working NVIDIA driver on this host (nvidia-smi -L failed)"
fi

say "checking that docker injects GPUs through volume mounts"
if ! docker run --rm -v /dev/null:/var/run/nvidia-container-devices/all ubuntu:22.04 \
    nvidia-smi -L; then
  die "docker does not inject GPUs from volume mounts. Run once, then retry:
  sudo nvidia-ctk runtime configure --runtime=docker --set-as-default --cdi.enabled
  sudo nvidia-ctk config --set accept-nvidia-visible-devices-as-volume-mounts=true --in-place
  sudo systemctl restart docker"
fi

mkdir -p "${WORK}"
if kind get clusters | grep -qx "${CLUSTER}"; then
  say "reusing kind cluster ${CLUSTER}"
else
  say "creating kind cluster ${CLUSTER}"
  kind create cluster --name "${CLUSTER}" --image "${KIND_IMAGE}" \
    --config "${HERE}/kind-config.yaml" --wait 120s

  say "installing the NVIDIA container toolkit in ${WORKER}"
  docker exec "${WORKER}" bash -euc '
    apt-get update -qq
    apt-get install -y -qq gpg curl >/dev/null
    curl -fsSL https://nvidia.github.io/libnvidia-container/gpgkey \
      | gpg --dearmor -o /usr/share/keyrings/nvidia-container-toolkit-keyring.gpg
    curl -fsSL https://nvidia.github.io/libnvidia-container/stable/deb/nvidia-container-toolkit.list \
      | sed "s#deb https://#deb [signed-by=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg] https://#g" \
      > /etc/apt/sources.list.d/nvidia-container-toolkit.list
    apt-get update -qq
    apt-get install -y -qq nvidia-container-toolkit >/dev/null
    nvidia-ctk runtime configure --runtime=containerd --set-as-default --cdi.enabled
    systemctl restart containerd'

  say "unmasking /proc/driver/nvidia in ${WORKER}"
  # Older toolkits mask the directory with a tmpfs; newer ones (>= 1.19) already set
  # ModifyDeviceFiles: 0 themselves (nvkind does the same check).
  docker exec "${WORKER}" bash -euc '
    if grep -q "ModifyDeviceFiles: 1" /proc/driver/nvidia/params 2>/dev/null \
       || ! [ -e /proc/driver/nvidia/params ]; then
      umount -R /proc/driver/nvidia || true
      cp /proc/driver/nvidia/params /root/gpu-params
      sed -i "s/^ModifyDeviceFiles: 1$/ModifyDeviceFiles: 0/" /root/gpu-params
      mount --bind /root/gpu-params /proc/driver/nvidia/params
    fi'
fi
kubectl config use-context "kind-${CLUSTER}" >/dev/null

say "installing the NVIDIA device plugin ${DEVICE_PLUGIN_VERSION}"
helm repo add nvdp https://nvidia.github.io/k8s-device-plugin >/dev/null 2>&1 || true
helm repo update nvdp >/dev/null
helm upgrade --install nvidia-device-plugin nvdp/nvidia-device-plugin \
  --version "${DEVICE_PLUGIN_VERSION}" --namespace nvidia --create-namespace --wait
for _ in $(seq 60); do
  gpus="$(kubectl get node "${WORKER}" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}')"
  [ -n "${gpus}" ] && [ "${gpus}" != "0" ] && break
  sleep 5
done
if [ -z "${gpus:-}" ] || [ "${gpus}" = "0" ]; then
  die "${WORKER} reports no allocatable nvidia.com/gpu"
fi
echo "${WORKER}: ${gpus} GPU(s) allocatable"

say "building and loading the KVQuota images"
docker build -f "${REPO}/Dockerfile.operator" -t "${OPERATOR_IMAGE}" "${REPO}"
docker build -f "${REPO}/Dockerfile.sidecar" -t "${SIDECAR_IMAGE}" "${REPO}"
kind load docker-image --name "${CLUSTER}" "${OPERATOR_IMAGE}" "${SIDECAR_IMAGE}"

say "deploying the operator and CRDs"
kubectl apply --server-side -k "${REPO}/manifests/crds"
kubectl apply --server-side -k "${REPO}/manifests/base"
kubectl wait --for=condition=Established --timeout=60s \
  crd/inferencepools.kvquota.dev crd/tenantquotas.kvquota.dev
kubectl -n kvquota-system rollout status deployment/kvquota-operator --timeout=180s

say "creating the engine Secret (a fresh key pair; the private key stays in ${WORK})"
if [ ! -f "${WORK}/jwt.key" ]; then
  openssl genrsa -out "${WORK}/jwt.key" 2048 2>/dev/null
  openssl rsa -in "${WORK}/jwt.key" -pubout -out "${WORK}/jwt.pub" 2>/dev/null
  openssl rand -hex 32 > "${WORK}/cache-salt"
fi
kubectl -n "${NAMESPACE}" create secret generic kvquota-auth \
  --from-file=jwt.pub="${WORK}/jwt.pub" --from-file=cache-salt="${WORK}/cache-salt" \
  --dry-run=client -o yaml | kubectl apply -f -

say "deploying the sample pool, tenants and the GPU engine"
kubectl apply --server-side -k "${REPO}/manifests/examples/gpu-engine"
# Pulling vllm/vllm-openai and the model weights takes a while on the first run.
kubectl -n "${NAMESPACE}" rollout status deployment/vllm-engine --timeout=30m
kubectl -n "${NAMESPACE}" wait --for=condition=Ready --timeout=300s \
  inferencepools.kvquota.dev/demo-pool

say "ready: run the GPU isolation test with"
echo "  .venv/bin/pytest e2e -v"
