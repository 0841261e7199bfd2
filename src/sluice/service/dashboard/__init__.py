"""The dashboard: one page of HTML, CSS and JavaScript, served as a mountable ASGI app.

``create_dashboard()`` returns a Starlette app that serves the page and its
assets (uPlot for the charts, vendored: nothing is fetched from elsewhere, and
there is no build step). The page holds no data of its own: it calls the API's
routes with the key the user gives it (kept in the tab's sessionStorage), so
it sees exactly what that key may see through the API, the same tenant
isolation and the same admin checks; without an admin key it is read-only.
``sluice serve`` and ``sluice dev`` mount it at ``/dashboard/``; an app of
your own can mount it too, pointing it at the API with ``api_base``::

    from sluice.service.dashboard import create_dashboard
    app.mount("/sluice", create_dashboard(api_base="https://jobs.example.com"))

(An API on another origin must allow the page's origin with CORS.)
"""

from __future__ import annotations

import html
from pathlib import Path
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import Message, Receive, Scope, Send

STATIC = Path(__file__).parent / "static"

#: The page may load scripts and styles from itself only, and talk to itself and the API.
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self' {api}; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def create_dashboard(api_base: str = "..", *, auth: bool | None = None) -> Starlette:
    """The dashboard app. ``api_base``: where the API is, relative to the page (the default
    suits a mount one level below the API's root, e.g. ``/dashboard``) or absolute. ``auth``:
    whether the API asks for a key (True: the page asks for one before anything else; None:
    it finds out by asking the API who it is)."""
    if any(c in api_base for c in "\"'<> \n;"):
        raise ValueError(f"api_base must be a plain URL or path, got {api_base!r}")
    page = (STATIC / "index.html").read_text(encoding="utf-8")
    page = page.replace("{{API_BASE}}", html.escape(api_base, quote=True))
    page = page.replace("{{AUTH}}", {True: "required", False: "off", None: "unknown"}[auth])
    # A source with a path matches that path only: the API's origin, then.
    connect = ""
    if api_base.startswith(("http://", "https://")):
        parts = urlsplit(api_base)
        connect = f"{parts.scheme}://{parts.netloc}"
    headers = {
        "Content-Security-Policy": _CSP.format(api=connect).replace("  ", " "),
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-cache",
    }

    async def index(request: Request) -> Response:
        return HTMLResponse(page, headers=headers)

    static = _Static(directory=STATIC)
    return Starlette(routes=[Route("/", index), Mount("/static", app=static, name="static")])


class _Static(StaticFiles):
    """The page's files, with the same headers as the page (no sniffing)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-content-type-options", b"nosniff")]
            await send(message)

        await super().__call__(scope, receive, sending)
