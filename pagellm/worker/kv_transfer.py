"""The runner's side of the KV connector (``disagg/connector.py``): load the blocks the scheduler found stored
before a step, store each prompt's full blocks once its last chunk ran.

Contract:
- ``load_stored(store, sched, states, block_size)`` fills the new requests' ``kv_load_block_ids`` from the store and
  returns the step to run: ``sched`` itself, or, when a block cannot be loaded, a copy in which that request computes
  the block and the ones after it (its ``num_computed_tokens`` lowered, its scheduled count raised by as much), so the
  step ends where the scheduler planned, only longer.
- ``save_prompts(store, sched, states, block_size)`` stores the full blocks of every prompt whose last chunk this step
  ran (their K/V are all written), named by the same chained hashes the prefix cache computes from the tokens
  (``KVStore.hash_tokens``).
"""

from __future__ import annotations

import msgspec

from pagellm.disagg.connector import KVStore
from pagellm.sched.output import SchedulerOutput
from pagellm.worker.input_batch import CachedRequestState


def load_stored(store: KVStore, sched: SchedulerOutput, states: dict[str, CachedRequestState],
                block_size: int) -> SchedulerOutput:
    widened: dict[str, int] = {}
    for new in sched.new_reqs:
        wanted = new.kv_load_block_ids
        if wanted:
            loaded = store.load(wanted, new.kv_load_hashes)
            if loaded < len(wanted):
                state = states[new.req_id]
                start = state.block_ids.index(wanted[loaded]) * block_size
                widened[new.req_id] = state.num_computed_tokens - start
                state.num_computed_tokens = start
    if not widened:
        return sched
    counts = [n + widened.get(r, 0) for r, n in zip(sched.req_ids, sched.num_scheduled_tokens)]
    return msgspec.structs.replace(sched, num_scheduled_tokens=counts,
                                   total_num_scheduled_tokens=sched.total_num_scheduled_tokens + sum(widened.values()))


def save_prompts(store: KVStore, sched: SchedulerOutput, states: dict[str, CachedRequestState],
                 block_size: int) -> None:
    for req_id, num_scheduled in zip(sched.req_ids, sched.num_scheduled_tokens):
        state = states[req_id]
        prompt = state.num_prompt_tokens
        if state.num_computed_tokens < prompt <= state.num_computed_tokens + num_scheduled and prompt >= block_size:
            full = prompt // block_size
            store.save(state.block_ids[:full], store.hash_tokens(state.token_ids[:full * block_size], block_size))
