"""Every field of vLLM's request models gets the same answer through the sidecar as from
the engine (issue 46): the sidecar judges only what admission needs.

The field lists are read from vLLM's own pydantic models when the test runs
(`ChatCompletionRequest`, `CompletionRequest`, `ResponsesRequest`), so a vLLM release
that adds a field is covered without editing this file. Each field gets one value made
from its annotation (a non-default one where that is easy: `True` for a flag), added to
a minimal valid request; the same body goes straight to the real CPU engine and through
the sidecar, and the two answers must be of the same status class. The exceptions are
the fields the sidecar refuses because they would take the request out of its
accounting (`REFUSED`, `REFUSED_HERE`): those must be a 400 that names the field and
says why, whatever the engine says.
"""

from __future__ import annotations

import enum
import types
import typing
from typing import Any, Literal

import httpx
import pytest
from pydantic import BaseModel

from engine_sidecar.gateway.intake.openai_request import REFUSED
from engine_sidecar.gateway.intake.responses_request import HARMLESS, REFUSED_HERE

from .conftest import Harness
from .helpers import Keys, make_policy, tenant

pytestmark = pytest.mark.engine

MESSAGES = [{"role": "user", "content": "tenant quota cache"}]
# What a request of each route needs to be valid; the field under test is added to it.
BASES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": MESSAGES, "max_completion_tokens": 2},
    "/v1/completions": {"prompt": "tenant quota cache", "max_tokens": 2},
    "/v1/responses": {"input": "tenant quota cache", "max_output_tokens": 2},
}
# Values made from the annotation that the engine would take for another request shape
# altogether; these get a value a client would send.
CHOSEN: dict[str, Any] = {
    "prompt": "tenant quota", "messages": MESSAGES, "input": "tenant quota",
    "max_tokens": 2, "max_completion_tokens": 2, "max_output_tokens": 2,
}

# Fields OpenAI's SDK sends that vLLM's models do not name (vLLM ignores them): the ones
# issue 46 saw refused, checked the same way.
OPENAI_ONLY: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "store": False, "metadata": {"k": "v"}, "service_tier": "auto",
        "prompt_cache_key": "k", "safety_identifier": "s", "verbosity": "low",
        "stream_options": {"include_usage": True, "include_obfuscation": False},
        "functions": [{"name": "f", "parameters": {"type": "object"}}]},
    "/v1/completions": {"best_of": 1},
    "/v1/responses": {"safety_identifier": "s", "stream_options": {"include_usage": True}},
}

# Values (not fields) the sidecar refuses for its accounting: `truncation: auto` would
# let the engine drop prompt tokens the sidecar counted.
REFUSED_VALUES: dict[str, set[str]] = {"/v1/responses": {"truncation"}}


def _sample(annotation: Any, default: Any) -> Any:
    """A value of `annotation`, not its default where a flag can say otherwise."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _sample(args[0], default)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        return _sample(options[0], default) if options else None
    if origin is Literal:
        others = [a for a in args if a != default]
        return (others or list(args))[0]
    if annotation is bool:
        return not default if isinstance(default, bool) else True
    if annotation is int:
        return 1
    if annotation is float:
        return 0.5
    if annotation is str:
        return "x"
    if origin in (list, tuple, set, typing.Sequence) or annotation in (list, tuple):
        item = args[0] if args else None
        # A list of choices: one of them (an empty list would test nothing).
        return [_sample(item, None)] if typing.get_origin(item) is Literal else []
    if origin is dict or annotation is dict:
        return {}
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return next(iter(annotation)).value
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return {}
    return {}


def _request_models() -> dict[str, type[BaseModel]]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    return {"/v1/chat/completions": ChatCompletionRequest,
            "/v1/completions": CompletionRequest, "/v1/responses": ResponsesRequest}


def _post(client: httpx.Client, url: str, body: dict[str, Any],
          headers: dict[str, str] | None = None) -> httpx.Response:
    with client.stream("POST", url, json=body, headers=headers) as response:
        response.read()
        return response


@pytest.mark.parametrize("route", list(BASES))
def test_every_vllm_request_field_gets_the_engines_status_class(
    sidecar: Harness, engine: Any, keys: Keys, route: str,
) -> None:
    sidecar.apply(make_policy(tenant("acme", max_tokens=16)))
    model = _request_models()[route]
    refused = REFUSED_HERE if route == "/v1/responses" else REFUSED
    harmless = HARMLESS if route == "/v1/responses" else {"use_beam_search": False}
    auth = {"authorization": f"Bearer {keys.hs('acme')}"}
    differ: list[str] = []
    unexplained: list[str] = []
    checked = accepted = 0
    with httpx.Client(timeout=60) as client:
        base = {"model": str(engine.model), **BASES[route]}
        assert _post(client, engine.url + route, base).status_code == 200
        assert _post(client, sidecar.url + route, base, auth).status_code == 200
        cases = [(name, CHOSEN.get(name, _sample(info.annotation, info.default)))
                 for name, info in model.model_fields.items() if name != "model"]
        cases += [(name, value) for name, value in OPENAI_ONLY[route].items()
                  if name not in model.model_fields]
        for name, value in cases:
            body = {"model": str(engine.model), **BASES[route], name: value}
            through = _post(client, sidecar.url + route, body, auth)
            checked += 1
            if ((name in refused and harmless.get(name, object()) != value)
                    or name in REFUSED_VALUES.get(route, ())):
                error = through.json().get("error", {})
                if through.status_code != 400 or name not in error.get("message", ""):
                    unexplained.append(f"{name}={value!r}: {through.status_code} "
                                       f"{through.text[:200]}")
                continue
            direct = _post(client, engine.url + route, body)
            accepted += direct.status_code == 200
            if direct.status_code // 100 != through.status_code // 100:
                differ.append(f"{name}={value!r}: engine {direct.status_code}, sidecar "
                              f"{through.status_code} {through.text[:300]}")
    assert checked == len(cases) >= len(model.model_fields) - 1
    assert not differ, "\n".join(differ)
    assert accepted > len(cases) // 2  # most values are ones the engine takes
    assert not unexplained, "\n".join(unexplained)
    assert sidecar.wait_ledger_empty()
