"""pagellm/native_build.py: concurrent requests for one build compile it once, background builds serve later loads,
a failed background build leaves the error to the foreground call, and stop_compiles ends the runs in flight."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import pytest

from pagellm import native_build

FLAGS = ["-O1", "-fPIC", "-shared"]


@pytest.fixture()
def compiles(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[list[str]]:
    """A fresh build cache, and the compiler runs made from here on (each slowed so that callers overlap)."""
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    runs: list[list[str]] = []
    real = subprocess.Popen

    def counting(argv: list[str], **kwargs: object) -> subprocess.Popen:
        runs.append(argv)
        threading.Event().wait(0.3)
        return real(argv, **kwargs)

    monkeypatch.setattr(native_build.subprocess, "Popen", counting)
    return runs


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's reaper may be slow, or absent, in a container)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


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


def test_built_says_whether_a_load_would_wait_for_a_compile(compiles: list[list[str]], tmp_path: Path) -> None:
    """The cold-start load asks before it uses a library: no build yet (its twin runs), then the build, remembered."""
    src = source(tmp_path)
    assert not native_build.built(src, FLAGS, "kernel.so") and not compiles
    target = native_build.build(src, FLAGS, "kernel.so")
    assert native_build.built(src, FLAGS, "kernel.so") and len(compiles) == 1
    target.unlink()  # remembered for the process: no second hash of the sources per matrix of a load
    assert native_build.built(src, FLAGS, "kernel.so")


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


def test_stop_compiles_ends_the_compiler_and_its_children(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # An engine core stopped during a cold start must not leave compilers running (nor their partial files).
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    marker = tmp_path / "pids"
    slow = tmp_path / "slow-c++"
    slow.write_text(f"#!/bin/sh\nsleep 60 &\necho $$ $! > {marker}\nwait\n")  # a driver with a child, as c++ is
    slow.chmod(0o755)
    monkeypatch.setenv("CXX", str(slow))
    src, failures = source(tmp_path), []

    def build() -> None:
        try:
            native_build.build(src, FLAGS, "kernel.so")
        except RuntimeError as exc:
            failures.append(exc)

    builder = threading.Thread(target=build)
    builder.start()
    deadline = time.monotonic() + 10
    while not (marker.exists() and len(marker.read_text().split()) == 2 and native_build._running) \
            and time.monotonic() < deadline:  # the driver runs, and its build has registered it (under load, later)
        time.sleep(0.02)
    pids = [int(pid) for pid in marker.read_text().split()]
    native_build.stop_compiles()
    builder.join(10)
    assert not builder.is_alive() and len(failures) == 1  # the build that was cut short reports it
    deadline = time.monotonic() + 10  # SIGKILL is sent to the whole group; an orphan dies when next scheduled
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(running(pid) for pid in pids)
    assert not list((tmp_path / "cache").rglob("*.so.tmp")) and not list((tmp_path / "cache").rglob("*.so"))
