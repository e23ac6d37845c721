"""A prompt's token ceiling is never below its exact count: admitting a request at its
ceiling can only reserve more than it needs, so no tenant goes over its maxBlocks
because a bound was used.

Checked on the tiny model's tokenizer (byte-level BPE) with chat prompts rendered as
the engine renders them, by its own template and by a tool-using template, over the
deterministic chat corpus and hypothesis-drawn shapes (multilingual text, emoji, code,
tool calls and tools, image parts given as text, long system prompts); and on a real
vocabulary shipped offline by a package: Mistral's Tekken (131k byte-level BPE tokens,
`mistral_common`'s data), by its own encoder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_sidecar.gateway.counting.chat_render import LocalChatRenderer
from engine_sidecar.gateway.counting.prompt_bounds import TokenCeiling, token_ceiling
from engine_sidecar.gateway.counting.tokens import chat_tokenize_payload

from .chat_corpus import chat_corpus

# A template in the style of the tool-calling ones (tools and arguments dumped as JSON,
# indented; a default system prompt): template text the tiny one never adds.
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>Tools:\n{{ tools | tojson(indent=4) }}</s>"
    "{% elif messages[0]['role'] != 'system' %}<|system|>You are a helpful assistant."
    "</s>{% endif %}{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% elif m['content'] %}"
    "{% for p in m['content'] %}{{ p['text'] }}\n{% endfor %}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}<call>{{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson(indent=2) }}</call>{% endfor %}</s>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")

SCRIPTS = [
    "tenant quota", "Grüße, Zoë — naïve café", "日本語のテキスト", "中文文本测试", "한국어 문장",
    "עברית", "العربية", "हिन्दी", "ελληνικά", "русский текст", "🙂👩‍💻🏳️‍🌈🇯🇵", "e\u0301\u200b",
    "ﷺ", "İstanbul", "\t\n  \r\n", "def f(x):\n    return {'a': [x, 2]}  # code\n",
    "SELECT * FROM t WHERE a = 'b';", "<|user|>", "</s>", "<s>", "{{ x }}", "\\u00e9",
    "\x00\x7f", "\ud7ff\ue000\U0010ffff", "a" * 300, "🙂" * 50]
TEXT = st.lists(st.one_of(st.sampled_from(SCRIPTS), st.text(max_size=40)),
                max_size=12).map(" ".join)
IMAGE_AS_TEXT = st.builds(lambda u: {"type": "text", "text": f"[image: {u}]"},
                          st.sampled_from(["https://example.invalid/cat.png",
                                           "data:image/png;base64," + "iVBORw0KGgo" * 40]))
PART = st.one_of(st.builds(lambda t: {"type": "text", "text": t}, TEXT), IMAGE_AS_TEXT)
CONTENT = st.one_of(TEXT, st.lists(PART, min_size=1, max_size=4))
ARGUMENTS = st.one_of(
    st.dictionaries(st.sampled_from(["q", "city", "code", "日付"]), TEXT, max_size=3
                    ).map(lambda d: json.dumps(d, ensure_ascii=False)),
    st.dictionaries(st.sampled_from(["n", "deep"]), st.integers() | st.lists(TEXT, max_size=3),
                    max_size=2).map(json.dumps))
TOOL_CALL = st.builds(lambda name, args: {"id": "call_0", "type": "function",
                                          "function": {"name": name, "arguments": args}},
                      st.sampled_from(["lookup", "get_weather", "run_sql"]), ARGUMENTS)
MESSAGE = st.one_of(
    st.builds(lambda c: {"role": "user", "content": c}, CONTENT),
    st.builds(lambda c, calls: {"role": "assistant", "content": c, "tool_calls": calls},
              st.one_of(st.none(), TEXT), st.lists(TOOL_CALL, min_size=1, max_size=2)),
    st.builds(lambda c: {"role": "tool", "tool_call_id": "call_0", "content": c}, TEXT),
    st.builds(lambda c: {"role": "assistant", "content": c}, TEXT))
SYSTEM = st.one_of(st.just([]), st.builds(
    lambda t, n: [{"role": "system", "content": t * n}], TEXT, st.integers(1, 12)))
TOOLS = st.one_of(st.none(), st.just([{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city, «today» ☀️.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]))
CHAT = st.builds(
    lambda system, messages, tools, special: {
        "messages": system + messages, **({"tools": tools} if tools else {}),
        **({"add_special_tokens": True} if special else {})},
    SYSTEM, st.lists(MESSAGE, min_size=1, max_size=5), TOOLS, st.booleans())


@pytest.fixture(scope="module")
def renderers(tiny_tokenizer: Any) -> list[LocalChatRenderer]:
    tooled = type(tiny_tokenizer).from_pretrained(tiny_tokenizer.name_or_path)
    tooled.chat_template = TOOL_TEMPLATE
    return [LocalChatRenderer(tiny_tokenizer), LocalChatRenderer(tooled)]


def _checked(renderer: LocalChatRenderer, body: dict[str, Any]) -> bool:
    """Ceiling >= count for one chat body, as the engine would render it (False: the
    template does not cover it: the sidecar counts such a body before admitting it)."""
    payload = chat_tokenize_payload(body)
    text = renderer.render_text(payload)
    if text is None:
        return False
    backend = renderer._backend  # the tokenizer the engine encodes the text with
    special = payload.get("add_special_tokens", False) is True
    ceiling = token_ceiling(backend)
    assert ceiling is not None
    exact = len(backend.encode(text, add_special_tokens=special).ids)
    assert ceiling.of(text, special) >= exact, (text, exact)
    return True


def test_the_tiny_tokenizer_has_a_ceiling(tiny_tokenizer: Any) -> None:
    assert token_ceiling(tiny_tokenizer.backend_tokenizer) == TokenCeiling(1, 0)


def test_ceiling_holds_over_the_chat_corpus(renderers: list[LocalChatRenderer]) -> None:
    checked = sum(_checked(r, body) for r in renderers for body in chat_corpus())
    assert checked >= 300  # both templates render most of the 210 shapes: with the
    # drawn ones below, 450+ chat shapes and 200 plain texts on a real vocabulary


@settings(max_examples=150, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(body=CHAT, tooled=st.booleans())
def test_ceiling_holds_for_drawn_chats(renderers: list[LocalChatRenderer],
                                       body: dict[str, Any], tooled: bool) -> None:
    _checked(renderers[tooled], body)


@settings(max_examples=200, deadline=None)
@given(text=TEXT, special=st.booleans())
def test_ceiling_holds_for_a_real_vocabulary(text: str, special: bool) -> None:
    tekken = _tekkenizer()
    ids = tekken.encode(text, bos=special, eos=special)
    assert TokenCeiling(1, 2).of(text, special) >= len(ids)


def _tekkenizer() -> Any:
    global _TEKKEN
    if _TEKKEN is None:
        mistral = pytest.importorskip("mistral_common.tokens.tokenizers.tekken")
        data = Path(mistral.__file__).parents[2] / "data" / "tekken_240911.json"
        _TEKKEN = mistral.Tekkenizer.from_file(data)
    return _TEKKEN


_TEKKEN: Any = None


DIGITS = {"type": "Split", "pattern": {"Regex": "\\d"}, "behavior": "Isolated",
          "invert": False}
BYTES = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": True}


@pytest.mark.parametrize("normalizer, pre_tokenizer, expected", [
    (None, {**BYTES, "add_prefix_space": True}, None),
    (None, {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always",
            "split": True}, None),
    ({"type": "Prepend", "prepend": "\u2581"}, None, None),
    ({"type": "NFC"}, {"type": "Sequence", "pretokenizers": [DIGITS, BYTES]},
     TokenCeiling(3, 0)),
    ({"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}]}, BYTES,
     TokenCeiling(54, 0)),
])
def test_tokenizers_that_add_text_have_no_ceiling(
        tiny_tokenizer: Any, normalizer: dict[str, Any] | None,
        pre_tokenizer: dict[str, Any] | None, expected: TokenCeiling | None) -> None:
    """A prefix space or '\u2581' adds tokens no byte of the prompt pays for: such a
    tokenizer keeps counting before admitting; a normalizer grows non-ASCII text."""
    from tokenizers import Tokenizer

    spec = json.loads(tiny_tokenizer.backend_tokenizer.to_str())
    spec["normalizer"], spec["pre_tokenizer"] = normalizer, pre_tokenizer
    assert token_ceiling(Tokenizer.from_str(json.dumps(spec))) == expected
