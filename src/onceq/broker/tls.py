"""TLS of the client port: the server's context from the configuration.

With ``tls_cert`` (and ``tls_key``) set, the client port speaks TLS only (TLS 1.2 or
later); a plain-text client gets no answer. ``tls_client_ca`` with ``tls_client_auth``
``optional`` or ``required`` asks clients for a certificate signed by that CA: its subject
CN names the connection's user (``security.py``); ``required`` refuses a client without one
in the handshake.
"""

from __future__ import annotations

import ssl

from .config import BrokerConfig


def metrics_context(config: BrokerConfig) -> ssl.SSLContext | None:
    """The metrics port's TLS context (the client port's certificate, no client
    certificates), None unless ``metrics_tls``."""
    return _with_certificate(config) if config.metrics_tls else None


def server_context(config: BrokerConfig) -> ssl.SSLContext | None:
    """The client port's TLS context, None when TLS is off; ``ValueError`` naming the
    setting when a file cannot be used."""
    if not config.tls_cert:
        return None
    ctx = _with_certificate(config)
    if config.tls_client_auth != "none":
        try:
            ctx.load_verify_locations(config.tls_client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"tls_client_ca: cannot load {config.tls_client_ca!r}: "
                             f"{exc}") from None
        ctx.verify_mode = (ssl.CERT_REQUIRED if config.tls_client_auth == "required"
                           else ssl.CERT_OPTIONAL)
    return ctx


def _with_certificate(config: BrokerConfig) -> ssl.SSLContext:
    """A server context (TLS 1.2 or later) holding ``tls_cert`` and ``tls_key``."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(config.tls_cert, config.tls_key or None)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"tls_cert/tls_key: cannot load {config.tls_cert}: {exc}") from None
    return ctx
