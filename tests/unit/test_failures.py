"""Pure logic of write failures: error mapping, rate-limited logging, the disk-usage guard."""

from __future__ import annotations

import errno
import logging

import pytest

from onceq.broker.store_errors import error_code
from onceq.protocol.errors import ErrorCode
from onceq.storage.errors import StorageError
from onceq.storage.failures import DiskGuard, RateLimitedLog, storage_error
from tests.clock import FakeClock


@pytest.mark.parametrize(("err", "code"), [
    (errno.ENOSPC, ErrorCode.DISK_FULL), (errno.EDQUOT, ErrorCode.DISK_FULL),
    (errno.EIO, ErrorCode.STORAGE_ERROR), (errno.EMFILE, ErrorCode.STORAGE_ERROR),
])
def test_storage_error_codes(err, code):
    e = storage_error(OSError(err, "boom"), "the write was rolled back")
    assert error_code(e) == code and e.retriable
    assert "the write was rolled back" in e.message and "boom" in e.message


def test_rate_limited_log_one_line_per_interval(caplog):
    clock = FakeClock(0.0)
    rl = RateLimitedLog(logging.getLogger("onceq.test"), clock, interval_s=10.0)
    with caplog.at_level(logging.ERROR, logger="onceq.test"):
        assert rl.error("put", "write failed: %s", "ENOSPC")
        for _ in range(462):
            clock.advance(0.01)
            assert not rl.error("put", "write failed: %s", "ENOSPC")
        assert rl.error("other", "another kind")  # counted per kind
        clock.advance(10.0)
        assert rl.error("put", "write failed: %s", "ENOSPC")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["write failed: ENOSPC", "another kind",
                     "write failed: ENOSPC (and 462 more like it in the last 15s)"]
    assert all(r.exc_info is None for r in caplog.records)


class Usage:
    def __init__(self, total: int, avail: int) -> None:
        self.total, self.avail, self.calls = total, avail, 0

    def __call__(self, path: str) -> tuple[int, int]:
        self.calls += 1
        return self.total, self.avail


def test_disk_guard_refuses_above_ratio_and_resumes():
    clock = FakeClock(0.0)
    usage = Usage(1000, 500)
    changes: list[bool] = []
    g = DiskGuard("/data", 0.75, clock, usage, on_change=lambda r, _ratio: changes.append(r))
    g.check()
    usage.avail = 200  # 80% used
    for _ in range(100):  # measured at most once per second
        g.check()
    assert usage.calls == 1
    clock.advance(1.0)
    with pytest.raises(StorageError) as ei:
        g.check()
    assert error_code(ei.value) == ErrorCode.DISK_FULL and "80%" in ei.value.message
    usage.avail = 300  # 70%
    with pytest.raises(StorageError):
        g.check()
    clock.advance(1.0)
    g.check()
    assert changes == [True, False] and usage.calls == 3


def test_disk_guard_ratio_one_never_asks():
    usage = Usage(1000, 0)
    DiskGuard("/data", 1.0, FakeClock(), usage).check()
    assert usage.calls == 0


def test_disk_guard_keeps_last_answer_when_statvfs_fails():
    clock = FakeClock(0.0)
    usage = Usage(1000, 0)
    g = DiskGuard("/data", 0.9, clock, usage)
    with pytest.raises(StorageError):
        g.check()

    def broken(path: str) -> tuple[int, int]:
        raise OSError(errno.EIO, "gone")

    g.usage = broken
    clock.advance(2)
    with pytest.raises(StorageError):
        g.check()
