// The scheduler's per-step loops over the running batch, as a CPython extension (pagellm/sched/native.py).
//
// A few calls take the common step (no draft tokens, the pool large enough for every row) instead of the numpy
// column work and the per-row Python: ``schedule_running`` hands the token budget out over the RunningBatch
// columns, serves the rows that need the KV manager (a new block, a block that fills: allocation from the free
// queue with lazy eviction, chained SHA-256 block hashes, registration in the prefix-cache table) and builds the
// step's lists; ``admit_waiting`` admits waiting requests (prefix look-up, first slots, the batch's new row, the
// step's NewRequestData); ``take_tokens`` appends the sampled tokens and picks the rows that need a stop rule or a
// first output; ``settle_rows`` records those that no token can stop and ends those at their length limit (their
// blocks back to the free queue); ``free_blocks`` and ``compact_rows`` return a finished request's blocks and drop
// its row. They work on the very Python objects the Python paths use (KVBlock slots, the free queue's links, the
// manager's dicts, the requests' token and hash lists), in the same order, so every block id, hash, free-list
// position and dict entry is what the Python twins (KVCacheManager, BlockPool, Intake) produce;
// tests/unit/test_scheduler_fastpath.py drives both in lockstep. Anything out of the common case (drafts, a pool
// that runs short, a salted request's hash) is left to the Python paths.
//
// The calls live in headers by concern, all compiled into this one translation unit: fastpath_blocks.h (shared
// state and the KV block work), fastpath_running.h, fastpath_admission.h and fastpath_finish.h.

#include "fastpath_blocks.h"  // first: it includes Python.h
#include "fastpath_admission.h"
#include "fastpath_finish.h"
#include "fastpath_running.h"

namespace {

PyObject *bind(PyObject *, PyObject *args) {
    PyObject *type;
    if (!PyArg_ParseTuple(args, "O!", &PyType_Type, &type)) return nullptr;
    if (!member_offset(type, "block_id", &off_block_id) || !member_offset(type, "ref_cnt", &off_ref_cnt) ||
        !member_offset(type, "block_hash", &off_block_hash) || !member_offset(type, "prev_free", &off_prev_free) ||
        !member_offset(type, "next_free", &off_next_free)) {
        off_block_id = -1;
        return nullptr;
    }
    Py_INCREF(type);
    Py_XSETREF(block_type, reinterpret_cast<PyTypeObject *>(type));
    Py_RETURN_NONE;
}

// extend_block_hashes(hashes, tokens, block_size, root) -> bool: ``kv.hashing.extend_block_hashes`` for an unsalted
// request (``hashes`` and ``tokens`` lists, ``root`` the 16-byte root hash). False, with nothing appended, when a
// token falls outside int32: the Python twin then raises its error.
PyObject *extend_block_hashes(PyObject *, PyObject *args) {
    PyObject *hashes, *tokens, *root;
    Py_ssize_t block_size;
    if (!PyArg_ParseTuple(args, "O!O!nO!", &PyList_Type, &hashes, &PyList_Type, &tokens, &block_size,
                          &PyBytes_Type, &root))
        return nullptr;
    if (block_size < 1) return PyErr_Format(PyExc_ValueError, "block_size must be positive, not %zd", block_size);
    if (PyBytes_GET_SIZE(root) != 16) return PyErr_Format(PyExc_ValueError, "the root hash must be 16 bytes");
    const Py_ssize_t first = PyList_GET_SIZE(hashes);
    const int rc = extend_hashes(hashes, tokens, block_size, root);
    if (rc < 0) return nullptr;
    if (rc == 1 && PyList_SetSlice(hashes, first, PY_SSIZE_T_MAX, nullptr) < 0) return nullptr;  // as it was
    return PyBool_FromLong(rc == 0);
}

PyMethodDef methods[] = {
    {"extend_block_hashes", extend_block_hashes, METH_VARARGS, "an unsalted request's new block hashes (see the source)"},
    {"bind", bind, METH_VARARGS, "bind(KVBlock): learn the block type's slot layout"},
    {"schedule_running", schedule_running, METH_VARARGS, "the running requests' share of a step (see the source)"},
    {"take_tokens", take_tokens, METH_VARARGS, "append a step's sampled tokens; the rows to look at"},
    {"admit_waiting", admit_waiting, METH_VARARGS, "admit waiting requests into the running batch (see the source)"},
    {"compact_rows", compact_rows, METH_VARARGS, "drop rows from the running batch's columns"},
    {"free_blocks", free_blocks, METH_VARARGS, "return a request's blocks to the free queue, tail first"},
    {"settle_rows", settle_rows, METH_VARARGS, "first outputs and length limits of looked-at rows (see the source)"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "pagellm_sched_fastpath", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_pagellm_sched_fastpath() {
    one = PyLong_FromLong(1);
    s_head = PyUnicode_InternFromString("_head");
    s_tail = PyUnicode_InternFromString("_tail");
    s_num_free_blocks = PyUnicode_InternFromString("num_free_blocks");
    s_num_evictions = PyUnicode_InternFromString("num_evictions");
    s_request_id = PyUnicode_InternFromString("request_id");
    s_block_hashes = PyUnicode_InternFromString("block_hashes");
    s_all_token_ids = PyUnicode_InternFromString("all_token_ids");
    s_cache_salt = PyUnicode_InternFromString("cache_salt");
    s_cached = PyUnicode_InternFromString("cached");
    s_spec_token_ids = PyUnicode_InternFromString("spec_token_ids");
    s_num_prompt_tokens = PyUnicode_InternFromString("num_prompt_tokens");
    s_length_limit = PyUnicode_InternFromString("length_limit");
    s_pop = PyUnicode_InternFromString("pop");
    s_peek = PyUnicode_InternFromString("peek");
    s_sampling_params = PyUnicode_InternFromString("sampling_params");
    s_min_tokens = PyUnicode_InternFromString("min_tokens");
    s_status = PyUnicode_InternFromString("status");
    s_num_cached_tokens = PyUnicode_InternFromString("num_cached_tokens");
    s_scheduled_time = PyUnicode_InternFromString("scheduled_time");
    s_stop_ids = PyUnicode_InternFromString("stop_ids");
    return PyModule_Create(&module);
}
