"""The development CA and certificates: real TLS handshakes, with and without mTLS."""

from __future__ import annotations

import os
import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest

pytest.importorskip("cryptography")

from onceq.cli.tls_dev_cert import (
    make_client_cert,
    make_dev_certs,
    make_untrusted_client_cert,
)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, Path]:
    return make_dev_certs(tmp_path_factory.mktemp("tls"), client_users=("alice",))


def server_context(certs, *, require_client: bool) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(certs["server"], certs["server_key"])
    if require_client:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(certs["ca"])
    return ctx


def client_context(certs, cert: Path | None = None, key: Path | None = None
                   ) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(certs["ca"]))
    if cert is not None:
        ctx.load_cert_chain(cert, key)
    return ctx


def handshake(server_ctx, client_ctx, hostname="localhost"):
    """Both sides of a TLS handshake over a socket pair, the server in a thread.

    Returns (server peer certificate or the server's exception, client exception or None).
    """
    a, b = socket.socketpair()
    a.settimeout(10)
    b.settimeout(10)
    result: dict[str, object] = {}

    def serve():
        try:
            with server_ctx.wrap_socket(a, server_side=True) as s:
                result["peer"] = s.getpeercert()
                s.sendall(b"ok")
        except (ssl.SSLError, OSError) as exc:
            result["peer"] = exc
            a.close()

    t = threading.Thread(target=serve)
    t.start()
    client_error = None
    try:
        with client_ctx.wrap_socket(b, server_hostname=hostname) as c:
            if c.recv(2) != b"ok":  # TLS 1.3: a refused client cert shows up at the read
                raise ConnectionError("no answer")
    except (ssl.SSLError, OSError) as exc:
        client_error = exc
    finally:
        b.close()
        t.join(10)
    return result.get("peer"), client_error


def common_name(peer: dict) -> str | None:
    for rdn in peer.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return value
    return None


def test_files_exist_with_private_keys(certs):
    assert set(certs) == {"ca", "ca_key", "server", "server_key", "client:alice",
                          "client_key:alice"}
    for role, path in certs.items():
        assert path.is_file() and path.stat().st_size > 0
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode == (0o600 if "key" in role else 0o644), role
    assert certs["ca"].name == "ca.pem" and certs["ca_key"].name == "ca.key"


def test_handshake_without_client_certificate(certs):
    peer, err = handshake(server_context(certs, require_client=False), client_context(certs))
    assert err is None and peer is None  # the server asked for no client certificate


def test_server_certificate_covers_ip_address(certs):
    _peer, err = handshake(server_context(certs, require_client=False), client_context(certs),
                          hostname="127.0.0.1")
    assert err is None


def test_client_refuses_a_host_not_in_the_certificate(certs):
    _peer, err = handshake(server_context(certs, require_client=False), client_context(certs),
                          hostname="broker.example.com")
    assert isinstance(err, ssl.SSLCertVerificationError)


def test_client_refuses_a_server_from_an_unknown_ca(certs):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies, and trusts no CA
    _, err = handshake(server_context(certs, require_client=False), ctx)
    assert isinstance(err, ssl.SSLCertVerificationError)


def test_mutual_tls_gives_the_user_name(certs):
    peer, err = handshake(server_context(certs, require_client=True),
                          client_context(certs, certs["client:alice"],
                                         certs["client_key:alice"]))
    assert err is None and isinstance(peer, dict)
    assert common_name(peer) == "alice"


def test_mutual_tls_refuses_a_missing_client_certificate(certs):
    peer, err = handshake(server_context(certs, require_client=True), client_context(certs))
    assert isinstance(peer, ssl.SSLError) and err is not None


def test_expired_client_certificate_is_refused(certs):
    cert, key = make_client_cert(certs["ca"].parent, "bob", expired=True)
    assert cert.name == "client-bob-expired.pem"
    peer, err = handshake(server_context(certs, require_client=True),
                          client_context(certs, cert, key))
    assert isinstance(peer, ssl.SSLCertVerificationError) and err is not None
    assert "expired" in str(peer)


def test_client_certificate_from_another_ca_is_refused(certs):
    cert, key = make_untrusted_client_cert(certs["ca"].parent, "alice")
    peer, err = handshake(server_context(certs, require_client=True),
                          client_context(certs, cert, key))
    assert isinstance(peer, ssl.SSLCertVerificationError) and err is not None


def test_rerun_reuses_the_ca(tmp_path):
    first = make_dev_certs(tmp_path, client_users=("alice",))
    ca = first["ca"].read_bytes()
    second = make_dev_certs(tmp_path, hosts=("broker.internal", "10.0.0.5", "::1"),
                            client_users=("bob",))
    assert second["ca"].read_bytes() == ca
    peer, err = handshake(server_context(second, require_client=True),
                          client_context(second, first["client:alice"],
                                         first["client_key:alice"]),
                          hostname="10.0.0.5")
    assert err is None and common_name(peer) == "alice"
    with pytest.raises(ValueError):
        make_dev_certs(tmp_path, hosts=())
