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

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <openssl/sha.h>

#include <cstdint>
#include <cstring>
#include <ctime>
#include <vector>

namespace {

// Byte offsets of KVBlock's __slots__ in its instances (found from the member descriptors by ``bind``).
Py_ssize_t off_block_id = -1, off_ref_cnt, off_block_hash, off_prev_free, off_next_free;
PyTypeObject *block_type = nullptr;
PyObject *one = nullptr;                       // the int 1 (every new block's ref_cnt)
PyObject *s_head, *s_tail, *s_num_free_blocks, *s_num_evictions, *s_request_id, *s_block_hashes,
    *s_all_token_ids, *s_cache_salt, *s_cached, *s_spec_token_ids, *s_num_prompt_tokens, *s_length_limit, *s_pop,
    *s_peek, *s_sampling_params, *s_min_tokens, *s_status, *s_num_cached_tokens, *s_scheduled_time, *s_stop_ids;

inline int64_t ceil_div(int64_t a, int64_t b) { return a >= 0 ? (a + b - 1) / b : -((-a) / b); }  // Python's -(-a // b)

inline PyObject *&slot(PyObject *block, Py_ssize_t offset) {
    return *reinterpret_cast<PyObject **>(reinterpret_cast<char *>(block) + offset);
}

inline void set_slot(PyObject *block, Py_ssize_t offset, PyObject *value) {  // value: borrowed
    Py_INCREF(value);
    Py_XSETREF(slot(block, offset), value);
}

bool member_offset(PyObject *type, const char *name, Py_ssize_t *offset) {
    PyObject *descr = PyDict_GetItemString(reinterpret_cast<PyTypeObject *>(type)->tp_dict, name);
    if (descr == nullptr || !Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        PyErr_Format(PyExc_TypeError, "KVBlock.%s is not a __slots__ member", name);
        return false;
    }
    *offset = reinterpret_cast<PyMemberDescrObject *>(descr)->d_member->offset;
    return true;
}

// A view of a RunningBatch's int64 columns (rows of one 2-D C-contiguous array).
struct Columns {
    Py_buffer view{};
    int64_t *base = nullptr;
    Py_ssize_t stride = 0;  // elements per column
    bool open(PyObject *array, Py_ssize_t num_columns) {
        if (PyObject_GetBuffer(array, &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) return false;
        if (view.ndim != 2 || view.itemsize != 8 || view.shape[0] < num_columns || (strcmp(view.format, "l") != 0 && strcmp(view.format, "q") != 0)) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_TypeError, "the running batch's columns must be a 2-D C-contiguous int64 array");
            return false;
        }
        base = static_cast<int64_t *>(view.buf);
        stride = view.shape[1];
        return true;
    }
    int64_t *operator[](Py_ssize_t column) const { return base + column * stride; }
    ~Columns() {
        if (base != nullptr) PyBuffer_Release(&view);
    }
};

enum Column { COMPUTED = 0, NUM_TOKENS = 1, NUM_SPEC = 2, KV_SLOTS = 3, KV_NEXT_FULL = 4, CHECK_AT = 5 };

// The free queue's ends and count, read once per call and written back at the end.
struct FreeQueue {
    PyObject *queue, *head, *tail;
    Py_ssize_t num_free;
};

// ``FreeBlockQueue.popleft`` + ``BlockPool.get_new_block``'s eviction (the caller checked that a block is free).
PyObject *take_block(FreeQueue &fq, PyObject *cached, Py_ssize_t &evictions) {
    PyObject *block = slot(fq.head, off_next_free);  // borrowed: the links hold it
    if (block == fq.tail) {
        PyErr_SetString(PyExc_ValueError, "no free KV blocks left");
        return nullptr;
    }
    PyObject *next = slot(block, off_next_free);
    Py_INCREF(block);  // the caller's reference, from here on
    set_slot(fq.head, off_next_free, next);
    set_slot(next, off_prev_free, fq.head);
    set_slot(block, off_prev_free, Py_None);
    set_slot(block, off_next_free, Py_None);
    fq.num_free -= 1;
    PyObject *hash = slot(block, off_block_hash);
    if (hash != Py_None) {
        PyObject *canonical = PyDict_GetItemWithError(cached, hash);
        if (canonical == block) {
            if (PyDict_DelItem(cached, hash) < 0) {
                Py_DECREF(block);
                return nullptr;
            }
            evictions += 1;
        } else if (canonical == nullptr && PyErr_Occurred()) {
            Py_DECREF(block);
            return nullptr;
        }
        set_slot(block, off_block_hash, Py_None);
    }
    set_slot(block, off_ref_cnt, one);
    return block;
}

