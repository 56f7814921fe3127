/* ========================================================================================= text journal
 * ``StepRecorder.put_text`` in one C call (``files/step_recorder.py``; #included by _fast_stats.c): a record given
 * as its JSON text is stored in the recorder's dicts and journaled whole, its frame built here and copied into the
 * journal's shared memory map, the same bytes ``marshal.dumps`` writes.
 *
 *   TextJournal(recorder, append, text_fields, put_text_field, field_keys)
 *                                  -> over one StepRecorder (a weak reference); append: ``Journal.append`` (a journal
 *                                     whose class has another one, a test's fault injection, is given each frame
 *                                     through it); text_fields: the ``TextFields`` class; put_text_field: the
 *                                     Python method (the route of a record that is no ``TextFields``); field_keys:
 *                                     ``_FIELD_KEYS`` (a field name -> its JSON text and '": [', as
 *                                     ``TextFields.text`` writes it: a complete record's text is made here when
 *                                     each of its names is there, by the method otherwise)
 *     .reserve(name, stack=None)  -> int (``StepRecorder.reserve``)
 *     .put_text(name, text, seq, stack=None, parent=NO_PARENT) -> None (``StepRecorder.put_text``)
 *     .put_text_field(name, field, index, text, fields, arg, parent=NO_PARENT) -> bool
 *                                  (``StepRecorder.put_text_field``: a slot of a ``TextFields`` record set here, the
 *                                  record's first field included (``fields(arg)`` called, its place taken, its
 *                                  skeleton journaled); a record that is no ``TextFields``, or an index that is no
 *                                  int from 0 on, by the Python method, ``put_field``)
 *     .count                       -> the records it stored (the recorder's change count adds them)
 *     .journal                     -> the recorder's ``_journal`` (set with it, under the lock)
 *   JournalBase, JournalLock       -> ``Journal``'s base (its map and position as C fields) and the recorder's lock
 *
 * The recorder's Python route stays the reference: the same dict stores, the same lock (a ``JournalLock``, taken
 * here with no Python call) and queue (a frame goes behind fragments still queued, or into the queue when the
 * disk is full), the same ``Journal`` (its ``JournalBase`` fields read and ``_pos`` moved on, the frames stored
 * as ``Journal.append`` stores them; ``Journal.append`` called whenever the map has no room, so growing and the
 * ``os.write`` fallback stay Python's).
 *
 * ``marshal.dumps`` (version 4) flags every object whose reference count is above one as a possible
 * back-reference (FLAG_REF), and writes an object seen before in the same frame as a reference to it. In
 * ``put_text``'s frame every item is held by a local variable as well as by the tuple, and the tuple by its
 * variable and the call: all of them are flagged. ``m_object`` writes them so; a frame with anything else than
 * ASCII strings, 32-bit ints, None and booleans (a non-ASCII name or text) is given to ``marshal`` itself, on a
 * tuple held twice. A first field's frame also holds the record's skeleton (``m_skeleton``): a dict held by the
 * tuple and a variable (flagged), its keys the record's own (flagged), its lists of None held by it alone (not). */

#include <marshal.h>
#include <stdatomic.h>

#define M_FLAG_REF 0x80
#define M_REFS 24

typedef struct { PyObject *seen[M_REFS]; int n; } mrefs_t;

/* v as 4 little-endian bytes (``m_le32``), or one byte (``m_byte``), stored in place where b has room (``m_frame``
 * makes it for its items), through ``text_put`` otherwise. */
static inline int m_le32(text_t *b, uint32_t v) {
    unsigned char c[4] = {(unsigned char)v, (unsigned char)(v >> 8), (unsigned char)(v >> 16), (unsigned char)(v >> 24)};
    if (b->len + 4 > b->cap) return text_put(b, (const char *)c, 4);
    memcpy(b->p + b->len, c, 4);
    b->len += 4;
    return 0;
}

static inline int m_byte(text_t *b, unsigned char c) {
    if (b->len == b->cap) return text_put(b, (const char *)&c, 1);
    b->p[b->len++] = (char)c;
    return 0;
}

static int m_object(text_t *b, mrefs_t *r, PyObject *v);

/* A record's skeleton (``TextFields.skeleton``: a flagged dict of ASCII field names, each held elsewhere as well (the
 * record's key), to lists of None held by the dict alone, which marshal does not flag): 0 written, 1 another shape
 * (the caller gives the frame to ``marshal``), -1 with an error. */
static int m_skeleton(text_t *b, mrefs_t *r, PyObject *v) {
    if (r->n == M_REFS) return 1;
    r->seen[r->n++] = v;
    if (m_byte(b, '{' | M_FLAG_REF) < 0) return -1;
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(v, &pos, &key, &value)) {
        if (!PyUnicode_CheckExact(key) || Py_REFCNT(key) == 1 || !PyList_CheckExact(value) || Py_REFCNT(value) != 1)
            return 1;
        int rc = m_object(b, r, key);
        if (rc != 0) return rc;
        Py_ssize_t n = PyList_GET_SIZE(value);
        if (n > INT32_MAX || m_byte(b, '[') < 0 || m_le32(b, (uint32_t)n) < 0) return n > INT32_MAX ? 1 : -1;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (PyList_GET_ITEM(value, i) != Py_None) return 1;
            if (m_byte(b, 'N') < 0) return -1;
        }
    }
    return m_byte(b, '0');  /* marshal's end of a dict */
}

/* v as marshal writes it inside a frame whose items are all flagged: 0 written, 1 not a type written here (the
 * caller gives the frame to ``marshal``), -1 with an error. */
