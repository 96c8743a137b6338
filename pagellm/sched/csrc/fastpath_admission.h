// Admission (fastpath.cpp): ``admit_waiting`` and what one admission does (prefix hits, first blocks, the
// batch's new row, the step's NewRequestData).
#pragma once

#include "fastpath_blocks.h"

namespace {

// The running batch's row of an admitted request (``RunningBatch.append``'s columns and lists).
struct Row {
    Columns *columns;  // opened once per call
    PyObject *requests, *req_ids, *token_lists;
};

bool append_row(const Row &batch, PyObject *request, PyObject *rid, PyObject *tokens, int64_t computed,
                int64_t kv_slots, int64_t kv_next_full) {
    const Columns &cols = *batch.columns;
    const Py_ssize_t row = PyList_GET_SIZE(batch.requests);
    if (row >= cols.stride || PyList_GET_SIZE(batch.req_ids) != row || PyList_GET_SIZE(batch.token_lists) != row) {
        PyErr_Format(PyExc_ValueError, "no room for row %zd in columns of %zd (grow the batch first)", row,
                     cols.stride);
        return false;
    }
    PyObject *spec = PyObject_GetAttr(request, s_spec_token_ids);
    Py_ssize_t num_spec = spec ? PyObject_Size(spec) : -1;
    Py_XDECREF(spec);
    if (num_spec < 0) return false;
    long long prompt = 0, limit = 0;
    if (!read_int(request, s_num_prompt_tokens, prompt) || !read_int(request, s_length_limit, limit)) return false;
    const int64_t num_tokens = PyList_GET_SIZE(tokens);
    cols[COMPUTED][row] = computed;
    cols[NUM_TOKENS][row] = num_tokens;
    cols[NUM_SPEC][row] = num_spec;
    cols[KV_SLOTS][row] = kv_slots;
    cols[KV_NEXT_FULL][row] = kv_next_full;
    cols[CHECK_AT][row] = num_tokens > prompt ? limit : prompt + 1;
    return PyList_Append(batch.token_lists, tokens) == 0 && PyList_Append(batch.requests, request) == 0 &&
           PyList_Append(batch.req_ids, rid) == 0;
}

// Everything one admission needs besides the request (``admit_waiting``'s arguments).
struct Admission {
    Manager m;
    PyObject *pool, *queue;
    int64_t step_lookahead, max_model_len;
    int64_t chunk_cap;  // the most tokens a request computes in one step (0: no cap)
    int64_t watermark_blocks;  // blocks an admission leaves free while other requests run (``watermark``)
    bool chunked, caching;
    bool reserve_full;  // an admission needs room for its whole sequence, not its first chunk alone
    Row batch;
};

// A request ``admit_request`` admitted: its id and token list (new references), hits, tokens to compute now and
// block ids (a new list).
struct Admitted {
    PyObject *rid = nullptr, *tokens = nullptr, *block_ids = nullptr;
    int64_t num_hit = 0, num_new = 0;
    ~Admitted() {
        Py_XDECREF(rid);
        Py_XDECREF(tokens);
        Py_XDECREF(block_ids);
    }
};

// ``hash_blocks`` and ``get_computed_blocks`` for a waiting request (prefix caching on): its full blocks hashed,
// then the cached blocks of its leading hashes into ``hits`` (borrowed: the prefix-cache table holds them). The
// last token is always computed, so at most num_tokens - 1 tokens hit.
bool prefix_hits(const Manager &m, PyObject *request, PyObject *hashes, PyObject *tokens,
                 std::vector<PyObject *> &hits) {
    const Py_ssize_t num_tokens = PyList_GET_SIZE(tokens), block_size = m.block_size;
    if (num_tokens >= (PyList_GET_SIZE(hashes) + 1) * block_size && !hash_full_blocks(m, request, hashes, tokens))
        return false;
    Py_ssize_t max_blocks = (num_tokens - 1) / block_size;
    Py_ssize_t limit = PyList_GET_SIZE(hashes) < max_blocks ? PyList_GET_SIZE(hashes) : max_blocks;
    for (Py_ssize_t b = 0; b < limit; ++b) {
        PyObject *block = PyDict_GetItemWithError(m.cached, PyList_GET_ITEM(hashes, b));
        if (block == nullptr) return !PyErr_Occurred();
        hits.push_back(block);
    }
    return true;
}

// The hits that sit in the free queue (no request holds them), or -1 on an error.
Py_ssize_t free_hits(const std::vector<PyObject *> &hits) {
    Py_ssize_t num_free = 0;
    for (PyObject *block : hits) {
        long ref = PyLong_AsLong(slot(block, off_ref_cnt));
        if (ref == -1 && PyErr_Occurred()) return -1;
        num_free += ref == 0;
    }
    return num_free;
}

// ``allocate_slots``' blocks for a request that holds none yet: the hits touched (``BlockPool.touch``) and counted
// as registered, then ``num_new_blocks`` from the free queue; the list becomes the request's in ``req_blocks``.
// Returns the list (a new reference), or null on an error.
PyObject *take_admitted_blocks(const Admission &a, FreeQueue &fq, PyObject *rid, const std::vector<PyObject *> &hits,
                               Py_ssize_t num_new_blocks) {
    PyObject *held = PyList_New(0);
    if (held == nullptr || PyDict_SetItem(a.m.req_blocks, rid, held) < 0) {
        Py_XDECREF(held);
        return nullptr;
    }
    bool ok = true;
    for (size_t i = 0; ok && i < hits.size(); ++i) {
        long ref = PyLong_AsLong(slot(hits[i], off_ref_cnt));
        if (ref == 0) unlink_block(fq, hits[i]);
        PyObject *bumped = PyLong_FromLong(ref + 1);
        if (bumped != nullptr) set_slot(hits[i], off_ref_cnt, bumped);
        Py_XDECREF(bumped);
        ok = bumped != nullptr && PyList_Append(held, hits[i]) == 0;
    }
    if (ok && !hits.empty()) {
        PyObject *count = PyLong_FromSsize_t(static_cast<Py_ssize_t>(hits.size()));
        ok = count != nullptr && PyDict_SetItem(a.m.num_cached_blocks, rid, count) == 0;
        Py_XDECREF(count);
    }
    Py_ssize_t evictions = 0;
    for (Py_ssize_t i = 0; ok && i < num_new_blocks; ++i) {
        PyObject *block = take_block(fq, a.m.cached, evictions);
        ok = block != nullptr && PyList_Append(held, block) == 0;
        Py_XDECREF(block);
    }
    ok = ok && write_free_count(fq) && (!evictions || add_to_attr(a.pool, s_num_evictions, evictions));
    if (!ok) Py_CLEAR(held);
    return held;
}

// The block ids of a request's ``held`` blocks, a new list (null on an error).
PyObject *block_id_list(PyObject *held) {
    Py_ssize_t num_held = PyList_GET_SIZE(held);
    PyObject *ids = PyList_New(num_held);
    for (Py_ssize_t i = 0; ids && i < num_held; ++i)
        PyList_SET_ITEM(ids, i, Py_NewRef(slot(PyList_GET_ITEM(held, i), off_block_id)));
    return ids;
}

// The blocks of ``request`` (holding ``held``, ``num_cached`` of them registered) that the step fills, registered
// (``cache_full_blocks(request, final)``); returns the registered count after it, or -1 on an error.
int64_t register_filled(const Manager &m, PyObject *request, PyObject *rid, PyObject *held, int64_t num_cached,
                        int64_t final) {
    const int64_t bs = m.block_size;
    if (final / bs <= num_cached) return num_cached;
    if (!register_blocks(m, request, rid, held, static_cast<Py_ssize_t>(num_cached), static_cast<Py_ssize_t>(final / bs)))
        return -1;
    return final / bs;
}

// ``admit_request`` once the request's prefix ``hits`` are known: the chunk rule, the pool's room, the blocks, the
// registration of the blocks the step fills and the batch's new row. Returns what ``admit_request`` does.
int admit_with_hits(const Admission &a, FreeQueue &fq, PyObject *request, PyObject *rid, PyObject *tokens,
                    const std::vector<PyObject *> &hits, int64_t budget, Admitted &out) {
    const int64_t bs = a.m.block_size, num_tokens = PyList_GET_SIZE(tokens);
    const Py_ssize_t num_hits = static_cast<Py_ssize_t>(hits.size());
    const int64_t num_hit = num_hits * bs;
    if (!a.chunked && num_tokens - num_hit > budget) return 0;
    int64_t num_new = num_tokens - num_hit < budget ? num_tokens - num_hit : budget;
    if (a.chunk_cap > 0 && num_new > a.chunk_cap) num_new = a.chunk_cap;
    int64_t lookahead = a.max_model_len - (num_hit + num_new);
    lookahead = lookahead < a.step_lookahead ? lookahead : a.step_lookahead;
    lookahead = lookahead > 0 ? lookahead : 0;
    const Py_ssize_t num_new_blocks = static_cast<Py_ssize_t>(ceil_div(num_hit + num_new + lookahead, bs)) - num_hits;
    const Py_ssize_t num_free_hits = free_hits(hits);
    if (num_free_hits < 0) return -1;
    Py_ssize_t needed = num_new_blocks;  // KVCacheManager.allocate_slots' must_fit_tokens and reserve
    if (a.reserve_full) {
        const int64_t whole = num_tokens < a.max_model_len ? num_tokens : a.max_model_len;
        const Py_ssize_t whole_blocks = static_cast<Py_ssize_t>(ceil_div(whole, bs)) - num_hits;
        needed = whole_blocks > needed ? whole_blocks : needed;
    }
    const Py_ssize_t reserve = PyList_GET_SIZE(a.batch.requests) > 0 ? a.watermark_blocks : 0;
    if ((num_new_blocks > 0 || num_hits) && needed + reserve > fq.num_free - num_free_hits) return 0;
    PyObject *held = take_admitted_blocks(a, fq, rid, hits, num_new_blocks);
    if (held == nullptr) return -1;
    const int64_t final = num_hit + num_new < num_tokens ? num_hit + num_new : num_tokens;
    const int64_t num_cached = a.caching ? register_filled(a.m, request, rid, held, num_hits, final) : num_hits;
    PyObject *ids = num_cached >= 0 ? block_id_list(held) : nullptr;
    const int64_t next_full = a.caching ? (num_cached + 1) * bs : (int64_t(1) << 62);
    const bool ok = ids && append_row(a.batch, request, rid, tokens, num_hit + num_new, PyList_GET_SIZE(held) * bs,
                                      next_full);
    Py_DECREF(held);
    if (!ok) {
        Py_XDECREF(ids);
        return -1;
    }
    out.block_ids = ids;
    out.rid = Py_NewRef(rid);
    out.tokens = Py_NewRef(tokens);
    out.num_hit = num_hit;
    out.num_new = num_new;
    return 1;
}

// A waiting request's admission within ``budget``, as Scheduler._allocate_new + RunningBatch.append do it through
// the KV manager: ``hash_blocks``, ``get_computed_blocks``, the chunk rule, ``allocate_slots`` (touching the hits,
// new blocks from the free queue, registering the blocks the step fills), ``block_ids``; then the request joins the
// running batch as its last row with ``slots_and_next_full`` (the caller made room in the columns). Returns 1 (done,
// ``out`` filled), 0 (it does not fit this step: nothing changed but its block hashes) or -1 (an error).
int admit_request(const Admission &a, PyObject *request, int64_t budget, Admitted &out) {
    PyObject *rid = PyObject_GetAttr(request, s_request_id);
    PyObject *tokens = rid ? PyObject_GetAttr(request, s_all_token_ids) : nullptr;
    PyObject *hashes = tokens ? PyObject_GetAttr(request, s_block_hashes) : nullptr;
    int result = -1;
    std::vector<PyObject *> hits;
    FreeQueue fq{};
    if (hashes == nullptr || !PyList_CheckExact(tokens) || !PyList_CheckExact(hashes) || !PyDict_Check(a.m.cached)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "unexpected request or pool layout");
    } else if (read_queue(a.queue, fq) && (!a.caching || prefix_hits(a.m, request, hashes, tokens, hits))) {
        result = admit_with_hits(a, fq, request, rid, tokens, hits, budget, out);
    }
    Py_XDECREF(hashes);
    Py_XDECREF(tokens);
    Py_XDECREF(rid);
    return result;
}

