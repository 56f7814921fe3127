/* ========================================================================================= by-line files
 * A "by line" JSON file (``files/step_recorder.py``: dump.json's records, stack.json, construct.json) written to
 * a file descriptor in one call, straight from the step's dict; #included by _fast_stats.c.
 *
 *   write_lines(fd, head, entries, indent, text, tail, empty) -> bool
 *       Writes head, the lines of dict entries joined by ",\n", tail (bytes); ``empty`` instead of all three
 *       when there is no line. A line is ``indent + "name": value``, the name escaped as
 *       ``json.encoder.encode_basestring`` escapes it (non-ASCII as is), all as UTF-8.
 *       text a callable: a value is JSON text already made; a str is that text, None is no line, anything else
 *         is given to text(value), which returns the str (asked once per object of an identity-hashed type).
 *       text None: a value is None (written null) or a str (written as a JSON string, escaped as a name).
 *       False, with nothing written, when the Python route must write the file: a name that is not a str, a
 *       value of another kind, or a name or text with no UTF-8 (a lone surrogate: Python writes its backslash
 *       escape). An OSError when writing fails (part of the file may be written: the caller's file is a
 *       temporary one).
 *
 * No copy of the records is made: names and separators go into one side buffer, and ``writev`` takes each
 * value's text from its str itself (held by a reference here), with the GIL released. */

#include <errno.h>
#include <sys/uio.h>

#define BL_IOV_MAX 1024 /* POSIX's least IOV_MAX (Linux's) */
#define BL_INLINE 96    /* texts up to this size are copied into the side buffer: fewer pieces for writev */

typedef struct {
    const char *p; /* NULL: the side buffer from off */
    Py_ssize_t off, len;
} bl_piece;

typedef struct {
    char *side;
    Py_ssize_t side_len, side_cap;
    bl_piece *pieces;
    Py_ssize_t n_pieces, pieces_cap, open; /* open: where the side buffer's last piece starts (-1: none) */
    PyObject **held;
    Py_ssize_t n_held;
} bl_file;

