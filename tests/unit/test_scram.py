"""SCRAM-SHA-256: the RFC 7677 vector, full exchanges, and every way one must fail."""

from __future__ import annotations

import base64
import contextlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onceq.protocol.scram import (
    DEFAULT_ITERATIONS,
    FAILED,
    MIN_ITERATIONS,
    Credentials,
    ScramClient,
    ScramError,
    ScramServer,
    make_credentials,
    saslprep,
)

# RFC 7677 section 3
C_NONCE = "rOprNGfwEbeRWgbNEkqO"
S_NONCE = "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0"
SALT = base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ==")
RFC_C1 = "n,,n=user,r=rOprNGfwEbeRWgbNEkqO"
RFC_S1 = ("r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
          "s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096")
RFC_C2 = ("c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
          "p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=")
RFC_S2 = "v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="

# few rounds keep the tests fast; MIN_ITERATIONS is the floor the client accepts
USERS = {"alice": make_credentials("s3cret", iterations=MIN_ITERATIONS),
         "user": make_credentials("pencil", salt=SALT, iterations=4096)}


def lookup(name: str) -> Credentials | None:
    return USERS.get(name)


def exchange(user: str, password: str) -> tuple[ScramClient, ScramServer, str, str]:
    client, server = ScramClient(user, password), ScramServer(lookup)
    s1 = server.first(client.first())
    return client, server, s1, client.final(s1)


# ------------------------------------------------------------------ RFC 7677 vector
def test_rfc7677_client_messages():
    client = ScramClient("user", "pencil", nonce=C_NONCE)
    assert client.first() == RFC_C1
    assert client.final(RFC_S1) == RFC_C2
    client.verify(RFC_S2)
    assert client.authenticated


def test_rfc7677_server_messages():
    server = ScramServer(lookup, nonce=S_NONCE)
    assert server.first(RFC_C1) == RFC_S1
    assert server.final(RFC_C2) == ("user", RFC_S2)


def test_credentials_round_trip_through_dict():
    creds = USERS["user"]
    assert Credentials.from_dict(creds.to_dict()) == creds
    with pytest.raises(ValueError):
        Credentials.from_dict({**creds.to_dict(), "stored_key": "!!"})
    with pytest.raises(ValueError):
        Credentials.from_dict({**creds.to_dict(), "iterations": "4096"})


def test_make_credentials_defaults_and_limits():
    a, b = make_credentials("pw"), make_credentials("pw")
    assert a.iterations == DEFAULT_ITERATIONS >= 4096
    assert a.salt != b.salt and a.stored_key != b.stored_key  # random salt each time
    with pytest.raises(ValueError):
        make_credentials("pw", iterations=1000)
    with pytest.raises(ValueError):
        make_credentials("")
    with pytest.raises(ValueError):
        make_credentials("bad\x00pw")


def test_saslprep_maps_and_normalizes():
    assert saslprep("I\u00adX") == "IX"  # soft hyphen mapped to nothing
    assert saslprep("a\u00a0b") == "a b"  # non-ASCII space mapped to space
    assert saslprep("\u2168") == "IX"  # NFKC
    with pytest.raises(ScramError):
        saslprep("\x07")


# ------------------------------------------------------------------ exchanges
def test_full_exchange_authenticates_both_sides():
    client, server, _, c2 = exchange("alice", "s3cret")
    user, s2 = server.final(c2)
    assert user == "alice" and server.user == "alice"
    client.verify(s2)
    assert client.authenticated


def test_user_name_with_comma_and_equals_is_escaped():
    USERS["a,b=c"] = make_credentials("pw", iterations=MIN_ITERATIONS)
    client = ScramClient("a,b=c", "pw")
    first = client.first()
    assert "n=a=2Cb=3Dc," in first
    server = ScramServer(lookup)
    c2 = client.final(server.first(first))
    assert server.final(c2)[0] == "a,b=c"


