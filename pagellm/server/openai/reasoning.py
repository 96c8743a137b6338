"""A reasoning model's thinking taken out of its reply (``--reasoning-parser NAME``, vLLM's flag and names): chat
responses carry it as ``message.reasoning_content`` (streamed: ``delta.reasoning_content``) and the answer alone as
``content``.

- ``deepseek_r1`` (DeepSeek-R1 and its Qwen/Llama distills): the chat template opens ``<think>`` in the prompt, so
  the reply is thinking up to ``</think>`` (a ``<think>`` the model writes again at the start is dropped), then the
  answer; a reply with no ``</think>`` is all thinking (it was cut short).
- ``olmo3`` (OLMo 3 Think): as ``deepseek_r1``, its template opening ``<think>`` in the prompt (vLLM's parser
  splits a whole reply with no ``</think>`` as all answer but streams it as thinking; here both say thinking).
- ``granite`` (Granite 3.2 and 3.3 with ``chat_template_kwargs: {"thinking": true}``): a reply that opens with "Here
  is my thought process:" (or "Here's ...") thinks up to "Here is my response:" (or "Here's ..."), then answers; one
  that opens otherwise is all answer, as ``qwen3``. vLLM's ``granite`` parser splits alike, but a whole reply with no
  response phrase is all answer there (streamed, thinking) and it finds the phrases anywhere in a whole reply; here
  a reply cut short is thinking either way, and its block opens only at its start. A constraint and
  ``thinking_token_budget`` see the "Here is" phrases alone (token ids).
- ``qwen3`` (Qwen3, QwQ): the reply thinks only when it opens with ``<think>``; then it is thinking up to
  ``</think>`` (or to its end when cut short), then the answer. A reply that does not open with ``<think>`` (thinking
  turned off with ``chat_template_kwargs: {"enable_thinking": false}``, whose template closes the block in the
  prompt) is all answer.

Contract: ``ReasoningStream.feed(piece)`` returns ``(thinking, answer)`` text that can go out now; only text that
may still turn out to be a tag is held back (a partial ``<think>`` at the start, a partial ``</think>``), and the
whitespace between ``</think>`` and the answer is dropped. ``finish()`` returns what was held. ``split(text)`` is the
same over a whole reply, so a stream and a whole response say the same; the answer then goes through the tool-call
parser, if any. A prompt that ends in a closed block (``closed_in_prompt``: Qwen3 with thinking turned off) makes the
reply all answer, with either parser (``ReasoningStream(parser, closed=True)``).

Structured-output constraints (a tool choice, ``response_format``, a regex) wait for the reply's ``</think>``: the
server sets their ``begin_after`` to its token ids, so the model thinks freely and then answers in the schema, as
vLLM does; when the prompt already closed the block they apply from the first token.

A ``--reasoning-parser-plugin`` file (vLLM's flag) adds parsers for other tags: ``register_reasoning_parser("name",
start="[THINK]", end="[/THINK]")`` (``thinks_by_default``: the template opens the block, as with deepseek_r1), then
named by ``--reasoning-parser``.
"""

from __future__ import annotations

from typing import Optional

from pagellm.plugins import run_file
from pagellm.thinking import END, PARSERS, START, ReasoningParser, get_reasoning_parser, register_reasoning_parser

__all__ = ["END", "PARSERS", "START", "ReasoningParser", "ReasoningStream", "closed_in_prompt", "get_reasoning_parser",
           "load_plugin", "register_reasoning_parser"]


def load_plugin(path: str) -> None:
    """Run a ``--reasoning-parser-plugin`` file (once per process), which calls ``register_reasoning_parser``."""
    run_file(path, "--reasoning-parser-plugin")


def _partial_tail(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``tag``."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0


def closed_in_prompt(prompt_tail: str, end: str = END) -> bool:
    """Whether a rendered prompt (its last characters) ends in a closed think block: the reply is then all answer."""
    return prompt_tail.rstrip().endswith(end)


class ReasoningStream:
    """One choice's reply as it arrives: thinking, then the answer (see the module doc)."""

    def __init__(self, parser: str, closed: bool = False) -> None:
        tags = get_reasoning_parser(parser)
        self.starts, self.ends, self.thinks_by_default = tags.starts, tags.ends, tags.thinks_by_default
        # start → thinking → gap (whitespace after </think>) → answer; a prompt that closed the block: answer
        self.state = "answer" if closed else "start"
        self.held = ""

    def feed(self, piece: str) -> tuple[str, str]:
        self.held += piece
        thinking = answer = ""
        while self.held:
            if self.state == "start":
                head = self.held.lstrip()
                if not head or any(start.startswith(head) and head != start for start in self.starts):
                    break  # may still become <think>
                opened = next((start for start in self.starts if head.startswith(start)), "")
                self.held = head[len(opened):] if opened else self.held
                self.state = "thinking" if opened or self.thinks_by_default else "answer"
            elif self.state == "thinking":
                ends = [(at, end) for end in self.ends if (at := self.held.find(end)) >= 0]
                if not ends:
                    cut = len(self.held) - max(_partial_tail(self.held, end) for end in self.ends)
                    thinking, self.held = thinking + self.held[:cut], self.held[cut:]
                    break
                at, end = min(ends)
                thinking, self.held, self.state = thinking + self.held[:at], self.held[at + len(end):], "gap"
            elif self.state == "gap":
                self.held = self.held.lstrip()
                self.state = "answer" if self.held else "gap"
            else:
                answer, self.held = answer + self.held, ""
        return thinking, answer

    def finish(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        if self.state == "thinking" or (self.state == "start" and self.thinks_by_default):
            return held, ""
        return "", held if self.state != "gap" else ""

    def split(self, text: str) -> tuple[Optional[str], str]:
        """A whole reply's thinking (None when it has none) and its answer."""
        thinking, answer = self.feed(text)
        more_thinking, more_answer = self.finish()
        return (thinking + more_thinking) or None, answer + more_answer