static int m_object(text_t *b, mrefs_t *r, PyObject *v) {
    if (v == Py_None) return m_byte(b, 'N');
    if (v == Py_False) return m_byte(b, 'F');
    if (v == Py_True) return m_byte(b, 'T');
    for (int i = 0; i < r->n; i++)
        if (r->seen[i] == v) return m_byte(b, 'r') < 0 ? -1 : m_le32(b, (uint32_t)i);
    if (r->n == M_REFS) return 1;
    if (PyLong_CheckExact(v)) {
        int overflow;
        long x = PyLong_AsLongAndOverflow(v, &overflow);
        if (overflow || x < INT32_MIN || x > INT32_MAX) return 1;  /* TYPE_LONG: marshal's */
        r->seen[r->n++] = v;
        return m_byte(b, 'i' | M_FLAG_REF) < 0 ? -1 : m_le32(b, (uint32_t)(int32_t)x);
    }
    if (PyUnicode_CheckExact(v) && PyUnicode_IS_ASCII(v)) {
        Py_ssize_t n = PyUnicode_GET_LENGTH(v);
        int interned = PyUnicode_CHECK_INTERNED(v) != 0;
        int rc;
        r->seen[r->n++] = v;
        if (n < 256)
            rc = m_byte(b, (interned ? 'Z' : 'z') | M_FLAG_REF) < 0 ? -1 : m_byte(b, (unsigned char)n);
        else if (n <= INT32_MAX)
            rc = m_byte(b, (interned ? 'A' : 'a') | M_FLAG_REF) < 0 ? -1 : m_le32(b, (uint32_t)n);
        else
            return 1;
        return rc < 0 ? -1 : text_put(b, (const char *)PyUnicode_1BYTE_DATA(v), n);
    }
    if (PyDict_CheckExact(v)) return m_skeleton(b, r, v);
    return 1;
}

/* The frame of the tuple of items[0..n) (length prefix, then marshal's bytes) appended to b: 0, or -1 with an
 * error. */
static int m_frame(text_t *b, PyObject *const *items, Py_ssize_t n) {
    Py_ssize_t start = b->len, room = 6;  /* the frame's length and the tuple's head; then each item's most */
    for (Py_ssize_t i = 0; i < n; i++)  /* (a str: 5 bytes before its text; others 5 at most, a skeleton more) */
        room += PyUnicode_CheckExact(items[i]) && PyUnicode_IS_ASCII(items[i]) ? 5 + PyUnicode_GET_LENGTH(items[i]) : 5;
    mrefs_t refs = {.n = 1};  /* the tuple itself is reference 0 */
    refs.seen[0] = NULL;
    int rc = text_room(b, room) < 0 ? -1 : m_le32(b, 0);
    if (rc == 0) rc = m_byte(b, ')' | M_FLAG_REF) < 0 ? -1 : m_byte(b, (unsigned char)n);
    for (Py_ssize_t i = 0; i < n && rc == 0; i++) rc = m_object(b, &refs, items[i]);
    if (rc > 0) {  /* marshal's own writer, on a tuple held twice as in the Python route */
        b->len = start;
        PyObject *tuple = PyTuple_New(n);
        if (tuple == NULL) return -1;
        for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(tuple, i, Py_NewRef(items[i]));
        Py_INCREF(tuple);
        PyObject *body = PyMarshal_WriteObjectToString(tuple, Py_MARSHAL_VERSION);
        Py_DECREF(tuple);
        Py_DECREF(tuple);
        if (body == NULL) return -1;
        rc = m_le32(b, (uint32_t)PyBytes_GET_SIZE(body));
        if (rc == 0) rc = text_put(b, PyBytes_AS_STRING(body), PyBytes_GET_SIZE(body));
        Py_DECREF(body);
        return rc;
    }
    if (rc < 0) return -1;
    uint32_t size = (uint32_t)(b->len - start - 4);
    unsigned char c[4] = {(unsigned char)size, (unsigned char)(size >> 8), (unsigned char)(size >> 16),
                          (unsigned char)(size >> 24)};
    memcpy(b->p + start, c, 4);
    return 0;
}

/* ----------------------------------------------------------------------------- JournalBase, JournalLock
 * ``JournalBase``: the base class of ``files/journal.py``'s ``Journal``, holding its ``_pos`` and ``_size`` and its
 * map (``_map``: the mmap or None; its writable buffer held while set, so the frames of ``put_text`` are copied
 * into it with no attribute read or set). ``JournalLock``: ``StepRecorder``'s journal lock, ``threading.Lock``'s
 * ``acquire``/``release``/``with`` (blocking, the GIL released while waiting), taken by ``put_text`` without a
 * Python call. Both rely on the GIL (this extension is built for Python with one). */

typedef struct {
    PyObject_HEAD
    PyObject *map;   /* the mmap, or NULL for None */
    Py_buffer view;  /* its bytes while map is set */
    Py_ssize_t pos, size;
} JournalBaseObject;

static PyObject *jb_get_map(JournalBaseObject *self, void *closure) {
    return Py_NewRef(self->map ? self->map : Py_None);
}

static int jb_set_map(JournalBaseObject *self, PyObject *value, void *closure) {
    Py_buffer view = {0};
    if (value == NULL) value = Py_None;
    if (value != Py_None && PyObject_GetBuffer(value, &view, PyBUF_WRITABLE) < 0) return -1;
    if (self->map != NULL) PyBuffer_Release(&self->view);
    Py_XSETREF(self->map, value == Py_None ? NULL : Py_NewRef(value));
    self->view = view;
    return 0;
}

