"""jaxpar.distributed in one process: initialize, process rows, global batches, port checks."""

import socket

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxpar.distributed as dist
from jaxpar.launch import ClusterError
from jaxpar.launch.ports import free_port, port_problem
from conftest import requires_devices

CLUSTER_VARS = ("JAXPAR_", "OMPI_COMM_WORLD", "SLURM_", "JOB_COMPLETION_INDEX", "RANK_ID")


@pytest.fixture
def clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith(CLUSTER_VARS):
            monkeypatch.delenv(name)
    yield
    dist.shutdown()


def test_initialize_one_process_is_idempotent(clean_env):
    spec = dist.initialize()
    assert (spec.num_processes, spec.process_id, spec.source) == (1, 0, "single")
    assert dist.initialize() is spec and dist.is_initialized()


def test_simulated_devices_after_backend_start_says_why(clean_env):
    jax.devices()
    assert dist.initialize(simulated_devices=len(jax.devices())).num_processes == 1
    dist.shutdown()
    with pytest.raises(RuntimeError, match="before any JAX operation"):
        dist.initialize(simulated_devices=len(jax.devices()) + 1)


def test_bad_timeout_and_env(clean_env, monkeypatch):
    with pytest.raises(ValueError, match="timeout=-1"):
        dist.initialize(timeout=-1)
    monkeypatch.setenv("JAXPAR_SIMULATED_DEVICES", "lots")
    with pytest.raises(ValueError, match="JAXPAR_SIMULATED_DEVICES='lots'"):
        dist.initialize()
    monkeypatch.delenv("JAXPAR_SIMULATED_DEVICES")
    for wait in ("nan", "inf"):     # nan gave up at once ("within nan s"), inf an OverflowError traceback
        monkeypatch.setenv("JAXPAR_CLUSTER_TIMEOUT", wait)
        with pytest.raises(ValueError, match=f"JAXPAR_CLUSTER_TIMEOUT='{wait}' must be a positive, finite number"):
            dist.initialize()
    for wait in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"timeout={wait} must be a positive, finite number of seconds"):
            dist.initialize(timeout=wait)


def test_process_rows():
    assert dist.process_rows(32, process_index=1, process_count=4) == slice(8, 16)
    assert dist.process_rows(8) == slice(0, 8)
    with pytest.raises(ValueError, match="global_batch_size=10 does not split over 4"):
        dist.process_rows(10, process_index=0, process_count=4)
    # the advice is a batch above (not 15 of 16 over 3)
    with pytest.raises(ValueError, match=r"does not split over 3 processes; use a multiple of 3, such as 18\.$"):
        dist.process_rows(16, process_index=0, process_count=3)
    # a row count that is not one was a slice of nothing (0) or of negative bounds (-4)
    for bad in (0, -4, 2.0, True):
        with pytest.raises(ValueError, match=f"global_batch_size={bad!r} must be a positive whole number of rows"):
            dist.process_rows(bad, process_index=0, process_count=4)


@requires_devices(8)
def test_make_global_batch():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    tokens = np.arange(16 * 5, dtype=np.int32).reshape(16, 5)
    labels = np.arange(16, dtype=np.float32)
    shardings = {"tokens": NamedSharding(mesh, P("data")), "labels": NamedSharding(mesh, P())}
    batch = dist.make_global_batch({"tokens": tokens, "labels": labels}, shardings)
    assert batch["tokens"].sharding == shardings["tokens"]
    np.testing.assert_array_equal(np.asarray(batch["tokens"]), tokens)
    np.testing.assert_array_equal(np.asarray(batch["labels"]), labels)
    wide = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    full = dist.make_global_batch(wide, NamedSharding(mesh, P("data", "model")), per_process=False)
    assert full.sharding.spec == P("data", "model")
    np.testing.assert_array_equal(np.asarray(full), wide)


def test_port_checks():
    port = free_port()
    assert port_problem(port) is None
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        assert "already in use" in port_problem(port)
        with pytest.raises(ClusterError, match=f"coordinator port {port} is already in use"):
            dist.check_port_free(f"127.0.0.1:{port}")


def spec_at(address):
    from jaxpar.launch import detect_cluster

    return detect_cluster({}, coordinator_address=address, num_processes=2, process_id=0)


def test_coordinator_bind_address_for_initialize(clean_env, monkeypatch, capsys):
    # Loopback stays on loopback, silently; the argument wins over the variable.
    assert dist._bind_address(spec_at("127.0.0.1:9000"), None) == "127.0.0.1:9000"
    monkeypatch.setenv("JAXPAR_COORDINATOR_BIND_ADDRESS", "127.0.0.2")
    assert dist._bind_address(spec_at("127.0.0.1:9000"), None) == "127.0.0.2:9000"
    assert dist._bind_address(spec_at("127.0.0.1:9000"), "[::1]") == "[::1]:9000"
    assert capsys.readouterr().err == ""
    # Listening on all interfaces (a host name, or asked for) comes with a warning.
    monkeypatch.delenv("JAXPAR_COORDINATOR_BIND_ADDRESS")
    assert dist._bind_address(spec_at("node-0:9000"), None) is None
    assert dist._bind_address(spec_at("node-0:9000"), "0.0.0.0") == "0.0.0.0:9000"
    err = capsys.readouterr().err
    assert err.count("listens on all interfaces") == 2 and "no authentication" in err
    monkeypatch.setenv("JAXPAR_COORDINATOR_BIND_ADDRESS", "x:y")
    with pytest.raises(ValueError, match="JAXPAR_COORDINATOR_BIND_ADDRESS 'x:y' must be"):
        dist._bind_address(spec_at("127.0.0.1:9000"), None)
    with pytest.raises(ValueError, match="bind_address='x:' must be"):
        dist._bind_address(spec_at("127.0.0.1:9000"), "x:")
