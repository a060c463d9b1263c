"""Who is on a connection and what they may do: authentication, authorization, the user and
grant administration requests, the audit log.

With ``acl`` on, a connection starts without a user. It gets one by a SCRAM-SHA-256
exchange (``AUTHENTICATE``, two steps: ``protocol/scram.py``; no secret on the wire, a
fresh server nonce each time, so a captured exchange cannot be replayed), or by a client
certificate whose subject CN names a user (mTLS). Until then every request but
``AUTHENTICATE`` is ``UNAUTHENTICATED``; a connection has one user for its life (a second
``AUTHENTICATE`` is refused). Failed logins are counted per source and per user name and
lock them out for a growing time (``auth_limits.py``).

Then every request is checked by the one table of ``acl.py``: a super user may do
everything; another user needs an allowing grant, and no denying one, for each check of the
request. A deleted user's connections lose everything at their next request.

With ``acl`` off nobody authenticates and everything is allowed (loopback only, unless the
broker runs with ``insecure``: ``config.check_exposure``); users and grants can still be
managed, to be ready when it is turned on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..protocol import requests as rq
from ..protocol.codes import RequestCode
from ..protocol.errors import ErrorCode, OnceqError
from ..protocol.replies import AclChanged, AuthReply, Empty, Grants, UserInfo, Users
from ..protocol.schema import Message
from ..protocol.scram import Credentials, ScramError, ScramServer
from .acl import AclStore, Action, Decision, Grant, make_grant, required
from .audit import AuditLog
from .auth_limits import FailedLogins
from .users import UserError, UserStore

if TYPE_CHECKING:
    from .config import BrokerConfig
    from .connection import Connection
    from .fields import Call, Handler

log = logging.getLogger("onceq.broker")

_CHANGES = (Action.CREATE, Action.UPDATE, Action.DELETE)  # allowed ones are audited
_USER_ERRORS = {"exists": ErrorCode.USER_EXISTS, "unknown": ErrorCode.USER_NOT_EXIST,
                "invalid": ErrorCode.INVALID_ARGUMENT, "damaged": ErrorCode.STORAGE_ERROR}


def _user_error(exc: UserError) -> OnceqError:
    return OnceqError(_USER_ERRORS.get(exc.kind, ErrorCode.INVALID_ARGUMENT), str(exc))


class Security:
    def __init__(self, config: BrokerConfig, clock: Callable[[], float]) -> None:
        data_dir = config.store.data_dir
        self.enabled = config.acl
        try:
            self.users = UserStore(data_dir, clock)
        except UserError as exc:
            raise ValueError(str(exc)) from None
        self.acls = AclStore(data_dir)
        self.failed = FailedLogins()
        path = config.audit_log or (f"{data_dir}/audit.log" if config.acl else None)
        self.audit = AuditLog(path, clock)

    def handlers(self) -> dict[type[Message], Handler]:
        return {rq.Authenticate: self.h_authenticate, rq.UserCreate: self.h_user_create,
                rq.UserUpdate: self.h_user_update, rq.UserDelete: self.h_user_delete,
                rq.UserList: self.h_user_list, rq.AclGrant: self.h_acl_grant,
                rq.AclRevoke: self.h_acl_revoke, rq.AclList: self.h_acl_list}

    # ---------------------------------------------------------------- the checks
    def admit(self, conn: Connection, code: int, corr: int) -> None:
        """Before a request is even decoded: ``UNAUTHENTICATED`` unless the connection has
        a user (that still exists), or the request is the way in (``AUTHENTICATE``)."""
        if not self.enabled or code == RequestCode.AUTHENTICATE:
            return
        user = conn.user
        if user is None or user not in self.users:
            name = _request_name(code)
            self.audit.record("unauthenticated", user=user, source=conn.source, request=name,
                              request_id=corr)
            raise OnceqError(ErrorCode.UNAUTHENTICATED, f"{name} needs a user: authenticate "
                             "first (user and password, or a client certificate)")

    def authorize(self, conn: Connection, code: int, corr: int, request: Message) -> None:
        """After ``admit``: ``ACCESS_DENIED`` unless ``conn``'s user may make ``request``
        (always allowed with ACLs off)."""
        if not self.enabled or type(request) is rq.Authenticate:
            return
        user, source = conn.user, conn.source
        assert user is not None
        name = _request_name(code)
        needs = required(request)
        if needs is None:  # a request type the table does not know: refused
            self.audit.record("deny", user=user, source=source, request=name,
                              request_id=corr, reason="no rule for this request")
            raise OnceqError(ErrorCode.ACCESS_DENIED, f"{name} is not allowed to anyone")
        is_super = self.users.is_super(user)
        for need in needs:
            if not is_super:
                decision, why = self.acls.decide(user, need, source)
                if decision is Decision.DENY:
                    self.audit.record("deny", user=user, source=source, action=need.action,
                                      resource=f"{need.kind}:{need.name}", request=name,
                                      request_id=corr, reason=why)
                    raise OnceqError(ErrorCode.ACCESS_DENIED, f"{name}: {why}")
            if need.action in _CHANGES:
                self.audit.record("allow", user=user, source=source, action=need.action,
                                  resource=f"{need.kind}:{need.name}", request=name,
                                  request_id=corr)

    def certificate_user(self, conn: Connection, common_name: str | None) -> None:
        """A client certificate verified by TLS names the connection's user (when it is a
        user of this broker)."""
        if common_name and common_name in self.users:
            conn.user = common_name
            self.audit.record("login", user=common_name, source=conn.source,
                              reason="client certificate")

    # ---------------------------------------------------------------- authentication
    def h_authenticate(self, call: Call, req: rq.Authenticate) -> AuthReply:
        conn = call.conn
        source = conn.source or "?"
        if conn.user is not None:
            raise OnceqError(ErrorCode.AUTH_FAILED, f"this connection is authenticated as "
                             f"{conn.user!r}: a connection has one user for its life")
        if req.mechanism != "SCRAM-SHA-256":
            raise OnceqError(ErrorCode.AUTH_FAILED, f"mechanism {req.mechanism!r} is not "
                             "supported: SCRAM-SHA-256")
        server, conn.scram = conn.scram, None  # one try per exchange
        try:
            if server is None:  # the client-first message
                server = ScramServer(self.users.credentials)
                answer = server.first(req.message)
                self._locked_out(source, server.user)
                conn.scram = server
                return AuthReply(answer)
            user, answer = server.final(req.message)
        except ScramError as exc:
            self._login_failed(source, server.user if server else None, str(exc))
            raise OnceqError(ErrorCode.AUTH_FAILED, "authentication failed") from None
        self._locked_out(source, user)
        self.failed.succeeded(source, user)
        conn.user = user
        self.audit.record("login", user=user, source=source, reason="SCRAM-SHA-256")
        return AuthReply(answer, user)

    def _locked_out(self, source: str, user: str | None) -> None:
        wait = self.failed.check(source, user)
        if wait is not None:
            self.audit.record("login-failed", user=user, source=source, reason="locked out")
            raise OnceqError(ErrorCode.AUTH_FAILED, f"too many failed logins: try again in "
                             f"{wait:.0f}s")

    def _login_failed(self, source: str, user: str | None, why: str) -> None:
        self.failed.failed(source, user)
        self.audit.record("login-failed", user=user, source=source, reason=why)

    # ---------------------------------------------------------------- users and grants
    def h_user_create(self, call: Call, req: rq.UserCreate) -> UserInfo:
        try:
            return UserInfo(self.users.create(req.name, _credentials(req.credentials),
                                              super=req.super))
        except UserError as exc:
            raise _user_error(exc) from None

    def h_user_update(self, call: Call, req: rq.UserUpdate) -> UserInfo:
        creds = None if req.credentials is None else _credentials(req.credentials)
        try:
            return UserInfo(self.users.update(req.name, password=creds, super=req.super))
        except UserError as exc:
            raise _user_error(exc) from None

    def h_user_delete(self, call: Call, req: rq.UserDelete) -> Empty:
        try:
            self.users.delete(req.name)
        except UserError as exc:
            raise _user_error(exc) from None
        if self.acls.revoke_user(req.name):  # a user made again later starts with none
            self.acls.save()
        return Empty()

    def h_user_list(self, call: Call, req: rq.UserList) -> Users:
        return Users(self.users.list())

    def h_acl_grant(self, call: Call, req: rq.AclGrant) -> AclChanged:
        changed = self.acls.grant(_grant(req))
        if changed:
            self.acls.save()
        return AclChanged(changed)

    def h_acl_revoke(self, call: Call, req: rq.AclRevoke) -> AclChanged:
        changed = self.acls.revoke(_grant(req))
        if changed:
            self.acls.save()
        return AclChanged(changed)

    def h_acl_list(self, call: Call, req: rq.AclList) -> Grants:
        return Grants([g.to_json() for g in self.acls.list(req.user)])

    def close(self) -> None:
        self.audit.close()


def _credentials(doc: dict) -> Credentials:
    try:
        return Credentials.from_dict(doc)
    except (ValueError, ScramError) as exc:
        raise OnceqError(ErrorCode.INVALID_ARGUMENT, f"credentials: {exc}") from None


def _grant(req: rq.AclGrant) -> Grant:
    try:
        return make_grant(req.user, req.kind, req.pattern, req.actions, req.decision,
                          req.sources)
    except ValueError as exc:
        raise OnceqError(ErrorCode.INVALID_ARGUMENT, str(exc)) from None


def _request_name(code: int) -> str:
    try:
        return RequestCode(code).name
    except ValueError:
        return str(code)
