"""The console's ASGI application (Starlette), and running it with uvicorn."""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles

from . import cluster, dlq, duplicates, groups, messages, overview, topics
from .access import Problem
from .web import HERE, Console, ConsoleConfig, render

log = logging.getLogger("onceq.console")


async def _not_found(request: Request, exc: Exception) -> Response:
    return render(request, "error.html", 404,
                  error=Problem("Not found", f"no page at {request.url.path}", 404))


async def _server_error(request: Request, exc: Exception) -> Response:
    """An unexpected failure: logged with its traceback here, one line on the page."""
    log.exception("console page %s failed", request.url.path)
    try:
        return render(request, "error.html", 500,
                      error=Problem("Console error", f"{type(exc).__name__}: {exc}", 500))
    except Exception:  # the template itself failed: plain text, still no traceback
        return HTMLResponse(f"console error: {type(exc).__name__}", status_code=500)


def create_app(config: ConsoleConfig | None = None) -> Starlette:
    console = Console(config or ConsoleConfig())
    app = Starlette(
        routes=[*overview.routes(), *topics.routes(), *groups.routes(), *messages.routes(),
                *duplicates.routes(), *dlq.routes(), *cluster.routes(),
                Mount("/static", StaticFiles(directory=str(HERE / "static")),
                      name="static")],
        exception_handlers={404: _not_found, 500: _server_error, Exception: _server_error},
    )
    app.state.console = console
    return app


def serve(config: ConsoleConfig) -> None:
    """Serve the console until interrupted (uvicorn, one process)."""
    import uvicorn

    uvicorn.run(create_app(config), host=config.host, port=config.port,
                log_level="warning", access_log=False)
