"""Frontend input side: prompts (text or token ids) and chat messages become validated ``EngineCoreRequest``s.

Besides the prompt it finishes the sampling parameters that need the tokenizer or the vocabulary: token ids
(``logit_bias``, ``allowed_token_ids``, ``stop_token_ids``) are checked against the vocabulary, and
``logprobs``/``prompt_logprobs`` against the engine's ``max_logprobs``, ``bad_words`` are
tokenized into ``bad_words_token_ids`` (each word as written and with a leading space, as it appears mid-text),
a thinking budget gets the engine's thinking tags as token ids (``pagellm/thinking.py``), and a structured-output
constraint is parsed so that a bad schema, regex or grammar is a ``ValueError`` here,
before anything reaches the core.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any, Sequence, Union

import msgspec

from pagellm import images
from pagellm.chat_content import EmbedsSource
from pagellm.engine.wire import EngineCoreRequest
from pagellm.multimodal import MultiModalInputs, is_tensor
from pagellm.lora import LoRARequest, check_adapter
from pagellm.mm_config import MultiModalConfig
from pagellm.prompt_embeds import PromptEmbeds, from_tensor
from pagellm.request import caller_salt_part
from pagellm.sampling_params import MAX_LOGPROBS, SamplingParams
from pagellm.thinking import NO_CONFIG, ReasoningConfig, ThinkingMarkers
from pagellm.tokenizer import NO_TOKENIZER, NoTokenizer, Tokenizer

# Text, token ids, input embeddings, or vLLM's dict forms of them ({"prompt": ...}, {"prompt_token_ids": ...},
# {"prompt_embeds": tensor}).
PromptType = Union[str, Sequence[int], PromptEmbeds, dict]
_PROMPT_KEYS = ("prompt", "prompt_token_ids", "prompt_embeds")
MM_EMBEDS_OFF = "image embeddings need --enable-mm-embeds (LLM(enable_mm_embeds=True)), as vLLM's do"
EMBEDS_OFF = ("this engine takes no prompt embeddings; start it with enable_prompt_embeds=True "
              "(--enable-prompt-embeds)")


CLASSIFY_ONLY = ("this model is a sequence classifier (a score head, no language-model head): it serves classify "
                 "requests only (LLM.classify, POST /classify), not generation or embeddings")
POOLING_ONLY = ("this model runs with no language-model head: it serves embeddings only (an embedding checkpoint, "
                "or --runner pooling / --convert embed: LLM.embed, POST /v1/embeddings), not generation")


def load_tokenizer(model_config: Any, model_dir: Path) -> Tokenizer:
    """The model's tokenizer, or the one of ``model_config.tokenizer`` (vLLM's ``--tokenizer``), whose ids must fit
    the model's vocabulary; EOS ids come from both folders' configs."""
    if model_config.skip_tokenizer_init:
        return NoTokenizer.from_dir(model_dir)  # type: ignore[return-value]
    folder = model_config.tokenizer_dir(model_dir)
    tokenizer = Tokenizer.from_dir(folder, config_dir=model_dir)
    if folder != model_dir:
        from pagellm.model.loader import load_hf_config

        hf_config = {**load_hf_config(model_dir), **(model_config.hf_overrides or {})}
        vocab_size = hf_config.get("vocab_size") or hf_config.get("text_config", {}).get("vocab_size")
        if vocab_size is not None and tokenizer.vocab_size > vocab_size:
            raise ValueError(f"tokenizer {folder} has {tokenizer.vocab_size} tokens, more than the model's "
                             f"vocabulary of {vocab_size}: it is not this model's tokenizer")
    return tokenizer


def lora_arch(config: Any, model_dir: Any) -> Any:
    """The model's ``ArchConfig`` when ``config`` enables LoRA (adapters are checked against it), else None. Imported
    here only then: the architecture module pulls in torch, which a frontend otherwise never loads."""
    if not config.model_config.enable_lora:
        return None
    from pagellm.model.arch import ArchConfig
    from pagellm.model.loader import load_hf_config

    return ArchConfig.from_hf({**load_hf_config(model_dir), **(config.model_config.hf_overrides or {})})


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int, pooling_only: bool = False,
                 lora_arch: Any = None, max_logprobs: int = MAX_LOGPROBS, classifier: bool = False,
                 hidden_size: int = 0, enable_prompt_embeds: bool = False,
                 logits_processors: Sequence[str] = (), logprobs_mode: str = "raw_logprobs",
                 max_lora_rank: int | None = None, reasoning: ReasoningConfig | None = None,
                 model_dir: Path | None = None, image_token_id: int | None = None,
                 multimodal: MultiModalConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.mm = multimodal or MultiModalConfig()  # images per prompt, the processor's defaults, image embeddings
        self.model_dir = model_dir
        self.image_token_id = image_token_id  # a vision-language model's: it takes images (``multimodal.py``)
        self._images: Any = None  # its ImageProcessor, made at the first prompt with images
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs  # the most logprobs per token a request may ask for
        self.pooling_only = pooling_only  # a model without an LM head: embedding requests only ...
        self.classifier = classifier  # ... or, a sequence classifier, classify requests only
        self.lora_arch = lora_arch  # the model's ArchConfig when LoRA is enabled (adapters are checked against it)
        self._adapters: set[LoRARequest] = set()  # checked already
        self.hidden_size = hidden_size  # an embeddings prompt's row width
        self.enable_prompt_embeds = enable_prompt_embeds
        self.logprobs_mode = logprobs_mode  # the engine's default of what logprobs carry
        self.max_lora_rank = max_lora_rank  # adapters of a higher rank are refused
        self.custom_processors: list[Any] = []  # custom logits processors' classes, to validate requests with
        self.reasoning = reasoning or ReasoningConfig()  # the thinking tags a thinking_token_budget counts by
        self._markers: ThinkingMarkers | None = None  # their token ids, once a request asks
        if logits_processors:
            from pagellm.sample.custom import resolve  # torch, only for an engine that has custom processors

            self.custom_processors = [resolve(name) for name in logits_processors]

    @classmethod
    def for_engine(cls, tokenizer: Tokenizer, runtime: Any, config: Any, model_dir: Path) -> InputProcessor:
        """The input processor of an engine of ``config`` that started with ``runtime`` (its ``RuntimeInfo``)."""
        model_config = config.model_config
        return cls(tokenizer, runtime.max_model_len, runtime.vocab_size, runtime.pooling_only,
                   lora_arch(config, model_dir), model_config.logprobs_cap(runtime.vocab_size),
                   classifier=bool(runtime.labels), hidden_size=runtime.hidden_size,
                   enable_prompt_embeds=model_config.enable_prompt_embeds,
                   logits_processors=model_config.logits_processors, logprobs_mode=model_config.logprobs_mode,
                   max_lora_rank=model_config.max_lora_rank, reasoning=config.reasoning_config,
                   model_dir=model_dir, image_token_id=runtime.image_token_id,
                   multimodal=config.multimodal_config)

    def tokenize(self, prompt: PromptType) -> list[int]:
        prompt = as_prompt(prompt)
        if isinstance(prompt, PromptEmbeds):
            raise ValueError("this call takes text or token-id prompts, not prompt embeddings")
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("a prompt must be a string or a list of integer token ids")
        return list(prompt)

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
                cache_salt: str | None = None) -> EngineCoreRequest:
        prompt = as_prompt(prompt)
        keep, side = self.kept_tokens(params.truncate_prompt_tokens), params.truncation_side
        embeds = prompt if isinstance(prompt, PromptEmbeds) else None
        if embeds is not None and keep is not None:
            embeds = embeds.first(keep) if side == "right" else embeds.last(keep)
        images = None
        if isinstance(prompt, (ImagePrompt, ImageTokens)):
            if keep is not None:
                raise ValueError("truncate_prompt_tokens cannot cut a prompt with images (an image's tokens go "
                                 "whole); shorten its text instead")
            prompt = prompt if isinstance(prompt, ImageTokens) else self.process_images(prompt, prompt.images,
                                                                                        kwargs=prompt.kwargs)
            token_ids, images = list(prompt), prompt.inputs
        else:
            token_ids = cut(self.tokenize(prompt), keep, side) if embeds is None else self.check_embeds(embeds,
                                                                                                      params)
        check_prompt(token_ids, self.max_model_len, self.vocab_size)
        params = self.prepare_params(params)
        # The caller's salt (length-prefixed, so that no other part can pass for it or for another caller's) ...
        salts = [] if cache_salt is None else [caller_salt_part(cache_salt)]
        if params.prompt_logprobs is not None:
            # ... every prompt position must be computed to score it: a unique salt makes prefix-cache hits impossible
            salts.append(f"prompt-logprobs-{uuid.uuid4().hex}")
        if params.lora_request is not None:  # ... KV computed under an adapter is its own
            salts.append(params.lora_request.cache_salt)
        if embeds is not None:  # ... and so is KV computed from embeddings (its token ids are placeholders)
            salts.append(f"embeds-{embeds.digest()}")
        if images is not None:  # ... or from images (their tokens are placeholders too)
            salts.append(f"images-{images.digest}")
        return EngineCoreRequest(request_id, token_ids, params, sorted(self.tokenizer.eos_token_ids), time.time(),
                                 priority, "/".join(salts) or None, embeds, images)

    def process_images(self, text: str, images: list[Any], add_special_tokens: bool = True,
                       kwargs: dict[str, Any] | None = None) -> ImageTokens:
        """Text with one image placeholder per image, and the images, through the model's processor: the prompt's
        token ids (each placeholder expanded into the model's image tokens; special tokens added as a text prompt
        gets them, not for a rendered chat, whose template writes its own) and the encoder's inputs; ``kwargs`` go to
        the processor over ``mm_processor_kwargs`` (vLLM's per-request ``mm_processor_kwargs``)."""
        cap = self.mm.max_images
        if cap is not None and len(images) > cap:
            raise ValueError(f"the prompt has {len(images)} images; this engine takes at most {cap} per prompt "
                             "(--limit-mm-per-prompt)")
        if not self.mm.enable_mm_embeds and any(is_tensor(image) or isinstance(image, dict) for image in images):
            raise ValueError(MM_EMBEDS_OFF)
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError(f"mm_processor_kwargs must be an object of the processor's keyword arguments, e.g. "
                             f"{{\"do_image_splitting\": false}}; got {kwargs!r}")
        return ImageTokens(*self._processor().process(text, images, add_special_tokens,
                                                       {**(self.mm.mm_processor_kwargs or {}), **(kwargs or {})}))

    def process_chat_images(self, text: str, urls: list[str], fetched: dict[str, bytes],
                            kwargs: dict[str, Any] | None = None) -> ImageTokens:
        """A rendered chat's text and its image parts' URLs (``images.load``: data URLs, and the http(s) ones
        ``fetched`` holds): ``process_images`` with no special tokens added (the template wrote its own)."""
        if not self.mm.enable_mm_embeds and any(isinstance(url, EmbedsSource) for url in urls):  # not even read
            raise ValueError(MM_EMBEDS_OFF)
        return self.process_images(text, [images.load(url, fetched) for url in urls], False, kwargs)

    @property
    def image_placeholder(self) -> str | None:
        """What a prompt writes where an image goes (the processor's, e.g. ``<image>``); None: this model takes no
        images."""
        return None if self.image_token_id is None else self._processor().image_token

    def _processor(self) -> Any:
        if self.image_token_id is None:
            raise ValueError("this model takes no images; serve a vision-language model (SmolVLM, LLaVA, Gemma 3), "
                             "without --language-model-only, for them")
        if self._images is None:
            from pagellm.multimodal import ImageProcessor  # transformers' processors, only for images

            self._images = ImageProcessor(self.model_dir, self.image_token_id)  # type: ignore[arg-type]
        return self._images

    def kept_tokens(self, truncate: int | None) -> int | None:
        """How many of a prompt's last tokens ``truncate_prompt_tokens`` keeps (None: all of them)."""
        keep = self.max_model_len if truncate == -1 else truncate
        if keep is not None and keep > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens ({keep}) must be at most max_model_len ({self.max_model_len})")
        return keep

    def with_logprobs_mode(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the engine's ``logprobs_mode`` where the request chose none; best_of ranks candidates by
        their logprobs, so it refuses the logits modes."""
        if params.logprobs_mode is None and not params.processed_logprobs and self.logprobs_mode != "raw_logprobs":
            params = msgspec.structs.replace(params, logprobs_mode=self.logprobs_mode)
        if params.values_mode.endswith("_logits") and params.best_of is not None and params.best_of > params.n:
            raise ValueError(f"best_of > n ranks candidates by their logprobs; logprobs_mode {params.values_mode} "
                             "returns logits (use a logprobs mode, or best_of = n)")
        return params

    def check_custom(self, params: SamplingParams) -> None:
        """Each custom logits processor's ``validate_params`` (a ValueError names what to fix)."""
        for processor in self.custom_processors:
            processor.validate_params(params)

    def check_embeds(self, embeds: PromptEmbeds, params: SamplingParams) -> list[int]:
        """An embeddings prompt's placeholder token ids (zeros, one per row), once this engine can run it."""
        if not self.enable_prompt_embeds:
            raise ValueError(EMBEDS_OFF)
        if embeds.hidden_size != self.hidden_size:
            raise ValueError(f"prompt_embeds rows have {embeds.hidden_size} values but this model's hidden size is "
                             f"{self.hidden_size}")
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs needs the prompt's tokens; an embeddings prompt has none")
        return [0] * embeds.num_tokens

    def check_adapter(self, request: LoRARequest) -> None:
        """Raise ValueError unless this engine can run ``request``'s adapter (checked once per adapter)."""
        if self.lora_arch is None:
            raise ValueError("this engine serves no LoRA adapters; start it with enable_lora=True (--enable-lora)")
        if request not in self._adapters:
            check_adapter(request, self.lora_arch, self.max_lora_rank)
            self._adapters.add(request)

    def thinking_markers(self) -> ThinkingMarkers:
        """The engine's thinking tags as token ids (tokenized on the first request with a thinking budget: a
        parser a server plugin registers is known by then)."""
        if self._markers is None:
            markers = self.reasoning.markers(lambda text: self.tokenizer.encode(text, add_special_tokens=False))
            if markers is None:
                raise ValueError(NO_CONFIG)
            self._markers = markers
        return self._markers

    def prepare_params(self, params: SamplingParams) -> SamplingParams:
        """Check token ids and the structured-output constraint; tokenize bad words and thinking tags (ValueError
        names the fix)."""
        if self.pooling_only and not params.pooling:
            raise ValueError(CLASSIFY_ONLY if self.classifier else POOLING_ONLY)
        if params.lora_request is not None:
            self.check_adapter(params.lora_request)
        params.check_token_ids(self.vocab_size)
        params.check_logprobs(self.max_logprobs)
        self.check_custom(params)
        params = self.with_logprobs_mode(params)
        if isinstance(self.tokenizer, NoTokenizer):
            if params.stop_strings or params.bad_words or params.structured_outputs is not None \
                    or params.thinking_token_budget is not None:
                raise ValueError(NO_TOKENIZER)
            params = msgspec.structs.replace(params, detokenize=False)
        if params.structured_outputs is not None:
            from pagellm.sample.structured import validate  # xgrammar loads only when a request needs it

            validate(params.structured_outputs)
        if params.bad_words and params.bad_words_token_ids is None:
            words: list[list[int]] = []
            for word in params.bad_words:
                for variant in (word, " " + word.lstrip()):
                    ids = self.tokenizer.encode(variant, add_special_tokens=False)
                    if ids and ids not in words:
                        words.append(ids)
            params = msgspec.structs.replace(params, bad_words_token_ids=words)
        if params.thinking_token_budget is not None and params.thinking_markers is None:
            params = msgspec.structs.replace(params, thinking_markers=self.thinking_markers())
        return params


def cut(token_ids: list[int], keep: int | None, side: str | None = None) -> list[int]:
    """``token_ids`` truncated to ``keep`` tokens (None: all of them): the last ones (``side`` "left", the default,
    as vLLM's tokenizers cut) or the first ("right"). The list itself when nothing is cut."""
    if keep is None or keep >= len(token_ids):
        return token_ids
    return token_ids[:keep] if side == "right" else token_ids[len(token_ids) - keep:]


class ImagePrompt(str):
    """A text prompt with images (vLLM's ``{"prompt": text, "multi_modal_data": {"image": ...}}``): the text, one
    image placeholder per image, with its images beside it (PIL images, as the model's processor takes them, or a
    LLaVA model's image embeddings: a [rows, hidden] tensor an image, or [images, rows, hidden])."""

    images: list[Any]
    kwargs: dict[str, Any] | None  # its ``mm_processor_kwargs``

    def __new__(cls, text: str, images: Any, kwargs: dict[str, Any] | None = None) -> ImagePrompt:
        prompt = super().__new__(cls, text)
        stacked = is_tensor(images, 3)  # embeddings, [images, rows, hidden]
        prompt.images = list(images) if isinstance(images, (list, tuple)) or stacked else [images]
        prompt.kwargs = kwargs
        return prompt


class ImageTokens(list):
    """A prompt's token ids with its images processed already (``InputProcessor.process_images``: the chat server
    counts and checks them before queuing): the engine takes both as they are."""

    inputs: MultiModalInputs

    def __init__(self, token_ids: list[int], inputs: MultiModalInputs) -> None:
        super().__init__(token_ids)
        self.inputs = inputs


def as_prompt(prompt: PromptType) -> Union[str, Sequence[int], PromptEmbeds]:
    """A prompt in one of vLLM's dict forms as its plain value (a tensor of embeddings as ``PromptEmbeds``, text
    with images as ``ImagePrompt``)."""
    if not isinstance(prompt, dict):
        return prompt
    if "multi_modal_data" in prompt:
        data, text = prompt["multi_modal_data"], prompt.get("prompt")
        if not isinstance(data, dict) or set(data) != {"image"}:
            raise ValueError("multi_modal_data takes {'image': an image or a list of images} (PIL images, or a "
                             "LLaVA model's image embeddings: tensors of [rows, hidden size])")
        if not {"prompt", "multi_modal_data"} <= set(prompt) <= {"prompt", "multi_modal_data", "mm_processor_kwargs"} \
                or not isinstance(text, str):
            raise ValueError("a prompt with multi_modal_data is {'prompt': text with one image placeholder per "
                             "image, 'multi_modal_data': {'image': ...}} (and optionally 'mm_processor_kwargs')")
        return ImagePrompt(text, data["image"], prompt.get("mm_processor_kwargs"))
    keys = [key for key in _PROMPT_KEYS if key in prompt]
    if len(keys) != 1 or len(prompt) != 1:
        raise ValueError(f"a dict prompt takes exactly one of the keys {', '.join(_PROMPT_KEYS)}; got "
                         f"{', '.join(map(str, prompt)) or 'none'}")
    value = prompt[keys[0]]
    if keys[0] == "prompt_embeds":
        return value if isinstance(value, PromptEmbeds) else from_tensor(value)
    if keys[0] == "prompt" and not isinstance(value, str):
        raise ValueError("a {\"prompt\": ...} prompt must be a string")
    return value


def check_prompt(token_ids: Sequence[int], max_model_len: int, vocab_size: int) -> None:
    """Raise ValueError naming the fix when a tokenized prompt cannot be served."""
    if not token_ids:
        raise ValueError("the prompt is empty; send at least one token")
    if len(token_ids) >= max_model_len:
        raise ValueError(f"the prompt has {len(token_ids)} tokens but max_model_len is {max_model_len}; "
                         f"shorten it to at most {max_model_len - 1} tokens")
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}); got {min(token_ids)}..{max(token_ids)}")