static void jb_dealloc(JournalBaseObject *self) {
    if (self->map != NULL) PyBuffer_Release(&self->view);
    Py_CLEAR(self->map);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef jb_members[] = {
    {"_pos", T_PYSSIZET, offsetof(JournalBaseObject, pos), 0, "where the next frame goes"},
    {"_size", T_PYSSIZET, offsetof(JournalBaseObject, size), 0, "the mapped (reserved) size"},
    {NULL},
};

static PyGetSetDef jb_getset[] = {
    {"_map", (getter)jb_get_map, (setter)jb_set_map, "the journal's shared memory map, or None", NULL},
    {NULL},
};

static PyTypeObject JournalBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "msprobe_core.stats._fast_stats.JournalBase",
    .tp_basicsize = sizeof(JournalBaseObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Journal's position and map (see files/journal.py)",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)jb_dealloc,
    .tp_members = jb_members,
    .tp_getset = jb_getset,
};

/* Held or not is a flag read and set with the GIL held (one step, no system call, no clock read: threading.Lock's
 * acquire reads the clock even when it need not wait); a thread that finds it held sleeps on the gate with the GIL
 * released, and a release that has waiters opens the gate. An extra opening wakes a waiter that finds the lock held
 * again and sleeps again. */
typedef struct {
    PyObject_HEAD
    PyThread_type_lock gate;  /* closed (acquired) while nobody is to wake */
    int held, waiters;
} JournalLockObject;

static void jl_take(JournalLockObject *self) {
    if (!self->held) {
        self->held = 1;
        return;
    }
    self->waiters++;
    while (self->held) {
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(self->gate, WAIT_LOCK);
        Py_END_ALLOW_THREADS
    }
    self->waiters--;
    self->held = 1;
}

static void jl_give(JournalLockObject *self) {
    self->held = 0;
    if (self->waiters) PyThread_release_lock(self->gate);
}

static PyObject *jl_acquire(JournalLockObject *self, PyObject *unused) {
    jl_take(self);
    Py_RETURN_TRUE;
}

static PyObject *jl_release(JournalLockObject *self, PyObject *unused) {
    if (!self->held) {
        PyErr_SetString(PyExc_RuntimeError, "release unlocked lock");
        return NULL;
    }
    jl_give(self);
    Py_RETURN_NONE;
}

static PyObject *jl_exit(JournalLockObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return jl_release(self, NULL);
}

static PyObject *jl_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds != NULL && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "JournalLock() takes no arguments");
        return NULL;
    }
    JournalLockObject *self = (JournalLockObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->gate = PyThread_allocate_lock();
    if (self->gate == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    PyThread_acquire_lock(self->gate, NOWAIT_LOCK);  /* closed */
    return (PyObject *)self;
}

static void jl_dealloc(JournalLockObject *self) {
    if (self->gate != NULL) PyThread_free_lock(self->gate);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef jl_methods[] = {
    {"acquire", (PyCFunction)jl_acquire, METH_NOARGS, "acquire() -> True (waits)"},
    {"release", (PyCFunction)jl_release, METH_NOARGS, "release()"},
    {"__enter__", (PyCFunction)jl_acquire, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))jl_exit, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject JournalLockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "msprobe_core.stats._fast_stats.JournalLock",
    .tp_basicsize = sizeof(JournalLockObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "StepRecorder's journal lock (threading.Lock's acquire/release/with; see _fast_journal.c)",
    .tp_new = jl_new,
    .tp_dealloc = (destructor)jl_dealloc,
    .tp_methods = jl_methods,
};

#define TJ_MEMO_BITS 6 /* 64 stacks a TextJournal knows the sids of (a step's records come from a few call sites) */
#define TJ_MEMO (1 << TJ_MEMO_BITS)

/* TextJournal's object fields */
#define TJ_OBJECTS(X) X(recorder) X(data) X(construct) X(stacks) X(journaled) X(queued) X(counter) X(lock) \
                      X(journal) X(append) X(text_fields) X(put_field) X(field_keys)

typedef struct {
    PyObject_HEAD
    TJ_OBJECTS(RT_DECLARE)
    Py_ssize_t count;
    int dir_ready;  /* the recorder's ``_dir_ready`` seen true (it never turns false again): not read any more */
    int journal_base;  /* journal is a JournalBase (checked once, when it is set) */
    /* Stacks whose sid is in the journaled set, and that sid, at a place of their address (``tj_stack_sid``) */
    PyObject *memo_stack[TJ_MEMO], *memo_sid[TJ_MEMO];
} TextJournalObject;

/* The Journal the recorder writes, or None (``journal``: NULL only once cleared) */
#define TJ_JOURNAL(self) ((self)->journal ? (self)->journal : Py_None)

static PyObject *S_DIR_READY, *S_ENSURE_DIR, *S_SID, *S_FRAMES, *S_APPEND, *S_J,
    *S_S, *S_T, *S_FILLED, *S_EXPECTED, *S_TEXT, *TJ_MINUS_ONE;

/* Stores the frames in b at pos of a journal's map as ``Journal.append`` does (``files/journal.py``): the bytes
 * after the first length prefix, a zero length after them (the journal's end), then that prefix, last (the compiler
 * may not move the stores across the fence; x86 makes them visible in program order): a process killed meanwhile
 * leaves a zero length at pos, never a frame in part. The map has room for the end's 4 bytes. */
static void tj_store(char *map, Py_ssize_t pos, const text_t *b) {
    memcpy(map + pos + 4, b->p + 4, (size_t)b->len - 4);
    memset(map + pos + b->len, 0, 4);
    atomic_signal_fence(memory_order_seq_cst);
    memcpy(map + pos, b->p, 4);
}

/* Copies b into the journal's map when it has room and the journal's class appends as ``Journal`` does (a test's
 * fault injection patches ``append``): 1 done, 0 not (the caller calls ``append``). */
static int tj_copy(TextJournalObject *self, PyObject *journal, text_t *b) {
    if (!self->journal_base || _PyType_Lookup(Py_TYPE(journal), S_APPEND) != self->append) return 0;
    JournalBaseObject *j = (JournalBaseObject *)journal;
    Py_ssize_t room = j->size < j->view.len ? j->size : j->view.len;
    if (j->map == NULL || j->pos < 0 || j->pos + b->len + 4 > room) return 0;
    tj_store(j->view.buf, j->pos, b);
    j->pos += b->len;
    return 1;
}

/* The journal fragments of a record (its stack's, when new, then its own items[0..n)), for the queue (a new
 * list). */
static PyObject *tj_entries(PyObject *stack_entry, PyObject *const *items, Py_ssize_t n) {
    PyObject *record = PyTuple_New(n);
    if (record == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(record, i, Py_NewRef(items[i]));
    PyObject *entries = stack_entry ? PyList_New(2) : PyList_New(1);
    if (entries == NULL) { Py_DECREF(record); return NULL; }
    if (stack_entry) PyList_SET_ITEM(entries, 0, Py_NewRef(stack_entry));
    PyList_SET_ITEM(entries, stack_entry ? 1 : 0, record);
    return entries;
}

/* Journals the frames in b (fragments: stack_entry, then the record's items) under the recorder's lock, as
 * ``_journal_now`` does: 0, or -1 with an error (an OSError of a full disk, the fragments then queued). */
static int tj_journal(TextJournalObject *self, text_t *b, PyObject *stack_entry, PyObject *const *items,
                      Py_ssize_t n) {
    jl_take((JournalLockObject *)self->lock);
    int rc = 0;
    PyObject *journal = Py_NewRef(TJ_JOURNAL(self));  /* (held: ``append`` runs Python code) */
    if (journal != Py_None) {
        if (PyList_GET_SIZE(self->queued) || !tj_copy(self, journal, b)) {
            PyObject *entries = tj_entries(stack_entry, items, n);
            if (entries == NULL) {
                rc = -1;
            } else if (PyList_GET_SIZE(self->queued)) {  /* earlier fragments wait for their statistics */
                rc = PyList_SetSlice(self->queued, PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, entries);
            } else {
                PyObject *frame = PyBytes_FromStringAndSize(b->p, b->len);
                PyObject *r = frame ? PyObject_CallMethodOneArg(journal, S_APPEND, frame) : NULL;
                Py_XDECREF(frame);
                if (r == NULL) {
                    rc = -1;
                    if (PyErr_ExceptionMatches(PyExc_OSError)) {  /* a full disk: the fragments wait, in order */
                        PyObject *type, *value, *tb;
                        PyErr_Fetch(&type, &value, &tb);
                        if (PyList_SetSlice(self->queued, PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, entries) < 0) {
                            Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(tb);
                        } else {
                            PyErr_Restore(type, value, tb);
                        }
                    }
                }
                Py_XDECREF(r);
            }
            Py_XDECREF(entries);
        }
    }
    Py_DECREF(journal);
    jl_give((JournalLockObject *)self->lock);
    return rc;
}

/* The recorder (a new reference), or NULL with an error once it is gone. */
static PyObject *tj_recorder(TextJournalObject *self) {
    PyObject *recorder = PyWeakref_GetObject(self->recorder);  /* borrowed */
    if (recorder == Py_None) PyErr_SetString(PyExc_RuntimeError, "a TextJournal of a recorder that is gone");
    return recorder == NULL || recorder == Py_None ? NULL : Py_NewRef(recorder);
}

/* The next sequence number (a new reference), the rank folder made first when it is not there yet, as ``reserve``
 * takes it; NULL with an error. */
static PyObject *tj_take_seq(TextJournalObject *self, PyObject *recorder) {
    if (!self->dir_ready) {
        PyObject *ready = PyObject_GetAttr(recorder, S_DIR_READY);
        int is_ready = ready ? PyObject_IsTrue(ready) : -1;
        Py_XDECREF(ready);
        if (is_ready < 0) return NULL;
        if (!is_ready) {
            PyObject *r = PyObject_CallMethodNoArgs(recorder, S_ENSURE_DIR);
            if (r == NULL) return NULL;
            Py_DECREF(r);
        }
        self->dir_ready = is_ready;  /* seen ready: the next call need not ask */
    }
    PyObject *seq = PyIter_Next(self->counter);
    if (seq == NULL && !PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "the record counter ended");
    return seq;
}

static PyObject *tj_reserve(TextJournalObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1 && nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "reserve() takes 1 or 2 arguments");
        return NULL;
    }
    PyObject *recorder = tj_recorder(self);
    if (recorder == NULL) return NULL;
    PyObject *seq = tj_take_seq(self, recorder);
    Py_DECREF(recorder);
    PyObject *had = seq ? PyDict_SetDefault(self->data, args[0], Py_None) : NULL;  /* borrowed */
    if (had == NULL || (nargs == 2 && args[1] != Py_None && PyDict_SetItem(self->stacks, args[0], args[1]) < 0)) {
        Py_XDECREF(seq);
        return NULL;
    }
    return seq;
}

/* The memo's place of a stack: its address's bits mixed (Fibonacci hashing: objects of one size class lie at
 * multiples of their size, whose low bits alone would share a few places). */
static inline size_t tj_memo_at(PyObject *stack) {
    return (size_t)(((uint64_t)(uintptr_t)stack * 0x9E3779B97F4A7C15ull) >> (64 - TJ_MEMO_BITS));
}

/* stack, whose sid is in the journaled set, kept in the memo. */
static void tj_stack_known(TextJournalObject *self, PyObject *stack, PyObject *sid) {
    size_t at = tj_memo_at(stack);
    Py_XSETREF(self->memo_stack[at], Py_NewRef(stack));
    Py_XSETREF(self->memo_sid[at], Py_NewRef(sid));
}

/* *sid = stack.sid (a new reference): 1 when it is in the journaled set, 0 when not, -1 with an error. A stack
 * known journaled is answered from the memo: its sid is not read again, nor looked up in the set (a set that only
 * grows, of sids a stack keeps). */
static int tj_stack_sid(TextJournalObject *self, PyObject *stack, PyObject **sid) {
    size_t at = tj_memo_at(stack);
    if (self->memo_stack[at] == stack) {
        *sid = Py_NewRef(self->memo_sid[at]);
        return 1;
    }
    *sid = PyObject_GetAttr(stack, S_SID);
    if (*sid == NULL) return -1;
    int known = PySet_Contains(self->journaled, *sid);
    if (known > 0) tj_stack_known(self, stack, *sid);
    return known;
}

static PyObject *tj_put_text(TextJournalObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"name", "text", "seq", "stack", "parent"};
    PyObject *a[5] = {NULL, NULL, NULL, Py_None, Py_False};  /* parent: NO_PARENT */
    if (nargs > 5) { PyErr_SetString(PyExc_TypeError, "put_text() takes at most 5 arguments"); return NULL; }
    for (Py_ssize_t i = 0; i < nargs; i++) a[i] = args[i];
    for (Py_ssize_t k = 0, nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0; k < nk; k++) {
        int i = 0;
        while (i < 5 && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, k), names[i]) != 0) i++;
        if (i == 5 || i < nargs) {
            PyErr_Format(PyExc_TypeError, "put_text() got an unexpected or repeated argument %R",
                         PyTuple_GET_ITEM(kwnames, k));
            return NULL;
        }
        a[i] = args[nargs + k];
    }
    if (a[0] == NULL || a[1] == NULL || a[2] == NULL) {
        PyErr_SetString(PyExc_TypeError, "put_text() needs name, text and seq");
        return NULL;
    }
    PyObject *name = a[0], *text = a[1], *stack = a[3], *parent = a[4];
    PyObject *recorder = tj_recorder(self);
    if (recorder == NULL) return NULL;
    PyObject *seq = Py_NewRef(a[2]), *sid = NULL, *stack_entry = NULL;
    PyObject *result = NULL;
    text_t b;
    text_init(&b);
    if (seq == Py_None) {  /* ``reserve`` and ``put_text`` in one */
        Py_DECREF(seq);
        seq = tj_take_seq(self, recorder);
        if (seq == NULL) goto done;
    }
    if (PyDict_SetItem(self->data, name, text) < 0) goto done;
    if (parent != Py_False && PyDict_SetItem(self->construct, name, parent) < 0) goto done;
    self->count++;
    int journaling = TJ_JOURNAL(self) != Py_None;  /* (the recorder's ``_journal``: not finished) */
    if (stack != Py_None) {
        if (PyDict_SetItem(self->stacks, name, stack) < 0) goto done;
        int known = tj_stack_sid(self, stack, &sid);
        if (known < 0) goto done;
        if (!known && journaling) {  /* the stack's frame first (once per distinct stack) */
            if (PySet_Add(self->journaled, sid) < 0) goto done;
            tj_stack_known(self, stack, sid);
            PyObject *frames = PyObject_GetAttr(stack, S_FRAMES);
            PyObject *listed = frames ? PySequence_List(frames) : NULL;
            Py_XDECREF(frames);
            if (listed == NULL) goto done;
            stack_entry = PyTuple_Pack(3, S_S, sid, listed);
            Py_DECREF(listed);
            if (stack_entry == NULL) goto done;
            Py_INCREF(stack_entry);  /* held twice, as the Python route holds it: marshal writes the same bytes */
            PyObject *body = PyMarshal_WriteObjectToString(stack_entry, Py_MARSHAL_VERSION);
            Py_DECREF(stack_entry);
            if (body == NULL) goto done;
            int rc = m_le32(&b, (uint32_t)PyBytes_GET_SIZE(body));
            if (rc == 0) rc = text_put(&b, PyBytes_AS_STRING(body), PyBytes_GET_SIZE(body));
            Py_DECREF(body);
            if (rc < 0) goto done;
        }
    } else {
        sid = PyLong_FromLong(-1);
        if (sid == NULL) goto done;
    }
    if (!journaling) { result = Py_NewRef(Py_None); goto done; }
    PyObject *items[6] = {S_J, name, seq, text, sid, parent};
    if (m_frame(&b, items, 6) < 0 || tj_journal(self, &b, stack_entry, items, 6) < 0) goto done;
    result = Py_NewRef(Py_None);
