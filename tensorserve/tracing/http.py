"""An HTTP request's span name and attributes, as OpenTelemetry's HTTP
semantic conventions name them (stable since 1.23).

Takes anything shaped like aiohttp's ``web.Request`` (``HttpRequest``), so
tracing itself imports no web framework."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from tensorserve.tracing.attributes import Attributes


class HttpRequest(Protocol):
    """What tracing reads of a request: read-only, as aiohttp's are."""

    @property
    def method(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def scheme(self) -> str: ...
    @property
    def host(self) -> str: ...
    @property
    def remote(self) -> str | None: ...
    @property
    def version(self) -> Any: ...  # (major, minor)
    @property
    def headers(self) -> Mapping[str, str]: ...


class HttpOrigin:
    """An HTTP request (the tracing's ``CallOrigin``); ``route`` is its
    route's pattern, ``/v2/models/{model}/infer``: a low-cardinality name."""

    __slots__ = ("request", "route")

    def __init__(self, request: HttpRequest, route: str | None) -> None:
        self.request, self.route = request, route

    @property
    def carrier(self) -> Mapping[str, str]:
        return self.request.headers

    def span_name(self) -> str:
        """``{method} {route}`` (no model names in it)."""
        method = self.request.method
        return f"{method} {self.route}" if self.route else method

    def attributes(self, request_id: str) -> Attributes:
        request, route = self.request, self.route
        host, port = request.host, ""
        if ":" in host:
            host, _, port = host.rpartition(":")
        attributes: dict[str, Any] = {
            "http.request.method": request.method,
            "url.path": request.path,
            "url.scheme": request.scheme,
            "server.address": host,
            "network.protocol.version": f"{request.version[0]}.{request.version[1]}",
            "tensorserve.request_id": request_id,
        }
        if port.isdigit():
            attributes["server.port"] = int(port)
        if route:
            attributes["http.route"] = route
        if request.remote:
            attributes["client.address"] = request.remote
        agent = request.headers.get("User-Agent")
        if agent:
            attributes["user_agent.original"] = agent
        return attributes

    def outcome(self, code: str, status: int) -> Attributes:
        return {"http.response.status_code": status}