// ``extend_block_hashes`` for an unsalted request: append the hash of every full block of ``tokens`` past
// ``hashes``. Returns 0, -1 on error, or 1 when the tokens do not fit the int32 layout (the caller then lets the
// Python twin raise its error).
int extend_hashes(PyObject *hashes, PyObject *tokens, Py_ssize_t block_size, PyObject *root) {
    Py_ssize_t first = PyList_GET_SIZE(hashes), last = PyList_GET_SIZE(tokens) / block_size;
    if (last <= first) return 0;
    static std::vector<unsigned char> message;  // reused: the GIL serialises every call
    message.resize(static_cast<size_t>(16 + 4 * block_size));
    PyObject *parent = first ? PyList_GET_ITEM(hashes, first - 1) : root;
    if (!PyBytes_Check(parent) || PyBytes_GET_SIZE(parent) != 16) {
        PyErr_SetString(PyExc_TypeError, "block hashes must be 16-byte bytes");
        return -1;
    }
    memcpy(message.data(), PyBytes_AS_STRING(parent), 16);
    unsigned char digest[SHA256_DIGEST_LENGTH];
    for (Py_ssize_t b = first; b < last; ++b) {
        int32_t *ids = reinterpret_cast<int32_t *>(message.data() + 16);
        for (Py_ssize_t t = 0; t < block_size; ++t) {
            PyObject *item = PyList_GET_ITEM(tokens, b * block_size + t);
            int overflow = 0;
            long long id = PyLong_Check(item) ? PyLong_AsLongLongAndOverflow(item, &overflow) : (overflow = 1, 0);
            if (overflow || id < INT32_MIN || id > INT32_MAX) return 1;
            int32_t narrow = static_cast<int32_t>(id);
            memcpy(ids + t, &narrow, 4);  // little-endian on every machine this builds for (x86-64, arm64)
        }
        SHA256_CTX sha;  // the low-level calls: OpenSSL 3's one-shot SHA256() looks the algorithm up by name each call
        SHA256_Init(&sha);
        SHA256_Update(&sha, message.data(), message.size());
        SHA256_Final(digest, &sha);
        PyObject *hash = PyBytes_FromStringAndSize(reinterpret_cast<char *>(digest), 16);
        if (hash == nullptr) return -1;
        int rc = PyList_Append(hashes, hash);
        Py_DECREF(hash);
        if (rc < 0) return -1;
        memcpy(message.data(), digest, 16);
    }
    return 0;
}

// The KV manager's state ``schedule_running`` works on.
struct Manager {
    PyObject *req_blocks, *num_cached_blocks, *cached, *hash_fallback, *root;
    Py_ssize_t block_size;
};

// ``extend_block_hashes(request.block_hashes, request.all_token_ids, block_size, (salt,) or None)``: natively for an
// unsalted request, through the Python twin for a salted one (or tokens outside int32, whose error it raises).
bool hash_full_blocks(const Manager &m, PyObject *request, PyObject *hashes, PyObject *tokens) {
    PyObject *salt = PyObject_GetAttr(request, s_cache_salt);
    if (salt == nullptr) return false;
    int salted = PyObject_IsTrue(salt);
    int rc = salted < 0 ? -1 : 1;
    if (salted == 0 && PyList_CheckExact(tokens)) rc = extend_hashes(hashes, tokens, m.block_size, m.root);
    if (rc == 1) {
        PyObject *extra = salted ? PyTuple_Pack(1, salt) : Py_NewRef(Py_None);
        PyObject *size = PyLong_FromSsize_t(m.block_size);
        PyObject *res = extra && size ? PyObject_CallFunctionObjArgs(m.hash_fallback, hashes, tokens, size, extra,
                                                                     nullptr) : nullptr;
        rc = res ? 0 : -1;
        Py_XDECREF(res);
        Py_XDECREF(size);
        Py_XDECREF(extra);
    }
    Py_DECREF(salt);
    return rc == 0;
}

