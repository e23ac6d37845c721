"""A deterministic corpus of chat and /v1/responses request shapes.

Each body is one the sidecar admits and the tiny engine accepts, drawn from a seeded
generator: `chat_corpus()` cycles through shape families (every role, string / empty /
multi-part content of text, refusal and thinking parts, assistant tool calls with
well-formed, empty and malformed arguments, reasoning, tools, template arguments,
documents, reasoning effort, the generation-prompt modes, special tokens, developer
messages anywhere, Claude Code's billing header, long and unicode text) and varies the
text of each; `responses_corpus()` does the same for Responses input items. The same
seed gives the same corpus on every run.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

SEED = 32
WORDS = ["tenant", "quota", "cache", "block", "lease", "premium", "free", "engine", "the",
         "sidecar", "7", "42.", "\n", "  ", "\t", "é", "ñandú", "日本語", "中文", "한국어",
         "🙂", "👩‍💻", "עברית", "العربية", "e\u0301", "\u200b", "Ω≈ç√", "<|user|>",
         "<|assistant|>", "</s>", "<s>", "<unk>", "{{ x }}", "{% if %}", '"q"', "\\n",
         "x-anthropic-billing-header"]
LONG_WORDS = WORDS[:10]
NAMES = ["alice", "bob_2", "lookup"]
TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}
BARE_TOOL = {"type": "function", "function": {"name": "ping"}}
STRICT_TOOL = {"type": "function", "function": {"name": "add", "strict": True, "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}


class Draw:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def text(self, low: int = 0, high: int = 16) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(low, high)))

    def long_text(self) -> str:  # ~600-900 tokens of the tiny tokenizer
        return " ".join(self.rng.choice(LONG_WORDS) for _ in range(self.rng.randint(250, 380)))

    def part(self) -> dict[str, Any]:
        kind = self.rng.choice(["text", "text", "refusal", "thinking"])
        part: dict[str, Any] = {"type": kind, kind: self.text()}
        if kind == "thinking" and self.rng.random() < 0.5:
            part["closed"] = self.rng.random() < 0.5
        return part

    def content(self) -> str | list[dict[str, Any]]:
        roll = self.rng.random()
        if roll < 0.1:
            return ""
        if roll < 0.15:
            return []
        if roll < 0.55:
            return self.text(1)
        return [self.part() for _ in range(self.rng.randint(1, 4))]

    def arguments(self) -> str:
        return self.rng.choice([
            json.dumps({"word": self.text(1, 3)}), json.dumps({"a": self.rng.randint(0, 99)}),
            "", "not json", "[1, 2]", "{}", json.dumps({"nested": {"k": [1, "é"]}})])

    def tool_call(self, i: int) -> dict[str, Any]:
        return {"id": f"call_{i}", "type": "function",
                "function": {"name": self.rng.choice(NAMES), "arguments": self.arguments()}}

    def message(self, role: str) -> dict[str, Any]:
        message: dict[str, Any] = {"role": role, "content": self.content()}
        if role == "assistant":
            if self.rng.random() < 0.3:
                message["content"] = None
            if self.rng.random() < 0.4:
                message["tool_calls"] = [self.tool_call(i)
                                         for i in range(self.rng.randint(0, 2))]
            if self.rng.random() < 0.3:
                message["reasoning"] = self.text()
        if role == "tool" and self.rng.random() < 0.7:
            message["tool_call_id"] = f"call_{self.rng.randint(0, 1)}"
        if role in ("user", "system", "developer", "assistant") and self.rng.random() < 0.2:
            message["name"] = self.rng.choice(NAMES)
        return message

    def messages(self, low: int = 1, high: int = 5) -> list[dict[str, Any]]:
        roles = ["system", "developer", "user", "assistant", "tool"]
        return [self.message(self.rng.choice(roles))
                for _ in range(self.rng.randint(low, high))]


def _plain(d: Draw) -> dict[str, Any]:
    return {"messages": d.messages()}


def _user_only(d: Draw) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": d.text(0, 30)}]}


def _multi_part(d: Draw) -> dict[str, Any]:
    return {"messages": [d.message("system"), {"role": "user", "content": [
        d.part() for _ in range(d.rng.randint(2, 6))]}]}


def _empty(d: Draw) -> dict[str, Any]:
    return {"messages": [{"role": d.rng.choice(["user", "system", "assistant", "tool"]),
                          "content": d.rng.choice(["", []])} for _ in range(d.rng.randint(1, 3))]}


def _long(d: Draw) -> dict[str, Any]:
    long: Any = d.long_text()
    if d.rng.random() < 0.5:
        long = [{"type": d.rng.choice(["text", "refusal", "thinking"]), "x": 0}]
        long[0][long[0]["type"]] = d.long_text()
        del long[0]["x"]
    return {"messages": [*d.messages(0, 2), {"role": "user", "content": long}]}


def _developer(d: Draw) -> dict[str, Any]:
    messages = d.messages(0, 3)
    for _ in range(d.rng.randint(1, 2)):
        messages.insert(d.rng.randint(0, len(messages)), d.message("developer"))
    if d.rng.random() < 0.5:
        messages.insert(d.rng.randint(0, len(messages)), d.message("system"))
    return {"messages": messages}


def _billing_header(d: Draw) -> dict[str, Any]:
    header = f"x-anthropic-billing-header: cc_version=1.0; cch={d.rng.randint(0, 10**6)}"
    rest = d.rng.choice(["", "\n" + d.text(1), "\n"])
    content: Any = header + rest
    if d.rng.random() < 0.5:
        content = [{"type": "text", "text": header + rest}, {"type": "text", "text": d.text(1)}]
    return {"messages": [{"role": "system", "content": content}, d.message("user")]}


def _tools(d: Draw) -> dict[str, Any]:
    tools = d.rng.sample([TOOL, BARE_TOOL, STRICT_TOOL], d.rng.randint(1, 3))
    messages = [d.message("user"), {"role": "assistant", "content": None,
                                    "tool_calls": [d.tool_call(0)]},
                {"role": "tool", "tool_call_id": "call_0", "content": d.content()}]
    return {"messages": messages, "tools": tools, "tool_choice": "none"}


def _template_kwargs(d: Draw) -> dict[str, Any]:
    kwargs = {k: d.rng.choice([True, False, d.text(1, 3)]) for k in d.rng.sample(
        ["enable_thinking", "thinking", "custom", "add_vision_id"], d.rng.randint(1, 3))}
    return {"messages": d.messages(), "chat_template_kwargs": kwargs}


def _documents(d: Draw) -> dict[str, Any]:
    return {"messages": d.messages(), "documents": [
        {"title": d.text(1, 3), "text": d.text(1)} for _ in range(d.rng.randint(1, 2))]}


def _reasoning_effort(d: Draw) -> dict[str, Any]:
    return {"messages": d.messages(),
            "reasoning_effort": d.rng.choice(["none", "low", "medium", "high"])}


def _no_generation_prompt(d: Draw) -> dict[str, Any]:
    return {"messages": d.messages(), "add_generation_prompt": False}


def _continue_final(d: Draw) -> dict[str, Any]:
    last = {"role": "assistant", "content": d.text(1)}
    if d.rng.random() < 0.3:
        last["content"] = [{"type": "text", "text": d.text(1)}]  # type: ignore[assignment]
    return {"messages": [*d.messages(1, 3), last], "add_generation_prompt": False,
            "continue_final_message": True}


def _special_tokens(d: Draw) -> dict[str, Any]:
    return {"messages": d.messages(), "add_special_tokens": True}


CHAT_FAMILIES: list[Callable[[Draw], dict[str, Any]]] = [
    _plain, _user_only, _multi_part, _empty, _long, _developer, _billing_header, _tools,
    _template_kwargs, _documents, _reasoning_effort, _no_generation_prompt,
    _continue_final, _special_tokens]


def chat_corpus(size: int = 210, seed: int = SEED) -> list[dict[str, Any]]:
    """`size` chat bodies (without model and max_tokens), each family in turn."""
    d = Draw(seed)
    return [CHAT_FAMILIES[i % len(CHAT_FAMILIES)](d) for i in range(size)]


# -- /v1/responses ------------------------------------------------------------------

def _input_message(d: Draw) -> dict[str, Any]:
    role = d.rng.choice(["user", "user", "system", "developer"])
    content: Any = d.text(1)
    if d.rng.random() < 0.5:
        content = [{"type": "input_text", "text": d.text(1)}
                   for _ in range(d.rng.randint(1, 3))]
    if role == "system" and isinstance(content, list):  # refused: `responses_input`
        for part in content:
            if part["text"].startswith("x-anthropic-billing-header"):
                part["text"] = "header: " + part["text"]
    item = {"role": role, "content": content}
    if d.rng.random() < 0.5:
        item["type"] = "message"
    return item


def _output_message(d: Draw, status: str = "completed") -> dict[str, Any]:
    if d.rng.random() < 0.3 and status == "completed":
        return {"role": "assistant", "content": d.text(1)}
    return {"type": "message", "role": "assistant", "status": status, "content": [
        {"type": "output_text", "text": d.text(1), "annotations": []}
        for _ in range(d.rng.randint(1, 2))]}


def _reasoning_item(d: Draw, status: str = "completed") -> dict[str, Any]:
    item: dict[str, Any] = {"type": "reasoning", "summary": [
        {"type": "summary_text", "text": d.text(1)} for _ in range(d.rng.randint(0, 2))],
        "status": status}
    if d.rng.random() < 0.4:
        item["content"] = [{"type": "reasoning_text", "text": d.text(1)}]
    return item


def _call_items(d: Draw, i: int) -> list[dict[str, Any]]:
    call = {"type": "function_call", "call_id": f"call_{i}", "name": "lookup",
            "arguments": d.arguments()}
    return [call, {"type": "function_call_output", "call_id": f"call_{i}",
                   "output": d.text(0)}]


def responses_body(d: Draw, i: int) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if i % 3 == 0:
        body["instructions"] = d.text(1)
    if i % 7 == 0:
        body["input"] = d.text(1)
        return body
    items: list[dict[str, Any]] = [_input_message(d)]
    for j in range(d.rng.randint(0, 4)):
        kind = d.rng.choice(["user", "assistant", "reasoning", "call"])
        if kind == "user":
            items.append(_input_message(d))
        elif kind == "assistant":
            items.append(_output_message(d))
        elif kind == "reasoning":
            items.append(_reasoning_item(d))
        else:
            items.extend(_call_items(d, j))
    if i % 5 == 1:  # a partial assistant turn, continued
        items.append(d.rng.choice([_output_message(d, "incomplete"),
                                   _reasoning_item(d, "in_progress")]))
    body["input"] = items
    if i % 4 == 2:
        body["tools"] = [{"type": "function", "name": "lookup", "description": "Look up.",
                          "parameters": TOOL["function"]["parameters"]}]  # type: ignore[index]
    if i % 6 == 3:
        body["reasoning"] = {"effort": d.rng.choice(["low", "high"])}
    if i % 8 == 5:
        body["chat_template_kwargs"] = {"enable_thinking": d.rng.random() < 0.5}
    return body


def responses_corpus(size: int = 40, seed: int = SEED) -> list[dict[str, Any]]:
    d = Draw(seed + 1)
    return [responses_body(d, i) for i in range(size)]
