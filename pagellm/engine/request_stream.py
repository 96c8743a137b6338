"""One ``AsyncLLM.generate`` call's stream: its core requests, the outputs handed to the caller's event loop, the
deltas merged for a consumer that fell behind, held back to vLLM's stream interval (``Paced``), and every sibling's
output so far (``Accumulated``) for vLLM's ``CUMULATIVE`` and ``FINAL_ONLY`` output kinds."""

from __future__ import annotations

import asyncio
import time
import dataclasses
from dataclasses import dataclass
from typing import Union

from pagellm.engine.output_processor import RequestState
from pagellm.engine.parallel_sampling import select_best
from pagellm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagellm.sampling_params import SamplingParams

StreamItem = Union[RequestOutput, BaseException]


class RequestStream:
    """The outputs of one ``generate`` call, handed from any thread to the caller's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: list[StreamItem] = []
        self._ready = asyncio.Event()

    def put(self, item: StreamItem) -> None:
        try:
            self.loop.call_soon_threadsafe(self._put, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass

    def _put(self, item: StreamItem) -> None:
        self._items.append(item)
        self._ready.set()

    async def take(self) -> list[StreamItem]:
        await self._ready.wait()
        self._ready.clear()
        items, self._items = self._items, []
        return items


@dataclass
class Tracked:
    """One core request of a ``generate`` call (one sibling when n > 1)."""

    request_id: str  # the caller's id
    index: int
    stream: RequestStream
    prompt: str | None
    prompt_token_ids: list[int]
    output: tuple[list[str], list[int]] | None = None  # its text and ids so far, when outputs are logged
    prefilled: bool = False  # it had its first output (``PauseGate``'s prefill backlog counts it no more)


def with_completion(output: RequestOutput, completion: CompletionOutput) -> RequestOutput:
    return RequestOutput(output.request_id, output.prompt, output.prompt_token_ids, [completion], False,
                         output.metrics, output.num_cached_tokens, prompt_logprobs=output.prompt_logprobs,
                         pooled=output.pooled)


async def best_of(stream: RequestStream, params: SamplingParams, count: int) -> list[RequestOutput]:
    """``best_of > n``: wait for all ``count`` siblings, then one whole output per chosen completion (rank order)."""
    items: list[StreamItem] = []
    done: set[int] = set()
    while len(done) < count:
        for item in await stream.take():
            if isinstance(item, BaseException):
                raise item
            if item.outputs[0].finished:
                done.add(item.outputs[0].index)
            items.append(item)
    whole = [item for item in coalesce(items) if isinstance(item, RequestOutput)]
    best = select_best([item.outputs[0] for item in whole], params)
    outputs = [with_completion(whole[0], c) for c in best]
    for output in outputs:
        output.finished = output is outputs[-1]
    return outputs


def aborted_output(tracked: Tracked, state: RequestState | None) -> RequestOutput:
    metrics = state.metrics if state is not None else RequestMetrics(time.time())
    metrics.finished_time = time.time()
    completion = CompletionOutput(tracked.index, "", [], "abort")
    return RequestOutput(tracked.request_id, tracked.prompt, tracked.prompt_token_ids, [completion], True,
                         metrics, state.num_cached_tokens if state is not None else 0)


def coalesce(items: list[StreamItem]) -> list[StreamItem]:
    """Merge the queued deltas of each sibling into one, so a slow consumer gets fewer, larger deltas."""
    merged: dict[int, RequestOutput] = {}
    for item in items:
        if isinstance(item, BaseException):
            return [*merged.values(), item]
        previous = merged.get(item.outputs[0].index)
        if previous is None:
            merged[item.outputs[0].index] = item
            continue
        _extend(previous, item)
    return list(merged.values())


def _extend(previous: RequestOutput, item: RequestOutput) -> None:
    """``previous`` (one sibling's output) with ``item``'s delta appended."""
    old, new = previous.outputs[0], item.outputs[0]
    old.text += new.text
    old.token_ids.extend(new.token_ids)
    if old.logprobs is not None and new.logprobs is not None:
        old.logprobs.extend(new.logprobs)
    old.cumulative_logprob = new.cumulative_logprob
    old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason
    previous.finished = item.finished
    previous.prompt_logprobs = previous.prompt_logprobs or item.prompt_logprobs
    previous.pooled = previous.pooled or item.pooled


class Paced:
    """vLLM's stream interval: a sibling's deltas are held back and merged until ``interval`` new tokens are
    unsent; its first output (nothing sent yet) and its last go at once."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.held: dict[int, RequestOutput] = {}
        self.started: set[int] = set()

    def add(self, item: RequestOutput) -> RequestOutput | None:
        """``item`` (merged with what was held) when it is due, else None."""
        index = item.outputs[0].index
        held = self.held.pop(index, None)
        if held is not None:
            _extend(held, item)
            item = held
        completion = item.outputs[0]
        if completion.finished or index not in self.started or len(completion.token_ids) >= self.interval:
            self.started.add(index)
            return item
        self.held[index] = item
        return None


class Accumulated:
    """Every sibling's output so far, from their deltas (``add``); ``snapshot`` is one ``RequestOutput`` holding each
    sibling's whole completion yet (index order), copies the caller may keep."""

    def __init__(self) -> None:
        self.whole: dict[int, RequestOutput] = {}

    def add(self, item: RequestOutput) -> None:
        index = item.outputs[0].index
        if index in self.whole:
            _extend(self.whole[index], item)
        else:
            self.whole[index] = dataclasses.replace(item, outputs=[_copy(item.outputs[0])])

    def snapshot(self, finished: bool) -> RequestOutput:
        first = self.whole[min(self.whole)]
        return dataclasses.replace(first, outputs=[_copy(self.whole[i].outputs[0]) for i in sorted(self.whole)],
                                   finished=finished)


def _copy(completion: CompletionOutput) -> CompletionOutput:
    return dataclasses.replace(completion, token_ids=list(completion.token_ids),
                               logprobs=None if completion.logprobs is None else list(completion.logprobs))