def test_wrong_password_fails():
    _, server, _, c2 = exchange("alice", "wrong")
    with pytest.raises(ScramError) as err:
        server.final(c2)
    assert str(err.value) == FAILED and err.value.server_error == "invalid-proof"


def test_unknown_user_fails_like_a_wrong_password():
    _, server, s1, c2 = exchange("mallory", "whatever")
    assert "s=" in s1 and f"i={DEFAULT_ITERATIONS}" in s1  # answered like a known user
    with pytest.raises(ScramError) as unknown:
        server.final(c2)
    _, server2, _, c2b = exchange("alice", "wrong")
    with pytest.raises(ScramError) as wrong:
        server2.final(c2b)
    assert str(unknown.value) == str(wrong.value) == FAILED
    assert unknown.value.server_error == wrong.value.server_error


def test_unknown_user_gets_the_same_salt_every_time():
    salts = {exchange("mallory", "x")[2].split(",")[1] for _ in range(3)}
    assert len(salts) == 1


def test_replayed_client_final_fails_on_a_new_exchange():
    client = ScramClient("alice", "s3cret", nonce="fixedclientnonce")
    server = ScramServer(lookup)
    c2 = client.final(server.first(client.first()))
    server.final(c2)  # the genuine login
    replay = ScramServer(lookup)  # the attacker replays both client messages
    replay.first("n,,n=alice,r=fixedclientnonce")
    with pytest.raises(ScramError, match=FAILED):
        replay.final(c2)


def test_tampered_nonce_fails():
    _, server, _, c2 = exchange("alice", "s3cret")
    attrs = c2.split(",")
    attrs[1] = attrs[1] + "x"
    with pytest.raises(ScramError, match=FAILED):
        server.final(",".join(attrs))


def test_tampered_channel_binding_fails():
    _, server, _, c2 = exchange("alice", "s3cret")
    with pytest.raises(ScramError, match=FAILED):
        server.final(c2.replace("c=biws", "c=eSws", 1))


def test_client_refuses_a_tampered_server_signature():
    client, server, _, c2 = exchange("alice", "s3cret")
    _, s2 = server.final(c2)
    sig = bytearray(base64.b64decode(s2[2:]))
    sig[0] ^= 1
    with pytest.raises(ScramError, match="not authentic"):
        client.verify("v=" + base64.b64encode(bytes(sig)).decode())
    assert not client.authenticated


def test_client_refuses_a_server_that_does_not_know_the_keys():
    # an impostor server with other keys for alice: the proof it checks fails, and the
    # signature it would send is refused by the client
    client = ScramClient("alice", "s3cret")
    impostor = ScramServer(lambda _: make_credentials("other", iterations=MIN_ITERATIONS))
    c2 = client.final(impostor.first(client.first()))
    with pytest.raises(ScramError):
        impostor.final(c2)
    with pytest.raises(ScramError, match="not authentic"):
        client.verify("v=" + base64.b64encode(bytes(32)).decode())


def test_client_reports_server_error():
    client, _, _, _ = exchange("alice", "wrong")
    with pytest.raises(ScramError, match="invalid-proof"):
        client.verify("e=invalid-proof")


def test_client_refuses_weak_or_huge_iteration_counts():
    for i in (1, MIN_ITERATIONS - 1, 10**9):
        client = ScramClient("alice", "s3cret", nonce="abc")
        client.first()
        with pytest.raises(ScramError, match="iterations"):
            client.final(f"r=abcdef,s={base64.b64encode(b'salt').decode()},i={i}")


def test_client_refuses_a_nonce_that_does_not_extend_its_own():
    client = ScramClient("alice", "s3cret", nonce="abc")
    client.first()
    with pytest.raises(ScramError, match="nonce"):
        client.final("r=xyzdef,s=c2FsdA==,i=4096")