done:
    text_free(&b);
    Py_DECREF(recorder);
    Py_XDECREF(seq);
    Py_XDECREF(sid);
    Py_XDECREF(stack_entry);
    return result;
}

/* record.<name> += 1 (``TextFields.filled``): the new count, or -1 with an error. */
static long tj_count_up(PyObject *record, PyObject *name) {
    PyObject *v = PyObject_GetAttr(record, name);
    long n = v ? PyLong_AsLong(v) : -1;
    Py_XDECREF(v);
    if (n == -1 && PyErr_Occurred()) return -1;
    PyObject *up = PyLong_FromLong(n + 1);
    int rc = up ? PyObject_SetAttr(record, name, up) : -1;
    Py_XDECREF(up);
    return rc < 0 ? -1 : n + 1;
}

/* ``TextFields.text`` of record (a new str) when each field name's text is in ``_FIELD_KEYS``, each field's slots
 * a list of strs and Nones, and each text has UTF-8; NULL without an error otherwise (the method writes it). */
static PyObject *tj_fields_text(TextJournalObject *self, PyObject *record) {
    text_t b;
    text_init(&b);
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    int first = 1;
    if (PUT_LIT(&b, "{") < 0) goto fail;
    while (PyDict_Next(record, &pos, &k, &v)) {
        PyObject *key = PyUnicode_CheckExact(k) ? PyDict_GetItemWithError(self->field_keys, k) : NULL;
        if (key == NULL || !PyUnicode_CheckExact(key) || !PyList_CheckExact(v)) goto fail;
        if ((!first && PUT_LIT(&b, ", ") < 0) || text_put_str(&b, key) < 0) goto fail;
        first = 0;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(v); i++) {
            PyObject *t = PyList_GET_ITEM(v, i);
            if (i && PUT_LIT(&b, ", ") < 0) goto fail;
            if (t == Py_None ? PUT_LIT(&b, "null") < 0 : !PyUnicode_CheckExact(t) || text_put_str(&b, t) < 0)
                goto fail;
        }
        if (PUT_LIT(&b, "]") < 0) goto fail;
    }
    if (PUT_LIT(&b, "}") < 0) goto fail;
    return text_finish(&b);
