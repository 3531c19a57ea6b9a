"""`make serve`'s launcher (serve_app/launch.py): the front door chosen for the graph, and, end to
end, `python -m serve_app.launch configs/serve.yaml` serving through the engine replica's own
HTTP server on the config's port, healing on the same port when the replica dies, releasing it
when stopped, and starting again at once after a stop with clients connected."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from conftest import STARTUP_BOUND_S, wait_healthy

from serve_app.config import AppConfig, SharedPortConfig
from serve_app.front_door import shared_socket
from serve_app.launch import (
    BUSY_MACHINE_ENV,
    HEADER_DEADLINE_ENV,
    IDLE_PACE_ENV,
    SERVE_LOOP_ENV,
    busy_ports,
    joins_running_cluster,
    main,
    plan,
)
from tests.conftest import free_port_block

ROOT = Path(__file__).parents[2]
SERVE_YAML = yaml.safe_load((ROOT / "configs" / "serve.yaml").read_text())


def with_args(**args) -> dict:
    app = SERVE_YAML["applications"][0]
    return SERVE_YAML | {"applications": [app | {"args": app["args"] | args}]}


def several_ingress_replicas(route_prefix: str = "/") -> dict:
    config = with_args(engine=SERVE_YAML["applications"][0]["args"]["engine"] | {"num_replicas": 2},
                       ingress={"num_replicas": 2, "max_body_bytes": 4096})
    return config | {"applications": [config["applications"][0] | {"route_prefix": route_prefix}]}


def test_the_ingress_replicas_serve_the_port_themselves_where_the_graph_allows():
    assert plan(SERVE_YAML)[0] == "direct"  # colocated: one engine replica, its front end inside
    split = with_args(engine=SERVE_YAML["applications"][0]["args"]["engine"] | {"num_replicas": 2})
    assert plan(split)[0] == "direct"  # one Ingress replica in front of two engines
    assert plan(several_ingress_replicas())[0] == "direct"  # they share the port
    assert plan(several_ingress_replicas("/llm"))[0] == "proxy"  # the own port serves the app at the root
    assert plan(SERVE_YAML | {"applications": SERVE_YAML["applications"] * 2})[0] == "proxy"
    assert plan(SERVE_YAML, starts_ray=False)[0] == "proxy"  # a running cluster's Serve keeps its settings


def test_the_ingress_replicas_port_is_the_configs_and_the_proxy_moves(monkeypatch):
    for name in IDLE_PACE_ENV | SERVE_LOOP_ENV | BUSY_MACHINE_ENV:
        monkeypatch.delenv(name, raising=False)
    written = several_ingress_replicas()
    written["http_options"] = {"host": "0.0.0.0", "port": 9000, "keep_alive_timeout_s": 30}
    door, config, env = plan(written)
    assert door == "direct" and config["http_options"]["port"] == 9001
    app = AppConfig.model_validate(config["applications"][0]["args"])  # as `serve run` will take it
    assert app.ingress.shared_port == SharedPortConfig(host="0.0.0.0", port=9000, keep_alive_timeout_s=30.0)
    assert app.ingress.max_body_bytes == 4096 and app.ingress.num_replicas == 2  # the rest as written
    assert env == HEADER_DEADLINE_ENV | IDLE_PACE_ENV | SERVE_LOOP_ENV | BUSY_MACHINE_ENV  # not Ray's direct ingress
    assert plan(written, proxy_port=9100)[1]["http_options"]["port"] == 9100
    assert written["applications"][0]["args"]["ingress"] == {"num_replicas": 2, "max_body_bytes": 4096}


def test_a_running_cluster_is_joined_through_its_proxy(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert joins_running_cluster()
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert not joins_running_cluster()


def test_one_ingress_replica_takes_the_configs_port_and_moves_the_proxy():
    door, config, env = plan(SERVE_YAML)
    assert door == "direct"
    assert config["http_options"]["port"] == 8001 and SERVE_YAML["http_options"]["port"] == 8000
    app = AppConfig.model_validate(config["applications"][0]["args"])
    assert app.ingress.shared_port == SharedPortConfig(host="127.0.0.1", port=8000, keep_alive_timeout_s=30.0)
    assert not any(name.startswith("RAY_SERVE_DIRECT_INGRESS") or name == "RAY_SERVE_ENABLE_DIRECT_INGRESS"
                   for name in env)  # Ray's direct ingress binds without SO_REUSEADDR
    assert env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == "serve_app.front_door:install"
    assert plan(SERVE_YAML, proxy_port=9100)[1]["http_options"]["port"] == 9100


def test_the_proxy_keeps_the_config_as_written(monkeypatch):
    for name in IDLE_PACE_ENV | SERVE_LOOP_ENV | BUSY_MACHINE_ENV:
        monkeypatch.delenv(name, raising=False)
    door, config, env = plan(SERVE_YAML, "proxy")
    assert door == "proxy" and config == SERVE_YAML
    assert env == HEADER_DEADLINE_ENV | IDLE_PACE_ENV | SERVE_LOOP_ENV | BUSY_MACHINE_ENV
    assert HEADER_DEADLINE_ENV == {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "serve_app.front_door:install"}


def test_a_pace_set_in_the_environment_is_kept(monkeypatch):
    monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.1")
    monkeypatch.setenv("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "1")
    monkeypatch.delenv("RAY_SERVE_METRICS_EXPORT_INTERVAL_MS", raising=False)
    env = plan(SERVE_YAML)[2]
    assert "RAY_SERVE_CONTROL_LOOP_INTERVAL_S" not in env  # Ray reads the user's 0.1
    assert "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD" not in env  # and the user's thread
    assert env["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"] == IDLE_PACE_ENV["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"]


def test_a_taken_port_stops_the_launcher_with_a_clear_error(tmp_path, monkeypatch):
    """Serve would retry a replica that cannot bind its port forever; the launcher says why first."""
    port = free_port_block(2, 32000, 32768)
    config = SERVE_YAML | {"http_options": SERVE_YAML["http_options"] | {"port": port}}
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # no running cluster to join
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(os, "execvpe", lambda *a: pytest.fail("serve run started on a taken port"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        with pytest.raises(SystemExit, match=f"port {port + 1} on 127.0.0.1 is in use"):
            main([str(tmp_path / "serve.yaml")])
    assert busy_ports("127.0.0.1", [port, port + 1]) == []


def test_connections_closed_at_a_stop_keep_neither_the_launcher_nor_the_server_off_the_port():
    """The server closes its connections first at a stop, so its side holds them in TIME_WAIT for
    a minute. Its listening socket (serve_app.front_door) binds with SO_REUSEADDR, which its
    connections inherit: the next server binds the port at once, and the launcher counts
    listeners only."""
    port = free_port_block(1, 32000, 32768)
    server = shared_socket("127.0.0.1", port)
    server.listen()
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    assert busy_ports("127.0.0.1", [port]) == [port]
    accepted.close()  # the server's side closes first: TIME_WAIT there
    server.close()
    client.close()
    assert any(c.laddr.port == port and c.status == psutil.CONN_TIME_WAIT for c in psutil.net_connections("tcp"))
    assert busy_ports("127.0.0.1", [port]) == []
    shared_socket("127.0.0.1", port).close()  # the next start binds it


def listener(port: int) -> psutil.Process | None:
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return psutil.Process(conn.pid)
    return None


def launcher_alive(proc: subprocess.Popen, log: Path) -> Callable[[], None]:
    def check() -> None:
        assert proc.poll() is None, f"launcher exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
    return check


def complete(url: str) -> str:
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.slow
@pytest.mark.timeout(4 * STARTUP_BOUND_S)  # a start, a heal, a stop and a start at once
def test_make_serve_answers_on_the_replicas_own_port_and_heals_there(tmp_path):
    port = free_port_block(2, 32000, 32768)  # apart from the shared test cluster's direct-ingress ports
    config = SERVE_YAML | {"http_options": SERVE_YAML["http_options"] | {"port": port}}
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(config))
    ray_tmp = tempfile.mkdtemp(prefix="cbs-")  # short: Ray's socket paths must fit 107 bytes
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {
        "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "disabled"}
    log = tmp_path / "launch.log"

    def launch() -> subprocess.Popen:
        with log.open("a") as out:
            return subprocess.Popen([sys.executable, "-m", "serve_app.launch", str(tmp_path / "serve.yaml")],
                                    cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    proc = launch()
    direct, proxy = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"
    try:
        wait_healthy(direct, STARTUP_BOUND_S, launcher_alive(proc, log))
        replica = listener(port)
        assert replica is not None and "ServeReplica:cbserve:IngressRouterEngine" in " ".join(replica.cmdline())
        assert SERVE_LOOP_ENV.items() <= replica.environ().items()  # Serve's main loop runs the app's code
        text = complete(direct)
        assert text and complete(proxy) == text  # Serve's proxy, moved to the next port, answers too
        graph = psutil.Process(proc.pid).children(recursive=True)
        for name in ("ServeController", "log_monitor.py"):  # Serve's pace, and Ray's log monitor's, reached them
            process = [p for p in graph if name in " ".join(p.cmdline())]
            assert process and IDLE_PACE_ENV.items() <= process[0].environ().items(), name

        replica.kill()
        replica.wait(30)
        # Serve restarts the replica, which takes the port back
        wait_healthy(direct, STARTUP_BOUND_S, launcher_alive(proc, log))
        healed = listener(port)
        assert healed is not None and healed.pid != replica.pid
        assert "ServeReplica:cbserve:IngressRouterEngine" in " ".join(healed.cmdline())
        assert complete(direct) == text

        engine = [p for p in healed.children(recursive=True) if "run_child" in " ".join(p.cmdline())]
        assert engine  # the engine's step loop, in a process of its own
        assert [p.nice() for p in (healed, *engine)] == [0] * (1 + len(engine))  # not Ray's workers' 15
        held = [socket.create_connection(("127.0.0.1", p)) for p in (port, port + 1)]  # clients connected
        for conn in held:
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert conn.recv(65536).startswith(b"HTTP/1.1 200")
        proc.terminate()  # a service manager's stop: serve run, its Ray and the engine exit
        proc.wait(60)
        psutil.wait_procs([healed, *engine], timeout=60)
        assert not healed.is_running() and not any(p.is_running() for p in engine)
        for conn in held:
            conn.close()
        assert busy_ports("127.0.0.1", [port, port + 1]) == []  # closed connections linger, no listener

        proc = launch()  # a start at once: the connections the server closed are in TIME_WAIT
        wait_healthy(direct, STARTUP_BOUND_S, launcher_alive(proc, log))
        assert complete(direct) == text and complete(proxy) == text
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)
        shutil.rmtree(ray_tmp, ignore_errors=True)
