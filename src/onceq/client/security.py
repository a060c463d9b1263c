"""How a client proves who it is and reaches the broker safely: a user and password
(SCRAM-SHA-256: the password never goes on the wire) and TLS.

Every client (``Producer``, the consumers, ``Admin``, the CLI, the Spark source and sink)
takes a ``ClientSecurity``; without one it reads the environment:

* ``ONCEQ_USER`` and ``ONCEQ_PASSWORD``, or ``ONCEQ_CREDENTIALS_FILE``: a file whose first
  line is ``user:password`` (keep it mode 0600; a password given on a command line would
  show in ``ps``);
* ``ONCEQ_TLS=1`` for TLS, ``ONCEQ_TLS_CA`` (the CA that signed the broker's certificate;
  default: the system's), ``ONCEQ_TLS_CERT`` and ``ONCEQ_TLS_KEY`` (a client certificate,
  whose CN is the user, for brokers that take one).

With TLS the broker's certificate is verified, and its name checked against the address's
host, unless ``verify=False`` (tests only).
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field

from .._credentials import CredentialsError, read_credentials_file

__all__ = ["ClientSecurity", "CredentialsError", "read_credentials_file"]


@dataclass(frozen=True)
class ClientSecurity:
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    ca_file: str | None = None
    cert_file: str | None = None  # a client certificate (mTLS)
    key_file: str | None = None
    verify: bool = True

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClientSecurity:
        env = os.environ if environ is None else environ
        user, password = env.get("ONCEQ_USER") or None, env.get("ONCEQ_PASSWORD") or None
        path = env.get("ONCEQ_CREDENTIALS_FILE")
        if path and user is None:
            user, password = read_credentials_file(path)
        tls = env.get("ONCEQ_TLS", "").lower() in ("1", "true", "yes", "on")
        cert = env.get("ONCEQ_TLS_CERT") or None
        return cls(user, password, tls or cert is not None, env.get("ONCEQ_TLS_CA") or None,
                   cert, env.get("ONCEQ_TLS_KEY") or None)

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context of a connection, None without TLS."""
        if not self.tls:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca_file)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if not self.verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.cert_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx
