"""Chat prompts rendered in the sidecar, as vLLM 0.32 renders them: a bound, no round trip.

A chat prompt's ceiling (`prompt_count.ceilings`) is taken of the text rendered here, so
the rendering must be vLLM's: the model's own tokenizer and chat template, following
vLLM's path step by step (`safe_apply_chat_template`, `parse_chat_messages`) without
importing vLLM, which the sidecar's image does not have: the template and its content
format, messages to text, tools, the template arguments it reads, and the request's
`add_special_tokens`. Compiled templates and their analysis are cached per template.

None (no ceiling: the prompt is counted before it is admitted) for a tokenizer without
a chat template of its own, or a template that raises for the request. What it cannot
see (engine flags, processor templates, Mistral, Harmony) the sidecar guards by
comparing its first counts with the engine's (`tokens`); the steps: docs/gateway.md.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

logger = logging.getLogger(__name__)

# The fields of vLLM's content part types (`_KNOWN_CONTENT_PART_FIELDS`): in "openai"
# format, any other key of a text part reaches the template beside its text.
KNOWN_PART_FIELDS = frozenset({
    "audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil",
    "image_url", "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text",
    "thinking", "type", "uuid", "video_embeds", "video_url"})
# Part type -> the key holding its text (vLLM's TEXT_PART_TYPES).
PART_TEXT_KEYS = {"text": "text", "input_text": "text", "output_text": "text",
                  "refusal": "refusal", "thinking": "thinking"}
BILLING_HEADER = "x-anthropic-billing-header"
# Set by vLLM itself, never from the request's template arguments.
UNEXPECTED_KWARGS = frozenset({"chat_template", "tokenize"})


class NotCovered(Exception):
    """The request is one the local renderer does not render: ask the engine."""


# -- the template's content format (vllm/renderers/hf.py, `_detect_content_format`) --

def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (_is_var(node.node, name) and isinstance(node.arg, jinja2.nodes.Const)
                and node.arg.value == key)
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _names_bound_to(root: jinja2.nodes.Node, name: str) -> Iterator[str]:
    yield name
    related = deque([name])
    while related:
        current = related.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_var_or_elems(assign.node, current):
                assert isinstance(assign.target, jinja2.nodes.Name)
                yield assign.target.name
                if assign.target.name != current:
                    related.append(assign.target.name)


def _message_loop_names(root: jinja2.nodes.Node) -> Iterator[str]:
    names = list(_names_bound_to(root, "messages"))
    for loop in root.find_all(jinja2.nodes.For):
        for name in names:
            if _is_var_or_elems(loop.iter, name):
                assert isinstance(loop.target, jinja2.nodes.Name)
                yield loop.target.name
                break


def _loops_over_content(root: jinja2.nodes.Node) -> bool:
    messages = list(_message_loop_names(root))
    params_by_loop: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        param_names = {arg.name for arg in macro.args}
        params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name:
                for i, arg in enumerate(call.args):
                    if i < len(macro.args) and any(
                            _is_var_or_elems(arg, m, "content") for m in messages):
                        params.add(macro.args[i].name)
                for kwarg in call.kwargs:
                    if (isinstance(kwarg, jinja2.nodes.Keyword) and kwarg.key in param_names
                            and any(_is_var_or_elems(kwarg.value, m, "content")
                                    for m in messages)):
                        params.add(kwarg.key)
        for loop in macro.find_all(jinja2.nodes.For):
            loops_in_macros.add(id(loop))
            if params:
                params_by_loop[id(loop)] = params
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems(loop.iter, m, "content") for m in messages):
            return True
        bound = params_by_loop.get(id(loop))
        if isinstance(loop.iter, jinja2.nodes.Name) and bound is not None \
                and loop.iter.name in bound:
            return True
        if id(loop) not in loops_in_macros and isinstance(loop.iter, jinja2.nodes.Name) \
                and loop.iter.name == "content":
            return True
    return False


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}` blocks, parsed as vLLM parses them to list template variables."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_generation_support")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)


@dataclass(frozen=True)
class TemplateFacts:
    """What vLLM reads off a template before rendering it (cached per template)."""

    text: str
    content_format: str  # "openai" or "string"
    developer_role: bool  # the template names the developer role
    variables: frozenset[str]  # undeclared variables: template arguments it reads


@lru_cache(maxsize=32)
def template_facts(text: str) -> TemplateFacts:
    import transformers.utils.chat_template_utils as hf_chat

    try:  # vLLM parses with transformers' environment; a failure means "string"
        compiled = hf_chat._compile_jinja_template(text)
        content_format = ("openai" if _loops_over_content(compiled.environment.parse(text))
                          else "string")
    except Exception:
        logger.debug("chat template not parsed; content format 'string'", exc_info=True)
        content_format = "string"
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(text)))
    developer = '"developer"' in text or "'developer'" in text
    return TemplateFacts(text, content_format, developer, variables)


# -- messages (vllm/renderers/chat_utils.py, `_parse_chat_message_content`) ----------

def _strip_billing_header(parts: list[Any]) -> list[Any]:
    kept: list[Any] = []
    for part in parts:
        text = part if isinstance(part, str) else (
            part.get("text") if part.get("type") == "text" else None)
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            kept.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            kept.append(rest if isinstance(part, str) else {**part, "text": rest})
    return kept


def _part(part: Any, openai_format: bool) -> Any:
    if isinstance(part, str):
        return {"type": "text", "text": part} if openai_format else part
    key = PART_TEXT_KEYS.get(part.get("type"))  # vetted: text-like parts only
    if key is None:
        raise NotCovered(f"content part {part.get('type')!r}")
    text = part.get(key)
    if text is None:
        return None  # vLLM skips a text part without its text
    if not openai_format:
        return text
    return {"type": "text", "text": text,
            **{k: v for k, v in part.items() if k not in KNOWN_PART_FIELDS}}


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """As vLLM's request model validates it (its key order, extra keys last), the
    arguments parsed to an object (`_postprocess_messages`)."""
    function = call["function"]
    arguments = function.get("arguments")
    parsed: Any = {}
    if isinstance(arguments, dict):
        parsed = arguments
    elif arguments:
        try:
            parsed = json.loads(arguments)
        except (json.JSONDecodeError, TypeError):
            parsed = {}
        if not isinstance(parsed, dict):
            parsed = {}
    out_function = {"arguments": parsed, "name": function["name"],
                    **{k: v for k, v in function.items() if k not in ("arguments", "name")}}
    return {"id": call["id"], "function": out_function, "type": call.get("type", "function"),
            **{k: v for k, v in call.items() if k not in ("id", "function", "type")}}


def conversation_message(message: dict[str, Any], openai_format: bool) -> dict[str, Any]:
    role = message["role"]
    content = message.get("content")
    parts: list[Any] = [] if content is None else (
        [{"type": "text", "text": content}] if isinstance(content, str) else list(content))
    if role == "system":
        parts = _strip_billing_header(parts)
    # vLLM keeps a part only if it is truthy: an empty text is dropped in "string" format
    # (no "\n" for it), kept as a part in "openai" format.
    rendered = [p for p in (_part(p, openai_format) for p in parts) if p]
    result: dict[str, Any] = {"role": role,
                              "content": rendered if openai_format else "\n".join(rendered)}
    if role == "assistant":
        calls = message.get("tool_calls")
        if calls is not None:
            result["tool_calls"] = [_tool_call(c) for c in calls]
        reasoning = message.get("reasoning")
        if reasoning is not None:
            result["reasoning"] = reasoning
            result["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            result["tool_call_id"] = message["tool_call_id"]
        if isinstance(result["content"], list):  # text parts: one string
            texts = [item.get("text", "") for item in result["content"]]
            result["content"] = "\n".join(texts) if texts else ""
    if isinstance(message.get("name"), str):
        result["name"] = message["name"]
    if role == "developer":
        result["tools"] = message.get("tools")
    if role == "assistant" and result.get("tool_calls") == []:
        del result["tool_calls"]  # vLLM drops an empty list: the plain assistant path
    return result


def _developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`_convert_developer_to_system` then `_consolidate_system_messages`."""
    converted = []
    for message in conversation:
        if message["role"] == "developer":
            message = {**message, "role": "system"}
            message.pop("tools", None)
        converted.append(message)
    system: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, message in enumerate(converted):
        if message["role"] != "system":
            rest.append(message)
            continue
        if i > 0 or system:
            merge = True
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, dict) else p for p in content
                                if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
        if content:
            system.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(system)}, *rest]


def tool_dict(tool: dict[str, Any]) -> dict[str, Any]:
    """A chat tool as vLLM's `ChatCompletionToolsParam.model_dump()` gives it."""
    function = tool["function"]
    dumped = {"name": function["name"], "description": function.get("description"),
              "parameters": function.get("parameters")}
    if function.get("strict") is not None:
        dumped["strict"] = function["strict"]
    return {"type": "function", "function": dumped}


# -- the whole render --------------------------------------------------------------

def _explicit_params(function: Any) -> frozenset[str]:
    return frozenset(
        p.name for p in inspect.signature(function).parameters.values()
        if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL))


class LocalChatRenderer:
    """Renders and tokenizes chat prompts with a transformers tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        from transformers import PythonBackend

        self._tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        # Arguments apply_chat_template takes by name, and the base class's: vLLM passes
        # those whatever the template reads (`resolve_chat_template_kwargs`).
        self._accepted = (_explicit_params(tokenizer.apply_chat_template)
                          | _explicit_params(PythonBackend.apply_chat_template))

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> LocalChatRenderer | None:
        """A renderer, or None when the tokenizer has no chat template of its own."""
        if not getattr(tokenizer, "chat_template", None):
            return None
        return cls(tokenizer)

    def _template(self, tools: list[dict[str, Any]] | None) -> TemplateFacts:
        try:
            text = self._tokenizer.get_chat_template(None, tools=tools)
        except Exception as exc:
            raise NotCovered("no chat template") from exc
        return template_facts(text)

    def render_text(self, payload: dict[str, Any]) -> str | None:
        """The prompt text vLLM renders for a chat /tokenize `payload`
        (`tokens.chat_tokenize_payload`), or None when the engine must render it."""
        try:
            return self._render_text(payload)
        except NotCovered as why:
            logger.debug("chat prompt left to the engine's /tokenize: %s", why)
            return None

    def _render_text(self, payload: dict[str, Any]) -> str:
        tools = [tool_dict(t) for t in payload["tools"]] if payload.get("tools") else None
        facts = self._template(tools)
        openai_format = facts.content_format == "openai"
        conversation = [conversation_message(m, openai_format) for m in payload["messages"]]
        if not facts.developer_role and any(m["role"] == "developer" for m in conversation):
            conversation = _developer_as_system(conversation)
        kwargs = dict(payload.get("chat_template_kwargs") or {})
        if UNEXPECTED_KWARGS & kwargs.keys():
            raise NotCovered("reserved template arguments")
        kwargs["add_generation_prompt"] = payload.get("add_generation_prompt", True)
        kwargs["continue_final_message"] = payload.get("continue_final_message", False)
        kwargs["return_dict"] = False
        accepted = self._accepted | facts.variables
        kwargs = {k: v for k, v in kwargs.items() if k in accepted and k not in ("tools",)}
        try:
            text: str = self._tokenizer.apply_chat_template(
                conversation=conversation, tools=tools, chat_template=facts.text,
                tokenize=False, **kwargs)
        except Exception as exc:
            raise NotCovered(f"the template raised {type(exc).__name__}") from exc
        return text

    def render(self, payload: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids, or None when the engine must count it."""
        text = self.render_text(payload)
        if text is None:
            return None
        special = payload.get("add_special_tokens", False) is True
        if self._backend is not None:
            ids: list[int] = self._backend.encode(text, add_special_tokens=special).ids
            return ids
        return list(self._tokenizer.encode(text, add_special_tokens=special))
