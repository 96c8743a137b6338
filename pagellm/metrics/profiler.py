"""Torch profiler sessions of a worker's process, started and stopped on request, and the engine's named spans.

``Profiler(out_dir)`` wraps ``torch.profiler.profile`` (CPU activity; on a CUDA machine the GPU's too).
``start()`` begins recording every op the process runs; ``stop()`` ends it and writes two files into ``out_dir``:
``pagellm-<pid>-<n>.pt.trace.json.gz``, a Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing),
and ``pagellm-<pid>-<n>.summary.txt``, the ops and spans ranked by their own CPU time. A second ``start`` while
recording, or a ``stop`` with nothing recording, changes nothing and says so (``False`` / no paths): plain data
for the frontend to answer with, not an exception in the engine's loop.

The native kernels are ctypes calls the profiler cannot see as ops, so the engine marks the parts of a step with
``span(name)`` (``pagellm::schedule``, ``pagellm::forward``, ``pagellm::sample``, ...): a ``record_function`` while
a session records, a shared no-op context otherwise (a step pays a few attribute loads for them).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import ContextManager

import torch

logger = logging.getLogger(__name__)

_NO_SPAN = contextlib.nullcontext()
_recording = 0  # sessions recording in this process


def span(name: str) -> ContextManager[object]:
    """A named range in the profile (``pagellm::<name>``) while one is recorded; nothing otherwise."""
    if not _recording:
        return _NO_SPAN
    return torch.profiler.record_function(f"pagellm::{name}")


class Profiler:
    def __init__(self, out_dir: str, with_stack: bool = False) -> None:
        self.out_dir = Path(out_dir)
        self.with_stack = with_stack
        self._session: torch.profiler.profile | None = None
        self._count = 0

    @property
    def recording(self) -> bool:
        return self._session is not None

    def start(self) -> bool:
        """Begin a session; False (and nothing changes) when one is recording already."""
        global _recording
        if self._session is not None:
            return False
        self.out_dir.mkdir(parents=True, exist_ok=True)  # a folder that cannot be made fails here, not at stop
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        session = torch.profiler.profile(activities=activities, with_stack=self.with_stack)
        session.start()
        self._session = session
        _recording += 1
        logger.info("torch profiler recording (traces go to %s)", self.out_dir)
        return True

    def stop(self) -> list[str]:
        """End the session and write its trace and summary; their paths (none when nothing was recording)."""
        global _recording
        session, self._session = self._session, None
        if session is None:
            return []
        session.stop()
        _recording -= 1
        self._count += 1
        stem = self.out_dir / f"pagellm-{os.getpid()}-{self._count}"
        trace, summary = f"{stem}.pt.trace.json.gz", f"{stem}.summary.txt"
        session.export_chrome_trace(trace)
        table = session.key_averages().table(sort_by="self_cpu_time_total", row_limit=60, max_name_column_width=60)
        Path(summary).write_text(table + "\n")
        logger.info("torch profiler stopped: wrote %s and %s", trace, summary)
        return [trace, summary]
