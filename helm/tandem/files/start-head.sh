#!/bin/bash
# The Ray head container's command (the RayCluster sets ray.io/overwrite-container-cmd, so
# KubeRay runs this instead of its own command and leaves its `ray start --head ... --block`
# in $KUBERAY_GEN_RAY_START_CMD).
#
# 1. Ray's head starts in the background (the GCS, the dashboard, the head's raylet).
# 2. wait_for_workers.py waits until the GCS answers and every prefill and decode pod has
#    joined (each declares its pool's custom resource), so that `tandem up` can place every
#    worker's placement group at once.
# 3. `tandem up` runs in the foreground: it places the workers, starts the registry client,
#    the routers, and serves the gRPC and HTTP APIs from this pod.
#
# The container lives as long as the deployment: SIGTERM (pod deletion) stops `tandem up`
# (which stops the workers) and then Ray; if `tandem up` or Ray exits by itself, the container
# exits non-zero and Kubernetes restarts the head, and with it the whole Ray cluster.
set -uo pipefail

CONFIG_DIR="${TANDEM_CONFIG_DIR:-/etc/tandem}"
RAY_ADDRESS_LOCAL="127.0.0.1:6379"

log() { echo "[tandem-head] $*" >&2; }

ulimit -n 65536 2>/dev/null || log "could not raise the open-files limit (ulimit -n 65536)"

if [[ -z "${KUBERAY_GEN_RAY_START_CMD:-}" ]]; then
    log "KUBERAY_GEN_RAY_START_CMD is not set: this script runs under KubeRay >= 1.1 with ray.io/overwrite-container-cmd"
    exit 2
fi

# Through a shell: the generated command quotes its JSON arguments (--resources) for one; a
# single command, which that shell execs, so that $ray_pid is `ray start` itself.
/bin/bash -c "$KUBERAY_GEN_RAY_START_CMD" &
ray_pid=$!
tandem_pid=""
wait_pid=""
stopping=""

stop_ray() {
    ray stop >/dev/null 2>&1 || true  # stops the node's Ray processes; `ray start --block` stays
    kill -TERM "$ray_pid" 2>/dev/null
    wait "$ray_pid" 2>/dev/null
}

stop() {
    stopping=1
    log "stopping"
    [[ -n "$wait_pid" ]] && kill -TERM "$wait_pid" 2>/dev/null
    if [[ -n "$tandem_pid" ]] && kill -0 "$tandem_pid" 2>/dev/null; then
        kill -TERM "$tandem_pid" 2>/dev/null
        wait "$tandem_pid" 2>/dev/null
    fi
    stop_ray
    exit 0
}
trap stop TERM INT

python_bin="${TANDEM_PYTHON:-python3}"
"$python_bin" "$CONFIG_DIR/wait_for_workers.py" --address "$RAY_ADDRESS_LOCAL" --ray-pid "$ray_pid" &
wait_pid=$!
wait "$wait_pid"
rc=$?
[[ -n "$stopping" ]] && exit 0
if (( rc != 0 )); then
    log "the Ray cluster is not complete (exit $rc); exiting so that Kubernetes restarts the head"
    stop_ray
    exit 1
fi

log "starting tandem up --topology $CONFIG_DIR/topology.yaml --address $RAY_ADDRESS_LOCAL"
tandem up --topology "$CONFIG_DIR/topology.yaml" --address "$RAY_ADDRESS_LOCAL" &
tandem_pid=$!

# Until either exits (a trapped signal interrupts the wait: then stop() runs and exits).
while kill -0 "$tandem_pid" 2>/dev/null && kill -0 "$ray_pid" 2>/dev/null; do
    sleep 1 &
    wait $!
done
[[ -n "$stopping" ]] && exit 0
if ! kill -0 "$tandem_pid" 2>/dev/null; then
    wait "$tandem_pid"
    rc=$?
    log "tandem up exited (status $rc); stopping Ray"
else
    wait "$ray_pid"
    rc=$?
    log "Ray's head exited (status $rc); stopping tandem up"
    kill -TERM "$tandem_pid" 2>/dev/null
    wait "$tandem_pid" 2>/dev/null
fi
stop_ray
exit $(( rc == 0 ? 1 : rc ))
