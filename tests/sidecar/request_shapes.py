"""Hypothesis strategies: request bodies of every shape the sidecar forwards, and how a
client sends them (`create`, through the official `openai` SDK).

Each drawn body is one the sidecar admits and the tiny engine accepts (so a property
can hold for every example): chat messages of every role and message field, text,
refusal and thinking parts, tools, template arguments, both generation-prompt modes;
completion prompts as text, text lists and token ids. `ESCAPES` are the fields and
parts that once let a request's cost escape the sidecar's count.
"""

from __future__ import annotations

import json
from typing import Any

import openai
from hypothesis import strategies as st

WORDS = ["tenant", "quota", "cache", "block", "lease", "premium", "free", "engine", "the",
         "sidecar", "7", "42.", "\n", "  ", "é", "日本", "🙂", "<|user|>", "</s>", "<s>",
         "{{ x }}", '"q"', "\\n"]
TEXT = st.lists(st.sampled_from(WORDS), max_size=24).map(" ".join)
SOME_TEXT = st.lists(st.sampled_from(WORDS), min_size=1, max_size=24).map(" ".join)
LONG_TEXT = st.lists(st.sampled_from(WORDS[:10]), min_size=100, max_size=400).map(" ".join)
NAME = st.sampled_from(["alice", "bob_2", "lookup"])

PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
    st.fixed_dictionaries({"type": st.just("refusal"), "refusal": TEXT}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": TEXT},
                          optional={"closed": st.booleans()}),
)
CONTENT = st.one_of(TEXT, st.lists(PART, max_size=3))
ARGUMENTS = st.one_of(
    st.dictionaries(st.sampled_from(["city", "n", "q"]), st.one_of(TEXT, st.integers(0, 99)),
                    max_size=2).map(json.dumps),
    st.just(""), st.just("not json"), st.just("[1, 2]"),
)
TOOL_CALL = st.fixed_dictionaries({
    "id": st.sampled_from(["call_1", "call_2"]), "type": st.just("function"),
    "function": st.fixed_dictionaries({"name": NAME, "arguments": ARGUMENTS}),
})
SYSTEM = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer"]),
                                "content": CONTENT}, optional={"name": NAME})
USER = st.fixed_dictionaries({"role": st.just("user"), "content": CONTENT},
                             optional={"name": NAME})
ASSISTANT = st.fixed_dictionaries(
    {"role": st.just("assistant"), "content": st.one_of(st.none(), CONTENT)},
    optional={"name": NAME, "tool_calls": st.lists(TOOL_CALL, max_size=2),
              "reasoning": TEXT, "reasoning_content": TEXT, "refusal": st.none(),
              "audio": st.none(), "function_call": st.none()},
)
TOOL = st.fixed_dictionaries({"role": st.just("tool"), "content": CONTENT},
                             optional={"tool_call_id": st.sampled_from(["call_1", "call_2"])})
MESSAGE = st.one_of(SYSTEM, USER, ASSISTANT, TOOL)

TOOL_SPEC = st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": NAME}, optional={"description": TEXT, "strict": st.booleans(),
                                  "parameters": st.just({"type": "object", "properties": {
                                      "city": {"type": "string"}}})})},
)
TEMPLATE_KWARGS = st.dictionaries(st.sampled_from(["enable_thinking", "thinking", "custom"]),
                                  st.one_of(st.booleans(), TEXT), max_size=2)
DOCUMENTS = st.lists(st.fixed_dictionaries({"title": TEXT, "text": TEXT}), max_size=2)
CHAT_OPTIONS = {
    "tools": st.lists(TOOL_SPEC, min_size=1, max_size=2),
    "chat_template_kwargs": TEMPLATE_KWARGS,
    "documents": DOCUMENTS,
    "reasoning_effort": st.sampled_from(["none", "low", "high"]),
    "add_special_tokens": st.booleans(),
    "echo": st.booleans(),
}
# vLLM takes n > 1 only with sampling (not greedy).
SAMPLING = st.one_of(st.just({}), st.just({"temperature": 0.0}),
                     st.fixed_dictionaries({"n": st.integers(1, 2), "temperature": st.just(0.7)}))


def long_part(kinds: tuple[str, ...] = ("text", "refusal", "thinking")) -> st.SearchStrategy[
        dict[str, str]]:
    """A content part of 100-400 words (a text part keeps its text under `text`, the
    others under their own type's name)."""
    return st.builds(lambda kind, text: {"type": kind, kind: text},
                     st.sampled_from(kinds), LONG_TEXT)


@st.composite
def chat_bodies(draw: st.DrawFn, long: bool = False) -> dict[str, Any]:
    """A chat request the tiny engine accepts; `long`: one message of 100-400 words."""
    messages = draw(st.lists(MESSAGE, min_size=1, max_size=5))
    if long:
        messages.append({"role": "user", "content": [draw(long_part())]})
    body: dict[str, Any] = {"messages": messages, **draw(SAMPLING),
                            **draw(st.fixed_dictionaries({}, optional=CHAT_OPTIONS))}
    if "tools" in body:
        body["tool_choice"] = "none"  # "auto" needs a tool parser the tiny engine lacks
    if draw(st.booleans()) and messages[-1]["role"] == "assistant":
        messages[-1]["content"] = draw(TEXT)
        body.update(add_generation_prompt=False, continue_final_message=True)
    elif draw(st.booleans()):
        body["add_generation_prompt"] = draw(st.booleans())
    return body


TOKEN_IDS = st.lists(st.integers(3, 2047), min_size=1, max_size=40)
PROMPT = st.one_of(SOME_TEXT, st.lists(SOME_TEXT, min_size=1, max_size=3),
                   TOKEN_IDS, st.lists(TOKEN_IDS, min_size=1, max_size=2))


@st.composite
def completion_bodies(draw: st.DrawFn) -> dict[str, Any]:
    return {"prompt": draw(PROMPT), **draw(SAMPLING), **draw(st.fixed_dictionaries({}, optional={
        "add_special_tokens": st.booleans(), "echo": st.booleans()}))}


# What a client once used to make the engine process more than the sidecar reserved.
ESCAPES: dict[str, Any] = {
    "kv_transfer_params": st.fixed_dictionaries(
        {"prompt_token_ids": st.lists(st.integers(3, 2047), min_size=200, max_size=600)}),
    "use_beam_search": st.just(True),
}


SDK_ARGS = frozenset({"messages", "prompt", "max_tokens", "n", "temperature"})


def create(client: openai.OpenAI, body: dict[str, Any]) -> Any:
    """Send `body` as an SDK user would: vLLM's own fields (and anything else) in
    `extra_body`. A chat body has `messages`, a completion body `prompt`."""
    args = {k: v for k, v in body.items() if k in SDK_ARGS}
    extra = {k: v for k, v in body.items() if k not in SDK_ARGS}
    if "messages" in body:
        return client.chat.completions.create(model="tiny", extra_body=extra, **args)
    return client.completions.create(model="tiny", extra_body=extra, **args)
