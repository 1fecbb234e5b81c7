"""The one list pager: every item of a list, in pages, over the ApiClient seam (`ipmasq status` and the summary).

One answer for 5,000 nodes' objects would pass the client's bound on an answer, so lists are asked for in pages
(`limit`, then each page's `continue`). A server whose `continue` never ends cannot keep the caller: after MAX_PAGES
pages it is an ApiError. Items that are not JSON objects are left out (a wrong shape is not a traceback).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ipmasq.errors import ApiUnreachable
from ipmasq.kube.client import ApiClient

__all__ = ["MAX_PAGES", "list_items"]

MAX_PAGES = 1000


def list_items(client: ApiClient, path: str, query: Mapping[str, str] | None = None, *,
               page: int = 500) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    ask = {**(query or {}), "limit": str(page)}
    for _ in range(MAX_PAGES):
        answer = client.get(path, query=ask)
        found = answer.get("items")
        if isinstance(found, list):
            items += [item for item in found if isinstance(item, dict)]
        metadata = answer.get("metadata")
        more = metadata.get("continue") if isinstance(metadata, dict) else None
        if not more or not isinstance(more, str):
            return items
        ask = {**(query or {}), "limit": str(page), "continue": more}
    raise ApiUnreachable(f"list {path}: more than {MAX_PAGES:,} pages of {page} (the server's continue never ends)")
