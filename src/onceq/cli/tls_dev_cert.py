"""A local certificate authority and certificates for tests and the quick start.

``make_dev_certs`` writes, in one directory::

    ca.pem, ca.key                  the local CA (reused when already there)
    server.pem, server.key          the broker's certificate, for the given host names
                                    and IP addresses (subject alternative names)
    client-<user>.pem, .key         one client certificate per user (mutual TLS): the
                                    subject common name is the onceq user name

Keys are ECDSA P-256, unencrypted PEM (PKCS#8), written with mode 0600; certificates are
PEM, mode 0644. These certificates are for development and tests: a production broker
should use certificates from the operator's own CA.

``make_client_cert`` signs one more client certificate with an existing CA (optionally
one already expired), and ``make_untrusted_client_cert`` one signed by a throwaway CA
nobody trusts: both exist to test that such certificates are refused.

Needs the ``cryptography`` package (``pip install 'onceq[tls]'``).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

try:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
except ImportError:  # pragma: no cover - the tls extra is not installed
    x509 = None  # type: ignore[assignment]

DEFAULT_DAYS = 825  # the longest validity common TLS clients accept for a leaf


def make_dev_certs(directory: str | os.PathLike[str], *,
                   hosts: Iterable[str] = ("localhost", "127.0.0.1"),
                   client_users: Iterable[str] = (), days: int = DEFAULT_DAYS,
                   ) -> dict[str, Path]:
    """Write a local CA, a server certificate for ``hosts`` and one client certificate
    per name of ``client_users`` into ``directory`` (created if needed).

    An existing ``ca.pem``/``ca.key`` pair in ``directory`` is reused, so certificates
    made by earlier calls stay valid; the server and client files are rewritten.
    Returns the paths by role: ``ca``, ``ca_key``, ``server``, ``server_key``, and
    ``client:<user>``, ``client_key:<user>`` for each user. ``hosts`` entries that parse
    as IP addresses become IP SANs, the others DNS SANs; the first is the subject CN.
    """
    _require()
    hosts = list(hosts)
    if not hosts:
        raise ValueError("at least one host name or address is needed")
    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = _load_or_make_ca(out_dir, days)
    paths = {"ca": out_dir / "ca.pem", "ca_key": out_dir / "ca.key"}

    key = _new_key()
    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    cert = _sign(_name(hosts[0]), key, ca_cert, ca_key, days, server=True, sans=sans)
    paths["server"], paths["server_key"] = _write_pair(out_dir, "server", cert, key)

    for user in client_users:
        cert_path, key_path = make_client_cert(out_dir, user, days=days)
        paths[f"client:{user}"], paths[f"client_key:{user}"] = cert_path, key_path
    return paths


def make_client_cert(directory: str | os.PathLike[str], user: str, *,
                     days: int = DEFAULT_DAYS, expired: bool = False,
                     stem: str | None = None) -> tuple[Path, Path]:
    """Sign a client certificate for ``user`` (subject CN) with the CA in ``directory``.

    ``expired=True`` makes one whose validity ended yesterday. Writes
    ``<stem>.pem``/``<stem>.key`` (default stem ``client-<user>``, ``-expired`` added
    when expired) and returns their paths. FileNotFoundError without a CA there.
    """
    _require()
    out_dir = Path(directory)
    ca_cert = x509.load_pem_x509_certificate((out_dir / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((out_dir / "ca.key").read_bytes(), None)
    key = _new_key()
    cert = _sign(_name(user), key, ca_cert, ca_key, days, server=False, expired=expired)
    stem = stem or f"client-{user}" + ("-expired" if expired else "")
    return _write_pair(out_dir, stem, cert, key)


def make_untrusted_client_cert(directory: str | os.PathLike[str], user: str, *,
                               stem: str | None = None) -> tuple[Path, Path]:
    """A client certificate for ``user`` signed by a new CA that is then thrown away
    (its key is never written): a broker trusting only ``ca.pem`` must refuse it."""
    _require()
    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    rogue_key = _new_key()
    rogue = _self_signed_ca(rogue_key, "onceq untrusted test CA", DEFAULT_DAYS)
    key = _new_key()
    cert = _sign(_name(user), key, rogue, rogue_key, DEFAULT_DAYS, server=False)
    return _write_pair(out_dir, stem or f"client-{user}-untrusted", cert, key)


# ------------------------------------------------------------------ internals
def _require() -> None:
    if x509 is None:
        raise RuntimeError("TLS certificates need the 'cryptography' package: "
                           "pip install 'onceq[tls]'")


def _new_key() -> Any:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> Any:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "onceq development"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _self_signed_ca(key: Any, common_name: str, days: int) -> Any:
    now = _now()
    public = key.public_key()
    return (x509.CertificateBuilder()
            .subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(public).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1))
            .not_valid_after(now + dt.timedelta(days=max(days, 3650)))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False),
                critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(key, hashes.SHA256()))


def _load_or_make_ca(out_dir: Path, days: int) -> tuple[Any, Any]:
    cert_path, key_path = out_dir / "ca.pem", out_dir / "ca.key"
    if cert_path.exists() and key_path.exists():
        return (x509.load_pem_x509_certificate(cert_path.read_bytes()),
                serialization.load_pem_private_key(key_path.read_bytes(), None))
    key = _new_key()
    cert = _self_signed_ca(key, "onceq development CA", days)
    _write_pair(out_dir, "ca", cert, key)
    return cert, key


def _sign(subject: Any, key: Any, ca_cert: Any, ca_key: Any, days: int, *, server: bool,
          sans: list[Any] | None = None, expired: bool = False) -> Any:
    now = _now()
    if expired:
        start, end = now - dt.timedelta(days=30), now - dt.timedelta(days=1)
    else:
        start, end = now - dt.timedelta(hours=1), now + dt.timedelta(days=days)
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    builder = (x509.CertificateBuilder()
               .subject_name(subject).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(
                   digital_signature=True, key_cert_sign=False, crl_sign=False,
                   content_commitment=False, key_encipherment=False,
                   data_encipherment=False, key_agreement=False, encipher_only=False,
                   decipher_only=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                              critical=False)
               .add_extension(x509.AuthorityKeyIdentifier
                              .from_issuer_subject_key_identifier(ca_ski), critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def _write_pair(out_dir: Path, stem: str, cert: Any, key: Any) -> tuple[Path, Path]:
    cert_path, key_path = out_dir / f"{stem}.pem", out_dir / f"{stem}.key"
    _write(key_path, key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()), 0o600)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert_path, key_path


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` with ``mode`` from the first byte (never wider)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
