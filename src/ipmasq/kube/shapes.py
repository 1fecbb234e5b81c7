"""The checks every shape of ipmasq.kube.objects (and ipmasq.kube.admission) is made of: each takes a decoded JSON
value and where it came from, and returns the same value when it has the type named (ApiMalformed, one line naming
the call and the field, when it has not). `shape` checks an object's named fields (null: absent), `list_of` a list's
every member; fields a shape does not name are kept as they are and not looked at.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ipmasq.errors import ApiMalformed, clip, one_line

__all__ = ["Check", "anything", "boolean", "integer", "list_of", "shape", "strings", "text", "wrong"]

Check = Callable[[Any, str], Any]  # (value, where) -> the value, checked; ApiMalformed when it is not


def wrong(where: str, expected: str, value: object) -> ApiMalformed:
    shown = clip(one_line(repr(value)), 40)
    return ApiMalformed(one_line(f"{where} is not {expected} ({shown}): not an answer the API server sends"))


def text(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise wrong(where, "a string", value)
    return value


def integer(value: object, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise wrong(where, "an integer", value)
    return value


def boolean(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise wrong(where, "true or false", value)
    return value


def strings(value: object, where: str) -> dict[str, str]:
    """A map of strings to strings (labels, a ConfigMap's data)."""
    if not isinstance(value, dict):
        raise wrong(where, "an object", value)
    for key, item in value.items():
        if not isinstance(item, str):
            raise wrong(f"{where}.{clip(one_line(key), 60)}", "a string", item)
    return value


def anything(value: object, where: str) -> object:
    """A member read by a later check of its own (an admitted object, whose kind the request names)."""
    return value


def list_of(item: Check) -> Check:
    def check(value: object, where: str) -> list[Any]:
        if not isinstance(value, list):
            raise wrong(where, "a list", value)
        for index, member in enumerate(value):
            item(member, f"{where}[{index}]")
        return value
    return check


def shape(fields: Mapping[str, Check], required: tuple[str, ...] = ()) -> Check:
    """An object whose named fields pass their checks (null: absent), the `required` ones present."""
    def check(value: object, where: str) -> object:
        if not isinstance(value, dict):
            raise wrong(where, "an object", value)
        for key, field in fields.items():
            member = value.get(key)
            if member is None:
                if key in required:
                    raise ApiMalformed(f"{where}.{key} is missing: not an answer the API server sends")
                continue
            field(member, f"{where}.{key}")
        return value
    return check
