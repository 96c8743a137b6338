"""Scoring text pairs by the cosine similarity of their embeddings (a bi-encoder's score), shared by ``LLM.score``
and the server's ``/score`` and ``/rerank``: vLLM's rule for pairing two inputs, and each distinct text embedded once.

- ``pair_texts(text_1, text_2)``: each a string or a list of strings; one and one is one pair, one and N pairs the
  one with each of the N, N and N pairs them index by index; anything else raises ``ValueError`` saying what to send.
- ``distinct(pairs)``: the texts to embed, each once, and every pair as two positions among them.
- ``cosine(a, b)``: the similarity of two L2-normalised embeddings.
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np

Texts = Union[str, Sequence[str]]


def pair_texts(first: Texts, second: Texts) -> list[tuple[str, str]]:
    ones = [first] if isinstance(first, str) else list(first)
    twos = [second] if isinstance(second, str) else list(second)
    if not ones or not twos:
        raise ValueError("text_1 and text_2 must not be empty")
    if len(ones) == 1:
        return [(ones[0], two) for two in twos]
    if len(ones) != len(twos):
        raise ValueError(f"text_1 has {len(ones)} texts and text_2 {len(twos)}: give one text_1, or as many as text_2 "
                         "(they are paired index by index)")
    return list(zip(ones, twos))


def distinct(pairs: Sequence[tuple[str, str]]) -> tuple[list[str], list[tuple[int, int]]]:
    texts = list(dict.fromkeys(text for pair in pairs for text in pair))
    position = {text: i for i, text in enumerate(texts)}
    return texts, [(position[a], position[b]) for a, b in pairs]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    return float(np.asarray(a, dtype=np.float64) @ np.asarray(b, dtype=np.float64))
