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

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from ..cluster import EtcdError
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
    from .shared_security import SharedSecurity

log = logging.getLogger("onceq.broker")

M = TypeVar("M", bound=Message)
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
        # in a cluster: the users and grants shared through etcd (set by the broker)
        self.shared: SharedSecurity | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # answers that wait for etcd

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
    def h_authenticate(self, call: Call, req: rq.Authenticate) -> AuthReply | None:
        conn = call.conn
        source = conn.source or "?"
        if conn.user is not None:
            raise OnceqError(ErrorCode.AUTH_FAILED, f"this connection is authenticated as "
                             f"{conn.user!r}: a connection has one user for its life")
        if self.shared is not None and not self.shared.ready:
            raise OnceqError(ErrorCode.SERVICE_UNAVAILABLE, (
                "this broker has not read the cluster's users from etcd yet "
                f"({self.shared.problem or 'none there yet'}): try again"))
        if req.mechanism != "SCRAM-SHA-256":
            raise OnceqError(ErrorCode.AUTH_FAILED, f"mechanism {req.mechanism!r} is not "
                             "supported: SCRAM-SHA-256")
        server, conn.scram = conn.scram, None  # one try per exchange
        try:
            if server is None:  # the client-first message
                server = ScramServer(self.users.credentials)
                answer = server.first(req.message)
                self._locked_out(source, server.user)
                if self.shared is not None and server.user not in self.users:
                    return self._first_after_refresh(call, req)
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

    def _first_after_refresh(self, call: Call, req: rq.Authenticate) -> None:
        """The first step of a login of a user this broker does not know, in a cluster:
        answered once the cluster's users are read again (made on another broker a moment
        ago, the user logs in here at once)."""
        shared = self.shared
        assert shared is not None

        async def answer() -> None:
            await shared.refresh()
            server = ScramServer(self.users.credentials)
            try:
                reply = AuthReply(server.first(req.message))
            except ScramError as exc:  # checked already: only a change of the users
                call.fail(OnceqError(ErrorCode.AUTH_FAILED, f"authentication failed: {exc}"))
                return
            call.conn.scram = server
            call.answer(reply)

        self._spawn(answer())

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
    def h_user_create(self, call: Call, req: rq.UserCreate) -> UserInfo | None:
        try:
            info = UserInfo(self.users.create(req.name, _credentials(req.credentials),
                                              super=req.super))
        except UserError as exc:
            raise _user_error(exc) from None
        return self._shared(call, info)

    def h_user_update(self, call: Call, req: rq.UserUpdate) -> UserInfo | None:
        creds = None if req.credentials is None else _credentials(req.credentials)
        try:
            info = UserInfo(self.users.update(req.name, password=creds, super=req.super))
        except UserError as exc:
            raise _user_error(exc) from None
        return self._shared(call, info)

    def h_user_delete(self, call: Call, req: rq.UserDelete) -> Empty | None:
        try:
            self.users.delete(req.name)
        except UserError as exc:
            raise _user_error(exc) from None
        if self.acls.revoke_user(req.name):  # a user made again later starts with none
            self.acls.save()
        return self._shared(call, Empty())

    def h_user_list(self, call: Call, req: rq.UserList) -> Users:
        return Users(self.users.list())

    def h_acl_grant(self, call: Call, req: rq.AclGrant) -> AclChanged | None:
        changed = self.acls.grant(_grant(req))
        if changed:
            self.acls.save()
        return self._shared(call, AclChanged(changed))

    def h_acl_revoke(self, call: Call, req: rq.AclRevoke) -> AclChanged | None:
        changed = self.acls.revoke(_grant(req))
        if changed:
            self.acls.save()
        return self._shared(call, AclChanged(changed))

    def _shared(self, call: Call, reply: M) -> M | None:
        """A change made: in a cluster (``shared``), answered once etcd has it (the
        cluster's users and grants: ``shared_security.py``); else now."""
        shared = self.shared
        if shared is None:
            return reply

        async def publish() -> None:
            try:
                await shared.publish()
            except (EtcdError, OSError) as exc:
                call.fail(OnceqError(ErrorCode.SERVICE_UNAVAILABLE, (
                    f"the change could not be written to etcd ({exc}): it is not the "
                    "cluster's; try again")))
                return
            call.answer(reply)

        self._spawn(publish())
        return None

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
