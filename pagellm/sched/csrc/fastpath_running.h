// The running rows' calls (fastpath.cpp): ``schedule_running`` (the budget rule and the rows' KV work) and
// ``take_tokens`` (the sampled tokens appended).
#pragma once

#include "fastpath_blocks.h"

namespace {

// Pass 1 of ``schedule_running``: the budget rule over the running rows, and the rows that need the KV manager.
struct Plan {
    std::vector<int64_t> grant, room;     // each row's tokens this step; its slots after it (with the lookahead)
    std::vector<Py_ssize_t> event_rows;   // scheduled rows that need a new block or fill one, in row order
    int64_t total = 0, blocks_needed = 0;  // the step's tokens; the new blocks the event rows take
    Py_ssize_t scheduled = 0;             // rows with a grant
};

Plan plan_rows(const Columns &cols, Py_ssize_t n, int64_t budget, int64_t max_model_len, int64_t lookahead,
               int64_t bs, int64_t chunk_cap) {
    const int64_t *computed = cols[COMPUTED], *tokens = cols[NUM_TOKENS], *kv_slots = cols[KV_SLOTS],
                  *next_full = cols[KV_NEXT_FULL];
    Plan plan;
    plan.grant.resize(n);
    plan.room.resize(n);
    int64_t used = 0;
    for (Py_ssize_t i = 0; i < n; ++i) {
        int64_t want = tokens[i] - computed[i];
        if (chunk_cap > 0 && want > chunk_cap) want = chunk_cap;
        int64_t g = budget - used;  // what the budget has left before this row
        g = g > 0 ? g : 0;
        g = g < want ? g : want;
        used += want;
        plan.grant[i] = g;
        plan.total += g;
        int64_t end = computed[i] + g, r = end;
        if (lookahead) {
            int64_t left = max_model_len - end;
            left = left > 0 ? left : 0;
            r += left < lookahead ? left : lookahead;
        }
        plan.room[i] = r;
        if (g != 0) plan.scheduled += 1;
        if (g > 0 && (r > kv_slots[i] || end >= next_full[i])) {
            plan.event_rows.push_back(i);
            // kv_slots is the row's blocks times the block size (the column mirrors the manager), so the blocks
            // it lacks follow without touching its block list.
            if (r > kv_slots[i]) plan.blocks_needed += ceil_div(r, bs) - kv_slots[i] / bs;
        }
    }
    return plan;
}

// Pass 2: serve the event rows in order (as ``allocate_running`` would) and update their KV columns; then the
// queue's free count and the pool's evictions. False on an error inside a Python object's method.
bool serve_events(const Manager &m, FreeQueue &fq, PyObject *pool, const Plan &plan, const Columns &cols,
                  PyObject *requests, PyObject *req_ids, bool caching, PyObject *new_block_ids) {
    const int64_t *computed = cols[COMPUTED];
    int64_t *kv_slots = cols[KV_SLOTS], *next_full = cols[KV_NEXT_FULL];
    const int64_t bs = m.block_size;
    const Py_ssize_t events = static_cast<Py_ssize_t>(plan.event_rows.size()), start_free = fq.num_free;
    Py_ssize_t evictions = 0;
    bool ok = true;
    // The rows' request and id objects are cold after a forward pass: each is prefetched a few events ahead.
    constexpr Py_ssize_t kAhead = 4;
    for (Py_ssize_t e = 0; e < events && e < kAhead; ++e) {
        __builtin_prefetch(PyList_GET_ITEM(requests, plan.event_rows[e]));
        __builtin_prefetch(PyList_GET_ITEM(req_ids, plan.event_rows[e]));
    }
    for (Py_ssize_t e = 0; ok && e < events; ++e) {
        if (e + kAhead < events) {
            __builtin_prefetch(PyList_GET_ITEM(requests, plan.event_rows[e + kAhead]));
            __builtin_prefetch(PyList_GET_ITEM(req_ids, plan.event_rows[e + kAhead]));
        }
        const Py_ssize_t i = plan.event_rows[e];
        int64_t final = computed[i] + plan.grant[i];
        ok = serve_row(m, fq, evictions, PyList_GET_ITEM(requests, i), PyList_GET_ITEM(req_ids, i), plan.room[i],
                       final, next_full[i], caching, new_block_ids);
        int64_t slots = ceil_div(plan.room[i], bs) * bs;
        kv_slots[i] = kv_slots[i] > slots ? kv_slots[i] : slots;
        if (final >= next_full[i]) next_full[i] = (final / bs + 1) * bs;
    }
    if (fq.num_free != start_free) ok = write_free_count(fq) && ok;
    if (evictions) ok = add_to_attr(pool, s_num_evictions, evictions) && ok;
    return ok;
}

// The step's lists (the scheduled rows' ids, computed tokens before the step and grants; their row numbers unless
// they are rows 0..k-1) as ``schedule_running`` returns them, and each row's computed column advanced.
PyObject *step_lists(const Plan &plan, const Columns &cols, Py_ssize_t n, PyObject *req_ids) {
    int64_t *computed = cols[COMPUTED];
    const Py_ssize_t scheduled = plan.scheduled;
    PyObject *ids = PyList_New(scheduled), *before = PyList_New(scheduled), *counts = PyList_New(scheduled);
    PyObject *rows = nullptr;
    bool prefix = true;
    for (Py_ssize_t i = 0, k = 0; ids && before && counts && i < n; ++i) {
        if (plan.grant[i] == 0) continue;
        if (k != i) prefix = false;
        PyList_SET_ITEM(ids, k, Py_NewRef(PyList_GET_ITEM(req_ids, i)));
        PyList_SET_ITEM(before, k, count_int(computed[i]));
        PyList_SET_ITEM(counts, k, count_int(plan.grant[i]));
        k += 1;
    }
    if (ids && before && counts && !prefix) {
        rows = PyList_New(scheduled);
        for (Py_ssize_t i = 0, k = 0; rows && i < n; ++i)
            if (plan.grant[i] != 0) PyList_SET_ITEM(rows, k++, count_int(i));
    }
    for (Py_ssize_t i = 0; i < n; ++i) computed[i] += plan.grant[i];
    if (ids == nullptr || before == nullptr || counts == nullptr || (!prefix && rows == nullptr) ||
        PyErr_Occurred()) {
        Py_XDECREF(ids);
        Py_XDECREF(before);
        Py_XDECREF(counts);
        Py_XDECREF(rows);
        return nullptr;
    }
    return Py_BuildValue("(LNNNN)", static_cast<long long>(plan.total), ids, before, counts,
                         rows ? rows : Py_NewRef(Py_None));
}

// schedule_running(columns, n, budget, max_model_len, lookahead, requests, req_ids, req_blocks, num_cached_blocks,
//                  pool, free_queue, block_size, caching, root_hash, hash_fallback, new_block_ids[, chunk_cap])
//   -> None (nothing changed: the pool cannot serve every row; the Python path takes the step)
//    | (num_tokens, req_ids, num_computed_tokens, num_scheduled, rows or None when the scheduled rows are 0..k-1)
PyObject *schedule_running(PyObject *, PyObject *args) {
    PyObject *array, *requests, *req_ids, *pool, *queue, *new_block_ids;
    Py_ssize_t n, block_size;
    long long budget, max_model_len, lookahead, chunk_cap = 0;
    int caching;
    Manager m{};
    if (!PyArg_ParseTuple(args, "OnLLLO!O!O!O!OOnpO!OO!|L", &array, &n, &budget, &max_model_len, &lookahead,
                          &PyList_Type, &requests, &PyList_Type, &req_ids, &PyDict_Type, &m.req_blocks, &PyDict_Type,
                          &m.num_cached_blocks, &pool, &queue, &block_size, &caching, &PyBytes_Type, &m.root,
                          &m.hash_fallback, &PyDict_Type, &new_block_ids, &chunk_cap))
        return nullptr;
    if (off_block_id < 0) return PyErr_Format(PyExc_RuntimeError, "bind(KVBlock) first");
    if (n > PyList_GET_SIZE(requests) || n > PyList_GET_SIZE(req_ids) || block_size < 1)
        return PyErr_Format(PyExc_ValueError, "%zd rows but %zd requests", n, PyList_GET_SIZE(requests));
    m.block_size = block_size;
    m.cached = PyObject_GetAttr(pool, s_cached);  // the pool keeps it alive
    if (m.cached == nullptr) return nullptr;
    Py_DECREF(m.cached);
    if (!PyDict_Check(m.cached)) return PyErr_Format(PyExc_TypeError, "pool.cached must be a dict");
    Columns cols;
    if (!cols.open(array, 6)) return nullptr;
    if (n > cols.stride) return PyErr_Format(PyExc_ValueError, "%zd rows in columns of %zd", n, cols.stride);
    const Plan plan = plan_rows(cols, n, budget, max_model_len, lookahead, block_size, chunk_cap);
    if (!plan.event_rows.empty()) {
        FreeQueue fq{};
        if (!read_queue(queue, fq)) return nullptr;
        if (plan.blocks_needed > fq.num_free) Py_RETURN_NONE;
        if (!serve_events(m, fq, pool, plan, cols, requests, req_ids, caching, new_block_ids))
            return nullptr;  // an error inside a Python object's method: state is as far as it got
    }
    return step_lists(plan, cols, n, req_ids);
}

// The step's token counts (``sampled``, one per row), checked before anything changes: none negative, and they add
// up to the ``num_flat`` sampled tokens. ``num_empty``: the rows that sampled nothing.
bool read_counts(PyObject *sampled, Py_ssize_t num_flat, std::vector<Py_ssize_t> &counts, Py_ssize_t &num_empty) {
    Py_ssize_t total = 0;
    bool negative = false;
    for (size_t i = 0; i < counts.size() && !negative; ++i) {
        counts[i] = PyLong_AsSsize_t(PyList_GET_ITEM(sampled, static_cast<Py_ssize_t>(i)));
        negative = counts[i] < 0;
        total += counts[i];
        num_empty += counts[i] == 0;
    }
    if (PyErr_Occurred()) return false;
    if (negative || total != num_flat) {
        PyErr_Format(PyExc_ValueError, "token counts (sum %zd) do not match the %zd sampled tokens", total, num_flat);
        return false;
    }
    return true;
}

// Append ``flat[start : start + count]`` to a row's token list; ``hit``: one of them is a key of ``stops`` (null:
// no stop tokens to look for).
bool append_tokens(PyObject *list, PyObject *flat, Py_ssize_t start, Py_ssize_t count, PyObject *stops, bool &hit) {
    for (Py_ssize_t t = start; t < start + count; ++t) {
        PyObject *token = PyList_GET_ITEM(flat, t);
        if (PyList_Append(list, token) < 0) return false;
        if (stops != nullptr && !hit) {
            int found = PyDict_Contains(stops, token);
            if (found < 0) return false;
            hit = found;
        }
    }
    return true;
}

// take_tokens(columns, n, sampled, flat, token_lists, stop_tokens) -> (looked, num_empty)
//   The step's rows are the batch's rows 0..n-1 in order and no request holds drafts. Appends each row's sampled
//   tokens to its token list, advances num_tokens, and returns the rows that need per-request Python (their
//   num_tokens reached check_at, or a new token is a key of ``stop_tokens``) as a list of (row, start in flat,
//   num_tokens before, count, hit), the entries Intake._look_native takes (``hit``: a new token is a stop token),
//   and the number of rows that sampled nothing (those are not looked at).
PyObject *take_tokens(PyObject *, PyObject *args) {
    PyObject *array, *sampled, *flat, *lists, *stops;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OnO!O!O!O!", &array, &n, &PyList_Type, &sampled, &PyList_Type, &flat, &PyList_Type,
                          &lists, &PyDict_Type, &stops))
        return nullptr;
    if (PyList_GET_SIZE(sampled) != n || PyList_GET_SIZE(lists) < n)
        return PyErr_Format(PyExc_ValueError, "%zd rows, %zd counts", n, PyList_GET_SIZE(sampled));
    Columns cols;
    if (!cols.open(array, 6)) return nullptr;
    if (n > cols.stride) return PyErr_Format(PyExc_ValueError, "%zd rows in columns of %zd", n, cols.stride);
    int64_t *num_tokens = cols[NUM_TOKENS], *check_at = cols[CHECK_AT];
    Py_ssize_t start = 0, num_empty = 0;
    std::vector<Py_ssize_t> counts(n);
    if (!read_counts(sampled, PyList_GET_SIZE(flat), counts, num_empty)) return nullptr;
    bool any_stops = PyDict_GET_SIZE(stops) > 0;
    PyObject *looked = PyList_New(0);
    if (looked == nullptr) return nullptr;
    // The token lists are scattered over the heap and cold after a forward pass: each list object is prefetched
    // kAhead rows ahead, and the end of its item array (where the append writes) kAhead / 2 rows ahead.
    constexpr Py_ssize_t kAhead = 8;
    for (Py_ssize_t i = 0; i < n && i < kAhead; ++i) __builtin_prefetch(PyList_GET_ITEM(lists, i), 1);
    for (Py_ssize_t i = 0; i < n; ++i) {
        if (i + kAhead < n) __builtin_prefetch(PyList_GET_ITEM(lists, i + kAhead), 1);
        if (i + kAhead / 2 < n) {
            PyListObject *ahead = reinterpret_cast<PyListObject *>(PyList_GET_ITEM(lists, i + kAhead / 2));
            __builtin_prefetch(ahead->ob_item + Py_SIZE(ahead), 1);
        }
        Py_ssize_t count = counts[i];
        if (count == 0) continue;
        bool hit = false;
        if (!append_tokens(PyList_GET_ITEM(lists, i), flat, start, count, any_stops ? stops : nullptr, hit)) {
            Py_DECREF(looked);
            return nullptr;
        }
        int64_t before = num_tokens[i];
        num_tokens[i] = before + count;
        if (hit || num_tokens[i] >= check_at[i]) {
            PyObject *entry = Py_BuildValue("(nnLnO)", i, start, static_cast<long long>(before), count,
                                            hit ? Py_True : Py_False);
            if (entry == nullptr || PyList_Append(looked, entry) < 0) {
                Py_XDECREF(entry);
                Py_DECREF(looked);
                return nullptr;
            }
            Py_DECREF(entry);
        }
        start += count;
    }
    return Py_BuildValue("(Nn)", looked, num_empty);
}
}  // namespace
