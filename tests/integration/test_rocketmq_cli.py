"""``onceq rocketmq group set|list|delete``: the settings of RocketMQ clients' consumer
groups in the broker's ``rocketmq_groups.json``, read by the broker as it runs."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from onceq.cli.main import main
from onceq.rocketmq.groups import FILE, GroupSettings, parse

ENV = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}


def cli(*args: str) -> Result:
    return CliRunner().invoke(main, ["rocketmq", "group", *args])


def ok(r: Result) -> str:
    assert r.exit_code == 0, (r.output, r.exception)
    return r.output


def settings(data_dir: Path) -> dict[str, GroupSettings]:
    return parse((data_dir / FILE).read_bytes())


def test_set_list_delete(tmp_path: Path) -> None:
    d = str(tmp_path)
    out = ok(cli("list", "--data-dir", d))
    assert "no RocketMQ group settings" in out and "17 delivery attempts" in out
    out = ok(cli("set", "payments", "--fifo", "--max-delivery-attempts", "5",
                 "--retry-delays", "1,5,10", "--data-dir", d))
    assert "group payments: FIFO, max delivery attempts 5, retry delays 1s 5s 10s" in out
    assert "restart them" in out  # the clients read their mode when they start
    assert settings(tmp_path) == {"payments": GroupSettings(True, 5, (1.0, 5.0, 10.0))}
    ok(cli("set", "billing", "--max-delivery-attempts", "3", "--data-dir", d))
    assert json.loads(ok(cli("list", "--json", "--data-dir", d))) == {
        "billing": {"fifo": False, "max_delivery_attempts": 3, "retry_delays": None},
        "payments": {"fifo": True, "max_delivery_attempts": 5, "retry_delays": "1s 5s 10s"}}
    out = ok(cli("list", "--data-dir", d))
    rows = [[c.strip() for c in line.strip().strip("│").split("│")]
            for line in out.splitlines() if "│" in line]
    assert rows == [["billing", "no", "3", "-"], ["payments", "yes", "5", "1s 5s 10s"]]
    out = ok(cli("delete", "payments", "--data-dir", d))
    assert "group payments: settings deleted" in out
    assert settings(tmp_path) == {"billing": GroupSettings(False, 3)}


def test_set_changes_only_what_it_names(tmp_path: Path) -> None:
    d = str(tmp_path)
    ok(cli("set", "g", "--fifo", "--max-delivery-attempts", "4", "--retry-delays",
           "30s, 5m 2h", "--data-dir", d))
    assert settings(tmp_path)["g"] == GroupSettings(True, 4, (30.0, 300.0, 7200.0))
    out = ok(cli("set", "g", "--no-fifo", "--data-dir", d))
    assert "not FIFO, max delivery attempts 4" in out and "restart them" in out
    out = ok(cli("set", "g", "--retry-delays", "none", "--data-dir", d))
    assert "retry delays the clients' own" in out and "restart" not in out
    assert settings(tmp_path)["g"] == GroupSettings(False, 4, ())
    raw = json.loads((tmp_path / FILE).read_text())
    assert raw["groups"]["g"] == {"fifo": False, "max_delivery_attempts": 4}


@pytest.mark.parametrize("args, message", [
    (["set", "g", "--data-dir"], "nothing to set"),
    (["set", "g", "--max-delivery-attempts", "0", "--data-dir"],
     "--max-delivery-attempts must be 1..10001, not 0"),
    (["set", "g", "--max-delivery-attempts", "10002", "--data-dir"], "1..10001"),
    (["set", "g", "--retry-delays", "1,soon", "--data-dir"], "bad delay 'soon'"),
    (["set", "g", "--retry-delays", "500ms", "--data-dir"], "bad delay '500ms'"),
    (["set", "g", "--retry-delays", "1.5", "--data-dir"], "bad delay '1.5'"),
    (["set", "g", "--retry-delays", "0", "--data-dir"], "out of range"),
    (["set", "g", "--retry-delays", "13h", "--data-dir"], "out of range"),
    (["set", "g", "--retry-delays", ",", "--data-dir"], "at least one delay"),
    (["set", "bad name", "--fifo", "--data-dir"], "invalid group name 'bad name'"),
    (["delete", "nobody", "--data-dir"], "group 'nobody' has no RocketMQ settings"),
])
def test_bad_input_is_refused_and_leaves_the_file(tmp_path: Path, args: list[str],
                                                  message: str) -> None:
    ok(cli("set", "kept", "--fifo", "--data-dir", str(tmp_path)))
    before = (tmp_path / FILE).read_bytes()
    r = cli(*args, str(tmp_path))
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("error: ") and message in r.stderr, r.stderr
    assert (tmp_path / FILE).read_bytes() == before


def test_a_file_that_does_not_read_is_reported_not_overwritten(tmp_path: Path) -> None:
    (tmp_path / FILE).write_text('{"version": 1, "groups": {"g": {"fifo": "yes"}}}')
    for args in (["list"], ["set", "g", "--no-fifo"], ["delete", "g"]):
        r = cli(*args, "--data-dir", str(tmp_path))
        assert r.exit_code == 2, r.output
        assert "cannot read the RocketMQ group settings" in r.stderr
        assert "fifo must be true or false" in r.stderr and "fix or remove" in r.stderr
    assert "yes" in (tmp_path / FILE).read_text()


def test_the_data_dir_must_exist(tmp_path: Path) -> None:
    r = cli("list", "--data-dir", str(tmp_path / "nowhere"))
    assert r.exit_code == 2 and "does not exist" in r.output
    assert not (tmp_path / "nowhere").exists()


def test_the_command_line_reports_errors_as_the_other_commands(tmp_path: Path) -> None:
    """Through ``python -m onceq.cli.main``: the exit code and ``error: ...`` on stderr."""
    cmd = [sys.executable, "-m", "onceq.cli.main", "rocketmq", "group"]
    r = subprocess.run([*cmd, "set", "g", "--fifo", "--data-dir", str(tmp_path)],
                       capture_output=True, text=True, env=ENV, timeout=60)
    assert r.returncode == 0 and "group g: FIFO" in r.stdout, r.stderr
    r = subprocess.run([*cmd, "delete", "h", "--data-dir", str(tmp_path)],
                       capture_output=True, text=True, env=ENV, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error: group 'h' has no"), r.stderr


async def test_a_running_endpoint_takes_the_change(tmp_path: Path) -> None:
    """A broker with the RocketMQ endpoint reads the file again within a second: a group
    set FIFO with 3 attempts by the command is served so without a restart."""
    pytest.importorskip("grpc")
    from onceq.rocketmq.server import GrpcFrontEnd
    from tests.helpers import free_port, running_broker

    data_dir = tmp_path / "d"
    async with running_broker(str(data_dir)) as b:
        fe = GrpcFrontEnd(free_port())
        await fe.start(b)
        try:
            assert fe.service is not None
            pop = fe.service.pop
            assert pop.settings("orders-g") == GroupSettings()
            ok(cli("set", "orders-g", "--fifo", "--max-delivery-attempts", "3",
                   "--data-dir", str(data_dir)))
            for _ in range(40):
                if pop.settings("orders-g").fifo:
                    break
                await asyncio.sleep(0.1)
            assert pop.settings("orders-g") == GroupSettings(True, 3)
            ok(cli("delete", "orders-g", "--data-dir", str(data_dir)))
            for _ in range(40):
                if not pop.settings("orders-g").fifo:
                    break
                await asyncio.sleep(0.1)
            assert pop.settings("orders-g") == GroupSettings()
        finally:
            await fe.stop()
