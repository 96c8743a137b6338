"""The frontend's Tokenizer: the built-in SmolLM2 tokenizer against transformers' own GGUF tokenizer, chat
templates, eos/bos ids, incremental detokenization and the errors users see."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from pagellm.config import ModelConfig
from pagellm.engine.input_processor import load_tokenizer
from pagellm.model.loader import default_model_path
from pagellm.tokenizer import Tokenizer

SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
TEXTS = [
    "Hello, world!",
    "def f(x):\n    return x**2  # square\n\tpass",
    "Pi is 3.14159; today is 2024-05-17, call 555-0100 x12345678.",
    "  leading spaces, trailing spaces   ",
    "naïve café 日本語 emoji 🤗👍🏽 Ελληνικά Привет",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><file_sep><repo_name>pagellm<filename>a.py",
    "I'm sure they'll say we've done it, can't they?",
    "",
    "\n\n\n",
]
# Non-ASCII numerals: the one place transformers' GGUF tokenizer (which ignores llama.cpp's "smollm" pre-type)
# and SmolLM2's real tokenizer (every \p{N} character split off first) disagree.
NON_ASCII_NUMERALS = "１２３ ٣٤ Ⅻ"


@pytest.fixture(scope="module")
def smollm(default_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_dir)


@pytest.fixture(scope="module")
def reference() -> Any:
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


def test_encodes_like_transformers_gguf_tokenizer(smollm: Tokenizer, reference: Any) -> None:
    for text in TEXTS:
        for add_special in (True, False):
            assert smollm.encode(text, add_special) == reference.encode(text, add_special_tokens=add_special), text
    assert smollm.encode("<|im_start|>") == [1]  # control tokens stay whole; add_bos_token is false


def test_every_numeral_is_its_own_token(smollm: Tokenizer, reference: Any) -> None:
    assert [smollm.decode([i]) for i in smollm.encode(" 2024")] == [" ", "2", "0", "2", "4"]
    fixed = BackendTokenizer.from_str(reference.backend_tokenizer.to_str())
    fixed.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    ours = smollm.encode(NON_ASCII_NUMERALS)
    assert ours == fixed.encode(NON_ASCII_NUMERALS).ids  # the same vocabulary and merges, digits split first
    assert ours != reference.encode(NON_ASCII_NUMERALS)  # the gap this pre-tokenizer fix closes


def test_decode_round_trip(smollm: Tokenizer) -> None:
    for text in TEXTS:
        ids = smollm.encode(text)
        assert smollm.decode(ids, skip_special_tokens=False) == text
    assert smollm.decode(smollm.encode("<|im_start|>user\nHi<|im_end|>")) == "user\nHi"


def test_backend_supports_incremental_detokenization(smollm: Tokenizer) -> None:
    text = "naïve café 🤗 says: x**2 == 4\n"
    stream = decoders.DecodeStream(skip_special_tokens=True)
    pieces = [stream.step(smollm.backend, token_id) for token_id in smollm.encode(text)]
    assert "".join(piece for piece in pieces if piece) == text


def test_chat_template(smollm: Tokenizer, reference: Any) -> None:
    messages = [{"role": "user", "content": "What is 2+2?"}]
    text = smollm.render_chat(messages)
    assert text.startswith(f"<|im_start|>system\n{SMOLLM_SYSTEM}<|im_end|>\n")
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert text == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = smollm.apply_chat_template(messages)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2
    assert not smollm.render_chat(messages, add_generation_prompt=False).endswith("assistant\n")
    own_system = smollm.render_chat([{"role": "system", "content": "Be brief."}, *messages])
    assert SMOLLM_SYSTEM not in own_system and own_system.startswith("<|im_start|>system\nBe brief.")


def test_special_ids(smollm: Tokenizer) -> None:
    assert 2 in smollm.eos_token_ids
    assert smollm.bos_token_id == 1
    assert smollm.vocab_size == 49152
    assert smollm.chat_template is not None and "<|im_start|>" in smollm.chat_template


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        ([{"content": "hi"}], r"messages\[0\] must be a dict with a string 'role'"),
        (["hi"], r"messages\[0\] must be a dict"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\['content'\] must be a string"),
    ],
)
def test_malformed_messages(smollm: Tokenizer, messages: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        smollm.apply_chat_template(messages)


# ---------------------------------------------------------------------------------------------- tiny dirs


def write_tiny_dir(path: Path, chat_template: str | None = None) -> Path:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<eot>": 3, "<eom>": 4, "hello": 5, "world": 6}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<unk>", "<s>", "</s>", "<eot>", "<eom>"])
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "bos_token": "<s>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "config.json").write_text(json.dumps({"eos_token_id": 3}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    return path


def test_eos_ids_are_the_union_of_all_sources(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_dir(write_tiny_dir(tmp_path))
    assert tokenizer.eos_token_ids == frozenset({2, 3, 4})
    assert tokenizer.bos_token_id == 1 and tokenizer.vocab_size == 7
    assert tokenizer.encode("hello world", add_special_tokens=False) == [5, 6]


def test_no_chat_template(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_dir(write_tiny_dir(tmp_path))
    assert tokenizer.chat_template is None
    with pytest.raises(ValueError, match="no chat template.*plain prompt"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])


def test_a_processors_chat_template_serves_where_the_tokenizer_has_none(tmp_path: Path) -> None:
    """llava-hf's checkpoints keep their template in the processor's chat_template.json; the tokenizer's own wins."""
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "USER: {{ messages[0]['content'] }}"}))
    assert Tokenizer.from_dir(write_tiny_dir(tmp_path)).render_chat([{"role": "user", "content": "hi"}]) == "USER: hi"
    assert Tokenizer.from_dir(write_tiny_dir(tmp_path, "own")).render_chat([{"role": "user", "content": "hi"}]) == \
        "own"


