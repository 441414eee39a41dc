"""The hidden-state store: capture writes it, training reads it (see `format.py` for the layout)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from draftsmith.common.lazy import lazy_exports

if TYPE_CHECKING:
    from draftsmith.store.reader import HiddenStateStore

__all__ = ["HiddenStateStore"]
# torch-free --help: the store CLI imports this package (draftsmith/common/lazy.py)
__getattr__, __dir__ = lazy_exports(__name__, {"HiddenStateStore": "draftsmith.store.reader"})
