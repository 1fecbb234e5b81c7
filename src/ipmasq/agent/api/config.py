"""Config from the API beside the mounted file: whichever shows the newer content is enforced, never an older one.

The agent follows its ConfigMap(s) through the API (ipmasq.kube.configmaps) and so sees a `kubectl apply` at once,
where the mounted file waits for kubelet's volume sync (up to about a minute). The file stays the source at start-up,
before the first list, and while the API cannot be reached. Which one wins is decided by ConfigChoice, pure:

- a content the API shows is newer than anything before it;
- a file content is newer only if the API has not shown it: kubelet writes into the volume what the API held, so a
  file that equals the API's current content changes nothing, and one that equals an earlier API content is kubelet
  catching up late (an older config), never a reason to go back;
- a file content the API never showed, read after a first one, wins: the API was out of reach (or its RBAC
  revoked) while kubelet, which still reached it, brought a newer config; or someone edited the file by hand.

A ConfigMap that does not exist is the reference's defaults, exactly as a missing file is.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from ipmasq.agent.origin import FILE, ConfigOrigin
from ipmasq.agent.trouble import Trouble
from ipmasq.config.source import ConfigInput, config_digest
from ipmasq.errors import ConfigError
from ipmasq.kube.client import ApiClient
from ipmasq.kube.configmaps import ConfigMapFollower, ConfigMapState

__all__ = ["ApiConfig", "ApiContent", "ConfigChoice", "Read", "configmap_source"]
# How many earlier API contents are remembered to recognise a late kubelet write (a digest each).
HISTORY = 32

Read = ConfigInput | ConfigError


def configmap_source(name: str, key: str) -> str:
    """How a ConfigMap's key is named where a file's path would be (logs, events, errors: `SOURCE:LINE: ...`)."""
    return f"configmap/{name}[{key}]"


def _content(read: Read) -> str:
    """What a read holds, whatever it is named: a digest of the files' bytes in order, or the error's message (the
    history keeps digests: up to HISTORY configs of up to 1 MiB each would otherwise stay in memory)."""
    if isinstance(read, ConfigError):
        return f"error: {read.message}"
    return read.digest()


@dataclass(frozen=True, slots=True)
class ApiContent:
    """The API's view of the followed ConfigMaps, composed once per change: the config, its origin (digest computed
    here, once), and the ConfigMaps as listed (the summary writer's target)."""

    read: Read
    origin: ConfigOrigin
    configmaps: tuple[ConfigMapState, ...]

    @property
    def target(self) -> ConfigMapState | None:
        """The first followed ConfigMap that exists (the summary's Events are about it)."""
        return next((c for c in self.configmaps if c.exists and c.uid), None)


class ConfigChoice:
    """Which source holds the newest config content (the module's rules). No I/O, no clock, no threads."""

    def __init__(self, history: int = HISTORY) -> None:
        self.api: Read | None = None  # None: the API has not been listed yet
        self.file: Read | None = None
        self.newest: Literal["api", "file"] = "file"
        self._api_history: collections.deque[str] = collections.deque(maxlen=history)
        self._api_content: str | None = None
        self._file_content: str | None = None

    def from_api(self, read: Read, content: str | None = None) -> None:
        """`content`: the read's _content when the caller has it already (the API's digest, computed once)."""
        content = _content(read) if content is None else content
        if self.api is not None and self._api_content == content:
            self.api = read
            return
        self.api, self._api_content = read, content
        self._api_history.append(content)
        self.newest = "api"

    def from_file(self, read: Read) -> None:
        if self.file is not None and read == self.file:
            return  # the same bytes under the same names: the common case, every wakeup, no digest needed
        content = _content(read)
        if self.file is not None and self._file_content == content:
            self.file = read
            return
        first = self.file is None
        self.file, self._file_content = read, content
        if self.api is not None and (first or content in self._api_history):
            # the API showed this already (the current one again, or kubelet catching up late); or the file's first
            # read came after the API's list: what the volume held at start-up is not news
            return
        self.newest = "file"

    def current(self) -> Read | None:
        if self.api is None or self.newest == "file":
            return self.file
        return self.api


class ApiConfig:
    """The agent's ConfigMaps followed through the API, and the choice between them and the mounted file.

    Data flows one way: the followers hand in each ConfigMap's state; once every name was listed, the content is
    composed once (ApiContent: its digest computed here) and handed on to the loop (`poke`, then `choose` at its next
    wakeup) and to every `listener` (the summary writer); nothing calls back for it."""

    def __init__(self, client: ApiClient, namespace: str, names: Sequence[str], key: str, *,
                 log: logging.Logger, poke: Callable[[], None], stop: threading.Event) -> None:
        self.namespace, self.names, self.key = namespace, tuple(sorted(set(names))), key
        self.log = log
        self.poke = poke  # wakes the agent's loop: look at the config again
        self.listeners: list[Callable[[ApiContent], None]] = []  # told each new content (from a follower's thread)
        self._lock = threading.Lock()
        self._states: dict[str, ConfigMapState] = {}
        self._troubles: dict[str, Trouble] = {}
        self._choice = ConfigChoice()
        self._content: ApiContent | None = None
        self._followers = [ConfigMapFollower(client, namespace, name, key, stop=stop,
                                             on_change=self._changed, on_trouble=self._trouble_for(name))
                           for name in self.names]

    def start(self) -> None:
        for follower in self._followers:
            follower.start()

    def choose(self, file_read: Read) -> tuple[Read, ConfigOrigin]:
        """The config to enforce now, given what the mounted file holds, and where it came from."""
        with self._lock:
            self._choice.from_file(file_read)
            content = self._content
            if content is None or self._choice.newest == "file":
                exists = content.origin.exists if content is not None else None
                current = self._choice.file if self._choice.file is not None else file_read
                return current, FILE if exists is None else ConfigOrigin("file", exists=exists)
            return content.read, content.origin

    def content(self) -> ApiContent | None:
        """The API's content as last composed (None: not every ConfigMap listed yet)."""
        with self._lock:
            return self._content

    def digest(self) -> str | None:
        """config_digest of the content the API shows now (None: not every ConfigMap listed yet)."""
        content = self.content()
        return content.origin.digest if content is not None else None

    def _changed(self, state: ConfigMapState) -> None:
        with self._lock:
            self._states[state.name] = state
            if len(self._states) < len(self.names):
                return  # the API's view is whole once every name was listed
            content = self._content = self._compose()
            self._choice.from_api(content.read, _content(content.read) if isinstance(content.read, ConfigError)
                                  else content.origin.digest)
        self.poke()
        for listener in self.listeners:
            listener(content)

    def _compose(self) -> ApiContent:
        states = tuple(self._states[name] for name in self.names)
        files = []
        read: Read | None = None
        for state in states:
            source = configmap_source(state.name, self.key)
            if state.bad_value is not None:
                read = ConfigError(f"{state.bad_value}: not read", source=source)
                break
            if state.content is not None:
                files.append((source, state.content))
        content = read if read is not None else ConfigInput(tuple(files))
        digest = (content.digest() if isinstance(content, ConfigInput)
                  else config_digest(tuple(data for _source, data in files)))
        origin = ConfigOrigin("api", digest=digest,
                              configmaps=tuple((s.name, s.resource_version or "") for s in states if s.exists),
                              exists=any(s.exists for s in states))
        return ApiContent(content, origin, states)

    def _trouble_for(self, name: str) -> Callable[[str | None], None]:
        trouble = self._troubles[name] = Trouble(
            self.log, said="%s (enforcing the last good config; the mounted file is the source until the API "
                           "answers again)", over=f"following ConfigMap {self.namespace}/{name} through the API again")
        return trouble.reporter(self._lock)
