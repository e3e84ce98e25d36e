"""The model's tokenizer without transformers: ``tokenizers`` on tokenizer.json + jinja2 chat template.

transformers takes seconds to import; the router only needs encode/decode and the chat template, so
this wrapper reads the same files with the libraries transformers itself uses underneath
(``tokenizers`` for the BPE, ``jinja2`` in an immutable sandbox for the template) and renders the
template with the same environment options and variables, so the token ids are identical to
``AutoTokenizer.apply_chat_template(..., tokenize=True)`` (checked in tests/unit/common).

Plain prompts are encoded with the tokenizer's post-processor, as transformers does by default
(SmolLM2's adds no BOS). The rendered chat template is encoded without it, like transformers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from services.common import chat_tools
from services.common.errors import ConfigError, InvalidArgument

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
_TOOL_ROLES = ("system", "user", "assistant", "tool")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Same override as transformers: jinja's own tojson escapes HTML characters.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken-style dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


class Tokenizer:
    """Encode/decode and chat templating for one model directory (tokenizer.json + template)."""

    def __init__(self, hf_dir: Path) -> None:
        tok_file = hf_dir / "tokenizer.json"
        if not tok_file.is_file():
            raise ConfigError(
                f"no tokenizer at {tok_file}; run `meshserve models prepare` or point tokenizer_dir at an HF dir"
            )
        self.path = hf_dir
        self._tok = _HFTokenizer.from_file(str(tok_file))
        config: dict[str, Any] = {}
        cfg_file = hf_dir / "tokenizer_config.json"
        if cfg_file.is_file():
            config = json.loads(cfg_file.read_text())
        template = config.get("chat_template")
        tpl_file = hf_dir / "chat_template.jinja"
        if tpl_file.is_file():
            template = tpl_file.read_text()
        self.chat_template: str | None = template if isinstance(template, str) else None
        self._specials = {k: t for k in _SPECIAL_KEYS if (t := _token_text(config.get(k))) is not None}
        eos = self._specials.get("eos_token")
        eos_id = self._tok.token_to_id(eos) if eos else None
        if eos_id is None:
            raise ConfigError(f"{cfg_file} names no eos_token present in the vocabulary; re-run models prepare")
        self.eos_token_id: int = int(eos_id)
        digest = hashlib.sha256(tok_file.read_bytes())
        digest.update(b"\0" + (self.chat_template or "").encode())
        self.fingerprint: str = digest.hexdigest()[:32]
        """Content hash of tokenizer.json + chat template: changes whenever token ids could."""
        self._template: jinja2.Template | None = None
        if self.chat_template is not None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(self.chat_template)
        self.template_knows_tools: bool = self.chat_template is not None and chat_tools.template_knows_tools(
            self.chat_template
        )
        """Whether the chat template renders ``tools`` itself; else :mod:`services.common.chat_tools` does."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's post-processor, like transformers' default)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The chat template applied to ``messages`` (dicts with ``role`` and ``content``, and the tool
        fields of :mod:`services.common.chat_tools`), as text.

        ``tools`` (OpenAI's ``[{"type": "function", "function": {...}}]``) are passed to the template
        as transformers passes them when it reads ``tools``; otherwise tools, assistant tool calls and
        ``tool`` messages are rendered by :func:`~services.common.chat_tools.fallback_messages`.
        """
        if self._template is None:
            raise InvalidArgument("this model has no chat template; use Generate with a plain prompt")
        native = self.template_knows_tools
        for m in messages:
            if m.get("role") not in _TOOL_ROLES:
                raise InvalidArgument(
                    f"chat message role must be one of {', '.join(_TOOL_ROLES)}, got {m.get('role')!r}"
                )
        has_tool_fields = any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
        if native:
            rendered: list[dict[str, Any]] = chat_tools.native_messages(messages)
        elif tools or has_tool_fields:
            rendered = list(chat_tools.fallback_messages(messages, tools))
        else:
            rendered = [{"role": m["role"], "content": m.get("content", "")} for m in messages]
        try:
            return self._template.render(
                messages=rendered,
                tools=list(tools) if native and tools else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._specials,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidArgument(f"the chat template rejected the conversation: {exc}") from None

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of the templated conversation (no extra special tokens, as transformers)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False)
