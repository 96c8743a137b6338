"""Fixtures shared by the model tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_gguf import train_tiny_tokenizer
from tokenizers import Tokenizer as BackendTokenizer

from pagellm.model.loader import resolve_model_dir


@pytest.fixture(scope="module")
def tiny_tokenizer() -> BackendTokenizer:
    return train_tiny_tokenizer()


@pytest.fixture(scope="module")
def default_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in GGUF converted into a cache root shared by the session, so it is converted once."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGELLM_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "pagellm-cache"))
        return resolve_model_dir(None)