fail:
    text_free(&b);
    PyErr_Clear();
    return NULL;
}

/* Sets slot i (in range) of a ``TextFields`` record's slots to text, counting it when it was empty; the record,
 * complete, is then held as its JSON text under name: 0, or -1 with an error. */
static int tj_set_slot(TextJournalObject *self, PyObject *record, PyObject *slots, Py_ssize_t i, PyObject *name,
                       PyObject *text) {
    if (PyList_GET_ITEM(slots, i) == Py_None && tj_count_up(record, S_FILLED) < 0) return -1;
    Py_INCREF(text);
    if (PyList_SetItem(slots, i, text) < 0) return -1;
    PyObject *filled = PyObject_GetAttr(record, S_FILLED);
    PyObject *expected = filled ? PyObject_GetAttr(record, S_EXPECTED) : NULL;
    int complete = expected ? PyObject_RichCompareBool(filled, expected, Py_EQ) : -1;
    Py_XDECREF(filled);
    Py_XDECREF(expected);
    if (complete <= 0) return complete;
    PyObject *whole = tj_fields_text(self, record);  /* held as its JSON text from now on */
    if (whole == NULL && !PyErr_Occurred()) whole = PyObject_CallMethodNoArgs(record, S_TEXT);
    int rc = whole ? PyDict_SetItem(self->data, name, whole) : -1;
    Py_XDECREF(whole);
    return rc;
}

