"""Credentials files, read by clients and by brokers (a follower's replication login): the
first line is ``user:password`` (keep the file mode 0600; a password given on a command
line would show in ``ps``)."""

from __future__ import annotations


class CredentialsError(ValueError):
    """The credentials file cannot be read or is not ``user:password``."""


def read_credentials_file(path: str) -> tuple[str, str]:
    """``user:password`` from the first line of ``path``; ``CredentialsError`` naming the
    file."""
    try:
        with open(path, encoding="utf-8") as f:
            line = f.readline().rstrip("\r\n")
    except OSError as exc:
        raise CredentialsError(f"credentials file {path}: {exc.strerror or exc}") from None
    user, sep, password = line.partition(":")
    if not sep or not user or not password:
        raise CredentialsError(f"credentials file {path}: the first line must be "
                               "user:password")
    return user, password
