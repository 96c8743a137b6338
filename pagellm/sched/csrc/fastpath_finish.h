// Rows that end or leave (fastpath.cpp): ``settle_rows`` (first outputs, length limits), ``free_blocks`` and
// ``compact_rows``.
#pragma once

#include "fastpath_blocks.h"

namespace {

// free_blocks(blocks, free_queue): ``KVCacheManager.free``'s pool part, ``release_blocks``.
PyObject *free_blocks(PyObject *, PyObject *args) {
    PyObject *blocks, *queue;
    if (!PyArg_ParseTuple(args, "O!O", &PyList_Type, &blocks, &queue)) return nullptr;
    if (off_block_id < 0) return PyErr_Format(PyExc_RuntimeError, "bind(KVBlock) first");
    FreeQueue fq{};
    if (!read_queue(queue, fq)) return nullptr;
    bool ok = release_blocks(blocks, fq);
    ok = write_free_count(fq) && ok;
    if (!ok) return nullptr;
    Py_RETURN_NONE;
}

// Where a request that ends on its length limit leaves its traces (``Scheduler._finish``'s state).
struct Ending {
    PyObject *by_id, *finish_reasons, *status, *reason, *dropped, *stop_tokens, *req_blocks, *num_cached_blocks;
    FreeQueue fq;
};

// ``Scheduler._finish(request, status)`` and the finish reason ``Intake._look_native`` records: the request's status,
// no drafts, ``KVCacheManager.free`` (its block list and registered count dropped, its blocks released), its id
// among the dropped, its stop tokens uncounted (``StopRules.remove``), gone from the unfinished requests.
bool end_request(Ending &e, PyObject *request, PyObject *rid) {
    if (PyObject_SetAttr(request, s_status, e.status) < 0) return false;
    PyObject *spec = PyObject_GetAttr(request, s_spec_token_ids);
    int has_spec = spec ? PyObject_IsTrue(spec) : -1;
    Py_XDECREF(spec);
    if (has_spec < 0) return false;
    if (has_spec) {
        PyObject *none = PyList_New(0);
        int rc = none ? PyObject_SetAttr(request, s_spec_token_ids, none) : -1;
        Py_XDECREF(none);
        if (rc < 0) return false;
    }
    PyObject *held = PyDict_GetItemWithError(e.req_blocks, rid);
    if (held == nullptr && PyErr_Occurred()) return false;
    Py_XINCREF(held);
    bool ok = held == nullptr || (PyList_CheckExact(held) && PyDict_DelItem(e.req_blocks, rid) == 0);
    if (ok) {
        int cached = PyDict_Contains(e.num_cached_blocks, rid);
        ok = cached == 0 || (cached == 1 && PyDict_DelItem(e.num_cached_blocks, rid) == 0);
    }
    if (ok && held != nullptr) ok = release_blocks(held, e.fq);
    Py_XDECREF(held);
    if (!ok || PySet_Add(e.dropped, rid) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "a request's blocks must be a list");
        return false;
    }
    PyObject *stop_ids = PyObject_GetAttr(request, s_stop_ids);
    PyObject *iter = stop_ids ? PyObject_GetIter(stop_ids) : nullptr;
    Py_XDECREF(stop_ids);
    if (iter == nullptr) return false;
    while (PyObject *token = PyIter_Next(iter)) {
        PyObject *count = PyDict_GetItemWithError(e.stop_tokens, token);
        long left = count ? PyLong_AsLong(count) - 1 : -1;
        PyObject *updated = left > 0 ? PyLong_FromLong(left) : nullptr;
        ok = left == 0 ? PyDict_DelItem(e.stop_tokens, token) == 0
                       : updated != nullptr && PyDict_SetItem(e.stop_tokens, token, updated) == 0;
        Py_XDECREF(updated);
        if (!ok && !PyErr_Occurred()) PyErr_Format(PyExc_KeyError, "stop token %R is not counted", token);
        Py_DECREF(token);
        if (!ok) break;
    }
    Py_DECREF(iter);
    if (!ok || PyErr_Occurred()) return false;
    return PyDict_DelItem(e.by_id, rid) == 0 && PyDict_SetItem(e.finish_reasons, rid, e.reason) == 0;
}

