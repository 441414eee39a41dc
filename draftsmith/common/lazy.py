"""Package attributes imported on first use (PEP 562), for the stage packages on `draftsmith --help`'s path.

`draftsmith --help` imports every stage's `cli` module, and with it the stage package's `__init__`; a package that
re-exported its torch-backed API eagerly (`from draftsmith.store.reader import HiddenStateStore`) would load torch
(~2 s) for a help text. Such a package declares its exports as {name: module} instead:

    __getattr__, __dir__ = lazy_exports(__name__, {"HiddenStateStore": "draftsmith.store.reader"})

`from draftsmith.store import HiddenStateStore` and `draftsmith.store.HiddenStateStore` work as before; the
value is cached in the package on first use. tests/unit/common/test_cli_startup.py keeps --help torch-free.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(package: str, names: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """(`__getattr__`, `__dir__`) for `package`, importing `names[attr]` when `attr` is first read."""

    def __getattr__(attr: str) -> object:
        where = names.get(attr)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {attr!r}")
        value = getattr(importlib.import_module(where), attr)
        setattr(sys.modules[package], attr, value)  # later reads skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__
