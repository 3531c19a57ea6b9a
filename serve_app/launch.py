"""`make serve`: `serve run` on a serve YAML, with the front door chosen for its graph.

Clients reach the app through one of two front doors:
- **direct** (serve_app.front_door): every ingress replica serves the config's HTTP port itself
  (one replica, or several bound with SO_REUSEPORT, the kernel spreading connections over them).
  No proxy process on the data path and no Serve hop between the socket and the OpenAI front end,
  as with Ray's own direct ingress, which took 12% more tokens a second than the proxy on the
  64-request burst on 2 cores with half the serving processes' CPU; this front door matches it
  (BENCHMARKS.md, "Serving over HTTP"), and binds with SO_REUSEADDR where Ray's does not: the
  TIME_WAIT of the connections it closed at a stop then kept a restarted server off the port
  for a minute.
- **proxy**: Serve's HTTP proxy actor takes the connections and forwards each request to an
  ingress replica: several applications, a route prefix, a cluster the launcher joins, or KubeRay
  (its Service targets the head's proxy, and replicas run on worker pods).

With the direct front door Ray still starts Serve's proxy; it moves to the next port
(`--proxy-port`) and answers there too. The header deadline (`serve_app.front_door`) holds on both.

Serve's own periodic work, and Ray's log monitor's, is slowed where a graph this command starts
gains nothing from its pace (`IDLE_PACE_ENV`): on a small host every wake-up of an idle Serve or
Ray process takes a core from the engine's forward, and the forward's other thread waits for it
at the next barrier. Each replica runs the app's code and its handles' routing on its main event
loop (`SERVE_LOOP_ENV`), not on threads of their own.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Literal

import psutil
import yaml

from engine.cache_dir import cache_dir
from serve_app.serve_internals import joins_running_cluster

FrontDoor = Literal["direct", "proxy"]
HEADER_DEADLINE_ENV = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "serve_app.front_door:install"}
# The controller reconciles twice a second, not ten times: each pass asks the GCS for every node's
# state, resources and draining (three RPCs), and at 10 Hz that was the idle graph's largest cost
# (BENCHMARKS.md). Replicas and the proxy hand their cached request metrics to Ray once a second, not
# ten times; Ray exports metrics every 10 s. Ray's log monitor looks for new log files twice a second,
# as it does past 1,000 files, not at each of its ten polls a second (a glob of the logs directory
# each: half its CPU); a new worker's lines reach the console up to 0.5 s later, none lost.
IDLE_PACE_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
                 "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0"}


# A Serve replica by default runs the app's code on an event loop of its own thread and its handles'
# routing on a third, so every request, stream message and HTTP send crosses threads twice. On the
# main loop, as Serve's throughput mode runs them, the GPU config's ingress took 24-29% less CPU with
# an engine that outpaces it (BENCHMARKS.md). A handle used from a thread with no event loop must keep
# Serve's router thread (`handle._init(_run_router_in_separate_loop=True)`, as serve_app.draft does).
SERVE_LOOP_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


# What a machine whose cores other processes hold needs. Ray starts its workers (every Serve actor,
# so the replicas and the engine's step loop under them) at niceness 15: beside one busy process at
# the default 0 a replica gets ~1/30 of a core (the kernel's weights 36 and 1024), and starts and
# serves at that pace; at 0 it takes its fair share. Serve gives a starting proxy 5 s to answer its
# readiness check, then kills it and `serve run` fails; a busy machine starts it slower than that.
BUSY_MACHINE_ENV = {"RAY_worker_niceness": "0", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60"}


def serve_env() -> dict[str, str]:
    """IDLE_PACE_ENV, SERVE_LOOP_ENV and BUSY_MACHINE_ENV, less what the environment already sets."""
    return {k: v for k, v in (IDLE_PACE_ENV | SERVE_LOOP_ENV | BUSY_MACHINE_ENV).items() if k not in os.environ}


def http_address(http: dict[str, Any]) -> tuple[str, int]:
    """The (host, port) a serve config's `http_options` give, with Serve's defaults."""
    return http.get("host", "127.0.0.1"), int(http.get("port", 8000))


def shared_port_options(http: dict[str, Any]) -> dict[str, Any]:
    """`ingress.shared_port` for the address of a serve config's `http_options`, keep-alive as
    they set it."""
    host, port = http_address(http)
    shared = {"host": host, "port": port}
    if "keep_alive_timeout_s" in http:
        shared["keep_alive_timeout_s"] = float(http["keep_alive_timeout_s"])
    return shared


def with_shared_port(app: dict[str, Any], http: dict[str, Any]) -> dict[str, Any]:
    """The serve config's application with its ingress replicas serving `http`'s address."""
    args = dict(app.get("args") or {})
    args["ingress"] = dict(args.get("ingress") or {}) | {"shared_port": shared_port_options(http)}
    return app | {"args": args}


def plan(serve_config: dict[str, Any], front_door: FrontDoor | None = None, proxy_port: int | None = None,
         starts_ray: bool = True) -> tuple[FrontDoor, dict[str, Any], dict[str, str]]:
    """(front door, the serve config to run, the environment to add). Several applications keep
    the proxy, which routes between them by prefix, and so does a cluster this command does not
    start, or an app under another route prefix. With the direct front door the ingress replicas
    take the config's port and the proxy `proxy_port` (default: the next one)."""
    apps = serve_config.get("applications") or []
    servable = len(apps) == 1 and apps[0].get("route_prefix", "/") == "/"  # the own port serves one app at the root
    door: FrontDoor = front_door or ("direct" if servable and starts_ray else "proxy")
    if not servable:
        door = "proxy"
    env = HEADER_DEADLINE_ENV | serve_env()
    if door == "proxy":
        return door, serve_config, env
    http = dict(serve_config.get("http_options") or {})
    _, port = http_address(http)
    moved = {"http_options": http | {"port": proxy_port if proxy_port is not None else port + 1}}
    return door, serve_config | moved | {"applications": [with_shared_port(apps[0], http)]}, env


