"""Run the service: ``python -m service --host H --port P [--artifact DIR]`` (or ``ibedl-serve``).

SIGTERM (and Ctrl-C) stop accepting connections, let in-flight requests finish (up to
IBEDL_SHUTDOWN_GRACE_S), drain the batch queue, and exit 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import uvicorn
from pydantic import ValidationError

from service.app import create_app
from service.settings import Settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service", description="Serve an IB-EDL adapter over HTTP.")
    parser.add_argument("--host", help="bind address (IBEDL_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (IBEDL_PORT, default 8000)")
    parser.add_argument("--artifact", help="adapter directory (IBEDL_ARTIFACT, default artifacts/default)")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port), ("artifact", args.artifact)) if v is not None}
    try:
        settings = Settings(**overrides)
    except ValidationError as e:
        print(f"error: invalid settings: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=settings.shutdown_grace_s, access_log=False)
    server = uvicorn.Server(config)
    app.state.service.server = server
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal under the handler that was installed
    # before it started; with the default handler the process would die of the signal (exit 143) after a
    # clean drain. A handler that does nothing makes a drained shutdown exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
