"""Start-up without a cluster: each rank's share of its node's KV budget, the one-line errors
for a worker that cannot start or be placed, actors whose constructor never raises, the ports
`tandem up` checks before it starts anything, and Ray's token notice."""

from __future__ import annotations

import logging
import socket

import pytest
import ray

from cluster.deployment.deployment import kv_memory_shares
from cluster.engine.config import EngineConfig, EngineConfigError
from cluster.deployment.launcher import port_problem, up
from cluster.runtime.ray_runtime import quiet_auth_notice
from cluster.runtime.startup import (
    CLI_SETTINGS,
    TOPOLOGY_SETTINGS,
    ClusterStartError,
    exception_line,
    guarded,
    placement_failed,
    serving_failed,
    worker_failed,
)
from cluster.topology import parse_topology

pytestmark = pytest.mark.unit


# -- the KV budget is the node's ----------------------------------------------------------------

def test_cpu_ranks_on_one_node_share_its_budget():
    # prefill TP 3 and decode TP 1 on node a; a decode worker alone on node b; a GPU worker on a.
    shares = kv_memory_shares([("a", 3, True), ("a", 1, True), ("b", 1, True), ("a", 2, False)])
    assert shares == [0.25, 0.25, 1.0, 1.0]


def test_engine_share_defaults_to_its_own_ranks():
    assert EngineConfig(model="m").kv_share == 1.0
    assert EngineConfig(model="m", tensor_parallel_size=4).kv_share == 0.25
    assert EngineConfig(model="m", tensor_parallel_size=4, device="cuda:0").kv_share == 1.0  # a GPU each
    assert EngineConfig(model="m", tensor_parallel_size=4, kv_memory_share=0.1).kv_share == 0.1
    for bad in (0, 1.5, True, "half"):
        with pytest.raises(EngineConfigError, match="kv_memory_share must be in"):
            EngineConfig(model="m", kv_memory_share=bad)


# -- one line per failure --------------------------------------------------------------------

def test_ray_memory_monitor_kill_names_the_kv_setting():
    killed = ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory.\n" * 5)
    error = worker_failed("prefill-0", killed, CLI_SETTINGS, 0.25, None)
    assert str(error) == ("prefill-0 ran out of memory while starting (Ray's memory monitor killed it: the node "
                          "ran low on memory): lower --kv-cache-memory-fraction (now 0.25) or give --num-kv-blocks")
    error = worker_failed("decode-1", killed, TOPOLOGY_SETTINGS, 0.25, 4096)
    assert str(error).endswith("lower kv.num_blocks (now 4096)")


def test_a_failed_allocation_is_out_of_memory_and_other_errors_are_quoted():
    allocation = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                              "memory: you tried to allocate 8192002097152 bytes. Error code 12\nmore")
    assert str(worker_failed("decode-0", allocation, TOPOLOGY_SETTINGS, 0.5, None)) == (
        "decode-0 ran out of memory while starting (could not allocate 7,629.4 GiB): lower "
        "kv.cache_memory_fraction (now 0.5) or give kv.num_blocks")
    cuda = RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB")
    assert str(worker_failed("decode-0", cuda, CLI_SETTINGS, 0.9, None)) == (
        "decode-0 ran out of memory while starting (RuntimeError: CUDA out of memory. Tried to allocate 20.00 GiB): "
        "lower --kv-cache-memory-fraction (now 0.9) or give --num-kv-blocks")
    refused = EngineConfigError("max_model_len 4096 exceeds the model's max_position_embeddings 512")
    assert str(worker_failed("prefill-1", refused, CLI_SETTINGS, 0.25, None)) == (
        "prefill-1 failed to start: max_model_len 4096 exceeds the model's max_position_embeddings 512")


def test_a_worker_process_that_died_points_at_memory_too():
    died = ray.exceptions.ActorDiedError()
    assert str(worker_failed("decode-0", died, CLI_SETTINGS, 0.25, None)) == (
        "decode-0 died while starting: its process died (a signal, the kernel's out-of-memory killer, or a "
        "crash); if it ran out of memory, lower --kv-cache-memory-fraction")


def test_a_worker_killed_mid_run_is_one_line_too():
    killed = ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory.\nMore.")
    assert serving_failed(killed, CLI_SETTINGS) == (
        "a worker failed while serving: Ray's memory monitor killed it: the node ran low on memory; lower "
        "--kv-cache-memory-fraction or --max-num-seqs")


