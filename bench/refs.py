"""
The reference proxies the bench measures beside nvproxy, each in its own
process in front of the same engine:

* C{rpr}: Twisted's stock C{ReverseProxyResource} (L{bench.rpr}), the floor
  for a Twisted proxy;
* C{agent}: a bare C{Agent} proxy on a persistent pool (L{bench.agentfloor}),
  the floor of the stack nvproxy's data path is built from (only in the
  C{floor} scenario);
* C{nginx}: Debian's nginx with C{proxy_buffering off}, HTTP/1.1 and a
  keep-alive pool to the engine, single process (C{master_process off}),
  with a config, error log and temp dirs generated in the work dir.  When
  no C{nginx} binary is found, L{start_nginx} returns None and the bench
  prints a note instead.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

from bench import procs
from nvproxy.testing.harness import NotHealthy, free_port, wait_healthy

NGINX_PATHS = (
    "/usr/sbin/nginx",
    "/usr/local/sbin/nginx",
    "/usr/local/nginx/sbin/nginx",
)


async def start_rpr(
    reactor: Any, workdir: Path, name: str, upstream: str
) -> tuple[procs.Proc, str]:
    """Start L{bench.rpr} in front of C{upstream} (C{http://HOST:PORT})."""
    return await _start_module(reactor, workdir, name, "bench.rpr", upstream)


async def start_agent_floor(
    reactor: Any, workdir: Path, name: str, upstream: str
) -> tuple[procs.Proc, str]:
    """Start L{bench.agentfloor} in front of C{upstream} (C{http://HOST:PORT})."""
    return await _start_module(reactor, workdir, name, "bench.agentfloor", upstream)


async def start_lean_floor(
    reactor: Any, workdir: Path, name: str, upstream: str
) -> tuple[procs.Proc, str]:
    """Start L{bench.leanfloor} in front of C{upstream} (C{http://HOST:PORT})."""
    return await _start_module(reactor, workdir, name, "bench.leanfloor", upstream)


async def start_facade_floor(
    reactor: Any, workdir: Path, name: str, upstream: str
) -> tuple[procs.Proc, str]:
    """Start L{bench.facadefloor} in front of C{upstream} (C{http://HOST:PORT})."""
    return await _start_module(reactor, workdir, name, "bench.facadefloor", upstream)


async def _start_module(
    reactor: Any, workdir: Path, name: str, module: str, upstream: str
) -> tuple[procs.Proc, str]:
    argv = [
        sys.executable,
        "-m",
        module,
        "--port",
        "0",
        "--upstream",
        upstream.removeprefix("http://").rstrip("/"),
    ]
    proc, line = await procs.spawn(reactor, name, argv, workdir, b"listening on ")
    return proc, f"http://{line.rsplit(' ', 1)[-1]}"


def nginx_binary() -> str | None:
    """C{$NVPROXY_BENCH_NGINX}, else nginx on the PATH or in the usual places."""
    configured = os.environ.get("NVPROXY_BENCH_NGINX")
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    found = shutil.which("nginx")
    if found:
        return found
    return next((p for p in NGINX_PATHS if os.access(p, os.X_OK)), None)


def nginx_config(workdir: Path, port: int, upstream: str) -> str:
    """An nginx config: one server on 127.0.0.1:C{port} proxying to C{upstream}."""
    temp = workdir / "nginx-temp"
    target = upstream.removeprefix("http://").rstrip("/")
    temp_paths = "\n".join(
        f"    {kind}_temp_path {temp / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""\
daemon off;
master_process off;
worker_processes 1;
worker_rlimit_nofile 16384;
pid {workdir / "nginx.pid"};
error_log {workdir / "nginx-error.log"} warn;
events {{
    worker_connections 8192;
    multi_accept on;
}}
http {{
    access_log off;
{temp_paths}
    upstream engine {{
        server {target};
        keepalive 600;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 300s;
            keepalive_requests 1000000;
        }}
    }}
}}
"""


async def start_nginx(
    reactor: Any, workdir: Path, name: str, upstream: str
) -> tuple[procs.Proc, str] | None:
    """Start nginx in front of C{upstream}; None when there is no nginx."""
    binary = nginx_binary()
    if binary is None:
        return None
    workdir = workdir.resolve()  # nginx reads relative paths from its prefix
    port = free_port()
    (workdir / "nginx-temp").mkdir(exist_ok=True)
    config = workdir / f"{name}.conf"
    config.write_text(nginx_config(workdir, port, upstream))
    argv = [
        binary,
        "-p",
        str(workdir),
        "-c",
        str(config),
        "-e",
        str(workdir / "nginx-error.log"),
    ]
    proc, _ = await procs.spawn(reactor, name, argv, workdir)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(
            reactor,
            f"{url}/api/tags",
            within=20.0,
            alive=lambda: not proc.child.ended.called,
        )
    except NotHealthy as e:
        await proc.stop(reactor)
        raise procs.BenchError(
            f"{name} did not start ({e}); see {workdir / 'nginx-error.log'}"
        ) from None
    return proc, url
