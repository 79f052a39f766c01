"""The model's chat template, read from each kind of source and rendered as transformers does."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from sluice_inference_adapter.chat_template import ChatTemplateError, load_chat_template
from sluice_inference_adapter.step_rows import PromptSpec

FIXTURES = Path(__file__).parent / "fixtures"
SMOLLM2_CONFIG = FIXTURES / "smollm2_tokenizer_config.json"
# What SmolLM2's template makes of one user message: its default system prompt, then ChatML.
SMOLLM2_CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhich city is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)
QUESTION = PromptSpec(messages=(("user", "Which city is the capital of France?"),))


def test_tokenizer_config_template_renders_smollm2_chat() -> None:
    assert load_chat_template(str(SMOLLM2_CONFIG)).render(QUESTION) == SMOLLM2_CHAT


def test_a_system_message_replaces_the_default_one() -> None:
    prompt = PromptSpec(messages=(("system", "Be brief."), ("user", "Hi")))
    text = load_chat_template(str(SMOLLM2_CONFIG)).render(prompt)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and "SmolLM" not in text


def test_a_raw_prompt_is_passed_as_is() -> None:
    assert load_chat_template(str(SMOLLM2_CONFIG)).render(PromptSpec(prompt="Once upon")) == "Once upon"


def test_gguf_metadata_with_special_tokens(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_chat_template("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}")
    writer.add_token_list(["<unk>", "<s>", "</s>"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert load_chat_template(str(path)).render(QUESTION) == "<s>[user] Which city is the capital of France?</s>"


def test_named_templates_use_the_default_one(tmp_path: Path) -> None:
    config = {"chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ messages[0]['content'] }}!"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(str(tmp_path / "tokenizer_config.json")).render(QUESTION) == "Which city is the capital of France?!"


def test_a_jinja_file_is_the_template(tmp_path: Path) -> None:
    (tmp_path / "chat.jinja").write_text("{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}")
    assert load_chat_template(str(tmp_path / "chat.jinja")).render(QUESTION) == "USER: Which city is the capital of France?\n"


def test_raise_exception_in_the_template_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "chat.jinja").write_text(
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message must come first') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="a system message must come first"):
        load_chat_template(str(tmp_path / "chat.jinja")).render(QUESTION)


def test_sources_without_a_template_are_refused(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ChatTemplateError, match="has no chat_template"):
        load_chat_template(str(tmp_path / "tokenizer_config.json"))
    with pytest.raises(ChatTemplateError, match="is not a file"):
        load_chat_template(str(tmp_path / "missing.gguf"))