def test_an_actor_constructor_error_reads_as_its_last_line():
    error = ray.exceptions.RayActorError(error_msg="The actor died because of an error raised in its creation "
                                                   "task, \x1b[36mray::X.__init__()\x1b[39m\n  File \"x.py\", line 3\n"
                                                   "cluster.runtime.startup.ClusterStartError: prefill-0 failed to start: no",
                                         actor_init_failed=True)
    assert exception_line(error) == "prefill-0 failed to start: no"


def test_placement_failures_name_the_worker_and_the_settings():
    assert str(placement_failed("prefill-0", "prefill", 3, {"CPU": 0.25}, CLI_SETTINGS, never=True)) == (
        "cannot place prefill-0: its 3 ranks need 0.25 CPU each, all on one node, and no node of the Ray cluster "
        "has that (see `ray status`); change --prefill-tp or --prefill-workers")
    message = str(placement_failed("decode-2", "decode", 1, {"CPU": 1, "GPU": 1}, TOPOLOGY_SETTINGS, never=False))
    assert message == ("cannot place decode-2: its rank needs 1 CPU, 1 GPU, and the Ray cluster has no room for that "
                       "(see `ray status`); change decode.tp, decode.cpus_per_rank, decode.gpus_per_rank or "
                       "decode.node.resources")
    assert isinstance(placement_failed("p", "prefill", 1, {}, CLI_SETTINGS, True), ClusterStartError)


class _Engine:
    """Stands for a worker: its constructor refuses a bad setting."""

    def __init__(self, size: int):
        if size < 1:
            raise EngineConfigError(f"size must be positive, got {size}")
        self.size = size


def test_guarded_keeps_a_constructor_error_for_started():
    good = guarded(_Engine)(3)
    assert good.started() is True and good.size == 3
    bad = guarded(_Engine)(0)  # does not raise here, where Ray would print the traceback
    with pytest.raises(EngineConfigError, match="size must be positive, got 0"):
        bad.started()
    assert guarded(_Engine).__name__ == "_Engine"


# -- ports `tandem up` needs ---------------------------------------------------------------------

@pytest.fixture
def held_port():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_a_server_port_in_use_is_one_line_naming_it(held_port):
    spec = parse_topology(f"server:\n  port: {held_port}\n")
    assert port_problem(spec) == (f"server.port: port {held_port} on 127.0.0.1 is already in use; choose another "
                                  "server.port, or stop what holds it")
    assert port_problem(parse_topology("server:\n  port: 0\n")) is None


def test_dashboard_and_metrics_ports_of_a_local_ray(held_port):
    spec = parse_topology(f"server:\n  port: 0\nobservability:\n  metrics_export_port: {held_port}\n")
    assert port_problem(spec).startswith(f"observability.metrics_export_port: port {held_port} on 127.0.0.1 is "
                                         "already in use")
    spec = parse_topology(f"server:\n  port: 0\nobservability:\n  dashboard: true\n  dashboard_port: {held_port}\n")
    assert port_problem(spec).startswith("observability.dashboard_port:")
    # Joining a remote Ray, the API and Ray's ports are on its head node, not here.
    spec = parse_topology(f"server:\n  port: {held_port}\nray:\n  address: head.example:6379\n")
    assert port_problem(spec) is None


def test_up_stops_at_a_busy_port_before_starting_anything(held_port, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    spec = parse_topology(f"cluster:\n  name: unit-busy\nserver:\n  port: {held_port}\n")
    assert up(spec, spec.to_yaml(), detach=False, argv=[]) == 1
    assert capsys.readouterr().err == (f"[tandem] server.port: port {held_port} on 127.0.0.1 is already in use; "
                                       "choose another server.port, or stop what holds it\n")
    assert not ray.is_initialized()


# -- Ray's token notice ------------------------------------------------------------------------

def test_rays_token_notice_is_dropped_and_other_warnings_are_not():
    quiet_auth_notice()
    quiet_auth_notice()  # once per process, however often called
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    assert len(logger.filters) == 1
    notice = logger.makeRecord(logger.name, logging.WARNING, __file__, 1, "Token authentication is enabled for "
                               "this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.", (), None)
    other = logger.makeRecord(logger.name, logging.WARNING, __file__, 1, "Token authentication is disabled", (),
                              None)
    assert not logger.filter(notice) and logger.filter(other)
