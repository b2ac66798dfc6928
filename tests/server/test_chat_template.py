"""A checkpoint's chat template (transformers' conventions) and the model source a ServeConfig
resolves to: explicit checkpoint, explicit preset, or the shipped QA model."""

from __future__ import annotations

import json

import pytest

from redknot_jax.quality import SHIPPED_MODEL
from redknot_jax.server.state import PROFILE_FILE, ServeConfig, model_source
from redknot_jax.server.tokenizer import chat_prompt, load_chat_template

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"


def test_template_sources(tmp_path):
    assert load_chat_template(None) is None and load_chat_template(str(tmp_path)) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    assert load_chat_template(str(tmp_path)) == TEMPLATE
    (tmp_path / "chat_template.jinja").write_text("{{ messages[-1]['content'] }}!")  # wins, as in transformers
    assert chat_prompt(MSGS, load_chat_template(str(tmp_path))) == "hi!"


def test_rendering_and_plain_layout():
    assert chat_prompt(MSGS, TEMPLATE) == "<system>be brief<user>hi<a>"
    assert chat_prompt(MSGS) == "system: be brief\nuser: hi\nassistant:"


def test_bad_templates(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "x", "template": "y"}]}))
    with pytest.raises(ValueError, match="chat_template must be a string"):
        load_chat_template(str(tmp_path))
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):  # sandboxed: no attribute escapes from a checkpoint's file
        chat_prompt(MSGS, "{{ messages.__class__.__mro__ }}")


def test_model_source():
    assert model_source(ServeConfig(checkpoint="/x")) == ("/x", None)
    assert model_source(ServeConfig(preset="tiny")) == (None, "tiny")
    assert model_source(ServeConfig()) == (str(SHIPPED_MODEL), None)
    assert (SHIPPED_MODEL / PROFILE_FILE).is_file() and (SHIPPED_MODEL / "chat_template.jinja").is_file()
    with pytest.raises(ValueError, match="give one of them"):
        ServeConfig(checkpoint="/x", preset="tiny")
