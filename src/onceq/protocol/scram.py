"""SCRAM-SHA-256 (RFC 5802, RFC 7677) as sans-I/O state machines.

Neither side sends the password: the client proves it knows it with a proof bound to
both nonces, and the server proves it holds the user's keys with its signature, which
the client checks. The broker stores only ``Credentials`` (salt, iteration count,
StoredKey, ServerKey): a stolen user file gives no password and no login.

The exchange (channel binding is not offered, the gs2 header is ``n,,``)::

    client = ScramClient(user, password)          server = ScramServer(lookup)
    m1 = client.first()                      ->   m2 = server.first(m1)
    m3 = client.final(m2)                    ->   user, m4 = server.final(m3)
    client.verify(m4)

Every failure raises ``ScramError``. On the server its message never tells an unknown
user from a wrong password: an unknown user is answered with a fake salt derived from
the name (the same on every attempt) and fails at the proof check, as a wrong password
does. Every object serves one exchange; reuse raises ``ScramError``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import stringprep
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_ITERATIONS = 8192
"""PBKDF2 rounds for new credentials. RFC 7677 asks for at least 4096; 8192 doubles the
cost of an offline guess against a stolen user file while a client pays only a few
milliseconds per connection, and stays within the 4096..16384 range other SCRAM
implementations (Kafka) accept. The count is stored per user, so raising it later only
affects credentials made from then on."""
MIN_ITERATIONS = 4096
MAX_ITERATIONS = 1_000_000  # a client refuses more: a rogue server cannot make it spin
MAX_MESSAGE = 4096  # longer SCRAM messages are refused unparsed
SALT_BYTES = 16
FAILED = "authentication failed"

_HASH_SIZE = hashlib.sha256().digest_size


class ScramError(Exception):
    """A SCRAM exchange failed. ``server_error`` is RFC 5802's ``e=`` value that fits."""

    def __init__(self, message: str, server_error: str = "other-error") -> None:
        super().__init__(message)
        self.server_error = server_error


