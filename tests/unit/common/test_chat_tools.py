"""Tools in the chat prompt: a template that knows tools renders them exactly as transformers does;
SmolLM2's, which does not, gets the documented Hermes-style fallback (services/common/chat_tools.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from services.common import chat_tools
from services.common.model_paths import model_paths
from services.common.tokenizer import Tokenizer

HF_DIR = model_paths().hf_dir
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
]
# A tool-aware template in the style of Qwen2.5's (reads `tools`, `tool_calls`, the `tool` role).
NATIVE = (
    "{%- if tools %}<|im_start|>system\n{{ messages[0]['content'] if messages[0]['role'] == 'system' else '' }}"
    "\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and tools %}{%- elif message.tool_calls %}<|im_start|>assistant\n"
    "{{ message.content }}{% for call in message.tool_calls %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    return Tokenizer(HF_DIR)


def test_smollm_template_does_not_know_tools_and_gets_the_fallback(smollm: Tokenizer) -> None:
    assert not smollm.template_knows_tools
    text = smollm.render_chat(CONVERSATION, tools=TOOLS)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(TOOLS[0]) in system and "<tool_call>" in system
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' in text
    assert (
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>\nsunny\n'
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in text
    assert smollm.apply_chat_template(CONVERSATION, tools=TOOLS) == smollm.encode(text, add_special_tokens=False)


def test_without_tools_the_prompt_is_the_one_it_always_was(smollm: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert smollm.render_chat(messages, tools=None) == smollm.render_chat(messages)
    assert "# Tools" not in smollm.render_chat(messages)


def test_fallback_tools_without_a_system_message_get_their_own() -> None:
    out = chat_tools.fallback_messages([{"role": "user", "content": "Hi"}], TOOLS)
    assert [m["role"] for m in out] == ["system", "user"]
    assert out[0]["content"] == chat_tools.tools_block(TOOLS)
    text_and_call = chat_tools.fallback_messages(
        [{"role": "assistant", "content": "Let me see.", "tool_calls": [CALL]}], None
    )
    assert (
        text_and_call[0]["content"]
        == 'Let me see.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )


def test_a_template_that_knows_tools_renders_them_as_transformers_does(tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(HF_DIR / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(NATIVE)
    tok = Tokenizer(tmp_path)
    assert tok.template_knows_tools
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [m if m["role"] != "assistant" else {**m, "tool_calls": [CALL]} for m in CONVERSATION]
    expected = hf.apply_chat_template(
        chat_tools.native_messages(messages), tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert tok.render_chat(messages, tools=TOOLS) == expected
    assert '"arguments": {"city": "Paris"}' in expected  # arguments reach the template as a dict
