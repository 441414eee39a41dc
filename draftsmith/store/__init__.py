"""The hidden-state store: capture writes it, training reads it (see `format.py` for the layout)."""

from draftsmith.store.reader import HiddenStateStore

__all__ = ["HiddenStateStore"]