@dataclass(frozen=True)
class Credentials:
    """What the broker stores for one user: never the password."""

    salt: bytes
    iterations: int
    stored_key: bytes
    server_key: bytes

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (byte fields in base64)."""
        return {"salt": _b64(self.salt), "iterations": self.iterations,
                "stored_key": _b64(self.stored_key), "server_key": _b64(self.server_key)}

    @classmethod
    def from_dict(cls, doc: Any) -> Credentials:
        """The inverse of ``to_dict``; ValueError when ``doc`` is not a valid form."""
        if not isinstance(doc, dict):
            raise ValueError("credentials are not an object")
        iterations = doc.get("iterations")
        if type(iterations) is not int or iterations < 1:
            raise ValueError("credentials: bad iteration count")
        try:
            salt, stored, server = (base64.b64decode(doc[k], validate=True)
                                    for k in ("salt", "stored_key", "server_key"))
        except (KeyError, TypeError, ValueError):
            raise ValueError("credentials: missing or bad base64 field") from None
        if not salt or len(stored) != _HASH_SIZE or len(server) != _HASH_SIZE:
            raise ValueError("credentials: bad field length")
        return cls(salt, iterations, stored, server)


def saslprep(text: str) -> str:
    """RFC 4013 SASLprep (query strings): maps, NFKC-normalizes and checks ``text``.

    Raises ``ScramError`` for prohibited characters or a bidi violation. ASCII
    printable text comes back unchanged.
    """
    mapped = "".join(" " if stringprep.in_table_c12(c) else c
                     for c in text if not stringprep.in_table_b1(c))
    out = unicodedata.ucd_3_2_0.normalize("NFKC", mapped)
    for c in out:
        if (stringprep.in_table_c12(c) or stringprep.in_table_c21_c22(c)
                or stringprep.in_table_c3(c) or stringprep.in_table_c4(c)
                or stringprep.in_table_c5(c) or stringprep.in_table_c6(c)
                or stringprep.in_table_c7(c) or stringprep.in_table_c8(c)
                or stringprep.in_table_c9(c)):
            raise ScramError("prohibited character in name or password")
    if any(stringprep.in_table_d1(c) for c in out) and (
            any(stringprep.in_table_d2(c) for c in out)
            or not stringprep.in_table_d1(out[0]) or not stringprep.in_table_d1(out[-1])):
        raise ScramError("bidirectional text not allowed in name or password")
    return out


def make_credentials(password: str, salt: bytes | None = None,
                     iterations: int = DEFAULT_ITERATIONS) -> Credentials:
    """The stored credentials of ``password`` (SASLprep, then PBKDF2-HMAC-SHA256).

    A fresh random salt of ``SALT_BYTES`` is drawn when none is given. ValueError for an
    empty password, an empty salt or fewer than ``MIN_ITERATIONS`` rounds.
    """
    if iterations < MIN_ITERATIONS:
        raise ValueError(f"iterations must be at least {MIN_ITERATIONS}")
    if salt is None:
        salt = secrets.token_bytes(SALT_BYTES)
    if not salt:
        raise ValueError("salt must not be empty")
    try:
        prepared = saslprep(password)
    except ScramError as exc:
        raise ValueError(str(exc)) from None
    if not prepared:
        raise ValueError("password must not be empty")
    salted = _salted_password(prepared, salt, iterations)
    client_key = _hmac(salted, b"Client Key")
    return Credentials(salt, iterations, hashlib.sha256(client_key).digest(),
                       _hmac(salted, b"Server Key"))


class ScramClient:
    """The client side: ``first()``, then ``final(server_first)``, then ``verify``.

    ``verify`` must be called: until it passes, the server is not authenticated.
    """

    def __init__(self, user: str, password: str, nonce: str | None = None,
                 *, max_iterations: int = MAX_ITERATIONS) -> None:
        self._user = saslprep(user)
        self._password = saslprep(password)
        self._nonce = _check_nonce(nonce) if nonce is not None else _new_nonce()
        self._max_iterations = max_iterations
        self._state = "start"
        self._first_bare = ""
        self._server_signature = b""

    @property
    def authenticated(self) -> bool:
        """True once ``verify`` accepted the server's signature."""
        return self._state == "done"

    def first(self) -> str:
        """The client-first-message (``n,,n=<user>,r=<nonce>``)."""
        self._step("start", "sent-first")
        self._first_bare = f"n={_escape_name(self._user)},r={self._nonce}"
        return "n,," + self._first_bare

    def final(self, server_first: str) -> str:
        """The client-final-message (with the proof) answering ``server_first``."""
        self._step("sent-first", "sent-final")
        attrs = _parse(server_first, ("r", "s", "i"), "server-first-message")
        nonce, salt_b64, iterations_s = attrs["r"], attrs["s"], attrs["i"]
        if not nonce.startswith(self._nonce) or len(nonce) == len(self._nonce):
            raise ScramError("server nonce does not extend the client nonce")
        _check_nonce(nonce)
        salt = _unb64(salt_b64, "salt")
        if not salt:
            raise ScramError("malformed SCRAM message: empty salt")
        if not iterations_s.isascii() or not iterations_s.isdigit():
            raise ScramError("malformed SCRAM message: bad iteration count")
        iterations = int(iterations_s)
        if not MIN_ITERATIONS <= iterations <= self._max_iterations:
            raise ScramError(f"server asks for {iterations} iterations, outside "
                             f"{MIN_ITERATIONS}..{self._max_iterations}")
        salted = _salted_password(self._password, salt, iterations)
        client_key = _hmac(salted, b"Client Key")
        without_proof = f"c=biws,r={nonce}"
        auth = f"{self._first_bare},{server_first},{without_proof}".encode()
        signature = _hmac(hashlib.sha256(client_key).digest(), auth)
        self._server_signature = _hmac(_hmac(salted, b"Server Key"), auth)
        self._password = ""
        return f"{without_proof},p={_b64(_xor(client_key, signature))}"

    def verify(self, server_final: str) -> None:
        """Check the server-final-message; ScramError unless the server knew the keys."""
        self._step("sent-final", "failed")
        if isinstance(server_final, str) and server_final.startswith("e="):
            raise ScramError(f"server refused: {server_final[2:MAX_MESSAGE]}")
        attrs = _parse(server_final, ("v",), "server-final-message")
        if not hmac.compare_digest(_unb64(attrs["v"], "server signature"),
                                   self._server_signature):
            raise ScramError("server signature mismatch: the server is not authentic")
        self._state = "done"

    def _step(self, expected: str, then: str) -> None:
        if self._state != expected:
            raise ScramError(f"SCRAM client used out of order (state {self._state})")
        self._state = then


