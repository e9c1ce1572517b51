"""A real PostgreSQL server for the tests (Debian's ``postgresql`` package; make test installs it): initdb on a
temporary data directory, listening on 127.0.0.1 on a free port only (no Unix socket), password authentication
(scram-sha-256) so the DSN the store gets holds a password as a deployed one does. PostgreSQL refuses to run as
root: as root the server runs as the package's ``postgres`` user. :class:`PostgresServer` starts and stops it;
tests/conftest.py starts one per session and gives each test a database of its own."""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.service_process import free_port

USER = "ibedl"


def postgres_bin(name: str) -> str:
    """The path of a PostgreSQL server binary (Debian keeps them out of PATH, under /usr/lib/postgresql/N/bin), or a
    failure saying how to install it."""
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)),
                                       None)
    if found is None:
        raise AssertionError(f"`{name}` (PostgreSQL's server) is not installed, and the store tests on PostgreSQL need "
                             "it: apt-get install -y --no-install-recommends postgresql (make test installs it as "
                             "root)")
    return found


class PostgresServer:
    """One PostgreSQL server on 127.0.0.1:``port`` with superuser :data:`USER` and a random password; ``dsn(db)``
    connects to database ``db``. Use as a context manager (started on enter, stopped and removed on exit)."""

    def __init__(self) -> None:
        self.password = secrets.token_hex(16)
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="ibedl-pg-"))  # not under pytest's root-only tmp: postgres reads it
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self._proc: subprocess.Popen | None = None
        self._as = {}  # who runs initdb and the server: as root, the package's user (both refuse root)
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self._as = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": [], "env": {
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.root), "LC_ALL": "C.UTF-8"}}

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://{USER}:{self.password}@127.0.0.1:{self.port}/{database}"

    def __enter__(self) -> PostgresServer:
        pwfile = self.root / "pw"
        pwfile.write_text(self.password + "\n")
        if self._as:
            shutil.chown(pwfile, "postgres")
        subprocess.run([postgres_bin("initdb"), "-D", str(self.data), "-U", USER, "--pwfile", str(pwfile), "-A",
                        "scram-sha-256", "-E", "UTF8", "--no-sync"], check=True, capture_output=True, timeout=120,
                       stdin=subprocess.DEVNULL, cwd=self.root, **self._as)
        pwfile.unlink()
        self._start()
        return self

    def _start(self) -> None:
        log = self.log.open("a")
        if self._as:
            shutil.chown(self.log, "postgres")
        # fsync off: a test server's data need not survive a power cut; max_connections covers the concurrent tests
        self._proc = subprocess.Popen(
            [postgres_bin("postgres"), "-D", str(self.data), "-h", "127.0.0.1", "-p", str(self.port), "-k", "", "-c",
             "fsync=off", "-c", "max_connections=60"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.root, **self._as)
        log.close()
        self._wait_ready()

    def _stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(2)  # SIGINT: fast shutdown (disconnects clients, no wait for them)
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def restart(self) -> None:
        """Stop the server (fast shutdown: every client is disconnected) and start it again on the same data and
        port; returns once it accepts connections."""
        self._stop()
        self._start()

    def _wait_ready(self, timeout_s: float = 60) -> None:
        import psycopg

        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                raise AssertionError(f"postgres exited {self._proc.returncode}:\n{self.log.read_text()[-4000:]}")
            try:
                psycopg.connect(self.dsn(), connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"postgres did not accept connections in {timeout_s:g} s:\n"
                                         f"{self.log.read_text()[-4000:]}") from None
                time.sleep(0.2)

    def create_database(self, name: str) -> str:
        """A new empty database; its DSN."""
        import psycopg

        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.dsn(name)

    def drop_database(self, name: str) -> None:
        import psycopg

        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def __exit__(self, *exc) -> None:
        self._stop()
        shutil.rmtree(self.root, ignore_errors=True)
