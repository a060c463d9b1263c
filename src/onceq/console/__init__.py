"""A web console for operators (``onceq console``): overview, topics, consumer groups
with their lag over time, messages, duplicates by cause, dead letters (docs/console.md).

Server-rendered pages (Starlette, Jinja2) over the client API (``Admin``); the pages, their
style sheet and their one small script are served from this package, so the console works
offline. It reads the broker only when a page asks: with no page open it costs the broker
nothing. Needs the ``console`` extra (``pip install 'onceq[console]'``).
"""

from .app import create_app, serve
from .web import ConsoleConfig

__all__ = ["ConsoleConfig", "create_app", "serve"]