def test_out_of_order_and_reuse_fail():
    client = ScramClient("alice", "s3cret")
    with pytest.raises(ScramError):
        client.final(RFC_S1)
    server = ScramServer(lookup)
    with pytest.raises(ScramError):
        server.final(RFC_C2)
    c, s, _, c2 = exchange("alice", "s3cret")
    s.final(c2)
    with pytest.raises(ScramError):
        s.final(c2)  # one exchange per server object
    with pytest.raises(ScramError):
        c.final(RFC_S1)


@pytest.mark.parametrize("msg", [
    "", "n,,", "n,", "p=tls-unique,,n=alice,r=abc", "n,a=admin,n=alice,r=abc",
    "x,,n=alice,r=abc", "n,,r=abc,n=alice", "n,,n=alice", "n,,m=ext,n=alice,r=abc",
    "n,,n=al=ice,r=abc", "n,,n=alice,r=a,b", "n,,n=alice,r=", "n,,n=alice,r=caf\u00e9",
    "n,,n=,r=abc", "n,,n=a\x00,r=abc", "n,,n=\ud800,r=abc", "n,," + "x" * 5000,
])
def test_malformed_client_first_is_a_scram_error(msg):
    with pytest.raises(ScramError):
        ScramServer(lookup).first(msg)


@pytest.mark.parametrize("msg", [
    "", "c=biws", "c=biws,r=x", "p=abc", "c=biws,r=x,p=!!!", "r=x,c=biws,p=AAAA",
    "c=biws,r=x,p=AAAA", "c=biws,r=x,m=1,p=AAAA", "c=biws,r=x,p=\u00e9",
])
def test_malformed_client_final_is_a_scram_error(msg):
    server = ScramServer(lookup)
    server.first("n,,n=alice,r=abc")
    with pytest.raises(ScramError):
        server.final(msg)


@pytest.mark.parametrize("msg", [
    "", "r=abc", "r=abcd,s=c2FsdA==", "r=abcd,s=!!,i=4096", "r=abcd,s=,i=4096",
    "r=abcd,s=c2FsdA==,i=-1", "r=abcd,s=c2FsdA==,i=4e3", "r=abcd,s=c2FsdA==,i=\u0664\u0660",
    "s=c2FsdA==,r=abcd,i=4096", "r=ab\u00e9,s=c2FsdA==,i=4096", "m=x,r=abcd,s=c2FsdA==,i=4096",
])
def test_malformed_server_first_is_a_scram_error(msg):
    client = ScramClient("alice", "s3cret", nonce="ab")
    client.first()
    with pytest.raises(ScramError):
        client.final(msg)


# ------------------------------------------------------------------ junk never crashes
JUNK = st.one_of(
    st.text(max_size=200),
    st.lists(st.sampled_from(["n", "y", "p", "=", ",", "r", "s", "i", "c", "v", "e", "m",
                              "biws", "abc", "AAAA", "4096", "=2C", "\x00", "\u00e9"]),
             max_size=30).map("".join),
)

FAST = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(JUNK)
def test_server_first_junk_raises_only_scram_error(junk):
    with contextlib.suppress(ScramError):
        ScramServer(lookup).first(junk)


@FAST
@given(JUNK)
def test_server_final_junk_raises_only_scram_error(junk):
    server = ScramServer(lookup)
    server.first("n,,n=alice,r=abc")
    with pytest.raises(ScramError):
        server.final(junk)


@FAST
@given(JUNK)
def test_client_final_junk_raises_only_scram_error(junk):
    client = ScramClient("alice", "s3cret", nonce="r")
    client.first()
    with contextlib.suppress(ScramError):
        client.final(junk)


@FAST
@given(JUNK)
def test_client_verify_junk_raises_only_scram_error(junk):
    client = ScramClient("user", "pencil", nonce=C_NONCE)
    client.first()
    client.final(RFC_S1)
    if junk == RFC_S2:
        return
    with pytest.raises(ScramError):
        client.verify(junk)
