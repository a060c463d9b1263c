"""More front ends on the broker's event loop, beside its own port: each is handed the
running broker and answers its clients through the broker's services with onceq's typed
requests (the RocketMQ gRPC endpoint, ``onceq.rocketmq``). The broker starts them after
its own port, and stops them first, before anything they call into closes."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .broker import Broker


class FrontEnd(Protocol):
    name: str
    port: int  # the port it listens on, once started

    async def start(self, broker: Broker) -> None: ...

    async def stop(self) -> None: ...


def file_stamp(path: str) -> tuple[int, int, int] | None:
    """(inode, size, mtime) of a file a front end re-reads when it changes (None: absent)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def write_file_atomic(path: str, data: bytes, *, private: bool = False) -> None:
    """What a front end keeps in the data directory, written as the broker writes its own
    state files (temp file, fsync, rename, fsync of the directory); ``private``: mode 0600
    from the start (a secret)."""
    from ..storage.files import OS_FILES
    from ..storage.metadata import write_atomic
    from .users import _PrivateFiles

    write_atomic(path, data, _PrivateFiles(OS_FILES) if private else OS_FILES)
