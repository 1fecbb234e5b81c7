"""Follow named objects through the API (ConfigMaps; in observe mode also the DaemonSet a provider's agent reads its
settings from): list, then watch from the list's resourceVersion; list again on 410.

One follower per object, each with a `metadata.name` field selector: RBAC can then grant list and watch on exactly
those names (resourceNames), and nothing else in the namespace is ever sent to the agent. A watch the server ends
(its timeoutSeconds) is started again from the last resourceVersion seen, bookmarks included; a 410 Gone (that
version fell out of the server's window) lists again; anything else (the server restarting, a broken stream, a
refusal) resumes the watch from the last resourceVersion seen. Every retry, the list after a 410 included, first waits
the one backoff (ipmasq.backoff: client-go's, 0.8 s doubling to 30 s, fully jittered), which only a watch that
delivered an event or ran its course resets: a thousand followers cut off together by an API server restart come back
spread over it, each with one watch request, and a server that answers every watch with 410 gets a list now and then,
never a storm of them. A follower never raises: what goes wrong is handed to `on_trouble` as one line, and it keeps
trying until stopped.
"""

from __future__ import annotations

import base64
import binascii
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ipmasq.backoff import Backoff
from ipmasq.errors import ApiError, ApiMalformed, Gone
from ipmasq.kube import objects, paths
from ipmasq.kube.client import ApiClient

__all__ = ["ConfigMapFollower", "ConfigMapState", "ObjectFollower", "configmap_state"]

BACKOFF_INITIAL = 0.8  # the first wait after trouble is drawn from [0, this); it doubles up to BACKOFF_MAX
BACKOFF_MAX = 30.0
WATCH_SECONDS = 300  # the server ends each watch after about this (jittered by WATCH_JITTER); bookmarks keep its
WATCH_JITTER = 0.1  # resourceVersion fresh, and the jitter keeps watches started together from ending together
SHORT_WATCH_SECONDS = 1.0  # a watch that ends sooner than this is followed by a backoff, not at once by another


@dataclass(frozen=True, slots=True)
class ConfigMapState:
    """What the API holds for one ConfigMap: absent, or the bytes of the key the agent reads (None: no such key)."""

    namespace: str
    name: str
    exists: bool
    content: bytes | None = None
    uid: str | None = None
    resource_version: str | None = None
    bad_value: str | None = None  # the key is there but cannot be read (binaryData that is not base64)
    # followed whole (key None): every key with its bytes, in key order, as kubelet projects them as files
    keys: tuple[tuple[str, bytes], ...] = ()


def configmap_state(namespace: str, name: str, key: str | None, obj: object | None) -> ConfigMapState:
    """The key's bytes as kubelet would write them into the volume (data as UTF-8, binaryData decoded); `key` None:
    every key's (a provider's agent that reads every file of the mounted directory). `obj` as the API server sent it,
    read here through objects.configmap: one of another shape cannot be read (bad_value, its one line)."""
    if obj is None:
        return ConfigMapState(namespace, name, exists=False)
    try:
        configmap = objects.configmap(obj, f"ConfigMap {namespace}/{name}")
    except ApiMalformed as exc:
        return ConfigMapState(namespace, name, True, None, bad_value=str(exc))
    meta = configmap["metadata"]
    uid, version = meta.get("uid"), meta.get("resourceVersion")
    data, binary = configmap.get("data") or {}, configmap.get("binaryData") or {}
    if key is None:
        return _whole(namespace, name, data, binary, uid, version)
    if key in data:
        return ConfigMapState(namespace, name, True, data[key].encode("utf-8", "surrogatepass"), uid, version)
    if key in binary:
        try:
            return ConfigMapState(namespace, name, True, base64.b64decode(binary[key], validate=True), uid, version)
        except (binascii.Error, ValueError):
            return ConfigMapState(namespace, name, True, None, uid, version,
                                  bad_value="binaryData that is not base64")
    return ConfigMapState(namespace, name, True, None, uid, version)


def _whole(namespace: str, name: str, data: dict[str, str], binary: dict[str, str], uid: str | None,
           version: str | None) -> ConfigMapState:
    keys: dict[str, bytes] = {}
    for k, v in binary.items():
        try:
            keys[k] = base64.b64decode(v, validate=True)
        except (binascii.Error, ValueError):
            return ConfigMapState(namespace, name, True, None, uid, version,
                                  bad_value=f"binaryData {k[:63]!r} that is not base64")
    keys.update((k, v.encode("utf-8", "surrogatepass")) for k, v in data.items())
    return ConfigMapState(namespace, name, True, None, uid, version, keys=tuple(sorted(keys.items())))


S = TypeVar("S")


