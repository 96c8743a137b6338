"""pagellm/native_build.py: concurrent requests for one build compile it once, background builds serve later loads,
and a failed background build leaves the error to the foreground call."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest

from pagellm import native_build

FLAGS = ["-O1", "-fPIC", "-shared"]


@pytest.fixture()
def compiles(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[list[str]]:
    """A fresh build cache, and the compiler runs made from here on (each slowed so that callers overlap)."""
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    runs: list[list[str]] = []
    real = subprocess.run

    def counting(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        runs.append(argv)
        threading.Event().wait(0.3)
        return real(argv, **kwargs)

    monkeypatch.setattr(native_build.subprocess, "run", counting)
    return runs


def source(tmp_path: Path, body: str = "int answer() { return 42; }") -> Path:
    path = tmp_path / "kernel.cpp"
    path.write_text(f'extern "C" {body}\n')
    return path


def test_concurrent_builds_compile_once(compiles: list[list[str]], tmp_path: Path) -> None:
    src, paths = source(tmp_path), []
    threads = [threading.Thread(target=lambda: paths.append(native_build.build(src, FLAGS, "kernel.so")))
               for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(compiles) == 1 and len(set(paths)) == 1 and paths[0].is_file()


def test_a_background_build_serves_the_later_load(compiles: list[list[str]], tmp_path: Path) -> None:
    src = source(tmp_path)
    native_build.start_in_background([lambda: native_build.build(src, FLAGS, "kernel.so")])
    path = native_build.build(src, FLAGS, "kernel.so")  # waits for the background compile instead of its own
    assert len(compiles) == 1 and path.is_file()


def test_a_failed_background_build_is_reported_by_the_foreground_one(compiles: list[list[str]],
                                                                      tmp_path: Path) -> None:
    src = source(tmp_path, "int broken( { return 1; }")
    native_build.start_in_background([lambda: native_build.build(src, FLAGS, "kernel.so")])
    with pytest.raises(RuntimeError, match="building kernel.cpp failed"):
        native_build.build(src, FLAGS, "kernel.so")
