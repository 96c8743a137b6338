"""Waiting queues: FCFS (arrival order, preempted requests back at the front) and priority (lowest
``(priority, arrival_time)`` first). Both expose the same small interface; pick one with ``make_queue``.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Iterator, Protocol

from pagellm.request import Request


class RequestQueue(Protocol):
    def add(self, request: Request) -> None: ...
    def add_front(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    def __init__(self) -> None:
        self._items: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._items.append(request)

    def add_front(self, request: Request) -> None:
        self._items.appendleft(request)

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        return self._items.popleft()

    def remove(self, request: Request) -> None:
        self._items.remove(request)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)


class PriorityQueue:
    """Lower ``priority`` first, then earlier arrival; ties broken by insertion order."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._counter), request))

    def add_front(self, request: Request) -> None:
        self.add(request)  # its key already decides its place

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap))


def make_queue(policy: str) -> RequestQueue:
    queues: dict[str, type] = {"fcfs": FCFSQueue, "priority": PriorityQueue}
    if policy not in queues:
        raise ValueError(f"unknown scheduling policy {policy!r}; supported: {', '.join(queues)}")
    return queues[policy]()