// ``KVCacheManager._register``: hash (if not done yet) and register blocks ``start .. end - 1`` of ``request``.
bool register_blocks(const Manager &m, PyObject *request, PyObject *rid, PyObject *held, Py_ssize_t start,
                     Py_ssize_t end) {
    PyObject *hashes = PyObject_GetAttr(request, s_block_hashes);
    if (hashes == nullptr) return false;
    bool ok = false;
    if (!PyList_CheckExact(hashes)) {
        PyErr_SetString(PyExc_TypeError, "request.block_hashes must be a list");
    } else if (PyList_GET_SIZE(hashes) >= end) {
        ok = true;
    } else {
        PyObject *tokens = PyObject_GetAttr(request, s_all_token_ids);
        ok = tokens != nullptr && hash_full_blocks(m, request, hashes, tokens);
        Py_XDECREF(tokens);
    }
    if (ok && PyList_GET_SIZE(hashes) < end) {
        PyErr_SetString(PyExc_RuntimeError, "a block to register has no hash (its tokens are not all there)");
        ok = false;
    }
    for (Py_ssize_t index = start; ok && index < end; ++index) {
        PyObject *block = PyList_GET_ITEM(held, index);
        if (slot(block, off_block_hash) != Py_None) continue;
        PyObject *hash = PyList_GET_ITEM(hashes, index);
        set_slot(block, off_block_hash, hash);
        ok = PyDict_SetDefault(m.cached, hash, block) != nullptr;
    }
    Py_DECREF(hashes);
    if (!ok) return false;
    PyObject *count = PyLong_FromSsize_t(end);
    if (count == nullptr) return false;
    int rc = PyDict_SetItem(m.num_cached_blocks, rid, count);
    Py_DECREF(count);
    return rc == 0;
}

bool is_block(PyObject *obj) { return PyObject_TypeCheck(obj, block_type); }

bool read_queue(PyObject *queue, FreeQueue &fq) {
    fq.queue = queue;
    PyObject *num = PyObject_GetAttr(queue, s_num_free_blocks);
    if (num == nullptr) return false;
    fq.num_free = PyLong_AsSsize_t(num);
    Py_DECREF(num);
    if (fq.num_free == -1 && PyErr_Occurred()) return false;
    fq.head = PyObject_GetAttr(queue, s_head);  // the sentinels: the queue keeps them alive
    fq.tail = PyObject_GetAttr(queue, s_tail);
    Py_XDECREF(fq.head);
    Py_XDECREF(fq.tail);
    if (fq.head == nullptr || fq.tail == nullptr) return false;
    if (!is_block(fq.head) || !is_block(fq.tail)) {
        PyErr_SetString(PyExc_TypeError, "the free queue's sentinels must be KVBlocks (call bind first)");
        return false;
    }
    return true;
}

bool read_int(PyObject *obj, PyObject *name, long long &value) {
    PyObject *attr = PyObject_GetAttr(obj, name);
    if (attr == nullptr) return false;
    value = PyLong_AsLongLong(attr);
    Py_DECREF(attr);
    return !(value == -1 && PyErr_Occurred());
}

bool add_to_attr(PyObject *obj, PyObject *name, Py_ssize_t delta) {
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == nullptr) return false;
    Py_ssize_t now = PyLong_AsSsize_t(value);
    Py_DECREF(value);
    if (now == -1 && PyErr_Occurred()) return false;
    PyObject *updated = PyLong_FromSsize_t(now + delta);
    if (updated == nullptr) return false;
    int rc = PyObject_SetAttr(obj, name, updated);
    Py_DECREF(updated);
    return rc == 0;
}