Lookup = Callable[[str], "Credentials | None"]


class ScramServer:
    """The server side of one exchange: ``first(client_first)``, ``final(client_final)``.

    ``lookup(user)`` returns the user's ``Credentials`` or None. ``nonce`` (the server's
    part of the combined nonce) is drawn from ``secrets`` when not given.
    """

    def __init__(self, lookup: Lookup, nonce: str | None = None) -> None:
        self._lookup = lookup
        self._server_nonce = _check_nonce(nonce) if nonce is not None else _new_nonce()
        self._state = "start"
        self._user: str | None = None
        self._gs2 = ""
        self._nonce = ""
        self._auth_prefix = ""
        self._creds: Credentials | None = None
        self._known = False

    @property
    def user(self) -> str | None:
        """The user name the client claims (set by ``first``), not yet authenticated."""
        return self._user

    def first(self, client_first: str) -> str:
        """The server-first-message (combined nonce, salt, iterations)."""
        self._step("start", "failed")
        if not isinstance(client_first, str) or len(client_first) > MAX_MESSAGE:
            raise ScramError("malformed SCRAM message: client-first-message")
        parts = client_first.split(",", 2)
        if len(parts) != 3:
            raise ScramError("malformed SCRAM message: no gs2 header")
        cbind, authzid, bare = parts
        if cbind.startswith("p="):
            raise ScramError("channel binding is not supported",
                             "channel-binding-not-supported")
        if cbind not in ("n", "y"):
            raise ScramError("malformed SCRAM message: bad gs2 channel binding flag")
        if authzid:
            raise ScramError("an authorization identity is not supported")
        attrs = _parse(bare, ("n", "r"), "client-first-message", extensions=True)
        user = saslprep(_unescape_name(attrs["n"]))
        if not user:
            raise ScramError("malformed SCRAM message: empty user name")
        client_nonce = _check_nonce(attrs["r"])
        creds = self._lookup(user)
        self._known = creds is not None
        self._creds = creds if creds is not None else _fake_credentials(user)
        self._user = user
        self._gs2 = f"{cbind},,"
        self._nonce = client_nonce + self._server_nonce
        server_first = (f"r={self._nonce},s={_b64(self._creds.salt)},"
                        f"i={self._creds.iterations}")
        self._auth_prefix = f"{bare},{server_first}"
        self._state = "sent-first"
        return server_first

    def final(self, client_final: str) -> tuple[str, str]:
        """Check the client's proof; ``(user, server-final-message)`` when it holds."""
        self._step("sent-first", "failed")
        if not isinstance(client_final, str) or len(client_final) > MAX_MESSAGE:
            raise ScramError("malformed SCRAM message: client-final-message")
        without_proof, sep, proof_b64 = client_final.rpartition(",p=")
        if not sep:
            raise ScramError("malformed SCRAM message: no proof")
        attrs = _parse(without_proof, ("c", "r"), "client-final-message", extensions=True)
        proof = _unb64(proof_b64, "proof")
        creds = self._creds
        assert creds is not None and self._user is not None
        binding_ok = hmac.compare_digest(attrs["c"].encode(),
                                         _b64(self._gs2.encode()).encode())
        nonce_ok = hmac.compare_digest(attrs["r"].encode(), self._nonce.encode())
        auth = f"{self._auth_prefix},{without_proof}".encode()
        signature = _hmac(creds.stored_key, auth)
        client_key = _xor(proof, signature) if len(proof) == _HASH_SIZE else bytes(_HASH_SIZE)
        proof_ok = hmac.compare_digest(hashlib.sha256(client_key).digest(), creds.stored_key)
        if not (binding_ok and nonce_ok and proof_ok and self._known):
            raise ScramError(FAILED, "invalid-proof")
        self._state = "done"
        return self._user, f"v={_b64(_hmac(creds.server_key, auth))}"

    def _step(self, expected: str, then: str) -> None:
        if self._state != expected:
            raise ScramError(f"SCRAM server used out of order (state {self._state})")
        self._state = then


