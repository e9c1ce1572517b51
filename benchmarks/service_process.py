"""``python -m ibedl.serve`` in a subprocess on a free loopback port: the harness of the end-to-end tests and of
``benchmarks.service_latency`` (tests/conftest.py re-exports it)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.common import REPO


def bound_socket(host: str = "127.0.0.1"):
    """A socket bound to a port of ``host`` the OS picked, for a server in this process to listen on (uvicorn's
    ``Server.run(sockets=[...])``): no other process can take the port first. The caller closes it."""
    import socket

    sock = socket.socket()
    sock.bind((host, 0))
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing on ``host`` listens on now, for a server another process binds (another process may take it
    before the server does, rarely: a server in this process takes a :func:`bound_socket` instead)."""
    with bound_socket(host) as s:
        return s.getsockname()[1]


class ServiceProcess:
    """``python -m ibedl.serve`` in a subprocess on a free loopback port; stopped with SIGTERM."""

    def __init__(self, artifact, env: dict | None = None, log_path=None, preexec_fn=None):
        """``artifact``: one adapter directory, or a list of them (served together, ``--artifacts``); ``preexec_fn``
        runs in the child before the service (e.g. joining a memory cgroup: benchmarks.memory_cgroup)."""
        import os
        import subprocess
        import sys

        self.port, self.grpc_port = free_port(), free_port()  # HTTP, and the Open Inference Protocol over gRPC
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ibedl.serve", "--host", "127.0.0.1", "--port", str(self.port),
             *(["--artifacts", ",".join(map(str, artifact))] if isinstance(artifact, (list, tuple))
               else ["--artifact", str(artifact)])],
            env={**os.environ, "TQDM_DISABLE": "1", "IBEDL_GRPC_PORT": str(self.grpc_port), **(env or {})},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=str(REPO),
            preexec_fn=preexec_fn,
        )

    def wait_ready(self, timeout: float = 180.0) -> None:
        import time

        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"service exited with {self.proc.returncode}; log: {self.log_text()}")
            try:
                r = httpx.get(self.url + "/health/ready", timeout=2)
                if r.status_code == 200:
                    return
                if r.json().get("status") == "failed":
                    raise AssertionError(f"service failed to load: {r.json()}")
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"service not ready within {timeout} s; log: {self.log_text()}")

    def rss_mib(self) -> float:
        """Resident memory of the service process now (VmRSS of /proc/<pid>/status), MiB."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError(f"no VmRSS in /proc/{self.proc.pid}/status")

    def log_text(self) -> str:
        return Path(self.log_path).read_text()[-3000:] if self.log_path else "(no log)"

    def stop(self, timeout: float = 30.0) -> int:
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log_path:
            self._log.close()
        return self.proc.returncode
