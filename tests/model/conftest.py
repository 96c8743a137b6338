"""Fixtures shared by the model tests."""

from __future__ import annotations

import pytest
from tiny_gguf import train_tiny_tokenizer
from tokenizers import Tokenizer as BackendTokenizer


@pytest.fixture(scope="module")
def tiny_tokenizer() -> BackendTokenizer:
    return train_tiny_tokenizer()