/* A field just set: counted, and its ("t", ...) frame of the 8 items journaled where the recorder journals
 * (``put_text_field``'s tail, the first field's and a later one's): 0, or -1 with an error. */
static int tj_field_frame(TextJournalObject *self, text_t *b, PyObject **items) {
    self->count++;
    if (TJ_JOURNAL(self) == Py_None) return 0;
    return m_frame(b, items, 8) < 0 || tj_journal(self, b, NULL, items, 8) < 0 ? -1 : 0;
}

/* ``TextFields.skeleton``: each field's slots as as many Nones (a new dict), or NULL with an error. */
static PyObject *tj_skeleton(PyObject *record) {
    PyObject *skeleton = PyDict_New();
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (skeleton != NULL && PyDict_Next(record, &pos, &key, &value)) {
        Py_ssize_t n = PyObject_Size(value);
        PyObject *nones = n >= 0 ? PyList_New(n) : NULL;
        for (Py_ssize_t k = 0; nones != NULL && k < n; k++) PyList_SET_ITEM(nones, k, Py_NewRef(Py_None));
        if (nones == NULL || PyDict_SetItem(skeleton, key, nones) < 0) Py_CLEAR(skeleton);
        Py_XDECREF(nones);
    }
    return skeleton;
}

/* The slots list of record's field (a new reference) with room for slot i, as the Python route makes it: a field
 * the record was not made with gets i + 1 empty slots; a slot beyond the field's makes the record's count unknown
 * (``expected`` -1). NULL with an error. */
static PyObject *tj_room(PyObject *record, PyObject *field, Py_ssize_t i) {
    PyObject *slots = PyDict_GetItemWithError(record, field);  /* borrowed */
    if (slots == NULL) {
        if (PyErr_Occurred()) return NULL;
        slots = PyList_New(i + 1);
        for (Py_ssize_t k = 0; slots != NULL && k <= i; k++) PyList_SET_ITEM(slots, k, Py_NewRef(Py_None));
        if (slots != NULL && PyDict_SetItem(record, field, slots) < 0) Py_CLEAR(slots);
        return slots;
    }
    if (!PyList_CheckExact(slots)) {
        PyErr_Format(PyExc_TypeError, "put_text_field: the slots of %R are a %.100s", field, Py_TYPE(slots)->tp_name);
        return NULL;
    }
    Py_INCREF(slots);
    if (i < PyList_GET_SIZE(slots)) return slots;
    while (PyList_GET_SIZE(slots) <= i)
        if (PyList_Append(slots, Py_None) < 0) { Py_DECREF(slots); return NULL; }
    if (PyObject_SetAttr(record, S_EXPECTED, TJ_MINUS_ONE) < 0) Py_CLEAR(slots);
    return slots;
}

