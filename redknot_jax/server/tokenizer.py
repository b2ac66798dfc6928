"""Tokenizers for the server: a checkpoint's `tokenizer.json` (HF `tokenizers`), or the
embedded tiny model's deterministic byte-level fallback.

The fallback is not a real tokenizer, only a stable text <-> id map so the embedded random
model can be served on a fresh machine: every UTF-8 byte b becomes id `(b - 32) % 95 + 2`
(ids 2..96; 0 and 1 stay BOS / EOS), and id i decodes to the printable ASCII character
`chr(i - 2 + 32)`. Printable ASCII (space to `~`) round-trips exactly; other bytes (newline,
tab, non-ASCII) fold onto printable characters and do not round-trip.
"""

from __future__ import annotations

import functools
import json
import pathlib
from typing import Protocol, Sequence


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """Byte-level fallback (see the module docstring); needs vocab_size >= 97."""

    name = "byte-fallback"
    N_SPECIAL = 2  # 0 = BOS, 1 = EOS

    def __init__(self, vocab_size: int):
        if vocab_size < 95 + self.N_SPECIAL:
            raise ValueError(f"ByteTokenizer: vocab_size must be >= 97, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [(b - 32) % 95 + self.N_SPECIAL for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i - self.N_SPECIAL + 32) for i in ids if self.N_SPECIAL <= i < 95 + self.N_SPECIAL)


class HFTokenizer:
    """A checkpoint directory's tokenizer.json through the `tokenizers` library."""

    def __init__(self, path: pathlib.Path):
        from tokenizers import Tokenizer as _T  # optional: only needed with a real checkpoint

        self._tok = _T.from_file(str(path))
        self.name = str(path)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(checkpoint_dir: str | None, vocab_size: int) -> Tokenizer:
    """tokenizer.json of the checkpoint when present, else the byte fallback."""
    if checkpoint_dir:
        p = pathlib.Path(checkpoint_dir) / "tokenizer.json"
        if p.is_file():
            return HFTokenizer(p)
    return ByteTokenizer(vocab_size)


def load_chat_template(checkpoint_dir: str | None) -> str | None:
    """The checkpoint's chat template (transformers' conventions): `chat_template.jinja`, else
    the `chat_template` string of `tokenizer_config.json`; None when it has neither."""
    if not checkpoint_dir:
        return None
    d = pathlib.Path(checkpoint_dir)
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text()
    cfg = d / "tokenizer_config.json"
    if cfg.is_file():
        t = json.loads(cfg.read_text()).get("chat_template")
        if t is not None and not isinstance(t, str):
            raise ValueError(f"{cfg}: chat_template must be a string (named templates are not supported)")
        return t
    return None


def chat_prompt(messages: list[dict], template: str | None = None) -> str:
    """The prompt text of a chat request. With the checkpoint's Jinja template: rendered in a
    sandbox as transformers does (`messages`, `add_generation_prompt=True`). Without one: a
    plain, documented layout (one "role: content" line per message, then "assistant:")."""
    if template is None:
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return "\n".join(lines + ["assistant:"])
    return _compiled(template).render(messages=messages, add_generation_prompt=True)


@functools.lru_cache(maxsize=4)
def _compiled(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)
