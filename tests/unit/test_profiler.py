"""metrics/profiler.py: a torch profiler session's files, its named spans, and start/stop said twice."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import torch

from pagellm.metrics import profiler
from pagellm.metrics.profiler import Profiler, span


def test_a_session_writes_a_chrome_trace_and_a_summary_with_the_spans(tmp_path: Path) -> None:
    prof = Profiler(str(tmp_path / "traces"))  # made on start
    assert span("forward") is span("sample")  # nothing records: one shared no-op context
    assert prof.start() and prof.recording
    with span("forward"):
        torch.ones(64, 64) @ torch.ones(64, 64)
    files = prof.stop()
    assert not prof.recording and span("forward") is span("sample")
    trace, summary = map(Path, files)
    assert trace.name.endswith(".pt.trace.json.gz") and trace.parent == tmp_path / "traces"
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = {event.get("name") for event in events}
    assert "pagellm::forward" in names and "aten::mm" in names
    table = summary.read_text()
    assert "pagellm::forward" in table and "Self CPU" in table


def test_start_twice_and_stop_without_a_session_change_nothing(tmp_path: Path) -> None:
    prof = Profiler(str(tmp_path))
    assert prof.stop() == []
    assert prof.start() and not prof.start()
    first = prof.stop()
    assert len(first) == 2 and prof.stop() == []
    assert prof.start()
    second = prof.stop()
    assert set(first).isdisjoint(second) and all(Path(f).exists() for f in first + second)  # numbered, not overwritten
    assert profiler._recording == 0
