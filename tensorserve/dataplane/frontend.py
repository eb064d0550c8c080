"""What the server needs of a front end beside HTTP (the gRPC one), so that
it can run it on its event loop and take it through the shutdown phases
(docs/reliability.md, "Shutdown") without knowing its transport."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tensorserve.dataplane.plane import DataPlane


class StartupError(Exception):
    """The server cannot start; the message says why, in one sentence."""


class FrontEnd(Protocol):
    async def start(self) -> None:
        """Listen and serve; ``StartupError`` (before any model loads) when
        it cannot, in one sentence."""
        ...

    async def stop_accepting(self) -> None:
        """Take no new calls; the calls in flight go on (the data plane's
        lifecycle tracks them, and answers them when the grace period ends)."""
        ...

    async def close(self) -> None:
        """Close every connection, once no call is in flight."""
        ...


FrontEndFactory = Callable[["DataPlane"], FrontEnd]
