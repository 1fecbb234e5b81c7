"""The seam to the API server: JSON requests and watch streams over HTTPS, on ipmasq.http11 (h11).

Every call has a deadline for the whole of it (connect, TLS, request, answer), not for each read: a server that
trickles a byte a second fails the call when its time is up. A watch ends by the server's timeoutSeconds or by the
client's own deadline a little after it, whichever comes first. Answers and watch lines are bounded as they arrive
(a ConfigMap is at most 1 MiB; nothing the agent asks for is larger than a few), so a hostile or broken server costs
a clear error, never the agent's memory.

One kept-alive connection per API server is reused across calls (a watch holds its own while it streams). A 3xx is
an error and is never followed (the token goes to the API server only). 429 and 503 with Retry-After are asked
again after the time the server gave, jittered, and every thread of the agent waits it out (one shared gate), so a
server shedding load is not asked again at once by each of them.

A collection is read through `list_items`, the one pager: pages of `limit` objects, each item checked against its
shape (ipmasq.kube.objects) before any caller sees it, and the whole list bounded in pages and bytes: a server whose
`continue` never ends costs one line (ApiMalformed) at the bound, never memory without end.

Everything that goes wrong is one of ipmasq.errors' ApiError tree: ApiUnreachable when there was no usable answer
(ApiMalformed: an answer of the wrong shape), an ApiRefused subclass when the server said no (its Status carried).
"""

from __future__ import annotations

import json
import random
import select
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar
from urllib.parse import urlencode, urlsplit

from ipmasq import __version__, http11
from ipmasq.errors import (
    ApiClientError,
    ApiError,
    ApiMalformed,
    ApiRefused,
    ApiServerError,
    ApiUnreachable,
    Conflict,
    Forbidden,
    Gone,
    NotFound,
    TooManyRequests,
    Unauthorized,
    clip,
)
from ipmasq.kube import objects
from ipmasq.kube.auth import Auth
from ipmasq.kube.credentials import Credentials

__all__ = ["LIST_PAGE", "MAX_ANSWER_BYTES", "MAX_LIST_BYTES", "MAX_LIST_PAGES", "ApiAnswer", "ApiClient", "KubeClient",
           "Listing", "RetryGate", "WatchEvent", "list_items"]

T = TypeVar("T")

# The largest answer (or watch line) read: a ConfigMap's 1 MiB of data, JSON-escaped, with its metadata and
# managedFields, fits several times over.
MAX_ANSWER_BYTES = 8 << 20
_REFUSALS: dict[int, type[ApiRefused]] = {401: Unauthorized, 403: Forbidden, 404: NotFound, 409: Conflict,
                                          410: Gone, 429: TooManyRequests}
MERGE_PATCH = "application/merge-patch+json"
MAX_ATTEMPTS = 3  # a call asked again at most twice after a Retry-After
MAX_RETRY_AFTER = 30.0  # a longer Retry-After is capped: the agent's own loop asks again later anyway
DEFAULT_RETRY_AFTER = 1.0  # a 429 that says nothing of when
WATCH_GRACE = 30.0  # the client ends a watch this long after the timeoutSeconds it asked the server for
# A list is read in pages of LIST_PAGE objects (one answer for 5,000 nodes' objects would pass MAX_ANSWER_BYTES) and
# ends with ApiMalformed past MAX_LIST_PAGES pages or MAX_LIST_BYTES of answers in all. What ipmasq lists is one
# object per node (an agent pod, a status object, a Node of 5-15 KiB) and Kubernetes' largest clusters have 5,000
# nodes: 10 pages of 500, 25 of 200 Nodes, about 75 MiB of Nodes. A server whose `continue` never ends, or that
# ignores `limit`, is cut off there (a JSON answer takes four to five times its size as Python objects).
LIST_PAGE = 500
MAX_LIST_PAGES = 100
MAX_LIST_BYTES = 128 << 20


