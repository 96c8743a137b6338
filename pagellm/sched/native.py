"""The scheduler's native fast path (``csrc/fastpath.cpp``, a CPython extension), built on first use like the
model kernels (``pagellm/native_build.py``) and loaded as a module; ``None`` where it cannot be built (no compiler,
no OpenSSL headers), and then the scheduler takes its numpy and Python paths, which are also the fast path's test
oracle. Set ``PAGELLM_NATIVE_SCHEDULER=0`` to take those paths anyway. No torch here.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import logging
import sysconfig
from pathlib import Path
from types import ModuleType

from pagellm import envs
from pagellm.kv.block import KVBlock
from pagellm.native_build import build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "fastpath.cpp"
NAME = "pagellm_sched_fastpath"
FLAGS = ["-O2", "-fPIC", "-shared", "-std=c++17", "-fno-strict-aliasing", "-Wno-deprecated-declarations"]


def build_extension() -> Path:
    """The extension's file, compiled now if this machine kind has no build of this version (``fastpath`` loads
    it; the engine core also calls this early on a background thread, ``EngineCore``)."""
    include = sysconfig.get_paths()["include"]  # in the flags, so in the build's key (not hashed file by file)
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return build(SOURCE, [*FLAGS, f"-I{include}"], NAME + suffix, link=["-lcrypto"])


@functools.lru_cache(maxsize=1)
def fastpath() -> ModuleType | None:
    """The extension module (bound to ``KVBlock``), or ``None`` when it is switched off or does not build."""
    if not envs.native_scheduler():
        return None
    try:
        path = build_extension()
        spec = importlib.util.spec_from_file_location(NAME, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (RuntimeError, OSError, ImportError) as exc:
        logger.warning("native scheduler fast path unavailable (%s); using the Python paths", exc)
        return None
    module.bind(KVBlock)
    return module