# ------------------------------------------------------------------ helpers
_FAKE_KEY = secrets.token_bytes(32)  # per process: a fake salt is stable while it runs


def _fake_credentials(user: str) -> Credentials:
    """Credentials no password matches, with a salt stable for ``user``."""
    digest = _hmac(_FAKE_KEY, user.encode("utf-8", "surrogatepass"))
    return Credentials(digest[:SALT_BYTES], DEFAULT_ITERATIONS,
                       _hmac(_FAKE_KEY, b"stored" + digest), _hmac(_FAKE_KEY, b"server" + digest))


def _salted_password(password: str, salt: bytes, iterations: int) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)


def _hmac(key: bytes, msg: bytes) -> bytes:
    return hmac.new(key, msg, hashlib.sha256).digest()


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b, strict=True))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeError):
        raise ScramError(f"malformed SCRAM message: bad base64 {what}") from None


def _new_nonce() -> str:
    return secrets.token_urlsafe(24)


def _check_nonce(nonce: str) -> str:
    """``nonce`` when it is printable ASCII without ``,`` (RFC 5802), else ScramError."""
    if (not isinstance(nonce, str) or not nonce
            or any(not 0x21 <= ord(c) <= 0x7E or c == "," for c in nonce)):
        raise ScramError("malformed SCRAM message: bad nonce")
    return nonce


def _escape_name(name: str) -> str:
    return name.replace("=", "=3D").replace(",", "=2C")


def _unescape_name(name: str) -> str:
    rest = name.replace("=3D", "").replace("=2C", "")
    if "=" in rest:
        raise ScramError("malformed SCRAM message: bad escape in user name")
    return name.replace("=2C", ",").replace("=3D", "=")


def _parse(message: str, keys: tuple[str, ...], what: str,
           extensions: bool = False) -> dict[str, str]:
    """The attributes ``keys`` of ``message``, in that order, each ``k=value``.

    Extra attributes after them are ignored when ``extensions`` (RFC 5802's
    extensions), refused otherwise; the reserved mandatory extension ``m=`` is refused.
    """
    if not isinstance(message, str) or len(message) > MAX_MESSAGE:
        raise ScramError(f"malformed SCRAM message: {what}")
    fields = message.split(",")
    if len(fields) < len(keys) or (len(fields) > len(keys) and not extensions):
        raise ScramError(f"malformed SCRAM message: {what}")
    out = {}
    for i, field in enumerate(fields):
        key, eq, value = field.partition("=")
        if not eq or len(key) != 1 or not key.isascii() or not key.isalpha():
            raise ScramError(f"malformed SCRAM message: {what}")
        if key == "m":
            raise ScramError("unsupported mandatory SCRAM extension",
                             "extensions-not-supported")
        if i < len(keys):
            if key != keys[i]:
                raise ScramError(f"malformed SCRAM message: {what} (expected {keys[i]}=)")
            out[key] = value
    return out
