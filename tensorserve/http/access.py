"""Who may call what, decided by the server's settings before any handler runs.

``restricted_api`` (Triton's ``--http-restricted-api``): each endpoint belongs
to one API (``ROUTES`` in ``http/app.py``); a request to a restricted API
without its header, or with another value, is refused with 403
``api_restricted``. The value is compared in constant time, so the time of a
refusal does not tell how much of a guess was right. Without restrictions no
middleware is installed: the hot path pays nothing.

(``model_control_mode``, which both front ends obey, is the data plane's:
``dataplane/models.py require_model_control``.)
"""

from __future__ import annotations

import hmac

from aiohttp import web
from aiohttp.typedefs import Middleware

from tensorserve.errors import ApiRestricted
from tensorserve.http.errors import Handler


def _raw(text: str) -> bytes:
    # aiohttp decodes header bytes as UTF-8 with surrogateescape; this undoes it.
    return text.encode("utf-8", "surrogateescape")


def restricted_api_middleware(
    restrictions: dict[str, tuple[str, str]], api_of_path: dict[str, str]
) -> Middleware:
    """A middleware refusing requests to a restricted API that lack its header.
    ``restrictions``: API -> (header, value) (``Settings.restrictions``);
    ``api_of_path``: each route's path pattern -> its API."""
    expected = {api: (header, _raw(value)) for api, (header, value) in restrictions.items()}

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        api = api_of_path.get(resource.canonical) if resource is not None else None
        rule = expected.get(api) if api is not None else None
        if rule is not None:
            header, value = rule
            given = request.headers.get(header)
            # One message for a missing and a wrong value: a refusal tells nothing.
            if given is None or not hmac.compare_digest(_raw(given), value):
                raise ApiRestricted(
                    f"the {api} API is restricted: send the header {header!r} with the "
                    f"value the server was given in --restricted-api "
                    f"(TENSORSERVE_RESTRICTED_API)"
                )
        return await handler(request)

    return check
