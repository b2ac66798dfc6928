"""Tokenizers for the server: a checkpoint's `tokenizer.json` (HF `tokenizers`), or the
embedded tiny model's deterministic byte-level fallback.

The fallback is not a real tokenizer, only a stable text <-> id map so the embedded random
model can be served on a fresh machine: every UTF-8 byte b becomes id `(b - 32) % 95 + 2`
(ids 2..96; 0 and 1 stay BOS / EOS), and id i decodes to the printable ASCII character
`chr(i - 2 + 32)`. Printable ASCII (space to `~`) round-trips exactly; other bytes (newline,
tab, non-ASCII) fold onto printable characters and do not round-trip.
"""

from __future__ import annotations

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


def chat_prompt(messages: list[dict]) -> str:
    """A plain, documented chat layout (not DeepSeek's template, which needs its special
    tokens): one "role: content" line per message, then "assistant:"."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines + ["assistant:"])