def test_template_rejection_is_a_value_error(tmp_path: Path) -> None:
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('start with a user turn') }}{% endif %}x"
    tokenizer = Tokenizer.from_dir(write_tiny_dir(tmp_path, template))
    assert tokenizer.render_chat([{"role": "user", "content": "hello"}]) == "x"
    with pytest.raises(ValueError, match="start with a user turn"):
        tokenizer.render_chat([{"role": "assistant", "content": "hello"}])


def test_directory_without_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no tokenizer files"):
        Tokenizer.from_dir(tmp_path)


def test_another_folders_tokenizer_with_the_models_eos_ids(tmp_path: Path) -> None:
    tokenizer_dir = write_tiny_dir(tmp_path / "tokenizer")  # EOS 2 (the tokenizer's), 3 and 4 (its configs')
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": 7, "eos_token_id": 5}))
    with pytest.raises(ValueError, match="no tokenizer files.*--tokenizer DIR"):
        load_tokenizer(ModelConfig(model=str(model_dir)), model_dir)
    tokenizer = load_tokenizer(ModelConfig(model=str(model_dir), tokenizer=str(tokenizer_dir)), model_dir)
    assert tokenizer.eos_token_ids == frozenset({2, 3, 4, 5})
    assert tokenizer.encode("hello world", add_special_tokens=False) == [5, 6]


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path: Path) -> None:
    tokenizer_dir = write_tiny_dir(tmp_path / "tokenizer")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": 6}))
    with pytest.raises(ValueError, match="has 7 tokens, more than the model's vocabulary of 6"):
        load_tokenizer(ModelConfig(model=str(model_dir), tokenizer=str(tokenizer_dir)), model_dir)
    config = ModelConfig(model=str(model_dir), tokenizer=str(tokenizer_dir), hf_overrides={"vocab_size": 7})
    assert load_tokenizer(config, model_dir).vocab_size == 7
    with pytest.raises(ValueError, match="is not a directory holding tokenizer.json or tokenizer_config.json"):
        ModelConfig(tokenizer=str(model_dir))


def test_import_is_cheap() -> None:
    # Measured against the package itself, which other modules may make heavier: this module adds neither.
    code = (
        "import sys, pagellm; before = set(sys.modules); import pagellm.tokenizer; "
        "print(sorted({m.split('.')[0] for m in set(sys.modules) - before} & {'torch', 'transformers'}))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_generic_fast_tokenizer_is_what_auto_tokenizer_builds(tiny_model_factory: Any, arch: str) -> None:
    # from_dir loads a declared generic fast tokenizer without AutoTokenizer (whose registry imports torch) where
    # AutoTokenizer would build that class too: either way it must be the very tokenizer AutoTokenizer makes of the
    # directory, for every model type pagellm serves (qwen2 gets Qwen2Tokenizer from both).
    from transformers import AutoTokenizer

    model_dir = tiny_model_factory(arch)
    ours, auto = Tokenizer.from_dir(model_dir)._hf, AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    assert type(ours) is type(auto)
    assert ours.init_kwargs == auto.init_kwargs and len(ours) == len(auto)
    for text in TEXTS:
        assert ours.encode(text) == auto.encode(text)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert ours.apply_chat_template(messages, tokenize=False) == auto.apply_chat_template(messages, tokenize=False)


def test_default_model_tokenizer_is_what_auto_tokenizer_builds(smollm: Tokenizer, default_dir: Path) -> None:
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(default_dir), local_files_only=True)
    assert type(smollm._hf) is type(auto) and smollm._hf.init_kwargs == auto.init_kwargs
    for text in TEXTS:
        assert smollm.encode(text) == auto.encode(text)


def test_default_model_tokenizer_loads_without_torch(smollm: Tokenizer, default_dir: Path) -> None:
    # The server's frontend loads this while the engine core starts: torch's import would be a second of start-up.
    code = ("import sys; from pathlib import Path; from pagellm.tokenizer import Tokenizer; "
            f"print(Tokenizer.from_dir(Path({str(default_dir)!r})).encode('Hello, world!'), 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == f"{smollm.encode('Hello, world!')} False"
