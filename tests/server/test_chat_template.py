"""A checkpoint's chat template (transformers' conventions) and the model source a ServeConfig
resolves to: explicit checkpoint, explicit preset, or the shipped QA model."""

from __future__ import annotations

import json

import pytest

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


def test_model_source(tmp_path, monkeypatch):
    import redknot_jax.server.state as state

    assert model_source(ServeConfig(checkpoint="/x")) == ("/x", None)
    assert model_source(ServeConfig(preset="tiny")) == (None, "tiny")
    monkeypatch.setattr(state, "SHIPPED_MODEL", tmp_path)  # a package without the trained model
    assert model_source(ServeConfig()) == (None, "tiny")
    (tmp_path / "config.json").write_text("{}")  # ... and with it: the default
    assert model_source(ServeConfig()) == (str(tmp_path), None)
    with pytest.raises(ValueError, match="give one of them"):
        ServeConfig(checkpoint="/x", preset="tiny")


def test_checkpoint_profile_and_template(tmp_path):
    """A checkpoint directory written by the QA trainer: `--profile auto` takes its
    redknot_profile.json, chat requests its chat template."""
    from redknot_jax.init import random_model
    from redknot_jax.quality.model_config import profile_of, qa_profile, qa_test_config
    from redknot_jax.quality.train import save_checkpoint, write_serving_files
    from redknot_jax.reuse.profile import named

    def make_profile(name, cfg, ckpt):  # as the server's build_state resolves --profile
        return named(name, cfg.num_layers, f"{ckpt}/{PROFILE_FILE}")

    cfg = qa_test_config()
    save_checkpoint(random_model(cfg, seed=0), tmp_path)
    write_serving_files(tmp_path)
    assert (tmp_path / PROFILE_FILE).is_file()
    assert make_profile("auto", cfg, str(tmp_path)) == qa_profile(cfg.num_layers, cfg.sliding_window)
    # a checkpoint's own profile is what the server and eval_quality.py use (profile_of); without
    # the file, qa_profile for its shape
    own = qa_profile(cfg.num_layers, cfg.sliding_window, fence_first=2, fence_last=1)
    (tmp_path / PROFILE_FILE).write_text(json.dumps(own.to_dict()))
    assert profile_of(tmp_path) == make_profile("auto", cfg, str(tmp_path)) == own
    (tmp_path / PROFILE_FILE).unlink()
    assert profile_of(tmp_path) == qa_profile(cfg.num_layers, cfg.sliding_window)
    assert make_profile("tiny", cfg, str(tmp_path)).name.startswith("tiny")
    prompt = chat_prompt([{"role": "user", "content": "question : where does ka lo live ?"}],
                         load_chat_template(str(tmp_path)))
    assert prompt == "question : where does ka lo live ? answer :"
