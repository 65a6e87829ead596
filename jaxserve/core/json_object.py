"""A config given as a dict or as its JSON text (the CLI's form), checked to be a JSON object."""
from __future__ import annotations

import json
from typing import Any


def json_object(value: Any, name: str) -> dict:
    """``value`` (a dict, or JSON text of one) as a new dict; an error naming ``name``
    otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    return dict(value)