// Serve one row: ``KVCacheManager.allocate_running``'s loop body (the caller checked the pool has its blocks).
// ``next_full`` is the row's kv_next_full column, ``(num_cached_blocks[rid] + 1) * block_size`` (the column mirrors
// the manager), so the registered count needs no look-up; with prefix caching off nothing is ever registered.
bool serve_row(const Manager &m, FreeQueue &fq, Py_ssize_t &evictions, PyObject *request, PyObject *rid,
               int64_t room, int64_t final, int64_t next_full, bool caching, PyObject *new_block_ids) {
    PyObject *held = PyDict_GetItemWithError(m.req_blocks, rid);
    if (held == nullptr || !PyList_CheckExact(held)) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_KeyError, "running request %R holds no block list", rid);
        return false;
    }
    const int64_t bs = m.block_size;
    Py_ssize_t num_new = static_cast<Py_ssize_t>(ceil_div(room, bs)) - PyList_GET_SIZE(held);
    if (num_new > 0) {
        PyObject *ids = PyList_New(num_new);
        if (ids == nullptr) return false;
        for (Py_ssize_t i = 0; i < num_new; ++i) {
            PyObject *block = take_block(fq, m.cached, evictions);
            if (block == nullptr || PyList_Append(held, block) < 0) {
                Py_XDECREF(block);
                Py_DECREF(ids);
                return false;
            }
            PyList_SET_ITEM(ids, i, Py_NewRef(slot(block, off_block_id)));
            Py_DECREF(block);
        }
        int rc = PyDict_SetItem(new_block_ids, rid, ids);
        Py_DECREF(ids);
        if (rc < 0) return false;
    }
    if (caching && final >= next_full)
        return register_blocks(m, request, rid, held, static_cast<Py_ssize_t>(next_full / bs - 1),
                               static_cast<Py_ssize_t>(final / bs));
    return true;
}

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

