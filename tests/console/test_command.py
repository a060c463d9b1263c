"""``onceq console``: the command serves the pages, and refuses a non-loopback address
unless told."""

from __future__ import annotations

import asyncio
import sys

import httpx
from click.testing import CliRunner

from onceq.cli.main import main
from tests.console.world import TOPIC, text_of
from tests.helpers import free_port


def test_a_non_loopback_host_needs_allow_remote():
    r = CliRunner().invoke(main, ["console", "--host", "0.0.0.0"])
    assert r.exit_code == 2 and "add --allow-remote" in r.output


async def test_the_command_serves_the_console(world):
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "onceq.cli.main", "console", "--broker", world.addr,
        "--port", str(port), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as web:
            for _ in range(200):
                try:
                    r = await web.get("/topics")
                    break
                except httpx.TransportError:
                    assert proc.returncode is None, await proc.stderr.read()
                    await asyncio.sleep(0.05)
            assert r.status_code == 200 and TOPIC in text_of(r.text)
            assert f"console on 127.0.0.1:{port}: loopback only" in text_of(r.text)
            css = await web.get("/static/console.css")
            assert css.status_code == 200 and "text/css" in css.headers["content-type"]
    finally:
        proc.terminate()
        _, err = await proc.communicate()
    assert f"onceq console on http://127.0.0.1:{port}/ (loopback only)" in err.decode()
