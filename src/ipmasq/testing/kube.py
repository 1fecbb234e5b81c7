"""FakeKubeClient: the API seam in memory, for fast unit tests of what the agent asks of the API server.

It keeps objects by path and answers as the API server does for what ipmasq uses: create (409 when the name is
taken; a name made from metadata.generateName), get (404), delete (404), a JSON merge patch (409 when it carries a
resourceVersion that is not the object's), a list by `metadata.name` field selector with a resourceVersion, a list of
a collection in pages (limit, continue) filtered by a labelSelector (equality and set-based, as Kubernetes parses
one), a namespaced kind listed across every namespace (`/apis/apps/v1/daemonsets`), and watches fed by the test (each
watch's query kept in `watch_queries`). `refuse` makes the next calls on a path fail with the given ApiError. The proof
that the real client and the real API server agree is in the Kubernetes lab's tests, never here.
"""

from __future__ import annotations

import copy
import json
import queue
import re
from collections.abc import Iterator, Mapping
from typing import Any

from ipmasq.errors import ApiError, Conflict, NotFound
from ipmasq.kube.client import ApiAnswer, WatchEvent

__all__ = ["FakeKubeClient"]


def _holds(requirement: str, labels: Mapping[str, str]) -> bool:
    """One requirement of a label selector: `k=v`, `k==v`, `k!=v`, `k in (a,b)`, `k notin (a,b)`, `k`, `!k`."""
    text = requirement.strip()
    found = re.fullmatch(r"(\S+?)\s+(in|notin)\s+\(([^)]*)\)", text)
    if found:
        values = {v.strip() for v in found.group(3).split(",")}
        return (labels.get(found.group(1)) in values) == (found.group(2) == "in")
    for op in ("!=", "==", "="):
        if op in text:
            key, value = (part.strip() for part in text.split(op, 1))
            return (labels.get(key) == value) == (op != "!=")
    return text[1:] not in labels if text.startswith("!") else text in labels


def _selected(selector: str, obj: Mapping[str, Any]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    requirements = re.split(r",(?![^(]*\))", selector) if selector.strip() else []
    return all(_holds(r, labels) for r in requirements)


def _in_collection(key: str, path: str) -> bool:
    """Whether the object at `key` is a member of the collection `path`: its own namespace's, or every namespace's
    (`/apis/apps/v1/daemonsets` holds `/apis/apps/v1/namespaces/x/daemonsets/y`)."""
    parent = key.rpartition("/")[0]
    if parent == path:
        return True
    head, _, plural = path.rpartition("/")
    found = re.fullmatch(re.escape(head) + r"/namespaces/[^/]+/" + re.escape(plural), parent)
    return found is not None


def _merge(target: dict[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)
    return target


def _answer(value: dict[str, Any]) -> ApiAnswer:
    """As the client gives it back: with its size on the wire (what list_items bounds)."""
    return ApiAnswer(value, len(json.dumps(value, separators=(",", ":"))))


class FakeKubeClient:
    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}  # full path -> object
        self.calls: list[tuple[str, str]] = []  # (verb, path) in order
        self.version = 100
        self.refusals: dict[str, list[ApiError]] = {}
        self.watch_events: queue.Queue[WatchEvent | ApiError | None] = queue.Queue()
        self.watch_queries: list[dict[str, str]] = []
        self.generated = 0

    def refuse(self, path: str, *errors: ApiError) -> None:
        self.refusals.setdefault(path, []).extend(errors)

    def _check(self, verb: str, path: str) -> None:
        self.calls.append((verb, path))
        waiting = self.refusals.get(path)
        if waiting:
            raise waiting.pop(0)

    def _bump(self, obj: dict[str, Any]) -> None:
        self.version += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.version)

    def get(self, path: str, *, query: Mapping[str, str] | None = None) -> ApiAnswer:
        self._check("GET", path)
        if query and "fieldSelector" in query:
            name = query["fieldSelector"].removeprefix("metadata.name=")
            found = self.objects.get(f"{path}/{name}")
            return _answer({"items": [copy.deepcopy(found)] if found else [],
                            "metadata": {"resourceVersion": str(self.version)}})
        if path not in self.objects:
            selector = (query or {}).get("labelSelector", "")
            members = sorted(key for key in self.objects
                             if _in_collection(key, path) and _selected(selector, self.objects[key]))
            if not members and not any(_in_collection(key, path) for key in self.objects):
                raise NotFound(404, f"{path} not found", verb="GET", path=path)
            start = int((query or {}).get("continue") or 0)
            limit = int((query or {}).get("limit") or len(members))
            more = str(start + limit) if start + limit < len(members) else ""
            return _answer({"items": [copy.deepcopy(self.objects[key]) for key in members[start:start + limit]],
                            "metadata": {"resourceVersion": str(self.version), "continue": more}})
        return _answer(copy.deepcopy(self.objects[path]))

    def create(self, path: str, body: Mapping[str, Any]) -> ApiAnswer:
        self._check("POST", path)
        body = copy.deepcopy(dict(body))
        if "name" not in body["metadata"]:  # generateName: the API server adds five characters of its own
            self.generated += 1
            body["metadata"]["name"] = f"{body['metadata']['generateName']}{self.generated:05d}"
        full = f"{path}/{body['metadata']['name']}"
        if full in self.objects:
            raise Conflict(409, "already exists", verb="POST", path=path)
        obj = copy.deepcopy(dict(body))
        obj["metadata"].setdefault("uid", f"uid-{len(self.objects) + 1}")
        self._bump(obj)
        self.objects[full] = obj
        return _answer(copy.deepcopy(obj))

    def patch(self, path: str, body: Mapping[str, Any]) -> ApiAnswer:
        self._check("PATCH", path)
        if path not in self.objects:
            raise NotFound(404, f"{path} not found", verb="PATCH", path=path)
        expected = (body.get("metadata") or {}).get("resourceVersion")
        if expected is not None and expected != self.objects[path]["metadata"].get("resourceVersion"):
            raise Conflict(409, "the object has been modified", verb="PATCH", path=path)
        obj = _merge(self.objects[path], body)
        self._bump(obj)
        return _answer(copy.deepcopy(obj))

    def delete(self, path: str) -> ApiAnswer:
        self._check("DELETE", path)
        if path not in self.objects:
            raise NotFound(404, f"{path} not found", verb="DELETE", path=path)
        return _answer(self.objects.pop(path))

    def put(self, path: str, obj: dict[str, Any]) -> None:
        """The test writes an object (as kubectl apply would)."""
        obj = copy.deepcopy(obj)
        # named by its path, as the API server names every object it holds
        obj.setdefault("metadata", {}).setdefault("name", path.rpartition("/")[2])
        obj["metadata"].setdefault("uid", f"uid-{len(self.objects) + 1}")
        self._bump(obj)
        self.objects[path] = obj

    def watch(self, path: str, *, query: Mapping[str, str], timeout_seconds: int = 300) -> Iterator[WatchEvent]:
        self._check("WATCH", path)
        self.watch_queries.append(dict(query))
        while True:
            item = self.watch_events.get()
            if item is None:
                return  # the server ended the watch
            if isinstance(item, ApiError):
                raise item
            yield item