// schedule_running(columns, n, budget, max_model_len, lookahead, requests, req_ids, req_blocks, num_cached_blocks,
//                  pool, free_queue, block_size, caching, root_hash, hash_fallback, new_block_ids)
//   -> None (nothing changed: the pool cannot serve every row; the Python path takes the step)
//    | (num_tokens, req_ids, num_computed_tokens, num_scheduled, rows or None when the scheduled rows are 0..k-1)
PyObject *schedule_running(PyObject *, PyObject *args) {
    PyObject *array, *requests, *req_ids, *pool, *queue, *new_block_ids;
    Py_ssize_t n, block_size;
    long long budget, max_model_len, lookahead;
    int caching;
    Manager m{};
    if (!PyArg_ParseTuple(args, "OnLLLO!O!O!O!OOnpO!OO!", &array, &n, &budget, &max_model_len, &lookahead,
                          &PyList_Type, &requests, &PyList_Type, &req_ids, &PyDict_Type, &m.req_blocks, &PyDict_Type,
                          &m.num_cached_blocks, &pool, &queue, &block_size, &caching, &PyBytes_Type, &m.root,
                          &m.hash_fallback, &PyDict_Type, &new_block_ids))
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
    int64_t *computed = cols[COMPUTED], *tokens = cols[NUM_TOKENS], *kv_slots = cols[KV_SLOTS],
            *next_full = cols[KV_NEXT_FULL];
    const int64_t bs = block_size;
    // Pass 1: the budget rule, and the blocks the rows that need the manager will take.
    std::vector<int64_t> grant(n), room(n);
    std::vector<Py_ssize_t> event_rows;
    int64_t used = 0, total = 0, blocks_needed = 0;
    Py_ssize_t scheduled = 0;
    for (Py_ssize_t i = 0; i < n; ++i) {
        int64_t want = tokens[i] - computed[i];
        int64_t g = budget - used;  // what the budget has left before this row
        g = g > 0 ? g : 0;
        g = g < want ? g : want;
        used += want;
        grant[i] = g;
        total += g;
        int64_t end = computed[i] + g, r = end;
        if (lookahead) {
            int64_t left = max_model_len - end;
            left = left > 0 ? left : 0;
            r += left < lookahead ? left : lookahead;
        }
        room[i] = r;
        if (g != 0) scheduled += 1;
        if (g > 0 && (r > kv_slots[i] || end >= next_full[i])) {
            event_rows.push_back(i);
            // kv_slots is the row's blocks times the block size (the column mirrors the manager), so the blocks
            // it lacks follow without touching its block list.
            if (r > kv_slots[i]) blocks_needed += ceil_div(r, bs) - kv_slots[i] / bs;
        }
    }
    const Py_ssize_t events = static_cast<Py_ssize_t>(event_rows.size());
    FreeQueue fq{};
    if (events && !read_queue(queue, fq)) return nullptr;
    if (events && blocks_needed > fq.num_free) Py_RETURN_NONE;
    // Pass 2: serve the rows in order (as allocate_running would), then the columns and the step's lists.
    Py_ssize_t evictions = 0, start_free = fq.num_free;
    bool ok = true;
    // The rows' request and id objects are cold after a forward pass: each is prefetched a few events ahead.
    constexpr Py_ssize_t kAhead = 4;
    for (Py_ssize_t e = 0; e < events && e < kAhead; ++e) {
        __builtin_prefetch(PyList_GET_ITEM(requests, event_rows[e]));
        __builtin_prefetch(PyList_GET_ITEM(req_ids, event_rows[e]));
    }
    for (Py_ssize_t e = 0; ok && e < events; ++e) {
        if (e + kAhead < events) {
            __builtin_prefetch(PyList_GET_ITEM(requests, event_rows[e + kAhead]));
            __builtin_prefetch(PyList_GET_ITEM(req_ids, event_rows[e + kAhead]));
        }
        const Py_ssize_t i = event_rows[e];
        int64_t final = computed[i] + grant[i];
        ok = serve_row(m, fq, evictions, PyList_GET_ITEM(requests, i), PyList_GET_ITEM(req_ids, i), room[i], final,
                       next_full[i], caching, new_block_ids);
        int64_t slots = ceil_div(room[i], bs) * bs;
        kv_slots[i] = kv_slots[i] > slots ? kv_slots[i] : slots;
        if (final >= next_full[i]) next_full[i] = (final / bs + 1) * bs;
    }
    if (events && fq.num_free != start_free) {
        PyObject *num = PyLong_FromSsize_t(fq.num_free);
        ok = num != nullptr && PyObject_SetAttr(queue, s_num_free_blocks, num) == 0 && ok;
        Py_XDECREF(num);
    }
    if (evictions) ok = add_to_attr(pool, s_num_evictions, evictions) && ok;
    if (!ok) return nullptr;  // an error inside a Python object's method: state is as far as it got
    PyObject *ids = PyList_New(scheduled), *before = PyList_New(scheduled), *counts = PyList_New(scheduled);
    PyObject *rows = nullptr;
    bool prefix = true;
    for (Py_ssize_t i = 0, k = 0; ids && before && counts && i < n; ++i) {
        if (grant[i] == 0) continue;
        if (k != i) prefix = false;
        PyList_SET_ITEM(ids, k, Py_NewRef(PyList_GET_ITEM(req_ids, i)));
        PyList_SET_ITEM(before, k, PyLong_FromLongLong(computed[i]));
        PyList_SET_ITEM(counts, k, PyLong_FromLongLong(grant[i]));
        k += 1;
    }
    if (ids && before && counts && !prefix) {
        rows = PyList_New(scheduled);
        for (Py_ssize_t i = 0, k = 0; rows && i < n; ++i)
            if (grant[i] != 0) PyList_SET_ITEM(rows, k++, PyLong_FromSsize_t(i));
    }
    for (Py_ssize_t i = 0; i < n; ++i) computed[i] += grant[i];
    if (ids == nullptr || before == nullptr || counts == nullptr || (!prefix && rows == nullptr) ||
        PyErr_Occurred()) {
        Py_XDECREF(ids);
        Py_XDECREF(before);
        Py_XDECREF(counts);
        Py_XDECREF(rows);
        return nullptr;
    }
    return Py_BuildValue("(LNNNN)", static_cast<long long>(total), ids, before, counts,
                         rows ? rows : Py_NewRef(Py_None));
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
    Py_ssize_t num_flat = PyList_GET_SIZE(flat), start = 0, total = 0, num_empty = 0;
    std::vector<Py_ssize_t> counts(n);
    bool negative = false;
    for (Py_ssize_t i = 0; i < n && !negative; ++i) {  // checked before anything changes
        counts[i] = PyLong_AsSsize_t(PyList_GET_ITEM(sampled, i));
        negative = counts[i] < 0;
        total += counts[i];
        num_empty += counts[i] == 0;
    }
    if (PyErr_Occurred()) return nullptr;
    if (negative || total != num_flat)
        return PyErr_Format(PyExc_ValueError, "token counts (sum %zd) do not match the %zd sampled tokens", total,
                            num_flat);
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
        PyObject *list = PyList_GET_ITEM(lists, i);
        bool hit = false;
        for (Py_ssize_t t = start; t < start + count; ++t) {
            PyObject *token = PyList_GET_ITEM(flat, t);
            if (PyList_Append(list, token) < 0) {
                Py_DECREF(looked);
                return nullptr;
            }
            if (any_stops && !hit) {
                int found = PyDict_Contains(stops, token);
                if (found < 0) {
                    Py_DECREF(looked);
                    return nullptr;
                }
                hit = found;
            }
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

// ``FreeBlockQueue.remove`` (a free block found in the prefix cache).
void unlink_block(FreeQueue &fq, PyObject *block) {
    PyObject *prev = slot(block, off_prev_free), *next = slot(block, off_next_free);
    set_slot(prev, off_next_free, next);  // prev and next stay alive: the queue links hold them
    set_slot(next, off_prev_free, prev);
    set_slot(block, off_prev_free, Py_None);
    set_slot(block, off_next_free, Py_None);
    fq.num_free -= 1;
}

bool write_free_count(const FreeQueue &fq) {
    PyObject *num = PyLong_FromSsize_t(fq.num_free);
    bool ok = num != nullptr && PyObject_SetAttr(fq.queue, s_num_free_blocks, num) == 0;
    Py_XDECREF(num);
    return ok;
}

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
    bool chunked, caching;
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

// A waiting request's admission within ``budget``, as Scheduler._allocate_new + RunningBatch.append do it through
// the KV manager: ``hash_blocks``, ``get_computed_blocks``, the chunk rule, ``allocate_slots`` (touching the hits,
// new blocks from the free queue, registering the blocks the step fills), ``block_ids``; then the request joins the
// running batch as its last row with ``slots_and_next_full`` (the caller made room in the columns). Returns 1 (done,
// ``out`` filled), 0 (it does not fit this step: nothing changed but its block hashes) or -1 (an error).
int admit_request(const Admission &a, PyObject *request, int64_t budget, Admitted &out) {
    const Manager &m = a.m;
    const Py_ssize_t block_size = m.block_size;
    const int64_t bs = block_size, step_lookahead = a.step_lookahead, max_model_len = a.max_model_len;
    const bool chunked = a.chunked, caching = a.caching;
    PyObject *pool = a.pool, *queue = a.queue;
    PyObject *rid = PyObject_GetAttr(request, s_request_id);
    PyObject *tokens = rid ? PyObject_GetAttr(request, s_all_token_ids) : nullptr;
    PyObject *hashes = tokens ? PyObject_GetAttr(request, s_block_hashes) : nullptr;
    int result = -1;
    PyObject *held = nullptr;
    std::vector<PyObject *> hits;  // borrowed: the prefix-cache table holds them
    FreeQueue fq{};
    if (hashes == nullptr || !PyList_CheckExact(tokens) || !PyList_CheckExact(hashes) || !PyDict_Check(m.cached)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "unexpected request or pool layout");
        goto done;
    }
    if (!read_queue(queue, fq)) goto done;
    {
        const Py_ssize_t num_tokens = PyList_GET_SIZE(tokens);
        int64_t num_hit = 0;
        if (caching) {
            if (num_tokens >= (PyList_GET_SIZE(hashes) + 1) * block_size) {  // ``hash_blocks``
                if (!hash_full_blocks(m, request, hashes, tokens)) goto done;
            }
            // ``get_computed_blocks``: the last token is always computed, so at most num_tokens - 1 tokens hit.
            Py_ssize_t max_blocks = (num_tokens - 1) / block_size;
            Py_ssize_t limit = PyList_GET_SIZE(hashes) < max_blocks ? PyList_GET_SIZE(hashes) : max_blocks;
            for (Py_ssize_t b = 0; b < limit; ++b) {
                PyObject *block = PyDict_GetItemWithError(m.cached, PyList_GET_ITEM(hashes, b));
                if (block == nullptr) {
                    if (PyErr_Occurred()) goto done;
                    break;
                }
                hits.push_back(block);
            }
            num_hit = static_cast<int64_t>(hits.size()) * bs;
        }
        int64_t num_new = num_tokens - num_hit;
        if (!chunked && num_new > budget) {
            result = 0;
            goto done;
        }
        num_new = num_new < budget ? num_new : budget;
        int64_t lookahead = max_model_len - (num_hit + num_new);
        lookahead = lookahead < step_lookahead ? lookahead : step_lookahead;
        lookahead = lookahead > 0 ? lookahead : 0;
        // ``allocate_slots(request, 0, num_new, hits, lookahead)`` for a request that holds no blocks yet.
        const Py_ssize_t num_hits = static_cast<Py_ssize_t>(hits.size());
        Py_ssize_t num_new_blocks = static_cast<Py_ssize_t>(ceil_div(num_hit + num_new + lookahead, bs)) - num_hits;
        Py_ssize_t num_free_hits = 0;
        for (PyObject *block : hits) {
            long ref = PyLong_AsLong(slot(block, off_ref_cnt));
            if (ref == -1 && PyErr_Occurred()) goto done;
            num_free_hits += ref == 0;
        }
        if ((num_new_blocks > 0 || num_hits) && num_new_blocks > fq.num_free - num_free_hits) {
            result = 0;
            goto done;
        }
        held = PyList_New(0);
        if (held == nullptr || PyDict_SetItem(m.req_blocks, rid, held) < 0) goto done;
        Py_ssize_t evictions = 0;
        for (PyObject *block : hits) {  // ``BlockPool.touch``
            long ref = PyLong_AsLong(slot(block, off_ref_cnt));
            if (ref == 0) unlink_block(fq, block);
            PyObject *bumped = PyLong_FromLong(ref + 1);
            if (bumped == nullptr) goto done;
            set_slot(block, off_ref_cnt, bumped);
            Py_DECREF(bumped);
            if (PyList_Append(held, block) < 0) goto done;
        }
        if (num_hits) {
            PyObject *count = PyLong_FromSsize_t(num_hits);
            int rc = count ? PyDict_SetItem(m.num_cached_blocks, rid, count) : -1;
            Py_XDECREF(count);
            if (rc < 0) goto done;
        }
        for (Py_ssize_t i = 0; i < num_new_blocks; ++i) {
            PyObject *block = take_block(fq, m.cached, evictions);
            int rc = block ? PyList_Append(held, block) : -1;
            Py_XDECREF(block);
            if (rc < 0) goto done;
        }
        bool ok = write_free_count(fq) && (!evictions || add_to_attr(pool, s_num_evictions, evictions));
        if (!ok) goto done;
        int64_t num_cached = num_hits;
        if (caching) {  // ``cache_full_blocks(request, min(num_hit + num_new, num_tokens))``
            int64_t final = num_hit + num_new < num_tokens ? num_hit + num_new : num_tokens;
            if (final / bs > num_cached) {
                if (!register_blocks(m, request, rid, held, static_cast<Py_ssize_t>(num_cached),
                                     static_cast<Py_ssize_t>(final / bs)))
                    goto done;
                num_cached = final / bs;
            }
        }
        Py_ssize_t num_held = PyList_GET_SIZE(held);
        PyObject *ids = PyList_New(num_held);
        if (ids == nullptr) goto done;
        for (Py_ssize_t i = 0; i < num_held; ++i)
            PyList_SET_ITEM(ids, i, Py_NewRef(slot(PyList_GET_ITEM(held, i), off_block_id)));
        int64_t next_full = caching ? (num_cached + 1) * bs : (int64_t(1) << 62);
        if (!append_row(a.batch, request, rid, tokens, num_hit + num_new, num_held * bs, next_full)) {
            Py_DECREF(ids);
            goto done;
        }
        out.block_ids = ids;
        out.rid = Py_NewRef(rid);
        out.tokens = Py_NewRef(tokens);
        out.num_hit = num_hit;
        out.num_new = num_new;
        result = 1;
    }
done:
    Py_XDECREF(held);
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
//               caching, root_hash, hash_fallback)
//   -> (budget left, requests admitted, prompt tokens of the admitted, their prefix-cache hit tokens)
//   ``Scheduler._schedule_waiting``: admit waiting requests in queue order (``peek``/``pop``, either policy) while
//   the budget and ``max_num_seqs`` allow, each through ``admit_request`` and ``record_admission``. The caller made
//   room in the columns for every row it may add, and bumps the batch's version and the stats after.
PyObject *admit_waiting(PyObject *, PyObject *args) {
    PyObject *waiting, *new_reqs, *step_req_ids, *num_scheduled, *dropped, *running, *new_request_type, *suppressed_fn;
    long long budget, max_rows, step_lookahead, max_model_len;
    int chunked, caching;
    Admission a{};
    PyObject *array;
    if (!PyArg_ParseTuple(args, "OLLpLLOO!O!O!O!O!O!O!OOOO!O!OOnpO!O", &waiting, &budget, &max_rows, &chunked,
                          &step_lookahead, &max_model_len, &array, &PyList_Type, &a.batch.requests,
                          &PyList_Type, &a.batch.req_ids, &PyList_Type, &a.batch.token_lists, &PyList_Type,
                          &new_reqs, &PyList_Type, &step_req_ids, &PyList_Type, &num_scheduled, &PySet_Type,
                          &dropped, &running, &new_request_type, &suppressed_fn, &PyDict_Type, &a.m.req_blocks,
                          &PyDict_Type, &a.m.num_cached_blocks, &a.pool, &a.queue, &a.m.block_size, &caching,
                          &PyBytes_Type, &a.m.root, &a.m.hash_fallback))
        return nullptr;
    if (off_block_id < 0) return PyErr_Format(PyExc_RuntimeError, "bind(KVBlock) first");
    Columns cols;
    if (!cols.open(array, 6)) return nullptr;
    a.batch.columns = &cols;
    a.chunked = chunked;
    a.caching = caching;
    a.step_lookahead = step_lookahead;
    a.max_model_len = max_model_len;
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

// ``BlockPool.free_blocks(reversed(blocks))`` on ``fq``: drop one reference from each block, tail first; those that
// reach zero join the free queue's tail in that order (the caller writes the free count back).
bool release_blocks(PyObject *blocks, FreeQueue &fq) {
    PyObject *last = slot(fq.tail, off_prev_free);
    Py_INCREF(last);
    bool ok = true;
    for (Py_ssize_t i = PyList_GET_SIZE(blocks) - 1; ok && i >= 0; --i) {
        PyObject *block = PyList_GET_ITEM(blocks, i);
        if (!is_block(block)) {
            PyErr_SetString(PyExc_TypeError, "a request's blocks must be KVBlocks");
            ok = false;
            break;
        }
        long ref = PyLong_AsLong(slot(block, off_ref_cnt)) - 1;
        if (ref < 0) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_AssertionError, "block %R freed twice", block);
            ok = false;
            break;
        }
        PyObject *count = PyLong_FromLong(ref);
        if (count == nullptr) {
            ok = false;
            break;
        }
        set_slot(block, off_ref_cnt, count);
        Py_DECREF(count);
        if (ref) continue;
        set_slot(last, off_next_free, block);  // ``FreeBlockQueue.extend``, one block at a time
        set_slot(block, off_prev_free, last);
        Py_SETREF(last, Py_NewRef(block));
        fq.num_free += 1;
    }
    set_slot(last, off_next_free, fq.tail);
    set_slot(fq.tail, off_prev_free, last);
    Py_DECREF(last);
    return ok;
}

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
        if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 5) {
            PyErr_SetString(PyExc_TypeError, "entries must be take_tokens' 5-tuples");
            ok = false;
            break;
        }
        row = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 0));
        before = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 2));
        count = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 3));
        hit = PyObject_IsTrue(PyTuple_GET_ITEM(entry, 4));
        if (PyErr_Occurred() || hit < 0 || row < 0 || row >= n) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "row %lld of %zd", row, n);
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
