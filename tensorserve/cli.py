"""``tensorserve`` command line: ``serve`` (and ``bench``, see tensorserve/bench)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from tensorserve.settings import Settings


def _serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve a model repository over HTTP")
    p.add_argument("--model-repository", help="model repository folder (default ./model_repository)")
    p.add_argument("--host", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, help="port (default 8000)")
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--access-log", action="store_true", default=None, help="log every request")
    p.add_argument("--max-request-bytes", type=int)
    p.add_argument("--max-items-per-request", type=int)
    p.add_argument("--intra-op-threads", type=int, help="torch threads per model thread")
    p.add_argument("--switch-interval-ms", type=float, help="GIL switch interval (default 0.1)")
    group = p.add_argument_group("overrides applied to every model's config.toml")
    group.add_argument("--max-batch-size", type=int)
    group.add_argument("--max-queue-delay-ms", type=float)
    group.add_argument("--device", help="auto | cpu | cuda | cuda:N")
    group.add_argument("--dispatch", choices=["eager", "timer"])
    group.add_argument("--policy", choices=["fifo", "length_aware"])
    group.add_argument("--instance-count", type=int)
    group.add_argument("--max-batch-tokens", type=int, help="padded-volume budget per batch")
    group.add_argument(
        "--isolation", choices=["thread", "process"], help="run each model instance in a thread or its own process"
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    """CLI flags override environment variables, which override defaults."""
    given = {
        name: value
        for name, value in vars(args).items()
        if name in Settings.model_fields and value is not None
    }
    return Settings(**given)


def _install_uvloop() -> None:
    try:
        import uvloop  # type: ignore[import-not-found]
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def serve(settings: Settings) -> None:
    from aiohttp import web

    from tensorserve.http.app import create_app

    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    _install_uvloop()
    sys.setswitchinterval(settings.switch_interval_ms / 1000)
    # nn.TransformerEncoder's default fast path announces itself on every start:
    # noise for operators, not a problem of theirs.
    warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype")
    app = create_app(settings)
    web.run_app(
        app,
        host=settings.host,
        port=settings.port,
        access_log=logging.getLogger("aiohttp.access") if settings.access_log else None,
        handler_cancellation=True,  # a caller that disconnects frees its queued items
        print=lambda msg: logging.getLogger("tensorserve").info(
            "serving %s on http://%s:%s", settings.model_repository, settings.host, settings.port
        ),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tensorserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    from tensorserve.bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(settings_from_args(args))
        return 0
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
