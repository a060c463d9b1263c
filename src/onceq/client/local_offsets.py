"""Consumer offsets kept on the client (BROADCASTING), in one JSON file per client+group."""

from __future__ import annotations

import json
import os
import re
import tempfile

from .allocation import MessageQueue


def default_offset_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".onceq", "offsets")


class LocalOffsetStore:
    def __init__(self, directory: str | None, client_id: str, group: str) -> None:
        directory = directory or default_offset_dir()
        safe = re.sub(r"[^A-Za-z0-9_.@#-]", "_", f"{client_id}-{group}")
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"{safe}.json")
        self._offsets: dict[str, int] = {}
        self._dirty = False
        try:
            with open(self.path) as f:
                raw = json.load(f)
            self._offsets = {str(k): int(v) for k, v in raw.items()}
        except FileNotFoundError:
            pass
        except (ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"{self.path}: corrupt offset file ({exc})") from None

    @staticmethod
    def _key(mq: MessageQueue) -> str:
        return f"{mq.topic}:{mq.queue_id}"

    def get(self, mq: MessageQueue) -> int | None:
        """The offset kept for ``mq``, None when there is none."""
        return self._offsets.get(self._key(mq))

    def set(self, mq: MessageQueue, offset: int) -> None:
        kept = self._offsets.get(self._key(mq))
        if kept is None or offset > kept:
            self._offsets[self._key(mq)] = offset
            self._dirty = True

    def save(self) -> None:
        if not self._dirty:
            return
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), prefix=".offsets-")
        with os.fdopen(fd, "w") as f:
            json.dump(self._offsets, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._dirty = False
