"""The router's OpenAI-compatible HTTP front: FastAPI on uvicorn's pure-Python h11 protocol.

`create_app` puts a router (`ChatFront`) behind the front's routes (clients/http_routes.py),
inside its guard (clients/http_limits.py); `make_server` and `serve` run it on uvicorn with
the front's limits (`HttpSettings`) and its drain (clients/http_drain.py). Streamed answers
go out as server-sent events (clients/http_sse.py), counted in the front's metrics
(clients/http_metrics.py); errors in OpenAI's shape (clients/http_errors.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI
from starlette.exceptions import HTTPException

from pdchat.clients.http_drain import Drain
from pdchat.clients.http_errors import ApiError
from pdchat.clients.http_limits import DrainingServer, Guard, HttpSettings, uvicorn_server
from pdchat.clients.http_metrics import FrontMetrics
from pdchat.clients.http_routes import GENERATION_FORMS, Routes

if TYPE_CHECKING:
    from pdchat.clients.fronts import ChatFront

__all__ = ["HttpSettings", "create_app", "make_server", "serve"]


def create_app(router: ChatFront, settings: HttpSettings | None = None) -> Guard:
    """The ASGI app of the front (for uvicorn or any ASGI server; `make_server` adds the
    timeouts); its drain is the guard's `drain`, which ends `router`'s streams."""
    settings = settings or HttpSettings()
    drain = Drain(router, settings.drain_timeout_s, settings.shutdown_timeout_s)
    metrics = FrontMetrics(router)
    routes = Routes(router, settings, metrics, drain)
    app = FastAPI(title="pdchat router", docs_url=None, redoc_url=None, openapi_url=None)
    for path in GENERATION_FORMS:
        app.add_api_route(path, routes.generate, methods=["POST"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/tokenize", routes.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", routes.detokenize, methods=["POST"])
    app.add_api_route("/version", routes.version, methods=["GET"])
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics_page, methods=["GET"])
    app.add_api_route("/drain", routes.drain_route, methods=["POST"])
    app.add_exception_handler(ApiError, routes.on_api_error)
    app.add_exception_handler(HTTPException, routes.on_http_exception)
    app.add_exception_handler(Exception, routes.on_unexpected)
    return Guard(app, settings, metrics, drain, frozenset(GENERATION_FORMS))


def make_server(
    router: ChatFront, host: str = "127.0.0.1", port: int = 8080, settings: HttpSettings | None = None
) -> DrainingServer:
    """A uvicorn server for the front (h11 with deadlines, asyncio loop); `.run()` blocks."""
    settings = settings or HttpSettings()
    app = create_app(router, settings)
    return uvicorn_server(app, app.drain, host, port, settings)


def serve(router: ChatFront, host: str = "127.0.0.1", port: int = 8080, settings: HttpSettings | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then drain, stop gracefully and return (in the main thread)."""
    make_server(router, host, port, settings).serve_until_signalled()
