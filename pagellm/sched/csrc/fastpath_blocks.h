// The fast path's shared part (fastpath.cpp): the interned names and KVBlock slot offsets, the running batch's
// columns, and the KV manager's block work that every call shares: the free queue (take, unlink, release),
// block hashing and registration in the prefix-cache table, and serving a running row's blocks.
#pragma once

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

// Token counts as Python ints (a new reference), each count below kCountCache built once and kept: a step's lists
// carry a count per running row (tokens computed before the step, tokens scheduled) and the prefix-cache counts, so
// an allocation, and later a deallocation, per row and step is what this saves. Above it: a fresh int.
constexpr int64_t kCountCache = int64_t{1} << 16;
std::vector<PyObject *> count_ints;

inline PyObject *count_int(int64_t value) {
    if (value < 0 || value >= kCountCache) return PyLong_FromLongLong(value);
    if (count_ints.empty()) count_ints.assign(static_cast<size_t>(kCountCache), nullptr);
    PyObject *&cached = count_ints[static_cast<size_t>(value)];
    if (cached == nullptr) cached = PyLong_FromLongLong(value);  // kept for the module's life
    return cached == nullptr ? nullptr : Py_NewRef(cached);
}

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
    PyObject *count = count_int(end);
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
}  // namespace
