"""One front-end process of ``tensorserve serve --frontends N``.

    python -m tensorserve.frontends.process FD INDEX   (started by the supervisor)

It serves HTTP and gRPC on the server's ports beside the other front ends
(``SO_REUSEPORT``: the kernel spreads connections among them), with the
same app, codecs, middlewares and shutdown phases as a one-process server
(``http/server.py``), on a data plane whose models live in the scheduler
process: FD is its end of a socket pair to it, the settings come in the
``SETTINGS_ENV`` variable (never on the command line: a restricted API's
header value is a secret). On SIGTERM it drains as a one-process server
does; if the scheduler process dies it exits at once.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
from collections.abc import AsyncIterator

from tensorserve.dataplane.frontend import FrontEndFactory, StartupError
from tensorserve.dataplane.plane import DataPlane
from tensorserve.frontends.remote import Scheduler
from tensorserve.grpc.server import GrpcFrontEnd
from tensorserve.http.app import App, create_app
from tensorserve.http.server import bind, run
from tensorserve.settings import Settings
from tensorserve.tracing import configure as configure_tracing

SETTINGS_ENV = "TENSORSERVE_FRONTEND_SETTINGS_JSON"
EXIT_CANNOT_START = 2


def build_app(settings: Settings, scheduler: Scheduler) -> App:
    tracer = configure_tracing(settings)
    if tracer is not None:
        scheduler.traceparent = tracer.current_traceparent
    plane = DataPlane(
        settings,
        None,  # no registry here: the models are the scheduler process's
        scheduler.metrics,
        None,
        tracer,
        models=scheduler,
        remote=scheduler.ask,
    )

    async def connected() -> AsyncIterator[None]:
        scheduler.connect()
        yield
        scheduler.close()  # after every request has been answered

    return create_app(settings, plane=plane, lifespan=connected)


def main(argv: list[str]) -> int:
    fd, index = int(argv[0]), int(argv[1])
    settings = Settings(**json.loads(os.environ.pop(SETTINGS_ENV)))
    scheduler = Scheduler(socket.socket(fileno=fd))
    try:
        sock = bind(settings.host, settings.port, reuse_port=True)
    except StartupError as exc:
        print(f"tensorserve front end {index}: error: {exc}", file=sys.stderr)
        return EXIT_CANNOT_START
    front_ends: list[FrontEndFactory] = []
    if settings.grpc_port >= 0:
        front_ends.append(functools.partial(GrpcFrontEnd, reuse_port=True))
    app = build_app(settings, scheduler)
    run(settings, front_ends, app=app, sock=sock, process=f"frontend {index}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