/* A record's first field (args as ``put_text_field``'s, index a non-negative int): the record made by
 * ``fields(arg)``, its place taken as ``reserve`` takes it, stored with its parent, the field set, and all of it
 * journaled in one frame with the record's skeleton, as the Python route does. */
static PyObject *tj_first_field(TextJournalObject *self, PyObject *recorder, PyObject *const *args, Py_ssize_t i,
                                PyObject *parent) {
    PyObject *name = args[0], *field = args[1], *index = args[2], *text = args[3];
    PyObject *record = PyObject_CallOneArg(args[4], args[5]);
    if (record == NULL) return NULL;
    PyObject *seq = NULL, *skeleton = NULL, *slots = NULL, *result = NULL;
    text_t b;
    text_init(&b);
    if (Py_TYPE(record) != (PyTypeObject *)self->text_fields) {
        PyErr_Format(PyExc_TypeError, "put_text_field: fields() made a %.100s, not a TextFields",
                     Py_TYPE(record)->tp_name);
        goto done;
    }
    if ((seq = tj_take_seq(self, recorder)) == NULL || PyDict_SetItem(self->data, name, record) < 0
        || (skeleton = tj_skeleton(record)) == NULL
        || (parent != Py_False && PyDict_SetItem(self->construct, name, parent) < 0)
        || (slots = tj_room(record, field, i)) == NULL || tj_set_slot(self, record, slots, i, name, text) < 0)
        goto done;
    PyObject *items[8] = {S_T, name, seq, skeleton, field, index, text, parent};
    if (tj_field_frame(self, &b, items) < 0) goto done;
    result = Py_NewRef(Py_False);
done:
    text_free(&b);
    Py_DECREF(record);
    Py_XDECREF(seq);
    Py_XDECREF(skeleton);
    Py_XDECREF(slots);
    return result;
}

static PyObject *tj_put_text_field(TextJournalObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 && nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "put_text_field() takes 6 or 7 arguments");
        return NULL;
    }
    PyObject *recorder = tj_recorder(self);
    if (recorder == NULL) return NULL;
    PyObject *name = args[0], *field = args[1], *index = args[2], *text = args[3];
    PyObject *parent = nargs == 7 ? args[6] : Py_False;
    Py_ssize_t i = PyLong_CheckExact(index) ? PyLong_AsSsize_t(index) : -1;
    if (i == -1 && PyErr_Occurred()) PyErr_Clear();  /* an index too large: the Python route */
    PyObject *record = PyDict_GetItemWithError(self->data, name);  /* held: hashing field may run Python code */
    if (record == NULL && PyErr_Occurred()) { Py_DECREF(recorder); return NULL; }
    if ((record == NULL || record == Py_None) && i >= 0 && i < PY_SSIZE_T_MAX) {  /* the record's first field */
        PyObject *r = tj_first_field(self, recorder, args, i, parent);
        Py_DECREF(recorder);
        return r;
    }
    if (record == NULL || Py_TYPE(record) != (PyTypeObject *)self->text_fields || i < 0 || i == PY_SSIZE_T_MAX) {
        /* a record that is no TextFields (``put_field``'s, or complete and set again), an odd index: Python's */
        PyObject *call[8] = {recorder, args[0], args[1], args[2], args[3], args[4], args[5], parent};
        PyObject *r = PyObject_Vectorcall(self->put_field, call, 8, NULL);
        Py_DECREF(recorder);
        return r;
    }
    Py_INCREF(record);
    PyObject *slots = tj_room(record, field, i);
    if (slots == NULL) { Py_DECREF(record); Py_DECREF(recorder); return NULL; }
    PyObject *result = NULL;
    text_t b;
    text_init(&b);
    if (tj_set_slot(self, record, slots, i, name, text) < 0) goto done;
    PyObject *items[8] = {S_T, name, TJ_MINUS_ONE, Py_None, field, index, text, Py_False};
    if (tj_field_frame(self, &b, items) < 0) goto done;
    result = Py_NewRef(Py_False);
done:
    text_free(&b);
    Py_DECREF(slots);
    Py_DECREF(record);
    Py_DECREF(recorder);
    return result;
}