// One of ``take_tokens``' entries ``(row, start, num_tokens before, count, hit)``, checked (a row of the ``n``).
bool read_entry(PyObject *entry, Py_ssize_t n, long long &row, long long &before, long long &count, int &hit) {
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 5) {
        PyErr_SetString(PyExc_TypeError, "entries must be take_tokens' 5-tuples");
        return false;
    }
    row = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 0));
    before = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 2));
    count = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 3));
    hit = PyObject_IsTrue(PyTuple_GET_ITEM(entry, 4));
    if (PyErr_Occurred() || hit < 0 || row < 0 || row >= n) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "row %lld of %zd", row, n);
        return false;
    }
    return true;
}

// settle_rows(looked, columns, requests, req_ids, by_id, finish_reasons, length_status, length_reason, dropped,
//             stop_tokens, req_blocks, num_cached_blocks, free_queue) -> (first, finished, rest)
//   ``Intake._look_native``'s rows that no token can stop: ``take_tokens``' entries ``(row, start, num_tokens before,
//   count, hit)`` without a hit, and not several tokens reaching the length limit. Each such row's check_at becomes
//   its length_limit; ``first`` lists the requests that got their first output; a row whose one token reaches its
//   length_limit ends there (``end_request``, FINISHED_LENGTH_CAPPED) and its row joins ``finished``. From the first
//   other entry on, every entry comes back in ``rest`` (for the exact stop rules in Python, in row order after the
//   settled ones, so first outputs and finish reasons are recorded in row order as the Python path does).
PyObject *settle_rows(PyObject *, PyObject *args) {
    PyObject *looked, *array, *requests, *req_ids, *queue;
    Ending e{};
    if (!PyArg_ParseTuple(args, "O!OO!O!O!O!OOO!O!O!O!O", &PyList_Type, &looked, &array, &PyList_Type, &requests,
                          &PyList_Type, &req_ids, &PyDict_Type, &e.by_id, &PyDict_Type, &e.finish_reasons, &e.status,
                          &e.reason, &PySet_Type, &e.dropped, &PyDict_Type, &e.stop_tokens, &PyDict_Type,
                          &e.req_blocks, &PyDict_Type, &e.num_cached_blocks, &queue))
        return nullptr;
    if (off_block_id < 0) return PyErr_Format(PyExc_RuntimeError, "bind(KVBlock) first");
    Columns cols;
    if (!cols.open(array, 6)) return nullptr;
    const Py_ssize_t n = PyList_GET_SIZE(requests);
    if (n > cols.stride || PyList_GET_SIZE(req_ids) != n)
        return PyErr_Format(PyExc_ValueError, "%zd rows in columns of %zd", n, cols.stride);
    int64_t *check_at = cols[CHECK_AT];
    PyObject *first = PyList_New(0), *finished = PyList_New(0), *rest = PyList_New(0);
    bool ok = first && finished && rest, queue_read = false;
    for (Py_ssize_t j = 0; ok && j < PyList_GET_SIZE(looked); ++j) {
        PyObject *entry = PyList_GET_ITEM(looked, j);
        long long row = -1, before = 0, count = 0;
        int hit = 1;
        if (!read_entry(entry, n, row, before, count, hit)) {
            ok = false;
            break;
        }
        PyObject *request = PyList_GET_ITEM(requests, row);
        long long limit = 0, prompt = 0;
        if (!read_int(request, s_length_limit, limit) || !read_int(request, s_num_prompt_tokens, prompt)) {
            ok = false;
            break;
        }
        const bool ends = before + count >= limit;
        if (hit || (ends && count > 1)) {  // this entry and all after it, so the outputs keep row order
            PyObject *tail = PyList_GetSlice(looked, j, PyList_GET_SIZE(looked));
            ok = tail != nullptr;
            Py_XSETREF(rest, tail);
            break;
        }
        if (before == prompt && PyList_Append(first, request) < 0) {
            ok = false;
            break;
        }
        check_at[row] = limit;
        if (!ends) continue;
        if (!queue_read && !(queue_read = read_queue(queue, e.fq))) {
            ok = false;
            break;
        }
        ok = end_request(e, request, PyList_GET_ITEM(req_ids, row)) &&
             PyList_Append(finished, PyTuple_GET_ITEM(entry, 0)) == 0;
    }
    if (queue_read) ok = write_free_count(e.fq) && ok;
    if (!ok) {
        Py_XDECREF(first);
        Py_XDECREF(finished);
        Py_XDECREF(rest);
        return nullptr;
    }
    return Py_BuildValue("(NNN)", first, finished, rest);
}

