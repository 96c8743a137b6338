"""The running requests in schedule order, with the counters the scheduler reads every step in numpy columns.

Row ``i`` is ``requests[i]``. The scheduler's two hot loops (handing out the token budget, taking in the sampled
tokens) run as a few numpy operations over these columns instead of a Python loop over request objects; only the
rows that need the KV manager or a stop rule come back to Python. While a request runs, its progress lives here
only: a request that is not running has computed nothing (preemption recomputes) and holds no KV slots.

Columns (int64; the first ``len(self)`` entries are the rows):

- ``computed``: num_computed_tokens (advanced when scheduled, rolled back by rejected drafts)
- ``num_tokens``: prompt + output tokens (``len(request.all_token_ids)``)
- ``num_spec``: draft tokens held (``len(request.spec_token_ids)``)
- ``kv_slots``: token slots in the request's KV blocks
- ``kv_next_full``: token count at which its next unregistered block fills (see ``KVCacheManager``)
- ``check_at``: num_tokens at which ``update_from_output`` must look at the request in Python: its first output
  token (``num_prompt + 1``) until it has one, then its ``length_limit`` (max_tokens or max_model_len reached)

``token_lists[i]`` is ``requests[i].all_token_ids`` (the same list object; a plain list beside ``requests``, so
removing a row moves pointers without touching the lists' reference counts). Rows keep their order; removing one
shifts the later ones up. ``version``
changes whenever rows are added, removed or reordered. No torch here.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from pagellm.request import Request

_COLUMNS = ("computed", "num_tokens", "num_spec", "kv_slots", "kv_next_full", "check_at")


class RunningBatch:
    computed: np.ndarray
    num_tokens: np.ndarray
    num_spec: np.ndarray
    kv_slots: np.ndarray
    kv_next_full: np.ndarray
    check_at: np.ndarray

    def __init__(self, capacity: int = 64, compact: Callable[..., None] | None = None) -> None:
        """``compact(columns, n, rows, *lists)``: drops ``rows`` of the first ``n`` from every column and list (the
        native fast path's ``compact_rows``); without it each removed row's tail is shifted in numpy and its list
        items deleted one by one."""
        self._compact = compact
        self.requests: list[Request] = []
        self.req_ids: list[str] = []
        self.token_lists: list[list[int]] = []
        self.version = 0
        self._columns = np.zeros((len(_COLUMNS), capacity), dtype=np.int64)
        self._bind()

    def _bind(self) -> None:
        for index, name in enumerate(_COLUMNS):
            setattr(self, name, self._columns[index])
        self._arange = np.arange(self._columns.shape[1])
        self._arange.flags.writeable = False  # handed out in views: nobody may write through them

    def first_rows(self, k: int) -> np.ndarray:
        """``np.arange(k)`` (k at most the capacity), as a read-only view of one array made per capacity."""
        return self._arange[:k]

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def __contains__(self, request: Request) -> bool:
        return request in self.requests

    def append(self, request: Request, computed: int, kv_slots: int, kv_next_full: int) -> int:
        """Add ``request`` as the last row; returns its row."""
        row, tokens = len(self.requests), request.all_token_ids
        if row == self._columns.shape[1]:
            self._grow()
        num_tokens, num_prompt = len(tokens), request.num_prompt_tokens
        self.computed[row], self.num_tokens[row], self.num_spec[row] = computed, num_tokens, len(request.spec_token_ids)
        self.kv_slots[row], self.kv_next_full[row] = kv_slots, kv_next_full
        self.check_at[row] = request.length_limit if num_tokens > num_prompt else num_prompt + 1
        self.token_lists.append(tokens)
        self.requests.append(request)
        self.req_ids.append(request.request_id)
        self.version += 1
        return row

    def reserve(self, num_rows: int) -> None:
        """Make sure the columns have ``num_rows`` rows (before native admissions write theirs)."""
        while num_rows > self._columns.shape[1]:
            self._grow()

    def index(self, request: Request) -> int:
        return self.requests.index(request)

    def remove_rows(self, rows: list[int]) -> None:
        """Remove the given rows (ascending, distinct); the others keep their order."""
        n = len(self.requests)
        if self._compact is not None:
            self._compact(self._columns, n, rows, self.requests, self.req_ids, self.token_lists)
        else:
            for end, row in enumerate(reversed(rows), start=1):  # shifting each row's tail beats a masked copy
                self._columns[:, row:n - end] = self._columns[:, row + 1:n - end + 1]
            for row in reversed(rows):
                del self.requests[row]
                del self.req_ids[row]
                del self.token_lists[row]
        self.version += 1

    def reorder(self, order: list[int]) -> None:
        """Put row ``order[i]`` at row ``i``."""
        n = len(self.requests)
        self._columns[:, :n] = self._columns[:, order]
        # In place: the lists stay the same objects (callers may hold them across a step).
        self.token_lists[:] = [self.token_lists[i] for i in order]
        self.requests[:] = [self.requests[i] for i in order]
        self.req_ids[:] = [self.req_ids[i] for i in order]
        self.version += 1

    def _grow(self) -> None:
        capacity = 2 * self._columns.shape[1]
        columns = np.zeros((len(_COLUMNS), capacity), dtype=np.int64)
        columns[:, :self._columns.shape[1]] = self._columns
        self._columns = columns
        self._bind()