def busy_ports(host: str, ports: list[int]) -> list[int]:
    """Those of `ports` that something on this machine listens on at `host` (or at every
    address). Connections closed lately (TIME_WAIT) do not count: the ingress replicas bind with
    SO_REUSEADDR. A replica whose port is taken fails to start and Serve retries it forever, so
    the launcher checks first."""
    anywhere = {"0.0.0.0", "::", ""}
    listening = {c.laddr.port for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN
                 and (c.laddr.ip in anywhere | {host} or host in anywhere)}
    return [port for port in ports if port in listening]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m serve_app.launch", description=__doc__.split("\n")[0])
    p.add_argument("config", help="serve YAML (e.g. configs/serve.yaml)")
    p.add_argument("--front-door", choices=["direct", "proxy"], default=None,
                   help="default: direct, where the graph allows it")
    p.add_argument("--proxy-port", type=int, default=None,
                   help="direct: Serve's proxy's port (default: the config's port + 1)")
    args = p.parse_args(argv)
    path = Path(args.config)
    written = yaml.safe_load(path.read_text())
    door, config, env = plan(written, args.front_door, args.proxy_port, starts_ray=not joins_running_cluster())
    run_path = path
    if door == "proxy":
        print("front door: Serve's proxy", flush=True)
    else:
        host, port = http_address(written.get("http_options") or {})
        busy = busy_ports(host, [port, config["http_options"]["port"]])
        if busy:
            sys.exit(f"port {', '.join(map(str, busy))} on {host} is in use; stop what listens there, or give "
                     "http_options.port (and --proxy-port) free ports")
        run_path = cache_dir("serve") / f"{path.stem}.{door}-{port}.yaml"  # serve run reads the proxy's port here
        run_path.parent.mkdir(parents=True, exist_ok=True)
        run_path.write_text(yaml.safe_dump(config, sort_keys=False))
        print(f"front door: the ingress replicas on {host}:{port} (Serve's proxy on {config['http_options']['port']})",
              flush=True)
    serve = shutil.which("serve", path=os.path.dirname(sys.executable)) or "serve"
    os.execvpe(serve, [serve, "run", str(run_path)], os.environ | env)


if __name__ == "__main__":
    main()