// clock_gettime(CLOCK_REALTIME) as a float, what time.time() returns.
PyObject *wall_clock() {
    timespec now{};
    clock_gettime(CLOCK_REALTIME, &now);
    return PyFloat_FromDouble(static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec) * 1e-9);
}

// The tokens the sampler must suppress for a newly admitted request (``sched.stop.suppressed_tokens``): none once it
// generated ``min_tokens`` tokens (read here), else what the Python function says.
PyObject *suppressed(PyObject *request, PyObject *params, Py_ssize_t num_output, PyObject *fallback) {
    long long min_tokens = 0;
    if (!read_int(params, s_min_tokens, min_tokens)) return nullptr;
    return min_tokens <= num_output ? PyList_New(0) : PyObject_CallOneArg(fallback, request);
}

// The rest of one admission (``Scheduler._schedule_waiting`` after ``_allocate_new``): the request leaves the
// queue, its NewRequestData joins ``new_reqs`` and its share of the step the step's lists; ``_admitted``'s request
// fields (status, first-admission hits and time) and dropped-id set. ``now``: the wall clock, read at the first
// admission that needs it.
bool record_admission(PyObject *waiting, PyObject *request, const Admitted &got, PyObject *new_request_type,
                      PyObject *suppressed_fn, PyObject *new_reqs, PyObject *step_req_ids, PyObject *num_scheduled,
                      PyObject *dropped, PyObject *running, PyObject *&now) {
    PyObject *popped = PyObject_CallMethodNoArgs(waiting, s_pop);
    if (popped == nullptr) return false;
    Py_DECREF(popped);
    PyObject *params = PyObject_GetAttr(request, s_sampling_params);
    PyObject *num_prompt = params ? PyObject_GetAttr(request, s_num_prompt_tokens) : nullptr;
    Py_ssize_t prompt = num_prompt ? PyLong_AsSsize_t(num_prompt) : -1;
    PyObject *stop_ids = prompt >= 0 ? suppressed(request, params, PyList_GET_SIZE(got.tokens) - prompt,
                                                  suppressed_fn) : nullptr;
    PyObject *token_ids = stop_ids ? PyList_GetSlice(got.tokens, 0, PyList_GET_SIZE(got.tokens)) : nullptr;
    PyObject *num_hit = token_ids ? PyLong_FromLongLong(got.num_hit) : nullptr;
    PyObject *entry = nullptr;
    if (num_hit != nullptr) {
        PyObject *fields[] = {got.rid, token_ids, num_prompt, params, got.block_ids, num_hit, stop_ids};
        entry = PyObject_Vectorcall(new_request_type, fields, 7, nullptr);
    }
    bool ok = entry != nullptr && PyList_Append(new_reqs, entry) == 0 && PySet_Discard(dropped, got.rid) >= 0 &&
              PyObject_SetAttr(request, s_status, running) == 0;
    Py_XDECREF(entry);
    Py_XDECREF(stop_ids);
    Py_XDECREF(token_ids);
    Py_XDECREF(num_prompt);
    Py_XDECREF(params);
    if (ok) {  // the first admission's prefix hits and time (a resumed request keeps its first ones)
        long long cached_tokens = 0;
        ok = read_int(request, s_num_cached_tokens, cached_tokens);
        if (ok && cached_tokens < 0) {
            if (now == nullptr) now = wall_clock();
            ok = now != nullptr && PyObject_SetAttr(request, s_num_cached_tokens, num_hit) == 0 &&
                 PyObject_SetAttr(request, s_scheduled_time, now) == 0;
        }
    }
    Py_XDECREF(num_hit);
    PyObject *num_new = ok ? PyLong_FromLongLong(got.num_new) : nullptr;
    ok = num_new != nullptr && PyList_Append(step_req_ids, got.rid) == 0 && PyList_Append(num_scheduled, num_new) == 0;
    Py_XDECREF(num_new);
    return ok;
}

