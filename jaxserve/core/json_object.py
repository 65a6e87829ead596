"""A config given as a dict or as its JSON text (the CLI's form), checked to be a JSON object."""
from __future__ import annotations

import dataclasses
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


def config_from(cls, value: Any, name: str):
    """A config dataclass ``cls`` from ``value``: None, an instance, a dict or its JSON text;
    a key that is not one of its fields is an error naming ``name`` and the known fields."""
    if value is None or isinstance(value, cls):
        return value
    value = json_object(value, name)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name}: unknown field(s) {unknown}; known: {sorted(known)}")
    return cls(**value)