class ApiAnswer(dict[str, Any]):
    """A JSON object the API server answered, with the size in bytes it had on the wire (what list_items bounds):
    what every call gives back, untyped until one of ipmasq.kube.objects' shapes has read it."""

    __slots__ = ("size",)

    def __init__(self, value: dict[str, Any], size: int) -> None:
        super().__init__(value)
        self.size = size


@dataclass(frozen=True, slots=True)
class Listing(Generic[T]):
    """Every item of a collection, checked, and the list's resourceVersion (where a watch of it starts)."""

    items: list[T]
    resource_version: str | None


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One line of a watch stream: ADDED, MODIFIED, DELETED, BOOKMARK (the object then carries only its
    resourceVersion); an ERROR line is raised as its ApiRefused instead."""

    type: str
    object: dict[str, Any]


class ApiClient(Protocol):
    """What the agent asks of the API server: KubeClient on a node, ipmasq.testing.kube.FakeKubeClient in tests."""

    def get(self, path: str, *, query: Mapping[str, str] | None = None) -> ApiAnswer: ...

    def create(self, path: str, body: Mapping[str, Any]) -> ApiAnswer: ...

    def patch(self, path: str, body: Mapping[str, Any]) -> ApiAnswer: ...

    def watch(self, path: str, *, query: Mapping[str, str], timeout_seconds: int = 300) -> Iterator[WatchEvent]: ...


class RetryGate:
    """When the API server may be asked again: one for all the threads that share a client. A Retry-After moves it
    on (with up to a quarter more, at random, so that many agents told the same do not come back together)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._lock = threading.Lock()
        self._until = 0.0
        self._clock, self._sleep = clock, sleep

    def hold(self, seconds: float) -> float:
        """Nobody asks before `seconds` (jittered) from now; the wait it set."""
        wait = min(seconds, MAX_RETRY_AFTER) * random.uniform(1.0, 1.25)
        with self._lock:
            self._until = max(self._until, self._clock() + wait)
        return wait

    def wait(self, deadline: http11.Deadline) -> float:
        """Sleep until the gate opens; the seconds still to wait when that is past the call's deadline (0: open)."""
        left = self._until - self._clock()
        if left <= 0:
            return 0.0
        if left >= deadline.at - time.monotonic():
            return left
        self._sleep(left)
        return 0.0


