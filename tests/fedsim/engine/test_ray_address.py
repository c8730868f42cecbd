"""A Ray address that nothing answers at is a one-line error before anything starts or is recorded."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from fedsim.cli import main
from fedsim.engine.ray_address import CLIENT_PORT, GCS_PORT, _host_port, check_cluster, check_ray_address, joining
from fedsim.errors import ConfigError, RunFailedError


@pytest.fixture
def no_ray_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process is not connected to Ray (else there is nothing to check) and RAY_ADDRESS is unset."""
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_address_that_answers_passes_and_one_that_refuses_is_one_line(no_ray_here) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        check_ray_address(f"127.0.0.1:{port}", "engine.ray.address")
        check_ray_address(f"ray://127.0.0.1:{port}", "--address")
    port = closed_port()
    for address, flag in ((f"127.0.0.1:{port}", "engine.ray.address"), (f"ray://127.0.0.1:{port}", "--address")):
        with pytest.raises(ConfigError) as exc:
            check_ray_address(address, flag)
        assert str(exc.value) == (f"{flag}={address}: no Ray cluster answers at 127.0.0.1:{port} (connection "
                                  f"refused); start its head there (`ray start --head`) or fix {flag}")


def test_a_head_that_never_accepts_times_out_within_the_limit(no_ray_here) -> None:
    """A port whose accept queue is full drops the SYN, as a firewalled or hung head does: the check
    gives up after ``timeout_s`` instead of Ray's minutes of retries."""
    with socket.socket() as server, socket.socket() as queued:
        server.bind(("127.0.0.1", 0))
        server.listen(0)  # one connection fits in the queue; the next SYN is dropped
        port = server.getsockname()[1]
        queued.connect(("127.0.0.1", port))
        start = time.monotonic()
        with pytest.raises(ConfigError, match=rf"^engine.flower.address=127.0.0.1:{port}: no Ray cluster answers "
                                              rf"at 127.0.0.1:{port} \(timed out\)"):
            check_ray_address(f"127.0.0.1:{port}", "engine.flower.address", timeout_s=0.5)
        assert 0.4 < time.monotonic() - start < 3


def test_addresses_are_parsed_with_ray_s_default_ports() -> None:
    assert _host_port("head", GCS_PORT, "head", "f") == ("head", 6379)
    assert _host_port("head:1234", GCS_PORT, "head:1234", "f") == ("head", 1234)
    assert _host_port("head", CLIENT_PORT, "ray://head", "f") == ("head", 10001)
    assert _host_port("[::1]:6380", GCS_PORT, "[::1]:6380", "f") == ("::1", 6380)
    for bad in ("head:port", ":6379", "head:0", "head:70000", ""):
        with pytest.raises(ConfigError, match=rf"f={bad!r} is not a Ray address; use host:port, ray://host:port "
                                              r"or auto"):
            _host_port(bad, GCS_PORT, bad, "f")


def test_nothing_is_checked_without_a_cluster_or_when_connected(monkeypatch) -> None:
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    check_cluster(None, "engine.ray.address")  # a local Ray will be started: nothing to reach
    check_ray_address("local", "engine.ray.address")
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    check_ray_address(f"127.0.0.1:{closed_port()}", "engine.ray.address")  # connected already: ray.init is skipped


def test_ray_address_from_the_environment_names_it(no_ray_here, monkeypatch) -> None:
    port = closed_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    with pytest.raises(ConfigError, match=rf"^RAY_ADDRESS=127.0.0.1:{port}: no Ray cluster answers"):
        check_cluster(None, "--address")
    with pytest.raises(ConfigError, match=r"^--address=127.0.0.1:1: no Ray cluster answers"):
        check_cluster("127.0.0.1:1", "--address")  # the flag wins over the environment


