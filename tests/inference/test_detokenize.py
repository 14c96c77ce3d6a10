"""Incremental detokenisation, stop strings across token boundaries, and the inference package's import order."""

from __future__ import annotations

import ast
import pathlib

import pytest

import lightning_llmopt.inference as inference
from lightning_llmopt.data.tokenizers import ByteTokenizer
from lightning_llmopt.inference import LLMEngine, SamplingParams
from lightning_llmopt.inference.detokenize import TextState

TEXT = "naïve café: 1€ = 😀 ok"


def _stream(state: TextState, tokens: list[int]) -> list[str]:
    pieces = []
    for i, t in enumerate(tokens):
        stopped = state.add(t)
        last = stopped or i == len(tokens) - 1
        if last:
            state.flush()
        piece = state.take(last)
        assert piece is not None
        pieces.append(piece)
        if stopped:
            break
    return pieces


def test_streamed_text_never_splits_a_character():
    tok = ByteTokenizer()
    tokens = tok.encode(TEXT)  # 2-, 3- and 4-byte characters: one token per byte
    pieces = _stream(TextState(tok, tok.encode("prompt")), tokens)
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)
    assert len(pieces) == len(tokens) and pieces.count("") == len(tokens) - len(TEXT)


@pytest.mark.parametrize(
    ("stop", "expected"),
    [(("€ =",), "naïve café: 1"), (("é:", "ï"), "na"), (("😀",), "naïve café: 1€ = "), (("absent",), TEXT)],
)
def test_stop_strings_across_token_boundaries(stop, expected):
    tok = ByteTokenizer()
    state = TextState(tok, [], stop)
    pieces = _stream(state, tok.encode(TEXT))
    assert "".join(pieces) == expected == state.text
    assert state.stopped == (expected != TEXT)
    for s in stop:  # no piece ever showed a stop string's beginning that turned out to be the stop
        assert s not in "".join(pieces)


def test_held_back_prefix_is_released_when_it_is_not_a_stop():
    tok = ByteTokenizer()
    state = TextState(tok, [], ("abX",))
    assert [state.add(t) or state.take(False) for t in tok.encode("zab")] == ["z", "", ""]  # "ab" may begin "abX"
    state.add(tok.encode("c")[0])
    assert state.take(False) == "abc"


def test_engine_stop_strings_match_the_unstopped_text(model_factory, prompts_factory):
    """A stop string cuts the text where it first appears (across tokens) and ends the sequence there."""
    model = model_factory()
    tok = ByteTokenizer()
    engine = LLMEngine(model, tok, num_blocks=64, block_size=8)
    prompt = prompts_factory([9], 256, seed=5)[0]
    full = engine.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0].text
    assert full is not None
    start = next(i for i in range(2, len(full) - 2) if "\ufffd" not in full[i : i + 2])
    stop = full[start : start + 2]
    out = engine.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,)))[0]
    assert out.text == full[: full.index(stop)] and out.outputs[0].finish_reason == "stop"
    streamed = list(engine.stream([prompt], SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,))))
    assert "".join(ev.text or "" for ev in streamed) == out.text and streamed[-1].finish_reason == "stop"
    with pytest.raises(ValueError, match="need a tokenizer"):
        LLMEngine(model, num_blocks=64, block_size=8).add_request(prompt, SamplingParams(stop=("x",)))


def _imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_llmopt.inference."):
            out.add(node.module.removeprefix("lightning_llmopt.inference."))
    return out


def test_inference_imports_flow_one_way():
    """No import circle among the inference modules (type-only imports included), and nothing below the server
    imports it (CONVENTIONS rule 13)."""
    root = pathlib.Path(inference.__file__).parent
    graph = {}
    for path in root.rglob("*.py"):
        name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = {m for m in _imports(path) if m != name}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for dep in graph.get(node, ()):
            assert state.get(dep) != 1, f"import circle: {' -> '.join([*trail, dep])}"
            if dep not in state:
                visit(dep, [*trail, dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    for name, deps in graph.items():
        if not name.startswith("serving"):
            assert not any(d.startswith("serving") for d in deps), f"{name} imports the server"
    assert "engine" in graph["serving.async_engine"]


def test_generation_config_stop_ids_end_sequences(model_factory, prompts_factory, tmp_path):
    """A Hugging Face folder's generation_config.json eos_token_id list (Llama-3 instruct's <|eot_id|>) ends
    sequences like the EOS token, unless ignore_eos."""
    import json

    from lightning_llmopt.data.tokenizers import load_tokenizer

    model = model_factory()
    prompt = prompts_factory([7], 256, seed=6)[0]
    ByteTokenizer().save_pretrained(tmp_path)
    free = LLMEngine(model, load_tokenizer(tmp_path), num_blocks=64, block_size=8)
    tokens = free.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0].token_ids
    stop = tokens[4]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, stop]}))
    tok = load_tokenizer(tmp_path)
    assert stop in tok.stop_ids
    engine = LLMEngine(model, tok, num_blocks=64, block_size=8)
    out = engine.generate([prompt], SamplingParams(max_tokens=20))[0]
    assert out.token_ids == tokens[: tokens.index(stop)] and out.outputs[0].finish_reason == "stop"
    assert engine.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0].token_ids == tokens


def test_special_tokens_are_skipped_unless_asked(tmp_path):
    """A Hugging Face tokenizer's special tokens (here ``<bos>``, id 256) are left out of the incremental text by
    default and kept with ``skip_special_tokens=False``; either way the text equals the tokenizers library's own
    decode of the whole sequence, streamed or not."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    from lightning_llmopt.data.tokenizers import load_tokenizer

    ByteTokenizer().save_pretrained(tmp_path)
    tok, reference = load_tokenizer(tmp_path), Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    bos = ByteTokenizer.BOS_ID
    tokens = [*tok.encode("a é"), bos, *tok.encode("b"), bos, bos, *tok.encode("€")]  # specials between characters
    for skip, special in ((True, ""), (False, "<bos>")):
        state = TextState(tok, tok.encode("prompt"), skip_special_tokens=skip)
        pieces = _stream(state, tokens)
        expected = f"a é{special}b{special}{special}€"
        assert "".join(pieces) == expected == state.text == reference.decode(tokens, skip_special_tokens=skip)
        assert all("\ufffd" not in p for p in pieces)
    plain = TextState(ByteTokenizer(), [], skip_special_tokens=False)  # a decode without the argument: as it is
    assert "".join(_stream(plain, tokens)) == "a éb€"