// compact_rows(columns, n, rows, *lists): ``RunningBatch.remove_rows``: drop the given rows (ascending, distinct,
// below n) from every column and from each list (of n items), the others keeping their order, in one pass per
// column and list. The dropped items are released last, once every list is consistent again (releasing a request
// may run arbitrary code).
PyObject *compact_rows(PyObject *, PyObject *args) {
    const Py_ssize_t num_args = PyTuple_GET_SIZE(args);
    if (num_args < 3) return PyErr_Format(PyExc_TypeError, "compact_rows(columns, n, rows, *lists)");
    PyObject *array = PyTuple_GET_ITEM(args, 0), *rows = PyTuple_GET_ITEM(args, 2);
    const Py_ssize_t n = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, 1));
    if (n == -1 && PyErr_Occurred()) return nullptr;
    if (!PyList_Check(rows)) return PyErr_Format(PyExc_TypeError, "rows must be a list");
    for (Py_ssize_t a = 3; a < num_args; ++a)
        if (!PyList_CheckExact(PyTuple_GET_ITEM(args, a)) || PyList_GET_SIZE(PyTuple_GET_ITEM(args, a)) != n)
            return PyErr_Format(PyExc_ValueError, "every list must be a list of the %zd rows", n);
    Columns cols;
    if (!cols.open(array, 6)) return nullptr;
    if (n > cols.stride) return PyErr_Format(PyExc_ValueError, "%zd rows in columns of %zd", n, cols.stride);
    const Py_ssize_t k = PyList_GET_SIZE(rows);
    std::vector<Py_ssize_t> drop(k);
    for (Py_ssize_t i = 0; i < k; ++i) {
        drop[i] = PyLong_AsSsize_t(PyList_GET_ITEM(rows, i));
        if (drop[i] == -1 && PyErr_Occurred()) return nullptr;
        if (drop[i] < 0 || drop[i] >= n || (i && drop[i] <= drop[i - 1]))
            return PyErr_Format(PyExc_ValueError, "rows must be ascending, distinct and below %zd", n);
    }
    for (Py_ssize_t c = 0; c < cols.view.shape[0]; ++c) {
        int64_t *column = cols[c];
        for (Py_ssize_t i = 0; i < k; ++i) {  // the run after drop[i] moves up by i + 1
            Py_ssize_t from = drop[i] + 1, to = i + 1 < k ? drop[i + 1] : n;
            memmove(column + from - (i + 1), column + from, static_cast<size_t>(to - from) * sizeof(int64_t));
        }
    }
    std::vector<PyObject *> dropped;
    dropped.reserve(static_cast<size_t>(k * (num_args - 3)));
    for (Py_ssize_t a = 3; a < num_args; ++a) {
        PyListObject *list = reinterpret_cast<PyListObject *>(PyTuple_GET_ITEM(args, a));
        for (Py_ssize_t i = 0; i < k; ++i) {
            dropped.push_back(list->ob_item[drop[i]]);
            Py_ssize_t from = drop[i] + 1, to = i + 1 < k ? drop[i + 1] : n;
            memmove(list->ob_item + from - (i + 1), list->ob_item + from,
                    static_cast<size_t>(to - from) * sizeof(PyObject *));
        }
        Py_SET_SIZE(list, n - k);  // the list keeps its allocation, as ``del`` of one item at a time may
    }
    for (PyObject *item : dropped) Py_DECREF(item);
    Py_RETURN_NONE;
}
}  // namespace