def test_ray_failing_to_join_past_the_check_is_one_line(monkeypatch) -> None:
    """A head that accepts the connection but is not Ray (or a proxy that accepts every connection) passes
    the check; ray.init's ConnectionError then becomes one line naming the setting."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(RunFailedError) as exc:
        with joining("ray://head:10001", "engine.ray.address"):
            raise ConnectionError("ray client connection\ntimeout")
    assert str(exc.value) == ("engine.ray.address=ray://head:10001: could not join the Ray cluster (ray client "
                              "connection timeout); check that its head runs and that this machine reaches it")
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")
    with pytest.raises(RunFailedError, match=r"^RAY_ADDRESS=head:6379: could not join the Ray cluster \(TimeoutError\)"):
        with joining(None, "--address"):
            raise TimeoutError
    monkeypatch.delenv("RAY_ADDRESS")
    with pytest.raises(ConnectionError):  # a local Ray that failed to start is not an address problem
        with joining(None, "--address"):
            raise ConnectionError("raylet died")
    with pytest.raises(ValueError):  # other errors pass through
        with joining("head:6379", "--address"):
            raise ValueError("bad runtime_env")


@pytest.mark.parametrize("argv, flag", [
    (["run", "fedavg_digits", "rounds=1", "engine.name=ray", "engine.ray.address={a}"], "engine.ray.address"),
    (["run", "fedavg_digits", "rounds=1", "engine.name=flower", "engine.flower.address={a}"], "engine.flower.address"),
    (["sweep", "fedavg_digits", "--grid", "rounds=1", "--address", "{a}"], "--address"),
])
def test_the_cli_exits_2_on_one_line_and_records_nothing(argv, flag, no_ray_here, tmp_path, monkeypatch,
                                                          capsys) -> None:
    monkeypatch.chdir(tmp_path)
    address = f"127.0.0.1:{closed_port()}"
    assert main([part.format(a=address) for part in argv]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"{flag}={address}: no Ray cluster answers" in lines[0], err
    assert "per trial" not in out
    assert not (tmp_path / "fedsim-sweeps").exists() and not list(tmp_path.glob("mlruns*"))
    if (tmp_path / "mlflow.db").exists():  # the store may be created by its check, but holds no run
        from mlflow import MlflowClient

        client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
        ids = [e.experiment_id for e in client.search_experiments()]
        assert not client.search_runs(ids)


@pytest.mark.parametrize("engine", ["ray", "flower"])
def test_both_engines_join_the_cluster_ray_address_names(engine, no_ray_here, tmp_path, monkeypatch, capsys) -> None:
    """RAY_ADDRESS (read by ray.init itself) is a cluster to join for either engine: checked on one line,
    and the flower engine no longer asks ray.init for local CPUs, which Ray refuses when joining."""
    from fedsim.engine.flower import backend_config
    from fedsim.engine.runtime import RunSpec
    from fedsim.config import load_config

    monkeypatch.chdir(tmp_path)
    address = f"127.0.0.1:{closed_port()}"
    monkeypatch.setenv("RAY_ADDRESS", address)
    assert main(["run", "fedavg_digits", "rounds=1", f"engine.name={engine}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"RAY_ADDRESS={address}: no Ray cluster answers" in lines[0]
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        head = f"127.0.0.1:{server.getsockname()[1]}"
        monkeypatch.setenv("RAY_ADDRESS", head)
        init_args = backend_config(RunSpec.from_config(load_config("fedavg_digits")))["init_args"]
    assert init_args["address"] == head and "num_cpus" not in init_args


@pytest.mark.slow  # the one-at-a-time group: no other test's Ray cluster runs meanwhile
def test_auto_finds_a_running_ray_and_refuses_when_there_is_none(no_ray_here) -> None:
    import ray
    from ray._private.services import find_gcs_addresses

    ray.shutdown()  # a session an earlier test of this worker left (no-op when none)
    deadline = time.monotonic() + 30  # a cluster that just ended takes a moment to exit
    while True:
        find_gcs_addresses.cache_clear()
        running = find_gcs_addresses()
        if not running or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not running, f"a Ray cluster outlived its test: GCS at {sorted(running)}"
    with pytest.raises(ConfigError, match=r"^engine.ray.address=auto but no Ray cluster runs on this machine; "
                                          r"start one \(`ray start --head`\)"):
        check_ray_address("auto", "engine.ray.address")
    head = subprocess.Popen([sys.executable, "-c", "import ray, sys, time; ray.init(num_cpus=1, "
                             "include_dashboard=False); print('up', flush=True); sys.stdin.read()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert head.stdout.readline().strip() == "up"
        check_ray_address("auto", "engine.ray.address")  # Ray's own lookup finds its GCS, which answers
    finally:
        head.stdin.close()
        head.wait(timeout=60)