static int bl_side_room(bl_file *f, Py_ssize_t more) {
    if (f->side_len + more <= f->side_cap) return 0;
    Py_ssize_t cap = f->side_cap ? f->side_cap : 1 << 16;
    while (cap < f->side_len + more) cap *= 2;
    char *side = PyMem_Realloc(f->side, (size_t)cap);
    if (side == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    f->side = side;
    f->side_cap = cap;
    return 0;
}

static int bl_add_piece(bl_file *f, const char *p, Py_ssize_t off, Py_ssize_t len) {
    if (f->n_pieces == f->pieces_cap) {
        Py_ssize_t cap = f->pieces_cap ? f->pieces_cap * 2 : 256;
        bl_piece *pieces = PyMem_Realloc(f->pieces, sizeof(bl_piece) * (size_t)cap);
        if (pieces == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        f->pieces = pieces;
        f->pieces_cap = cap;
    }
    f->pieces[f->n_pieces++] = (bl_piece){p, off, len};
    return 0;
}

/* Ends the side buffer's open piece (its bytes become one piece). */
static int bl_close_side(bl_file *f) {
    if (f->open < 0 || f->open == f->side_len) return 0;
    int rc = bl_add_piece(f, NULL, f->open, f->side_len - f->open);
    f->open = -1;
    return rc;
}

static int bl_put(bl_file *f, const char *s, Py_ssize_t n) {
    if (bl_side_room(f, n) < 0) return -1;
    if (f->open < 0) f->open = f->side_len;
    memcpy(f->side + f->side_len, s, (size_t)n);
    f->side_len += n;
    return 0;
}

/* encode_basestring's escape of each byte: 0 for a byte written as it is, 'u' for \u00XX, else the letter after
 * the backslash (one table look-up per byte instead of a switch and a comparison). */
static const char BL_ESCAPE[256] = {
    [0 ... 0x1f] = 'u', ['\b'] = 'b', ['\f'] = 'f', ['\n'] = 'n', ['\r'] = 'r', ['\t'] = 't', ['"'] = '"',
    ['\\'] = '\\',
};

/* Does the 8 bytes' word w hold one that encode_basestring escapes (below 0x20, '"', '\\')? The high bit of a
 * byte of (x - 0x01..) & ~x is set for the lowest byte of x that is 0, and of (x - 0x20..) & ~x for the lowest
 * below 0x20: set somewhere when there is one (a byte from 0x80 on, ~x's high bit clear, is never flagged). */
static inline int bl_word_escapes(uint64_t w) {
    const uint64_t ones = 0x0101010101010101ull;
    return (((w - ones * 0x20) | ((w ^ ones * '"') - ones) | ((w ^ ones * '\\') - ones)) & ~w
            & 0x8080808080808080ull) != 0;
}

/* s[0:n] quoted and escaped as encode_basestring escapes it (UTF-8 bytes of non-ASCII pass as is): eight bytes
 * at a time while none is escaped, then byte by byte. */
static int bl_put_string(bl_file *f, const char *s, Py_ssize_t n) {
    static const char hex[] = "0123456789abcdef";
    if (bl_side_room(f, 6 * n + 2) < 0) return -1;
    if (f->open < 0) f->open = f->side_len;
    char *o = f->side + f->side_len;
    *o++ = '"';
    Py_ssize_t i = 0;
    for (uint64_t w; i + 8 <= n; i += 8, o += 8) {
        memcpy(&w, s + i, 8);
        if (bl_word_escapes(w)) break;
        memcpy(o, &w, 8);
    }
    for (; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        char e = BL_ESCAPE[c];
        if (!e) {
            *o++ = (char)c;
        } else if (e != 'u') {
            *o++ = '\\';
            *o++ = e;
        } else {
            memcpy(o, "\\u00", 4);
            o[4] = hex[c >> 4];
            o[5] = hex[c & 15];
            o += 6;
        }
    }
    *o++ = '"';
    f->side_len = o - f->side;
    return 0;
}

/* A piece for held str t's UTF-8 (copied into the side buffer when short). */
static int bl_put_text(bl_file *f, const char *p, Py_ssize_t n) {
    if (n <= BL_INLINE) return bl_put(f, p, n);
    if (bl_close_side(f) < 0) return -1;
    return bl_add_piece(f, p, 0, n);
}

/* The UTF-8 of str s; 0 when it has none (the error cleared: the Python route writes it), -1 on another error. */
static int bl_utf8(PyObject *s, const char **p, Py_ssize_t *n) {
    *p = PyUnicode_AsUTF8AndSize(s, n);
    if (*p != NULL) return 1;
    if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) return -1;
    PyErr_Clear();
    return 0;
}

/* The text of value v in text mode (a new reference), through text() and the per-call cache. */
static PyObject *bl_value_text(PyObject *v, PyObject *text, PyObject *cache) {
    int cached = Py_TYPE(v)->tp_hash == PyBaseObject_Type.tp_hash; /* identity hash: a safe, cheap key */
    if (cached) {
        PyObject *t = PyDict_GetItemWithError(cache, v);
        if (t != NULL) return Py_NewRef(t);
        if (PyErr_Occurred()) return NULL;
    }
    PyObject *t = PyObject_CallOneArg(text, v);
    if (t != NULL && cached && PyUnicode_CheckExact(t) && PyDict_SetItem(cache, v, t) < 0) Py_CLEAR(t);
    return t;
}

/* The lines of entries into f: 1, 0 when the Python route must write them, -1 on error. */
static int bl_lines(bl_file *f, PyObject *entries, const char *ind, Py_ssize_t nind, PyObject *text,
                    PyObject *cache) {
    Py_ssize_t pos = 0, lines = 0, cap = PyDict_GET_SIZE(entries);
    PyObject *k, *v;
    while (PyDict_Next(entries, &pos, &k, &v)) {
        if (!PyUnicode_CheckExact(k)) return 0;
        if (v == Py_None && text != NULL) continue;
        PyObject *t;
        if (v == Py_None || (text == NULL && !PyUnicode_CheckExact(v))) {
            if (v != Py_None) return 0; /* strings mode: a value that is no string */
            t = NULL;
        } else if (PyUnicode_CheckExact(v)) {
            t = Py_NewRef(v);
        } else {
            Py_INCREF(k); /* text() may run any Python code */
            t = bl_value_text(v, text, cache);
            Py_DECREF(k);
            if (t == NULL) return -1;
            if (!PyUnicode_CheckExact(t)) {
                Py_DECREF(t);
                return 0;
            }
        }
        if (f->n_held == cap) { /* text() made the dict grow: the Python route is the reference for that */
            Py_XDECREF(t);
            return 0;
        }
        if (t != NULL) f->held[f->n_held++] = t;
        const char *kp, *tp = "null";
        Py_ssize_t nk, nt = 4;
        int ok = bl_utf8(k, &kp, &nk);
        if (ok > 0 && t != NULL) ok = bl_utf8(t, &tp, &nt);
        if (ok <= 0) return ok;
        if ((lines++ && bl_put(f, ",\n", 2) < 0) || bl_put(f, ind, nind) < 0 || bl_put_string(f, kp, nk) < 0 ||
            bl_put(f, ": ", 2) < 0)
            return -1;
        if (text == NULL && t != NULL ? bl_put_string(f, tp, nt) < 0 : bl_put_text(f, tp, nt) < 0) return -1;
    }
    return lines ? 1 : 2; /* 2: no line */
}

/* Writes f's pieces to fd (the GIL released around each writev); -1 with OSError set when it fails. */
static int bl_write(bl_file *f, int fd) {
    Py_ssize_t n = f->n_pieces, i = 0;
    struct iovec *iov = PyMem_Malloc(sizeof(struct iovec) * (size_t)(n ? n : 1));
    if (iov == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        bl_piece *p = &f->pieces[j];
        iov[j].iov_base = (void *)(p->p != NULL ? p->p : f->side + p->off);
        iov[j].iov_len = (size_t)p->len;
    }
    int rc = 0;
    while (i < n) {
        int count = n - i < BL_IOV_MAX ? (int)(n - i) : BL_IOV_MAX;
        ssize_t w;
        Py_BEGIN_ALLOW_THREADS
        w = writev(fd, iov + i, count);
        Py_END_ALLOW_THREADS
        if (w < 0) {
            if (errno == EINTR && PyErr_CheckSignals() == 0) continue;
            if (!PyErr_Occurred()) PyErr_SetFromErrno(PyExc_OSError);
            rc = -1;
            break;
        }
        if (w == 0) { /* no progress: not a regular file's answer */
            errno = EIO;
            PyErr_SetFromErrno(PyExc_OSError);
            rc = -1;
            break;
        }
        while (i < n && (size_t)w >= iov[i].iov_len) w -= (ssize_t)iov[i++].iov_len;
        if (i < n) { /* a piece written in part */
            iov[i].iov_base = (char *)iov[i].iov_base + w;
            iov[i].iov_len -= (size_t)w;
        }
    }
    PyMem_Free(iov);
    return rc;
}

static PyObject *write_lines(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 || !PyBytes_Check(args[1]) || !PyUnicode_Check(args[3]) || !PyBytes_Check(args[5]) ||
        !PyBytes_Check(args[6])) {
        PyErr_SetString(PyExc_TypeError, "write_lines(fd, head, entries, indent, text, tail, empty)");
        return NULL;
    }
    int fd = PyObject_AsFileDescriptor(args[0]);
    if (fd < 0) return NULL;
    PyObject *head = args[1], *entries = args[2], *text = args[4] == Py_None ? NULL : args[4];
    PyObject *tail = args[5], *empty = args[6];
    if (!PyDict_CheckExact(entries)) Py_RETURN_FALSE;
    Py_ssize_t nind;
    const char *ind = PyUnicode_AsUTF8AndSize(args[3], &nind);
    if (ind == NULL) return NULL;
    bl_file f = {NULL, 0, 0, NULL, 0, 0, -1, NULL, 0};
    PyObject *cache = NULL, *result = NULL;
    f.held = PyMem_Malloc(sizeof(PyObject *) * (size_t)(PyDict_GET_SIZE(entries) + 1));
    if (f.held == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (text != NULL && (cache = PyDict_New()) == NULL) goto done;
    if (bl_add_piece(&f, PyBytes_AS_STRING(head), 0, PyBytes_GET_SIZE(head)) < 0) goto done;
    int rc = bl_lines(&f, entries, ind, nind, text, cache);
    if (rc < 0) goto done;
    if (rc == 0) {
        result = Py_NewRef(Py_False);
        goto done;
    }
    if (rc == 2) { /* no line: ``empty`` alone */
        f.n_pieces = 0;
        f.open = -1;
        if (bl_add_piece(&f, PyBytes_AS_STRING(empty), 0, PyBytes_GET_SIZE(empty)) < 0) goto done;
    } else if (bl_close_side(&f) < 0 || bl_add_piece(&f, PyBytes_AS_STRING(tail), 0, PyBytes_GET_SIZE(tail)) < 0) {
        goto done;
    }
    if (bl_write(&f, fd) == 0) result = Py_NewRef(Py_True);
done:
    for (Py_ssize_t i = 0; i < f.n_held; i++) Py_DECREF(f.held[i]);
    PyMem_Free(f.held);
    PyMem_Free(f.pieces);
    PyMem_Free(f.side);
    Py_XDECREF(cache);
    return result;
}

static PyMethodDef bl_methods[] = {
    {"write_lines", (PyCFunction)(void (*)(void))write_lines, METH_FASTCALL,
     "write_lines(fd, head, entries, indent, text, tail, empty) -> bool: a by-line JSON file written to fd "
     "(files/step_recorder.py); False: nothing written, the Python route writes it"},
    {NULL, NULL, 0, NULL},
};

static int add_by_line(PyObject *m) { return PyModule_AddFunctions(m, bl_methods); }
/* ==================================================================================== end of by-line files */
