"""The metrics port: Prometheus's exposition at /metrics, and /readyz and /livez for proxies and
orchestrators that check over HTTP rather than grpc.health.v1 (HAProxy has no gRPC check).

It runs in its own threads, as prometheus_client's own server does, so a scrape or a check
costs the event loop nothing; `status()` is called there and only reads plain attributes.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import urlparse

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import MetricsHandler

CHECKS = {"/readyz": "ready", "/livez": "live"}


def start_metrics_http(host: str, port: int, registry: CollectorRegistry,
                       status: Callable[[], dict[str, Any]]) -> ThreadingHTTPServer:
    """Serve until the process exits. `status()` returns a JSON-able mapping with booleans
    `ready` and `live`: /readyz and /livez answer it with 200 when theirs is true, else 503."""

    class Handler(MetricsHandler.factory(registry)):  # type: ignore[misc]
        def do_GET(self) -> None:
            check = CHECKS.get(urlparse(self.path).path)
            if check is None:
                super().do_GET()
                return
            state = status()
            body = json.dumps(state).encode()
            self.send_response(200 if state[check] else 503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer((host, port), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return httpd
