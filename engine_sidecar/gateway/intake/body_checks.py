"""Value checks for request body fields: each raises a 400 that names the field.

The sidecar forwards a field only after one of these has vetted its value (see the
allow-lists in `openai_request`); the checks are about shape and about bounds where a
value costs the engine, not a re-implementation of vLLM's validation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from typing import Any

from engine_sidecar.gateway import errors
from engine_sidecar.gateway.errors import ApiError

Check = Callable[[str, Any], None]
"""`check(param, value)`: raise `invalid(...)` naming `param` unless `value` is fine."""

INT64 = 2**63


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, errors.INVALID_REQUEST, message, param=param)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def shown(value: Any) -> str:
    """A client value quoted in an error message, cut short."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def anything(_param: str, _value: Any) -> None:
    """For fields the sidecar overwrites or reads itself (their checks live there)."""


def boolean(param: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise invalid(f"{param} must be true or false, got {shown(value)}", param)


def number(param: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(f"{param} must be a number, got {shown(value)}", param)


def integer(low: int, high: int) -> Check:
    def check(param: str, value: Any) -> None:
        if not is_int(value) or not low <= value <= high:
            raise invalid(f"{param} must be an integer from {low} to {high}, got {shown(value)}",
                          param)
    return check


def string(max_chars: int) -> Check:
    def check(param: str, value: Any) -> None:
        if not isinstance(value, str):
            raise invalid(f"{param} must be a string, got {shown(value)}", param)
        if len(value) > max_chars:
            raise invalid(f"{param} is longer than {max_chars} characters", param)
    return check


def one_of(values: Collection[str]) -> Check:
    def check(param: str, value: Any) -> None:
        if not isinstance(value, str) or value not in values:
            raise invalid(f"{param} must be one of {', '.join(sorted(values))}; got "
                          f"{shown(value)}", param)
    return check


def json_object(param: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise invalid(f"{param} must be a JSON object, got {shown(value)}", param)


def list_of(item: Check, max_items: int, min_items: int = 0) -> Check:
    def check(param: str, value: Any) -> None:
        if not isinstance(value, list):
            raise invalid(f"{param} must be a list, got {shown(value)}", param)
        if not min_items <= len(value) <= max_items:
            raise invalid(f"{param} must have {min_items} to {max_items} items, "
                          f"got {len(value)}", param)
        for i, element in enumerate(value):
            item(f"{param}[{i}]", element)
    return check


def string_or_strings(max_chars: int, max_items: int) -> Check:
    single, several = string(max_chars), list_of(string(max_chars), max_items)

    def check(param: str, value: Any) -> None:
        (single if isinstance(value, str) else several)(param, value)
    return check


def object_with(allowed: dict[str, Check], required: Collection[str] = (),
                open_ended: bool = False) -> Check:
    """A JSON object with only the `allowed` keys (null values skip their check); `open_ended`:
    other keys too, unchecked (the engine judges them)."""
    def check(param: str, value: Any) -> None:
        json_object(param, value)
        for key in required:
            if value.get(key) is None:
                raise invalid(f"{param}.{key} is required", f"{param}.{key}")
        for key, element in value.items():
            if key not in allowed:
                if open_ended:
                    continue
                raise invalid(f"{param}.{key} is not a field the KVQuota sidecar accepts here "
                              f"(accepted: {', '.join(sorted(allowed))})", f"{param}.{key}")
            if element is not None:
                allowed[key](f"{param}.{key}", element)
    return check


def mapping_of(value_check: Check, max_items: int) -> Check:
    """A JSON object with string keys (any) and checked values."""
    def check(param: str, value: Any) -> None:
        json_object(param, value)
        if len(value) > max_items:
            raise invalid(f"{param} has more than {max_items} entries", param)
        for key, element in value.items():
            value_check(f"{param}.{key}", element)
    return check
