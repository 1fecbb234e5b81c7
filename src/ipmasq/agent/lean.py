"""Importing dataclasses without inspect, for the node agent's long-lived process.

On Python 3.11 `import dataclasses` imports inspect, which imports ast, dis and opcode: about 0.9 MiB of the agent's
resident memory, kept for good. dataclasses uses inspect for one thing only: a class without a docstring gets one
made from inspect.signature(cls). Every dataclass on the agent's import path has its own docstring (a unit test
holds that), so the agent never needs inspect; dataclasses imports it, though, at its own import.

So dataclasses is imported while sys.modules["inspect"] is a stand-in, taken out again as soon as dataclasses holds
it: dataclasses keeps the stand-in as its `inspect`, and nothing else can reach it. The first attribute asked of it
(a dataclass defined later without a docstring) imports the real inspect and answers from it, so nothing breaks;
it only costs the memory again. Anyone else importing inspect gets the real module as usual.

importlib.util.LazyLoader cannot do this on 3.11: the import system reads the module's __spec__ on every `import`
of a module already in sys.modules, and a lazy module loads itself on any attribute read.
"""

from __future__ import annotations

import importlib
import sys
import threading
import types
from typing import Any

__all__ = ["import_dataclasses_without_inspect"]


class _ImportedOnFirstUse(types.ModuleType):
    """A stand-in for a module not imported yet: the first attribute read imports the real one and answers from it."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__spec__ = None  # read by `import name` while the stand-in is in sys.modules; None: not initialising
        self._real: types.ModuleType | None = None
        self._lock = threading.Lock()

    def __getattr__(self, attribute: str) -> Any:  # only for what the stand-in itself does not hold
        if attribute.startswith("__") and attribute.endswith("__"):
            raise AttributeError(attribute)  # copy, pickle and the like probe dunders: no reason to import for them
        with self._lock:
            if self._real is None:
                if sys.modules.get(self.__name__) is self:
                    del sys.modules[self.__name__]
                self._real = importlib.import_module(self.__name__)
        return getattr(self._real, attribute)


def import_dataclasses_without_inspect() -> None:
    """Import dataclasses with a stand-in for inspect (see the module docstring); nothing when either is imported."""
    if "dataclasses" in sys.modules or "inspect" in sys.modules:
        return
    stand_in = _ImportedOnFirstUse("inspect")
    sys.modules["inspect"] = stand_in
    try:
        import dataclasses  # noqa: F401  (imported for its side effect: in sys.modules, holding the stand-in)
    finally:
        if sys.modules.get("inspect") is stand_in:
            del sys.modules["inspect"]