class KubeClient:
    def __init__(self, credentials: Credentials, *, timeout: float = 10.0, gate: RetryGate | None = None) -> None:
        """`timeout`: the seconds each call may take in all (a watch: its timeoutSeconds and WATCH_GRACE)."""
        self.credentials = credentials
        self.timeout = timeout
        self.auth = Auth(credentials)
        self.gate = gate or RetryGate()
        self.user_agent = f"ipmasq/{__version__}"
        self._authority = f"{credentials.host}:{credentials.port}"
        self._idle: http11.Connection | None = None
        self._idle_lock = threading.Lock()
        proxy = urlsplit(credentials.proxy_url) if credentials.proxy_url else None
        self._proxy = (proxy.hostname or "", proxy.port or 80) if proxy is not None else None

    def close(self) -> None:
        with self._idle_lock:
            if self._idle is not None:
                self._idle.close()
                self._idle = None

    # ---- requests -------------------------------------------------------------------------------------------

    def get(self, path: str, *, query: Mapping[str, str] | None = None) -> ApiAnswer:
        return self.request("GET", path, query=query)

    def create(self, path: str, body: Mapping[str, Any]) -> ApiAnswer:
        return self.request("POST", path, body=body)

    def replace(self, path: str, body: Mapping[str, Any]) -> ApiAnswer:
        return self.request("PUT", path, body=body)

    def patch(self, path: str, body: Mapping[str, Any]) -> ApiAnswer:
        """A JSON merge patch (RFC 7386): the fields given replace the object's, null removes one."""
        return self.request("PATCH", path, body=body, content_type=MERGE_PATCH)

    def delete(self, path: str) -> ApiAnswer:
        return self.request("DELETE", path)

    def request(self, verb: str, path: str, *, query: Mapping[str, str] | None = None,
                body: Mapping[str, Any] | list[Any] | None = None,
                content_type: str = "application/json") -> ApiAnswer:
        """One call, within `timeout` in all; the answer's JSON object. A 401 reads the token again and asks once
        more (it rotated); a 429 or a 503 with Retry-After is asked again after it, while the deadline allows."""
        target = path + (f"?{urlencode(dict(query))}" if query else "")
        payload = json.dumps(body, separators=(",", ":")).encode() if body is not None else None
        deadline = http11.Deadline(self.timeout)
        reread = False
        for attempt in range(1, MAX_ATTEMPTS + 1):
            self._wait_for_gate(deadline, verb, path)
            connection, head = self._exchange(verb, target, payload, content_type, deadline, reread=reread)
            data = self._read(connection, deadline, verb, path)
            if head.status == 401 and not reread and self.auth.rotates:
                reread = True
                continue
            if 200 <= head.status < 300:
                return _json_object(data, verb, path)
            refusal = _refusal(head, data, verb, path)
            if isinstance(refusal, ApiRefused) and refusal.retry_after is not None and attempt < MAX_ATTEMPTS:
                wait = self.gate.hold(refusal.retry_after)
                if wait < deadline.at - time.monotonic():
                    continue
            raise refusal
        raise AssertionError("unreachable")  # the loop returns or raises

    def watch(self, path: str, *, query: Mapping[str, str], timeout_seconds: int = 300) -> Iterator[WatchEvent]:
        """The events of a watch, until the server ends it (its timeoutSeconds), the client's own deadline passes
        (WATCH_GRACE later: a server that keeps the stream open past it is not waited on), or it breaks.

        `query` gives resourceVersion (where to start) and any selector; bookmarks are asked for, so that a quiet
        watch still moves its resourceVersion on and a restart rarely lands on 410 Gone."""
        params = {**query, "watch": "true", "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout_seconds)}
        target = f"{path}?{urlencode(params)}"
        deadline = http11.Deadline(timeout_seconds + WATCH_GRACE)
        head_deadline = http11.Deadline(min(self.timeout, timeout_seconds + WATCH_GRACE))
        self._wait_for_gate(head_deadline, "WATCH", path)
        connection, head = self._exchange("GET", target, None, "application/json", head_deadline, reread=False)
        kept = False
        try:
            if head.status == 401 and self.auth.rotates:
                self.auth.token(reread=True)
            if not 200 <= head.status < 300:
                refusal = _refusal(head, self._read(connection, head_deadline, "WATCH", path), "WATCH", path)
                if isinstance(refusal, ApiRefused) and refusal.retry_after is not None:
                    self.gate.hold(refusal.retry_after)
                raise refusal
            try:
                for line in connection.lines(deadline, MAX_ANSWER_BYTES):
                    if not line.strip():
                        continue
                    yield _watch_event(line, path)
            except http11.HttpTimeout:
                return  # the client's own end of the watch: the caller watches again from where it got to
            except http11.TooLarge:
                raise ApiUnreachable(f"watch {path}: an event of more than {MAX_ANSWER_BYTES:,} bytes") from None
            except http11.HttpError as exc:
                raise ApiUnreachable(f"watch {path}: the stream broke: {exc}") from None
            kept = self._keep(connection)
        finally:
            if not kept:
                connection.close()

    # ---- the connection --------------------------------------------------------------------------------------

    def _wait_for_gate(self, deadline: http11.Deadline, verb: str, path: str) -> None:
        left = self.gate.wait(deadline)
        if left > 0:
            raise TooManyRequests(429, f"the API server asked to wait {left:.1f} s more before asking again",
                                  verb=verb, path=path, retry_after=left)

    def _exchange(self, verb: str, target: str, payload: bytes | None, content_type: str,
                  deadline: http11.Deadline, *, reread: bool) -> tuple[http11.Connection, http11.Head]:
        """Send the request and take the answer's head, on the kept-alive connection when there is one (asked
        again on a new connection if that one turns out closed before any answer)."""
        headers = {"Host": self._authority, "Accept": "application/json", "User-Agent": self.user_agent}
        token = self.auth.token(reread=reread)
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if payload is not None:
            headers["Content-Type"] = content_type
        where = f"{verb} {target.split('?')[0]}: {self.credentials.server}"
        for kept in (True, False):
            connection = self._take() if kept else None
            if kept and connection is None:
                continue
            try:
                if connection is None:
                    connection = self._connect(deadline)
                connection.send_request(verb, target, headers, payload, deadline)
                return connection, connection.receive_head(deadline)
            except http11.HttpTimeout as exc:
                if connection is not None:
                    connection.close()
                raise ApiUnreachable(f"{where}: {exc}") from None
            except http11.HttpError as exc:
                if connection is not None:
                    connection.close()
                if kept:
                    continue  # the server had closed the kept connection: a new one
                raise ApiUnreachable(f"{where}: {exc}") from None
        raise AssertionError("unreachable")

    def _connect(self, deadline: http11.Deadline) -> http11.Connection:
        host = self.credentials.host.strip("[]")
        return http11.connect(host, self.credentials.port, deadline, tls=self.auth.context(),
                              server_hostname=self.credentials.tls_server_name or host, proxy=self._proxy)

    def _take(self) -> http11.Connection | None:
        with self._idle_lock:
            connection, self._idle = self._idle, None
        if connection is not None and _closed_by_peer(connection):
            connection.close()
            return None
        return connection

    def _keep(self, connection: http11.Connection) -> bool:
        """Keep `connection` for the next call when its exchange ended cleanly and none is kept yet."""
        if not connection.reusable:
            return False
        connection.next_exchange()
        with self._idle_lock:
            if self._idle is None:
                self._idle = connection
                return True
        return False

    def _read(self, connection: http11.Connection, deadline: http11.Deadline, verb: str, path: str) -> bytes:
        try:
            data = connection.read_body(deadline, MAX_ANSWER_BYTES)
        except http11.TooLarge:
            connection.close()
            raise ApiUnreachable(f"{verb} {path}: an answer of more than {MAX_ANSWER_BYTES:,} bytes") from None
        except http11.HttpError as exc:
            connection.close()
            raise ApiUnreachable(f"{verb} {path}: the answer broke off: {exc}") from None
        if not self._keep(connection):
            connection.close()
        return data


def list_items(client: ApiClient, path: str, item: Callable[[object, str], T], *,
               query: Mapping[str, str] | None = None, page: int = LIST_PAGE, max_pages: int = MAX_LIST_PAGES,
               max_bytes: int = MAX_LIST_BYTES) -> Listing[T]:
    """Every object of the collection at `path` (with `query`'s selectors), `limit` at a time, each checked by
    `item` (one of ipmasq.kube.objects' shapes); ApiMalformed past `max_pages` pages or `max_bytes` bytes of
    answers, or when the server hands back the continue token it was given (a list that would never end)."""
    items: list[T] = []
    ask = {**(query or {}), "limit": str(page)}
    size = 0
    for number in range(1, max_pages + 1):
        answer = client.get(path, query=ask)
        where = f"GET {path}"
        size += answer.size if isinstance(answer, ApiAnswer) else len(json.dumps(answer))
        if size > max_bytes:
            raise ApiMalformed(f"{where}: a list of more than {max_bytes >> 20} MiB in {number} pages: not an "
                               "answer the API server sends")
        raw = answer.get("metadata")
        meta = objects.list_meta({} if raw is None else raw, f"{where}: metadata")
        members = answer.get("items")
        if members is None:
            members = []
        if not isinstance(members, list):
            raise ApiMalformed(f"{where}: items is not a list: not an answer the API server sends")
        offset = len(items)
        items.extend(item(member, f"{where}: items[{offset + index}]") for index, member in enumerate(members))
        more = meta.get("continue")
        if not more:
            return Listing(items, meta.get("resourceVersion"))
        if more == ask.get("continue"):
            raise ApiMalformed(f"{where}: the server handed back the continue token it was given: a list that "
                               "would never end")
        ask = {**(query or {}), "limit": str(page), "continue": more}
    raise ApiMalformed(f"GET {path}: a list of more than {max_pages:,} pages: not an answer the API server sends")


def _closed_by_peer(connection: http11.Connection) -> bool:
    """Whether an idle kept-alive connection was closed (or written to) by the server meanwhile."""
    poller = select.poll()  # not select(): a descriptor past 1,023 is valid in a process with many connections
    try:
        poller.register(connection.sock, select.POLLIN | select.POLLPRI)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


def _watch_event(line: bytes, path: str) -> WatchEvent:
    event = _json_object(line, "WATCH", path)
    kind, obj = event.get("type"), event.get("object")
    if not isinstance(kind, str) or not isinstance(obj, dict):
        shown = clip(line.decode("utf-8", "replace"))
        raise ApiUnreachable(f"watch {path}: a line that is not a watch event: {shown!r}")
    if kind == "ERROR":
        code = obj.get("code")
        raise _refusal(http11.Head(code if isinstance(code, int) else 500, {}), line, "WATCH", path)
    return WatchEvent(kind, obj)


def _json_object(data: bytes, verb: str, path: str) -> ApiAnswer:
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        raise ApiUnreachable(f"{verb} {path}: an answer that is not JSON: "
                             f"{clip(data.decode('utf-8', 'replace'))!r}") from None
    if not isinstance(value, dict):
        raise ApiUnreachable(f"{verb} {path}: an answer that is not a JSON object")
    return ApiAnswer(value, len(data))


def _retry_after(head: http11.Head, now: Callable[[], float] = time.time) -> float | None:
    """The seconds a 429 or a 503 asks us to wait, at most MAX_RETRY_AFTER: Retry-After as delay-seconds (ASCII
    digits only: str.isdigit() and int() also take "²" or Arabic-Indic digits) or an HTTP-date (RFC 9110 10.2.3);
    anything else, or a 429 without one, a second."""
    if head.status not in (429, 503):
        return None
    text = head.headers.get("retry-after", "").strip()
    if text and text.isascii() and text.isdigit():
        return float(min(int(text[:6]), int(MAX_RETRY_AFTER)))
    if text and text.isascii() and len(text) <= 64:  # an IMF-fixdate is 29 characters
        # imported here: the email package costs the agent about 1 MiB resident, and servers send delay-seconds
        import email.utils

        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError, OverflowError):
            when = None
        if when is not None and when.tzinfo is not None:
            return min(max(when.timestamp() - now(), 0.0), MAX_RETRY_AFTER)
    return DEFAULT_RETRY_AFTER if head.status == 429 or text else None


def _refusal(head: http11.Head, data: bytes, verb: str, path: str) -> ApiError:
    """The error for an answer that is not a 2xx: the server's Status (its message, reason, details) when it sent
    one, else the start of whatever it sent."""
    status = head.status
    message = data.decode("utf-8", "replace").strip()
    status_object: dict[str, Any] | None = None
    try:
        value = json.loads(data)
        if isinstance(value, dict):
            inner = value.get("object") if value.get("type") == "ERROR" else value
            if isinstance(inner, dict) and inner.get("kind") == "Status":
                status_object = inner
            if isinstance(inner, dict) and isinstance(inner.get("message"), str):
                message = inner["message"]
    except (ValueError, RecursionError):
        pass
    if 300 <= status < 400:
        location = clip(head.headers.get("location", "nowhere said"), 120)
        return ApiClientError(status, f"a redirect to {location}, not followed (the token goes to the API server "
                                      "only)", verb=verb, path=path)
    kind = _REFUSALS.get(status) or (ApiServerError if status >= 500 else ApiClientError)
    return kind(status, message, verb=verb, path=path, status_object=status_object, retry_after=_retry_after(head))
