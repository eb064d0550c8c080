"""Running the server: logging, the event loop, and aiohttp's ``run_app``.

The command line calls ``run``; everything that needs aiohttp stays under
``tensorserve/http/``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import warnings

from aiohttp import web

from tensorserve.http.app import create_app
from tensorserve.settings import Settings


def _install_uvloop() -> None:
    try:
        import uvloop  # type: ignore[import-not-found]
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def run(settings: Settings) -> None:
    """Serve until interrupted."""
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