class ObjectFollower(Generic[S]):
    """Keeps one named object's state (what `decode` makes of it; None: it does not exist) current through
    list+watch, in a thread of its own."""

    def __init__(self, client: ApiClient, kind: str, path: str, namespace: str, name: str, *,
                 decode: Callable[[object | None], S], on_change: Callable[[S], None],
                 on_trouble: Callable[[str | None], None], stop: threading.Event,
                 watch_seconds: int = WATCH_SECONDS) -> None:
        self.client = client
        self.kind = kind  # as messages name it
        self._path, self.namespace, self.name, self.decode = path, namespace, name, decode
        self.on_change = on_change
        self.on_trouble = on_trouble  # one line when the API cannot be followed; None once it can again
        self.stop = stop
        self.watch_seconds = watch_seconds
        self.state: S | None = None  # None: never listed
        # where the next watch starts: the last resourceVersion seen (None: list first). Kept across trouble, so a
        # follower resumes its watch after an outage; only a 410 Gone makes it list again.
        self.resource_version: str | None = None
        self.relists = 0  # lists after the first (each a 410 Gone)
        self._not_older_than: str | None = None
        self._backoff = Backoff(BACKOFF_INITIAL, BACKOFF_MAX)
        self._troubled = False
        self._thread: threading.Thread | None = None

    @property
    def path(self) -> str:
        return self._path

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=f"{self.kind.lower()}-{self.name}", daemon=True)
        self._thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                if self.resource_version is None:
                    self.resource_version = self._list()
                while not self.stop.is_set():
                    started = time.monotonic()
                    if not self._watch(self.resource_version) and time.monotonic() - started < SHORT_WATCH_SECONDS:
                        break  # ended at once: a server shutting down ends every watch together; back off below
                    self._healthy()
                    self._backoff.reset()  # the server ended the watch as asked, or it delivered: a healthy watch
            except Gone:
                # list again, after the backoff: that is what 410 asks for; not older than what was seen, so the
                # server may answer from its watch cache (after its restart, every follower's version is older
                # than its cache)
                self._not_older_than, self.resource_version = self.resource_version, None
                self.relists += 1
            except ApiError as exc:
                self._trouble(str(exc))
            except Exception as exc:  # a bug must not end the thread: the agent would silently stop following
                self._trouble(f"{type(exc).__name__}: {exc}")
            # followers cut off together (an API server restart) come back spread over the backoff
            self.stop.wait(self._backoff.next())

    def _selector(self) -> dict[str, str]:
        return {"fieldSelector": f"metadata.name={self.name}"}

    def _list(self) -> str:
        query = self._selector()
        if self._not_older_than is not None:
            query.update(resourceVersion=self._not_older_than, resourceVersionMatch="NotOlderThan")
        # one name's list: one object at most, in one answer (bounded by the client), so not paged
        listing = self.client.get(self.path, query=query)
        self._not_older_than = None
        where = f"GET {self.path}"
        raw = listing.get("metadata")
        version = objects.list_meta({} if raw is None else raw, f"{where}: metadata").get("resourceVersion")
        items = listing.get("items") or []
        if not isinstance(items, list):
            raise ApiMalformed(f"{where}: items is not a list: not an answer the API server sends")
        self._publish(self.decode(items[0] if items else None))  # decode reads it through its shape
        if version is None:
            raise ApiError(f"list {self.path}: no resourceVersion in the answer")
        self._healthy()  # the trouble is over; the backoff goes on until a watch is healthy
        return version

    def _watch(self, version: str) -> bool:
        """Follow from `version` until the server ends the watch; resource_version moves with every event seen.
        True when it delivered any event."""
        delivered = False
        seconds = max(1, round(self.watch_seconds * random.uniform(1.0 - WATCH_JITTER, 1.0 + WATCH_JITTER)))
        for event in self.client.watch(self.path, query={**self._selector(), "resourceVersion": version},
                                       timeout_seconds=seconds):
            seen = (objects.versioned(event.object, f"WATCH {self.path}").get("metadata") or {}).get("resourceVersion")
            if seen is not None:
                self.resource_version = seen
            if event.type in ("ADDED", "MODIFIED"):
                self._publish(self.decode(event.object))
            elif event.type == "DELETED":
                self._publish(self.decode(None))
            delivered = True
            self._healthy()
            if self.stop.is_set():
                break
        return delivered

    def _trouble(self, why: str) -> None:
        self._troubled = True
        self.on_trouble(f"cannot follow {self.kind} {self.namespace}/{self.name}: {why}")

    def _healthy(self) -> None:
        if self._troubled:
            self._troubled = False
            self.on_trouble(None)

    def _publish(self, state: S) -> None:
        if state != self.state:
            self.state = state
            self.on_change(state)


class ConfigMapFollower(ObjectFollower[ConfigMapState]):
    """One ConfigMap's key (`key` None: all of its keys) followed."""

    def __init__(self, client: ApiClient, namespace: str, name: str, key: str | None, *,
                 on_change: Callable[[ConfigMapState], None], on_trouble: Callable[[str | None], None],
                 stop: threading.Event, watch_seconds: int = WATCH_SECONDS) -> None:
        self.key = key
        super().__init__(client, "ConfigMap", paths.configmaps(namespace), namespace, name,
                         decode=lambda obj: configmap_state(namespace, name, key, obj), on_change=on_change,
                         on_trouble=on_trouble, stop=stop, watch_seconds=watch_seconds)
