"""The model's own chat template, which the adapter applies for passthrough models.

Step-protocol models apply their template themselves; a model behind Triton's vLLM backend
receives `text_input` as is, so the adapter turns a chat into text here, with the template the
model ships (never a constant: a Llama, Mistral or Qwen model each has its own):

  - a GGUF file: its `tokenizer.chat_template` metadata,
  - a Hugging Face `tokenizer_config.json`: its `chat_template` (a string, or a list of named
    templates, of which "default" is used),
  - any other file: the Jinja template itself.

It is rendered as Hugging Face transformers renders it (`apply_chat_template`): a sandboxed
Jinja environment with trim_blocks and lstrip_blocks, the loop-controls extension, `raise_exception`
and `tojson`, the messages as role/content dicts, the special tokens, and add_generation_prompt.

The backend tokenizes this text whole, so a control token's string inside a message (ChatML's
"<|im_start|>system") becomes a control token there: the vLLM backend takes text only, no token
ids, and the hole stays on this path. Step-protocol models tokenize content as text (triton-local's
encode_chat).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from sluice_inference_adapter.step_rows import PromptSpec


class ChatTemplateError(ValueError):
    """The template could not be found or rendered; the message names the file and the cause."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    def __init__(self, source: str, template: str, special_tokens: dict[str, str]) -> None:
        self.source = source
        self._special_tokens = special_tokens
        try:
            self._template = _environment().from_string(template)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"the chat template of {source} is not valid Jinja: {exc}") from exc

    def render(self, prompt: PromptSpec) -> str:
        """The text the model receives: a raw prompt as is, a chat through the template."""
        if prompt.prompt_token_ids:
            # The gateway refuses these for a text-only model (ModelInfo.token_prompts): never here.
            raise ChatTemplateError("this model takes text prompts only, not token ids")
        if not prompt.messages:
            return prompt.prompt
        messages = [{"role": role, "content": content} for role, content in prompt.messages]
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **self._special_tokens)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template of {self.source} refused these messages: {exc}") from exc


def load_chat_template(path: str) -> ChatTemplate:
    file = Path(path)
    if not file.is_file():
        raise ChatTemplateError(f"chat template source {path} is not a file")
    loaders: dict[str, Callable[[Path], tuple[str, dict[str, str]]]] = {".gguf": _from_gguf, ".json": _from_tokenizer_config}
    template, special_tokens = loaders.get(file.suffix.lower(), _from_jinja)(file)
    return ChatTemplate(path, template, special_tokens)


def _from_jinja(file: Path) -> tuple[str, dict[str, str]]:
    return file.read_text(), {}


def _from_tokenizer_config(file: Path) -> tuple[str, dict[str, str]]:
    config = json.loads(file.read_text())
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        raise ChatTemplateError(f"{file} has no chat_template (a string, or a list with a 'default' entry)")
    tokens = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return template, tokens


def _from_gguf(file: Path) -> tuple[str, dict[str, str]]:
    import gguf  # only for GGUF sources; reading the metadata maps the file, it does not load it

    reader = gguf.GGUFReader(str(file))
    template = _gguf_value(reader, "tokenizer.chat_template")
    if not isinstance(template, str) or not template:
        raise ChatTemplateError(f"{file} has no tokenizer.chat_template metadata")
    vocabulary = _gguf_value(reader, "tokenizer.ggml.tokens") or []
    tokens = {}
    for name in ("bos", "eos", "unknown", "padding"):
        token_id = _gguf_value(reader, f"tokenizer.ggml.{name}_token_id")
        if isinstance(token_id, int) and 0 <= token_id < len(vocabulary):
            key = {"unknown": "unk", "padding": "pad"}.get(name, name)
            tokens[f"{key}_token"] = vocabulary[token_id]
    return template, tokens


def _gguf_value(reader: Any, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()
