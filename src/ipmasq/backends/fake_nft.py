"""A stateful fake `nft` for fast tests, in the spirit of knftables' Fake: it parses the scripts it is given
(our dialect only, refusing anything else as nft would refuse a syntax error), keeps the tables, and answers the
listings the backend reads with the JSON the real nft prints (the kernel tests prove the two identical).

Supported: `nft -f -` (atomic: a failing script changes nothing), `nft -j [-t] list ruleset [FAMILY]`,
`nft -j list table|set ...`, `nft -j list chains`, and the drift an operator might cause: `nft delete table`,
`nft flush chain|set`, `nft add rule`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ipmasq.backends.base import Result
from ipmasq.rules.nft import NftChain, NftParseError, NftTable, list_json, parse_script, rule_to_json

__all__ = ["FakeNft"]

_ABSENT = "Error: No such file or directory"
_META = {"metainfo": {"version": "1.0.6", "release_name": "fake", "json_schema_version": 1}}


def _rename(objects: list[dict[str, Any]], family: str, name: str) -> list[dict[str, Any]]:
    """list_json speaks of our table; re-label its objects for any other table the fake holds."""
    out = []
    for o in objects:
        kind, body = next(iter(o.items()))
        body = dict(body, family=family)
        body["name" if kind == "table" else "table"] = name
        out.append({kind: body})
    return out


class FakeNft:
    """A Runner (`fake(argv, stdin) -> Result`) for argv[0] == "nft"; `tables` is the kernel's state."""

    def __init__(self) -> None:
        self.tables: dict[tuple[str, str], NftTable] = {}
        self.transactions = 0  # successful `nft -f` writes: an idle agent must not add any

    def __call__(self, argv: Sequence[str], stdin: str | None = None) -> Result:
        args = list(argv[1:])
        try:
            if args == ["-f", "-"]:
                return self._transaction(stdin or "")
            if args[:1] == ["-j"]:
                return self._list(args[1:])
            return self._command(args)
        except NftParseError as exc:
            return Result(1, "", f"Error: {exc}\n")

    def _transaction(self, script: str) -> Result:
        tables = dict(self.tables)
        for command in parse_script(script):
            key = (command.family, command.table)
            if command.verb == "add":
                tables.setdefault(key, NftTable((), ()))
            elif command.verb == "delete":
                if key not in tables:
                    return Result(1, "", f"{_ABSENT}\ndelete table {command.family} {command.table}\n")
                del tables[key]
            elif command.definition is not None:
                current = tables.get(key, NftTable((), ()))
                names = {s.name for s in current.sets} | {c.name for c in current.chains}
                new = command.definition
                clash = names & ({s.name for s in new.sets} | {c.name for c in new.chains})
                if clash:
                    # the fake only ever defines into an empty table, as our scripts do after `delete table`
                    return Result(1, "", f"Error: fake nft: {sorted(clash)} already exist\n")
                tables[key] = NftTable(tuple(sorted(current.sets + command.definition.sets, key=lambda s: s.name)),
                                       tuple(sorted(current.chains + command.definition.chains, key=lambda c: c.name)))
        self.tables = tables
        self.transactions += 1
        return Result(0)

    def _objects(self, key: tuple[str, str], *, terse: bool) -> list[dict[str, Any]]:
        return _rename(list_json(self.tables[key], terse=terse), *key)

    def _list(self, args: list[str]) -> Result:
        terse = args[:1] == ["-t"]
        args = args[1:] if terse else args
        objects: list[dict[str, Any]] = []
        if args[:2] == ["list", "ruleset"]:
            for key in sorted(self.tables):
                if len(args) < 3 or key[0] == args[2]:
                    objects += self._objects(key, terse=terse)
        elif args[:2] == ["list", "chains"]:
            for key in sorted(self.tables):
                objects += [o for o in self._objects(key, terse=True) if "chain" in o]
        elif args[:2] == ["list", "table"] and len(args) == 4:
            key = (args[2], args[3])
            if key not in self.tables:
                return Result(1, "", f"{_ABSENT}\n")
            objects = self._objects(key, terse=terse)
        elif args[:2] == ["list", "set"] and len(args) == 5:
            key = (args[2], args[3])
            if key not in self.tables or self.tables[key].set_named(args[4]) is None:
                return Result(1, "", f"{_ABSENT}\n")
            objects = [o for o in self._objects(key, terse=terse) if o.get("set", {}).get("name") == args[4]]
        else:
            return Result(1, "", f"Error: fake nft: unsupported listing {args}\n")
        return Result(0, json.dumps({"nftables": [_META, *objects]}))

    def _command(self, args: list[str]) -> Result:
        if len(args) < 3:
            return Result(1, "", f"Error: fake nft: unsupported command {args}\n")
        verb, kind, key = args[0], args[1], (args[2], args[3] if len(args) > 3 else "")
        table = self.tables.get(key)
        if table is None:
            return Result(1, "", f"{_ABSENT}\n")
        if (verb, kind) == ("delete", "table"):
            del self.tables[key]
        elif (verb, kind) == ("flush", "chain") and len(args) == 5:
            chain = table.chain_named(args[4])
            if chain is None:
                return Result(1, "", f"{_ABSENT}\n")
            self._put(key, table, chain=replace(chain, rules=()))
        elif (verb, kind) == ("flush", "set") and len(args) == 5:
            s = table.set_named(args[4])
            if s is None:
                return Result(1, "", f"{_ABSENT}\n")
            self.tables[key] = replace(table, sets=tuple(replace(x, elements=()) if x is s else x for x in table.sets))
        elif (verb, kind) == ("add", "rule") and len(args) >= 6:
            chain = table.chain_named(args[4])
            if chain is None:
                return Result(1, "", f"{_ABSENT}\n")
            rule = " ".join(args[5:])
            rule_to_json(rule)  # our dialect only
            self._put(key, table, chain=replace(chain, rules=(*chain.rules, rule)))
        else:
            return Result(1, "", f"Error: fake nft: unsupported command {args}\n")
        return Result(0)

    def _put(self, key: tuple[str, str], table: NftTable, *, chain: NftChain) -> None:
        self.tables[key] = replace(table, chains=tuple(chain if c.name == chain.name else c for c in table.chains))
