"""Small facts about transformers objects that several stages need."""

from __future__ import annotations

from typing import Any


def text_config(config: Any) -> Any:
    """The language model's config: multimodal configs nest it (`get_text_config`), plain ones are it."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config
