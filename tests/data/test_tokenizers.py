from pathlib import Path

import pytest

from lightning_llmopt.data import ByteTokenizer, HFTokenizer, load_tokenizer

TEXTS = ["hello world", "déjà vu — naïve café", "日本語のテキスト", "emoji 🙂 and tabs\t\n", ""]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))  # reference: Python's own UTF-8 codec
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == text  # special tokens are dropped
    assert tok.encode_array(text).tolist() == ids


def test_byte_tokenizer_specials_and_errors() -> None:
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (258, 256, 257)
    assert tok.decode([0xC3]) == "\ufffd"  # truncated UTF-8 sequence is replaced, not raised
    with pytest.raises(ValueError, match="token id 300"):
        tok.decode([300])


def _train_wordlevel(tmp_path: Path, specials: list[str]) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", *specials])
    tokenizer.train_from_iterator(["the cat sat on the mat", "the dog ate the cat"], trainer=trainer)
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_hf_tokenizer_from_trained_tokenizer_json(tmp_path: Path) -> None:
    path = _train_wordlevel(tmp_path, ["<s>", "</s>"])
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(path))
    tok = HFTokenizer(path)
    assert tok.vocab_size == reference.get_vocab_size()
    assert tok.bos_id == reference.token_to_id("<s>")
    assert tok.eos_id == reference.token_to_id("</s>")
    ids = tok.encode("the cat sat")
    assert ids == [reference.token_to_id(w) for w in ("the", "cat", "sat")]
    assert tok.decode(ids) == "the cat sat"
    assert tok.encode_batch(["the dog", "mat"]) == [tok.encode("the dog"), tok.encode("mat")]


def test_hf_tokenizer_without_specials_and_gpt2_style_eos(tmp_path: Path) -> None:
    tok = HFTokenizer(_train_wordlevel(tmp_path, []))
    assert tok.bos_id is None and tok.eos_id is None
    gpt2_dir = tmp_path / "gpt2"
    gpt2_dir.mkdir()
    tok2 = HFTokenizer(_train_wordlevel(gpt2_dir, ["<|endoftext|>"]))
    assert tok2.bos_id is None
    assert tok2.eos_id == tok2._tokenizer.token_to_id("<|endoftext|>")


def test_load_tokenizer_specs(tmp_path: Path) -> None:
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    path = _train_wordlevel(tmp_path, ["</s>"])
    from_file = load_tokenizer(str(path))
    from_dir = load_tokenizer(str(tmp_path))
    assert isinstance(from_file, HFTokenizer) and isinstance(from_dir, HFTokenizer)
    assert from_dir.encode("the mat") == from_file.encode("the mat")


def test_load_tokenizer_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_tokenizer(str(missing))
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(FileNotFoundError, match="empty.*no tokenizer.json"):
        load_tokenizer(str(empty_dir))
