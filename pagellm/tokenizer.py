"""The text side of a model: encode, decode and chat templates, as the frontend needs them.

Contract: ``Tokenizer.from_dir(model_dir)`` wraps transformers' fast tokenizer for a local Hugging Face-style
directory (``loader.resolve_model_dir`` makes one from any model source), so encoding and chat templates behave
exactly as transformers does. ``backend`` exposes the underlying ``tokenizers.Tokenizer`` for incremental
detokenization (``tokenizers.decoders.DecodeStream``). ``eos_token_ids`` is every id that ends a reply: the union
of generation_config.json's and config.json's ``eos_token_id`` and the tokenizer's eos token.

Bad chat input (no template, empty or malformed messages, a template that rejects them) raises ``ValueError``.
``chat_template`` can be replaced (``pagellm serve --chat-template``, ``LLM.chat(chat_template=...)``) with a
template ``load_chat_template`` read and checked.
No torch here, and transformers is imported only inside ``from_dir``, so importing this module is cheap. A
directory whose ``tokenizer_config.json`` declares the generic fast tokenizer (what the GGUF converter writes and
``PreTrainedTokenizerFast.save_pretrained`` records) of a Llama or Mistral model is loaded with that class
directly: it is the tokenizer ``AutoTokenizer`` builds there (``tests/model/test_tokenizer.py`` holds the two equal
for every served model type), and ``AutoTokenizer``'s model registry imports torch, over a second of the server's
start-up. Everything else goes through ``AutoTokenizer``.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagellm.chat_content import format_messages

if TYPE_CHECKING:
    import tokenizers
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class Tokenizer:
    """A model's tokenizer: ids in and out, chat rendering, and the special ids the engine needs."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, eos_token_ids: frozenset[int]) -> None:
        self._hf = hf_tokenizer
        self.eos_token_ids: frozenset[int] = eos_token_ids
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.vocab_size: int = len(hf_tokenizer)
        self.chat_template: str | None = _default_template(hf_tokenizer.chat_template)
        # How messages' content reaches the template (chat_content.py): auto, string or openai
        self.content_format = "auto"

    def info(self) -> dict[str, Any]:
        """What a client needs to tokenize as the server does (vLLM's ``GET /tokenizer_info``): the tokenizer's class,
        special tokens, added tokens, vocabulary size and chat template."""
        hf = self._hf
        added = {str(i): {"content": t.content, "special": t.special} for i, t in hf.added_tokens_decoder.items()}
        special = {name: getattr(hf, name, None) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return {"tokenizer_class": type(hf).__name__, **{k: v if isinstance(v, str) or v is None else str(v)
                                                          for k, v in special.items()},
                "eos_token_ids": sorted(self.eos_token_ids), "vocab_size": self.vocab_size,
                "chat_template": self.chat_template, "added_tokens_decoder": added}

    @classmethod
    def from_dir(cls, model_dir: Path, config_dir: Path | None = None) -> Tokenizer:
        """Load the tokenizer files of a local model directory (never the hub). EOS ids: the tokenizer's, and those
        of the config.json and generation_config.json in ``model_dir`` and in ``config_dir`` (the model's folder,
        when the tokenizer is another's)."""
        model_dir = Path(model_dir)
        if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
            raise ValueError(
                f"{model_dir} has no tokenizer files (tokenizer.json / tokenizer_config.json); "
                "pass a model directory that includes its tokenizer, or another folder's with --tokenizer DIR"
            )
        if _declares_generic_fast(model_dir):
            from transformers import PreTrainedTokenizerFast

            hf_tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir), local_files_only=True)
        else:
            from transformers import AutoTokenizer

            hf_tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        if not hf_tokenizer.is_fast:
            raise ValueError(f"{model_dir}: only fast (tokenizer.json) tokenizers are supported; add tokenizer.json")
        if not hf_tokenizer.chat_template:  # a vision-language model's processor may hold it (llava-hf's do)
            hf_tokenizer.chat_template = _processor_template(model_dir)
        eos_ids = _config_eos_ids(model_dir) | (_config_eos_ids(Path(config_dir)) if config_dir is not None else set())
        if hf_tokenizer.eos_token_id is not None:
            eos_ids.add(int(hf_tokenizer.eos_token_id))
        return cls(hf_tokenizer, frozenset(eos_ids))

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token of the vocabulary (added tokens too) stands for: text longer than
        ``max_model_len`` times this cannot fit, whatever it tokenizes to."""
        return max(map(len, self._hf.get_vocab()), default=1)

    @property
    def hf(self) -> PreTrainedTokenizerBase:
        """The Hugging Face tokenizer itself (``LLM.get_tokenizer``)."""
        return self._hf

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (for ``DecodeStream`` incremental detokenization)."""
        return self._hf.backend_tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the model expects (e.g. BOS). ValueError for text
        that is not Unicode (a lone surrogate, which JSON's ``\\ud800`` escapes can carry)."""
        try:
            return list(self._hf.encode(text, add_special_tokens=add_special_tokens))
        except TypeError:
            _refuse_surrogates(text)
            raise

    def encode_pair(self, first: str, second: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text pair as the tokenizer joins two sequences (its pair template: what a cross-encoder
        was trained on)."""
        try:
            return list(self._hf(first, second, add_special_tokens=add_special_tokens)["input_ids"])
        except TypeError:
            _refuse_surrogates(first)
            _refuse_surrogates(second)
            raise

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        content_format: str | None = None,
        image_placeholder: str | None = None,
    ) -> str:
        """The prompt text the chat template (``chat_template``, else the tokenizer's) makes of ``messages``
        (OpenAI-style ``{"role", "content"}`` dicts, content a string or a list of text parts, given to the template
        in the form ``content_format`` names, else ``self.content_format``: ``chat_content.py``; image parts as
        ``image_placeholder`` says, a vision-language model's);
        ``continue_final_message`` leaves the last message open (its end-of-turn markup cut), so that the model
        continues it."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(
                "this model has no chat template; send a plain prompt (completions) instead of messages, "
                "or give one (pagellm serve --chat-template FILE, LLM.chat(chat_template=...))"
            )
        _check_messages(messages)
        messages = format_messages(messages, template, content_format or self.content_format, image_placeholder)
        from jinja2 import TemplateError

        try:
            return self._hf.apply_chat_template(
                messages,
                tokenize=False,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )
        except TemplateError as error:  # templates reject bad conversations with raise_exception(...)
            raise ValueError(f"the chat template rejected the messages: {error}") from error

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        content_format: str | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat prompt."""
        text = self.render_chat(messages, add_generation_prompt, chat_template_kwargs, chat_template,
                                continue_final_message, content_format)
        # The template already writes every special token the model wants (BOS included), as transformers'
        # own apply_chat_template assumes; adding them again would double the BOS (unless a request asks).
        return self.encode(text, add_special_tokens=add_special_tokens)


# The generic fast tokenizer's names (transformers 5 calls it TokenizersBackend, PreTrainedTokenizerFast its alias),
# and the served model types for which AutoTokenizer keeps it (for qwen2 it builds Qwen2Tokenizer instead).
_GENERIC_FAST = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
_GENERIC_FAST_MODEL_TYPES = frozenset({"llama", "mistral"})


NO_TOKENIZER = ("this engine runs without a tokenizer (skip_tokenizer_init, --skip-tokenizer-init): send prompts as "
                "token ids, and take the output's token ids (return_token_ids); text, chat, stop strings, bad words, "
                "structured outputs and thinking budgets need a tokenizer")


class NoTokenizer:
    """The engine's tokenizer when it runs without one (``skip_tokenizer_init``, vLLM's flag, for a frontend that
    tokenizes itself, e.g. a router in front of several engines): the EOS and BOS ids of the model's configs, and
    ``ValueError(NO_TOKENIZER)`` for anything that needs text. A token decodes to no text (``backend``)."""

    chat_template: str | None = None
    vocab_size = 0

    def __init__(self, eos_token_ids: frozenset[int], bos_token_id: int | None) -> None:
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id

    def info(self) -> dict[str, Any]:
        return {"tokenizer_class": None, "eos_token_ids": sorted(self.eos_token_ids), "chat_template": None}

    @classmethod
    def from_dir(cls, model_dir: Path) -> NoTokenizer:
        model_dir = Path(model_dir)
        try:
            config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            config = {}
        bos = config.get("bos_token_id") if isinstance(config, dict) else None
        return cls(frozenset(_config_eos_ids(model_dir)), bos if isinstance(bos, int) else None)

    @property
    def max_token_chars(self) -> int:
        raise ValueError(NO_TOKENIZER)

    @property
    def hf(self) -> Any:
        raise ValueError(NO_TOKENIZER)

    @property
    def backend(self) -> _NoText:
        return _NO_TEXT

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise ValueError(NO_TOKENIZER)

    def encode_pair(self, first: str, second: str, add_special_tokens: bool = True) -> list[int]:
        raise ValueError(NO_TOKENIZER)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        raise ValueError(NO_TOKENIZER)

    def render_chat(self, *args: Any, **kwargs: Any) -> str:
        raise ValueError(NO_TOKENIZER)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> list[int]:
        raise ValueError(NO_TOKENIZER)


class _NoText:
    """Token texts without a tokenizer: none (logprobs then name tokens by id: ``return_tokens_as_token_ids``)."""

    @staticmethod
    def decode(ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ""


_NO_TEXT = _NoText()


def _declares_generic_fast(model_dir: Path) -> bool:
    """Whether ``AutoTokenizer`` would build the generic fast tokenizer for ``model_dir``: its tokenizer config names
    it (and no custom code), and its model type has no tokenizer class of its own that AutoTokenizer prefers."""
    try:
        tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (isinstance(tokenizer_config, dict) and isinstance(config, dict)
            and tokenizer_config.get("tokenizer_class") in _GENERIC_FAST and "auto_map" not in tokenizer_config
            and config.get("model_type") in _GENERIC_FAST_MODEL_TYPES and (model_dir / "tokenizer.json").is_file())


def load_chat_template(value: str) -> str:
    """A chat template as ``--chat-template`` takes it: the file ``value`` names, else ``value`` itself when it is
    Jinja text; a ``ValueError`` when it is neither or does not parse."""
    if _is_file(value):
        text = Path(value).read_text(encoding="utf-8")
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"chat template {value!r}: no such file, and not a Jinja template either (no {{{{ or {{%)")
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:  # the environment transformers renders templates in
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except TemplateSyntaxError as exc:
        raise ValueError(f"chat template {value[:60]!r}: line {exc.lineno}: {exc.message}") from None
    return text


def _is_file(value: str) -> bool:
    try:
        return Path(value).is_file()
    except OSError:  # a template's text longer than a file name can be (ENAMETOOLONG) is no file
        return False


def _processor_template(model_dir: Path) -> str | None:
    """The chat template a processor saved beside the tokenizer (``chat_template.json``), which the tokenizer does not
    read (vLLM falls back to it too)."""
    path = model_dir / "chat_template.json"
    if not path.is_file():
        return None
    try:
        template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"{path} is not a processor's chat template ({{\"chat_template\": ...}}): {exc}") from None
    return template if isinstance(template, str) else None


def _default_template(template: str | dict[str, str] | None) -> str | None:
    # Some tokenizers carry several named templates (e.g. "default", "tool_use"); chat uses "default".
    if isinstance(template, dict):
        return template.get("default")
    return template or None


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for position, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{position}] must be a dict with a string 'role' (e.g. 'user'), got {message!r}")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(
                f"messages[{position}]['content'] must be a string or a list of content parts, "
                f"got {type(content).__name__}"
            )


def _config_eos_ids(model_dir: Path) -> set[int]:
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(item) for item in value)
    return ids


def _refuse_surrogates(text: Any) -> None:
    """ValueError naming the first lone surrogate in ``text`` (the tokenizers library takes only Unicode text and
    says no more than TypeError)."""
    if not isinstance(text, str):
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"the text holds a lone surrogate ({text[exc.start]!r}) at character {exc.start}, which is "
                         "not Unicode; send UTF-8 text (a JSON \\ud800-\\udfff escape must be one of a pair)") from None
