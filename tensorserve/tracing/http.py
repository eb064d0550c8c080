"""A request span's name and attributes from an HTTP request, as
OpenTelemetry's HTTP semantic conventions name them (stable since 1.23).

Takes anything shaped like aiohttp's ``web.Request`` (``HttpRequest``), so
tracing itself imports no web framework."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from tensorserve.tracing import Attributes


class HttpRequest(Protocol):
    method: str
    path: str
    scheme: str
    host: str
    remote: str | None
    version: Any  # (major, minor)
    headers: Mapping[str, str]


def span_name(request: HttpRequest, route: str | None) -> str:
    """``{method} {route}``: a low-cardinality name (no model names in it)."""
    return f"{request.method} {route}" if route else request.method


def request_attributes(request: HttpRequest, route: str | None, request_id: str) -> Attributes:
    host, _, port = request.host.rpartition(":") if ":" in request.host else (request.host, "", "")
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


def outcome_attributes(
    status: int, code: str, model: str | None, version: str, items: int
) -> dict[str, Any]:
    """The outcome, set when the request ends. ``error.type`` for a 5xx (the
    server's fault, as the conventions ask of a server span), the error code
    for every outcome."""
    attributes: dict[str, Any] = {
        "http.response.status_code": status,
        "tensorserve.outcome": code,
        "tensorserve.items": items,
    }
    if model is not None:
        attributes["tensorserve.model"] = model
        attributes["tensorserve.model.version"] = version
    if status >= 500:
        attributes["error.type"] = code
    return attributes