// admit_waiting(waiting, budget, max_num_seqs, chunked_prefill, step_lookahead, max_model_len, columns, requests,
//               req_ids, token_lists, new_reqs, step_req_ids, num_scheduled, dropped, running_status,
//               new_request_type, suppressed_tokens, req_blocks, num_cached_blocks, pool, free_queue, block_size,
//               caching, root_hash, hash_fallback[, chunk_cap, watermark_blocks, reserve_full])
//   -> (budget left, requests admitted, prompt tokens of the admitted, their prefix-cache hit tokens)
//   ``Scheduler._schedule_waiting``: admit waiting requests in queue order (``peek``/``pop``, either policy) while
//   the budget and ``max_num_seqs`` allow, each through ``admit_request`` and ``record_admission``. The caller made
//   room in the columns for every row it may add, and bumps the batch's version and the stats after.
PyObject *admit_waiting(PyObject *, PyObject *args) {
    PyObject *waiting, *new_reqs, *step_req_ids, *num_scheduled, *dropped, *running, *new_request_type, *suppressed_fn;
    long long budget, max_rows, step_lookahead, max_model_len, chunk_cap = 0, watermark_blocks = 0;
    int chunked, caching, reserve_full = 0;
    Admission a{};
    PyObject *array;
    if (!PyArg_ParseTuple(args, "OLLpLLOO!O!O!O!O!O!O!OOOO!O!OOnpO!O|LLp", &waiting, &budget, &max_rows, &chunked,
                          &step_lookahead, &max_model_len, &array, &PyList_Type, &a.batch.requests,
                          &PyList_Type, &a.batch.req_ids, &PyList_Type, &a.batch.token_lists, &PyList_Type,
                          &new_reqs, &PyList_Type, &step_req_ids, &PyList_Type, &num_scheduled, &PySet_Type,
                          &dropped, &running, &new_request_type, &suppressed_fn, &PyDict_Type, &a.m.req_blocks,
                          &PyDict_Type, &a.m.num_cached_blocks, &a.pool, &a.queue, &a.m.block_size, &caching,
                          &PyBytes_Type, &a.m.root, &a.m.hash_fallback, &chunk_cap, &watermark_blocks,
                          &reserve_full))
        return nullptr;
    if (off_block_id < 0) return PyErr_Format(PyExc_RuntimeError, "bind(KVBlock) first");
    Columns cols;
    if (!cols.open(array, 6)) return nullptr;
    a.batch.columns = &cols;
    a.chunked = chunked;
    a.caching = caching;
    a.step_lookahead = step_lookahead;
    a.max_model_len = max_model_len;
    a.chunk_cap = chunk_cap;
    a.watermark_blocks = watermark_blocks;
    a.reserve_full = reserve_full;
    a.m.cached = PyObject_GetAttr(a.pool, s_cached);  // the pool keeps it alive
    if (a.m.cached == nullptr) return nullptr;
    Py_DECREF(a.m.cached);
    long long admitted = 0, queries = 0, hits = 0;
    PyObject *now = nullptr;
    bool ok = true;
    while (ok && budget > 0 && PyList_GET_SIZE(a.batch.requests) < max_rows) {
        Py_ssize_t num_waiting = PyObject_Size(waiting);
        if (num_waiting <= 0) {
            ok = num_waiting == 0;
            break;
        }
        PyObject *request = PyObject_CallMethodNoArgs(waiting, s_peek);
        if (request == nullptr) {
            ok = false;
            break;
        }
        Admitted got;
        int rc = admit_request(a, request, budget, got);
        if (rc == 1)
            ok = record_admission(waiting, request, got, new_request_type, suppressed_fn, new_reqs, step_req_ids,
                                  num_scheduled, dropped, running, now);
        Py_DECREF(request);
        if (rc != 1) {
            ok = rc == 0;
            break;
        }
        admitted += 1;
        queries += PyList_GET_SIZE(got.tokens);
        hits += got.num_hit;
        budget -= got.num_new;
    }
    Py_XDECREF(now);
    if (!ok) return nullptr;  // an error inside a Python object's method: state is as far as it got
    return Py_BuildValue("(LLLL)", budget, admitted, queries, hits);
}
}  // namespace
