"""The console tests need the console extra (and httpx); without it they are not collected."""

import importlib.util

if any(importlib.util.find_spec(m) is None
       for m in ("starlette", "jinja2", "multipart", "uvicorn", "httpx")):
    collect_ignore_glob = ["test_*.py"]
else:
    from tests.console.world import web, world  # noqa: F401 - fixtures
