"""A small OTLP/HTTP receiver on 127.0.0.1 for tests: decodes each export (protobuf) with opentelemetry-proto and
keeps its spans as plain dicts."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

_BOUND_S = 30  # a hang bound, not a timing check


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                for resource in request.resource_spans:
                    service = {a.key: _value(a.value) for a in resource.resource.attributes}
                    for scope in resource.scope_spans:
                        for s in scope.spans:
                            receiver.spans.append({
                                "name": s.name, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                                "parent_id": s.parent_span_id.hex(), "start": s.start_time_unix_nano,
                                "end": s.end_time_unix_nano, "kind": s.kind, "status": s.status.code,
                                "attributes": {a.key: _value(a.value) for a in s.attributes},
                                "resource": service})
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def wait_for(self, predicate) -> list[dict]:
        deadline = time.monotonic() + _BOUND_S
        while not predicate(self.spans):
            assert time.monotonic() < deadline, [s["name"] for s in self.spans]
            time.sleep(0.02)
        return self.spans

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
