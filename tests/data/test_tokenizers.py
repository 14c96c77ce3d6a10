import json
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


# --------------------------------------------------------------------------- faithful to transformers' AutoTokenizer
# Three tokenizer folders in the layouts of Llama-3, Llama-2 and Qwen2 (tokenizer.json trained here with the
# `tokenizers` library on a few sentences; the config files with the keys those models ship), checked against
# transformers' AutoTokenizer on the same folder: ids with and without special tokens, BOS/EOS/stop ids and the
# rendered chat template (through transformers and through our jinja2 path).
CORPUS = [
    "the cat sat on the mat",
    "the dog ate the cat",
    "hello world, héllo wörld!",
    "def f(x): return x * 2",
    "Once upon a time there was a tiny model",
] * 5

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _bytelevel(specials):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def _llama3(folder: Path) -> Path:
    from tokenizers import processors

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = _bytelevel(specials)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                special_tokens=[("<|begin_of_text|>", bos)],
            ),
        ]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>",
                "chat_template": LLAMA3_TEMPLATE,
                "clean_up_tokenization_spaces": True,
                "model_max_length": 8192,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    (folder / "generation_config.json").write_text(
        json.dumps(
            {"bos_token_id": bos, "eos_token_id": [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")]}
        )
    )
    return folder


def _llama2(folder: Path) -> Path:
    """SentencePiece-style BPE as transformers writes Llama-2's: Metaspace, byte fallback over <0x00>..<0xFF>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200))
    learned = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for token in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "add_bos_token": True,
                "add_eos_token": False,
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": None,
                "chat_template": LLAMA2_TEMPLATE,
                "legacy": False,
                "tokenizer_class": "LlamaTokenizer",
                "clean_up_tokenization_spaces": False,
            }
        )
    )
    (folder / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "bos_token": {
                    "content": "<s>",
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                },
                "eos_token": {
                    "content": "</s>",
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                },
                "unk_token": {
                    "content": "<unk>",
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                },
            }
        )
    )
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return folder


# Qwen2's pre-tokenizer split (digits one by one), as its tokenizer.json and transformers' Qwen2Tokenizer have it.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _qwen2(folder: Path) -> Path:
    from tokenizers import Regex, normalizers, pre_tokenizers, processors

    tok = _bytelevel(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHATML_TEMPLATE,
                "add_prefix_space": False,
                "errors": "replace",
                "split_special_tokens": False,
                "tokenizer_class": "Qwen2Tokenizer",
                "model_max_length": 32768,
            }
        )
    )
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": eot, "eos_token_id": [im_end, eot], "pad_token_id": eot})
    )
    return folder


MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "the cat sat"},
    {"role": "user", "content": "def f(x): héllo 🙂"},
]
FOLDERS = {"llama3": _llama3, "llama2": _llama2, "qwen2": _qwen2}


@pytest.mark.parametrize("style", sorted(FOLDERS))
def test_hf_tokenizer_matches_auto_tokenizer(style: str, tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    folder = FOLDERS[style](tmp_path / style)
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    tok = load_tokenizer(folder)
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id)
    generation = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    assert set(tok.stop_ids) == {ref.eos_token_id, *(generation if isinstance(generation, list) else [generation])}
    assert tok.stop_ids[0] == ref.eos_token_id
    for text in ["hello world", " the cat", "héllo\n x 🙂", "<|im_end|> [INST] x", "x * 2 = 42;\n\n  y", ""]:
        assert tok.encode(text, add_special_tokens=True) == ref.encode(text), text
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(ref.encode(text)) == ref.decode(ref.encode(text)), text
    for gen in (False, True):
        want = ref.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=False)
        want_ids = ref.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=True)
        want_ids = want_ids["input_ids"] if isinstance(want_ids, dict) or hasattr(want_ids, "keys") else want_ids
        assert tok.apply_chat_template(MESSAGES, add_generation_prompt=gen) == want
        assert tok.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=True) == want_ids
        tok._auto = None
        tok._auto_tokenizer = lambda: None  # type: ignore[method-assign]  # the path without transformers
        assert tok.apply_chat_template(MESSAGES, add_generation_prompt=gen) == want
        assert tok.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=True) == want_ids
        del tok._auto_tokenizer


def test_chat_template_errors_and_missing_template(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    tok = HFTokenizer(_llama2(tmp_path / "l2"))
    tok._auto_tokenizer = lambda: None  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    bare = HFTokenizer(_train_wordlevel(tmp_path, ["</s>"]))
    with pytest.raises(ValueError, match="has no chat template"):
        bare.apply_chat_template(MESSAGES)


def test_byte_tokenizer_saved_folder_loads_in_auto_tokenizer(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    byte = ByteTokenizer()
    byte.save_pretrained(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = load_tokenizer(tmp_path)
    for text in TEXTS:
        assert ref.encode(text) == byte.encode(text) == ours.encode(text, add_special_tokens=True), text
        assert ref.decode(byte.encode(text)) == text
    assert (ref.bos_token_id, ref.eos_token_id) == (ours.bos_id, ours.eos_id) == (byte.bos_id, byte.eos_id)
    assert ref.convert_ids_to_tokens([256, 257]) == ["<bos>", "<eos>"]


def test_hf_tokenizer_save_pretrained_copies_the_folder(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    tok = HFTokenizer(_qwen2(tmp_path / "src"))
    written = tok.save_pretrained(tmp_path / "out")
    assert {p.name for p in written} == {"tokenizer.json", "tokenizer_config.json"}
    again = load_tokenizer(tmp_path / "out")
    assert again.encode("hello world") == tok.encode("hello world")
    assert (again.eos_id, again.pad_id) == (tok.eos_id, tok.pad_id)
