"""The model names clients see: what the pool serves, never a path on the server.

vLLM started on a local directory without `--served-model-name` serves the model under
that path and reports it as the card's `id` and `root`. The sidecar lists the pool's
served model name (`spec.model`) instead and maps that name back to the engine's on
generation requests. Completion responses still carry the name the engine serves under
(they stream through untouched): injection starts vLLM with `--served-model-name`
(the pool's model) unless the pod names its own. A name the engine does not serve is a
404 `model_not_found` listing `served_names` (`admission.admitter`).
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any, TypeGuard


def is_path(name: object) -> TypeGuard[str]:
    return isinstance(name, str) and name.startswith(("/", "./", "../", "~"))


def public_name(engine_name: str, served_name: str | None) -> str:
    """`engine_name` if it is a name; else the pool's served name, else the last path
    component."""
    if not is_path(engine_name):
        return engine_name
    if served_name and not is_path(served_name):
        return served_name
    return PurePosixPath(engine_name).name or "model"


def engine_name(requested: object, engine_model: str | None, served_name: str | None) -> object:
    """The `model` to forward: the engine's own name for the public one it hides."""
    if engine_model is not None and is_path(engine_model) and requested == public_name(
        engine_model, served_name
    ):
        return engine_model
    return requested


def public_cards(payload: Any, served_name: str | None) -> Any:
    """The engine's /v1/models answer with every path (`id`, `root`, `parent`) replaced.
    The first card is the base model: the one the served name stands for."""
    cards = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(cards, list):
        return payload
    names: dict[str, str] = {}
    for index, card in enumerate(cards):
        if isinstance(card, dict) and isinstance(card.get("id"), str):
            names[card["id"]] = public_name(card["id"], served_name if index == 0 else None)
    for card in cards:
        if not isinstance(card, dict):
            continue
        card_id = card.get("id")
        own = names.get(card_id) if isinstance(card_id, str) else None
        if own is not None:
            card["id"] = own
        for key in ("root", "parent"):
            value = card.get(key)
            if is_path(value):
                card[key] = names.get(value) or own or public_name(value, None)
    return payload


def served_names(engine_models: tuple[str, ...], served_name: str | None) -> list[str]:
    """The names clients may ask for, as /v1/models lists them (the first card is the
    base model, which the pool's served name stands for)."""
    return [public_name(model, served_name if index == 0 else None)
            for index, model in enumerate(engine_models)]


def is_served(requested: object, engine_models: tuple[str, ...],
              served_name: str | None) -> bool:
    """Whether the engine serves `requested`, by its own name or the public one."""
    return requested in engine_models or requested in served_names(engine_models, served_name)
