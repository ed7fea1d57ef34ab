"""Tokenizers: byte level for the project's models, tokenizer.json through `tokenizers`."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from jaxspec.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return x  # é"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode("ab") + [300]) == "ab"  # ids past the byte range decode to nothing


@pytest.fixture
def hf_dir(tmp_path):
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "spec": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_tokenizer_json_is_used_when_present(hf_dir, tmp_path_factory):
    tok = load_tokenizer(hf_dir)
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello spec world") == [1, 3, 2]
    assert tok.decode([1, 2]) == "hello world"
    assert isinstance(load_tokenizer(tmp_path_factory.mktemp("bare")), ByteTokenizer)
