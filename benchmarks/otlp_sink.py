#!/usr/bin/env python3
"""An OTLP/HTTP traces endpoint that accepts every export and counts the
spans: the receiving end for measuring tracing's cost in the server
(docs/performance.md, "Tracing's cost"), in a process of its own so its CPU
is not the server's.

    python benchmarks/otlp_sink.py --port 4318   # prints the spans received on Ctrl-C
"""

from __future__ import annotations

import argparse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

received = 0


class Sink(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        global received
        export = ExportTraceServiceRequest.FromString(
            self.rfile.read(int(self.headers["Content-Length"]))
        )
        received += sum(len(s.spans) for r in export.resource_spans for s in r.scope_spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=4318)
    server = ThreadingHTTPServer(("127.0.0.1", parser.parse_args().port), Sink)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print(f"{received} spans received")


if __name__ == "__main__":
    main()
