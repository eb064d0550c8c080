"""The data plane: what a call goes through that is not its transport.

Both front ends, HTTP (``tensorserve/http``) and gRPC (``tensorserve/grpc``),
only translate: they read their transport's request, call the one
``DataPlane`` (``plane.py``), and write what it returns in their own terms.
Everything else is here, once:

    plane.py       DataPlane: the registry, settings, metrics and lifecycle every
                   front end shares; request ids, the infer path (decode ->
                   validate -> admit -> wait -> encode, deadlines, in-flight
                   tracking), metrics and failure logs per call
    calls.py       Call: what one call's metrics and log lines need
    models.py      the answers about models both front ends give: readiness,
                   metadata, config, statistics, the repository extension
    lifecycle.py   the shutdown phases every front end reads
    logs.py        request ids on every log line, text or JSON lines, rate limits
"""

from tensorserve.dataplane.calls import Call, WireCall
from tensorserve.dataplane.plane import DataPlane

__all__ = ["Call", "DataPlane", "WireCall"]