static PyObject *tj_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *recorder, *append, *text_fields, *put_field, *field_keys;
    if (!PyArg_ParseTuple(args, "OOO!OO!:TextJournal", &recorder, &append, &PyType_Type, &text_fields, &put_field,
                          &PyDict_Type, &field_keys))
        return NULL;
    TextJournalObject *self = (TextJournalObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->recorder = PyWeakref_NewRef(recorder, NULL);  /* weak: the recorder holds this (its put_text) */
    if (self->recorder == NULL) { Py_DECREF(self); return NULL; }
    self->append = Py_NewRef(append);
    self->text_fields = Py_NewRef(text_fields);
    self->put_field = Py_NewRef(put_field);
    self->field_keys = Py_NewRef(field_keys);
    self->data = PyObject_GetAttrString(recorder, "data");
    self->construct = self->data ? PyObject_GetAttrString(recorder, "construct") : NULL;
    self->stacks = self->construct ? PyObject_GetAttrString(recorder, "stack") : NULL;
    self->journaled = self->stacks ? PyObject_GetAttrString(recorder, "_journaled_stacks") : NULL;
    self->queued = self->journaled ? PyObject_GetAttrString(recorder, "_queued") : NULL;
    self->counter = self->queued ? PyObject_GetAttrString(recorder, "_seq") : NULL;
    self->lock = self->counter ? PyObject_GetAttrString(recorder, "_journal_lock") : NULL;
    self->journal = Py_NewRef(Py_None);
    if (self->lock == NULL) { Py_DECREF(self); return NULL; }
    if (!PyDict_CheckExact(self->data) || !PyDict_CheckExact(self->construct) || !PyDict_CheckExact(self->stacks)
        || !PySet_CheckExact(self->journaled) || !PyList_CheckExact(self->queued) || !PyIter_Check(self->counter)
        || !Py_IS_TYPE(self->lock, &JournalLockType)) {
        PyErr_SetString(PyExc_TypeError, "TextJournal: not a StepRecorder's dicts, set, queue, counter and lock");
        Py_DECREF(self);
        return NULL;
    }
    self->count = 0;
    self->dir_ready = 0;
    return (PyObject *)self;
}

static int tj_traverse(TextJournalObject *self, visitproc visit, void *arg) {
    TJ_OBJECTS(RT_VISIT)
    for (int i = 0; i < TJ_MEMO; i++) { Py_VISIT(self->memo_stack[i]); Py_VISIT(self->memo_sid[i]); }
    return 0;
}

static int tj_clear(TextJournalObject *self) {
    TJ_OBJECTS(RT_CLEAR)
    for (int i = 0; i < TJ_MEMO; i++) { Py_CLEAR(self->memo_stack[i]); Py_CLEAR(self->memo_sid[i]); }
    return 0;
}

static void tj_dealloc(TextJournalObject *self) {
    PyObject_GC_UnTrack(self);
    tj_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef tj_methods[] = {
    {"reserve", (PyCFunction)(void (*)(void))tj_reserve, METH_FASTCALL,
     "reserve(name, stack=None) -> int (StepRecorder.reserve)"},
    {"put_text", (PyCFunction)(void (*)(void))tj_put_text, METH_FASTCALL | METH_KEYWORDS,
     "put_text(name, text, seq, stack=None, parent=NO_PARENT) -> None (StepRecorder.put_text)"},
    {"put_text_field", (PyCFunction)(void (*)(void))tj_put_text_field, METH_FASTCALL,
     "put_text_field(name, field, index, text, fields, arg, parent=NO_PARENT) -> bool (StepRecorder.put_text_field)"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef tj_members[] = {
    {"count", T_PYSSIZET, offsetof(TextJournalObject, count), READONLY, "the records stored so far"},
    {NULL},
};

static PyObject *tj_get_journal(TextJournalObject *self, void *closure) {
    return Py_NewRef(TJ_JOURNAL(self));
}

static int tj_set_journal(TextJournalObject *self, PyObject *value, void *closure) {
    Py_XSETREF(self->journal, Py_NewRef(value ? value : Py_None));
    self->journal_base = PyObject_TypeCheck(self->journal, &JournalBaseType);
    return 0;
}

static PyGetSetDef tj_getset[] = {
    {"journal", (getter)tj_get_journal, (setter)tj_set_journal,
     "the recorder's ``_journal`` (set with it, under its lock): the Journal it writes, or None", NULL},
    {NULL},
};

static PyTypeObject TextJournalType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "msprobe_core.stats._fast_stats.TextJournal",
    .tp_basicsize = sizeof(TextJournalObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "StepRecorder.put_text in C (see step_recorder.py)",
    .tp_new = tj_new,
    .tp_dealloc = (destructor)tj_dealloc,
    .tp_traverse = (traverseproc)tj_traverse,
    .tp_clear = (inquiry)tj_clear,
    .tp_methods = tj_methods,
    .tp_members = tj_members,
    .tp_getset = tj_getset,
};

static int add_text_journal(PyObject *m) {
    struct { PyObject **slot; const char *text; } strings[] = {
        {&S_DIR_READY, "_dir_ready"}, {&S_ENSURE_DIR, "ensure_dir"}, {&S_SID, "sid"}, {&S_FRAMES, "frames"},
        {&S_APPEND, "append"}, {&S_J, "J"}, {&S_S, "S"}, {&S_T, "t"}, {&S_FILLED, "filled"}, {&S_EXPECTED, "expected"},
        {&S_TEXT, "text"}};
    if ((TJ_MINUS_ONE = PyLong_FromLong(-1)) == NULL) return -1;
    for (size_t i = 0; i < sizeof(strings) / sizeof(strings[0]); i++)
        if ((*strings[i].slot = PyUnicode_InternFromString(strings[i].text)) == NULL) return -1;
    struct { PyTypeObject *type; const char *name; } types[] = {
        {&TextJournalType, "TextJournal"}, {&JournalBaseType, "JournalBase"}, {&JournalLockType, "JournalLock"}};
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
        if (PyType_Ready(types[i].type) < 0) return -1;
        Py_INCREF(types[i].type);
        if (PyModule_AddObject(m, types[i].name, (PyObject *)types[i].type) < 0) {
            Py_DECREF(types[i].type);
            return -1;
        }
    }
    return 0;
}
/* ================================================================================== end of text journal */
