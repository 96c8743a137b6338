"""Process helpers for tests that start engine cores and worker processes: a process's descendants (from
``/proc``), without multiprocessing's resource trackers, and which still run."""

from __future__ import annotations

from pathlib import Path


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``."""
    found, todo = set(), [pid]
    while todo:
        current = todo.pop()
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                children = [int(p) for p in (task / "children").read_text().split()]
            except OSError:
                continue
            found.update(children)
            todo.extend(children)
    return found


def without_trackers(pids: set[int]) -> set[int]:
    """Without multiprocessing's resource trackers."""
    return {p for p in pids if b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()}


def alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` that still run (not gone, not zombies)."""
    return {pid for pid in pids if Path(f"/proc/{pid}").exists()
            and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]}
