"""Run the service: ``python -m ibedl.serve --host H --port P [--artifact DIR | --artifacts A,B,C]`` (or
``ibedl-serve``). ``--help`` lists every setting with its environment variable and default.

A non-loopback ``--host`` without IBEDL_API_TOKEN refuses to start (exit 2) unless IBEDL_ALLOW_ANONYMOUS=true.
SIGTERM (and Ctrl-C) stop accepting connections, let in-flight requests finish (up to
IBEDL_SHUTDOWN_GRACE_S), drain the batch queue, and exit 0.
"""

from __future__ import annotations

import argparse
import signal
import sys
import textwrap

import uvicorn
from pydantic import ValidationError

from ibedl.engine.settings import settings_errors
from ibedl.serve import logs
from ibedl.serve.app import create_app
from ibedl.serve.server import log_exposure, refusal, uvicorn_config
from ibedl.serve.settings import SECRET_SETTINGS, Settings


def settings_help(width: int = 100) -> str:
    """Every setting of :class:`Settings`: environment variable, default and description (the ``--help`` epilog)."""
    lines = ["settings (environment variables; the flags above override their namesakes):"]
    for name, field in Settings.model_fields.items():
        default = field.get_default(call_default_factory=True)
        shown = "unset" if default is None or default == [] else str(default)
        lines.append(f"  IBEDL_{name.upper()} (default {shown})")
        if field.description:
            lines += textwrap.wrap(field.description, width - 6, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ibedl.serve",
                                     description="Serve IB-EDL adapters over HTTP and gRPC.", epilog=settings_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", help="bind address (IBEDL_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (IBEDL_PORT, default 8000)")
    parser.add_argument("--grpc-port", type=int, help="port of the Open Inference Protocol over gRPC (IBEDL_GRPC_PORT, "
                        "default 8001; 0: a free one)")
    one = parser.add_mutually_exclusive_group()
    one.add_argument("--artifact", help="adapter directory (IBEDL_ARTIFACT, default artifacts/default)")
    one.add_argument("--artifacts", help="adapter directories, comma-separated, on one shared base model; the "
                     "first is the default (IBEDL_ARTIFACTS)")
    args = parser.parse_args(argv)
    flags = ("host", "port", "grpc_port", "artifact", "artifacts")
    overrides = {k: getattr(args, k) for k in flags if getattr(args, k) is not None}
    if args.artifact is not None:
        overrides["artifacts"] = []  # the flag names the one adapter, whatever IBEDL_ARTIFACTS says
    try:
        settings = Settings(**overrides)
    except ValidationError as e:
        print(f"error: invalid settings: {settings_errors(e, SECRET_SETTINGS)}", file=sys.stderr)
        return 2
    refused = refusal(settings)
    if refused is not None:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level, settings.log_format)
    log_exposure(settings)
    app = create_app(settings)
    server = uvicorn.Server(uvicorn_config(app, settings))
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
