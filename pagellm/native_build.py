"""Compile a C++ source once per machine kind and source version into the user's cache, with no torch involved.

A build lives under ``envs.cache_dir()/kernels/<tag>/`` where the tag hashes the CPU's feature flags
(``-march=native`` code only runs on this CPU kind), the compiler flags, the source and the headers it may
include. A build is written to a temporary name and renamed into place, so concurrent processes never load a
half-written file; within a process, concurrent calls for one build compile it once (the others wait for it).
``start_in_background`` runs build calls on threads, so a cold start compiles its kernels side by side and beside
whatever else it does, and the first load of each kernel waits only for its own compile; ``stop_compiles`` ends
the runs in flight for a process on its way out. ``ops/build.py`` loads
the model kernels (plain C ABI, ctypes) from here; ``sched/native.py`` builds the scheduler's CPython extension the
same way (``kv/`` and ``sched/`` import no torch).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from pagellm import envs

logger = logging.getLogger(__name__)

_locks: dict[Path, threading.Lock] = {}  # one per build target: concurrent callers compile it once
_locks_guard = threading.Lock()
_background_slots = threading.BoundedSemaphore(os.cpu_count() or 1)  # compiles running in background at once
_running: dict[subprocess.Popen, Path] = {}  # compiler runs in flight, and the partial file each writes
_running_guard = threading.Lock()


def cpu_flags() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.machine()


def build_tag(source: Path, flags: Sequence[str], headers: Sequence[Path] = ()) -> str:
    """A short digest of the CPU flags, the compiler flags, the source, the given header folders' headers and the
    headers next to the source, to key builds by."""
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted({*(h for folder in headers for h in folder.glob("*.h")), *source.parent.glob("*.h")}):
        digest.update(header.read_bytes())
    return hashlib.sha256(f"{cpu_flags()}|{' '.join(flags)}|{digest.hexdigest()}".encode()).hexdigest()[:12]


def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    return cxx


def build(source: Path, flags: Sequence[str], filename: str, headers: Sequence[Path] = (),
          link: Sequence[str] = ()) -> Path:
    """The shared object built from ``source`` with ``flags`` (then ``link``, e.g. ``-lcrypto``), named ``filename``
    in its build folder; compiled now if this machine kind has no build of this version."""
    target = _target(source, flags, filename, headers, link)
    out_dir = target.parent
    if target.exists():
        return target
    with _locks_guard:
        lock = _locks.setdefault(target, threading.Lock())
    with lock:
        if target.exists():  # another thread of this process built it meanwhile
            return target
        _compile(source, flags, headers, link, out_dir, target)
    return target


def built(source: Path, flags: Sequence[str], filename: str, headers: Sequence[Path] = (),
          link: Sequence[str] = ()) -> bool:
    """Whether ``build`` would return at once: this machine kind has a build of this version. A build once found is
    remembered for the process (hashing the sources again costs about 0.3 ms, and a load may ask once a matrix)."""
    key = (envs.cache_dir(), source, tuple(flags), filename, tuple(headers), tuple(link))
    if key not in _found:
        if not _target(source, flags, filename, headers, link).exists():
            return False
        _found.add(key)
    return True


_found: set[tuple] = set()


def _target(source: Path, flags: Sequence[str], filename: str, headers: Sequence[Path],
            link: Sequence[str]) -> Path:
    """Where ``build`` puts this build: its folder keyed by ``build_tag``, in the cache."""
    return envs.cache_dir() / "kernels" / build_tag(source, [*flags, *link], headers) / filename


def start_in_background(builds: Sequence[Callable[[], object]]) -> None:
    """Run each of ``builds`` (calls that end in ``build``) on a daemon thread of its own, at most as many at a time
    as there are cores (over every call), in the given order. A failure is only logged at debug level: the kernel's
    own load builds again and reports."""

    def run(call: Callable[[], object]) -> None:
        with _background_slots:
            try:
                call()
            except Exception as exc:  # noqa: BLE001  (reported by the foreground build that follows)
                logger.debug("background build failed: %s", exc)

    for call in builds:
        threading.Thread(target=run, args=(call,), daemon=True, name="pagellm-build").start()


def stop_compiles() -> None:
    """Kill the compiler runs still in flight and remove their partial files: for a process that exits while
    background builds run (the engine core stopped during a cold start), so no compiler outlives it."""
    with _running_guard:
        running = list(_running.items())
    for proc, partial in running:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # done meanwhile
            pass
        proc.wait()
        partial.unlink(missing_ok=True)


def _compile(source: Path, flags: Sequence[str], headers: Sequence[Path], link: Sequence[str], out_dir: Path,
             target: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.NamedTemporaryFile(dir=out_dir, suffix=".so.tmp", delete=False) as tmp:
        partial = Path(tmp.name)
    argv = [compiler(), *flags, *(f"-I{h}" for h in headers), str(source), "-o", str(partial), *link]
    try:
        # A session of its own, so stop_compiles can end the driver and the compiler it runs (cc1plus, as) alike.
        with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) as proc:
            with _running_guard:
                _running[proc] = partial
            try:
                _, stderr = proc.communicate()
            finally:
                with _running_guard:
                    _running.pop(proc, None)
        if proc.returncode != 0:
            raise RuntimeError(f"building {source.name} failed:\n{stderr[-2000:]}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    logger.info("built %s in %.1fs", target, time.perf_counter() - start)
