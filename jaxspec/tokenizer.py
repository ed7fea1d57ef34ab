"""Tokenizers: byte-level for the project's own tiny models, `tokenizers` for tokenizer.json."""

import os


class ByteTokenizer:
    """Token id = UTF-8 byte value (ids >= 256 decode to nothing)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's tokenizer.json through the `tokenizers` package."""

    def __init__(self, path):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(os.fspath(path))
        except Exception as e:  # the tokenizers package raises a bare Exception
            raise ValueError(f"{path}: not a readable tokenizer.json ({e})") from None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def load_tokenizer(model_dir):
    """tokenizer.json of the directory if present, else byte level."""
    path = os.path.join(model_dir, "tokenizer.json")
    return HFTokenizer(path) if os.path.exists(path) else ByteTokenizer()
