/* ========================================================================================= by-line files
 * The body of a "by line" JSON object (``files/step_recorder.py``'s ``_lines``: dump.json's records, stack.json)
 * as UTF-8 bytes in one call, straight from the step's dict; #included by _fast_stats.c.
 *
 *   by_line(entries, indent, text) -> bytes or None
 *       entries: a dict of str names. Each entry is the line ``indent + "name": value``, lines joined by ",\n"
 *       (no brackets, no newline after the last line; b"" when no line). The name is escaped as
 *       ``json.encoder.encode_basestring`` escapes it (non-ASCII as is).
 *       text a callable: a value is JSON text already made; a str is that text, None is no line, anything else
 *         is given to text(value), which returns the str (asked once per object of an identity-hashed type).
 *       text None: a value is None (written null) or a str (written as a JSON string, escaped as a name).
 *       None when the Python route must write the body: a name that is not a str, a value of another kind, or
 *       a name or text with no UTF-8 (a lone surrogate: Python writes it as its backslash escape).
 *
 * Two passes: the first takes each line's pieces (and their sizes), the second copies them into a bytes object
 * of the exact size, with the GIL released (the pieces are immutable strs, each held by a reference here). */

typedef struct {
    PyObject *key;      /* held */
    PyObject *value;    /* held: the value's text (text mode) or the str value (strings mode); NULL: null */
    const char *k, *v;  /* UTF-8 of key and value */
    Py_ssize_t nk, nv;
    Py_ssize_t ek, ev;  /* their sizes escaped (quotes left out; == nk, nv: nothing to escape) */
} bl_line;

/* The size of s[0:n] escaped as encode_basestring escapes it (UTF-8 bytes of non-ASCII pass as is). */
static Py_ssize_t bl_escaped_size(const char *s, Py_ssize_t n) {
    Py_ssize_t size = n;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\' || c == '\b' || c == '\f' || c == '\n' || c == '\r' || c == '\t')
            size += 1;
        else if (c < 0x20)
            size += 5; /* \u00XX */
    }
    return size;
}

static char *bl_put_escaped(char *o, const char *s, Py_ssize_t n, Py_ssize_t escaped) {
    if (escaped == n) {
        memcpy(o, s, (size_t)n);
        return o + n;
    }
    static const char hex[] = "0123456789abcdef";
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        char e = 0;
        switch (c) {
            case '"': e = '"'; break;
            case '\\': e = '\\'; break;
            case '\b': e = 'b'; break;
            case '\f': e = 'f'; break;
            case '\n': e = 'n'; break;
            case '\r': e = 'r'; break;
            case '\t': e = 't'; break;
            default: break;
        }
        if (e) {
            *o++ = '\\';
            *o++ = e;
        } else if (c < 0x20) {
            memcpy(o, "\\u00", 4);
            o[4] = hex[c >> 4];
            o[5] = hex[c & 15];
            o += 6;
        } else {
            *o++ = (char)c;
        }
    }
    return o;
}

/* The UTF-8 of str s; 0 and *fallback set when it has none (the error is cleared), -1 on another error. */
static int bl_utf8(PyObject *s, const char **p, Py_ssize_t *n, int *fallback) {
    *p = PyUnicode_AsUTF8AndSize(s, n);
    if (*p != NULL) return 1;
    if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) return -1;
    PyErr_Clear();
    *fallback = 1;
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

static PyObject *by_line(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyUnicode_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "by_line(entries, indent, text)");
        return NULL;
    }
    PyObject *entries = args[0], *text = args[2] == Py_None ? NULL : args[2];
    if (!PyDict_CheckExact(entries)) Py_RETURN_NONE;
    Py_ssize_t nind;
    const char *ind = PyUnicode_AsUTF8AndSize(args[1], &nind);
    if (ind == NULL) return NULL;
    Py_ssize_t cap = PyDict_GET_SIZE(entries), n = 0;
    bl_line *lines = PyMem_Malloc(sizeof(bl_line) * (size_t)(cap ? cap : 1));
    PyObject *cache = text ? PyDict_New() : NULL, *result = NULL;
    if (lines == NULL || (text && cache == NULL)) {
        PyErr_NoMemory();
        goto done;
    }
    int fallback = 0;
    Py_ssize_t pos = 0, total = 0;
    PyObject *k, *v;
    while (PyDict_Next(entries, &pos, &k, &v)) {
        if (!PyUnicode_CheckExact(k)) {
            fallback = 1;
            break;
        }
        PyObject *vt;
        if (v == Py_None) {
            if (text) continue;
            vt = NULL;
        } else if (PyUnicode_CheckExact(v)) {
            vt = Py_NewRef(v);
        } else if (text) {
            Py_INCREF(k); /* text() may run any Python code */
            vt = bl_value_text(v, text, cache);
            Py_DECREF(k);
            if (vt == NULL) goto done;
            if (!PyUnicode_CheckExact(vt)) {
                Py_DECREF(vt);
                fallback = 1;
                break;
            }
        } else {
            fallback = 1;
            break;
        }
        if (n == cap) { /* text() made the dict grow: the Python route is the reference for that */
            Py_XDECREF(vt);
            fallback = 1;
            break;
        }
        bl_line *l = &lines[n];
        l->key = Py_NewRef(k);
        l->value = vt;
        n++;
        int ok = bl_utf8(k, &l->k, &l->nk, &fallback);
        if (ok > 0 && vt != NULL) ok = bl_utf8(vt, &l->v, &l->nv, &fallback);
        if (ok < 0) goto done;
        if (!ok) break;
        if (vt == NULL) {
            l->v = "null";
            l->nv = 4;
        }
        l->ek = bl_escaped_size(l->k, l->nk);
        int quoted = vt != NULL && !text; /* a str of strings mode */
        l->ev = quoted ? bl_escaped_size(l->v, l->nv) : l->nv;
        total += nind + l->ek + 4 + l->ev + 2 * quoted + 2; /* indent "key": value,\n */
    }
    if (fallback) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (n) total -= 2; /* no ",\n" after the last line */
    result = PyBytes_FromStringAndSize(NULL, total);
    if (result == NULL) goto done;
    char *o = PyBytes_AS_STRING(result);
    int strings = text == NULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        bl_line *l = &lines[i];
        if (i) {
            *o++ = ',';
            *o++ = '\n';
        }
        memcpy(o, ind, (size_t)nind);
        o += nind;
        *o++ = '"';
        o = bl_put_escaped(o, l->k, l->nk, l->ek);
        memcpy(o, "\": ", 3);
        o += 3;
        if (strings && l->value != NULL) {
            *o++ = '"';
            o = bl_put_escaped(o, l->v, l->nv, l->ev);
            *o++ = '"';
        } else {
            memcpy(o, l->v, (size_t)l->nv);
            o += l->nv;
        }
    }
    Py_END_ALLOW_THREADS
done:
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_DECREF(lines[i].key);
        Py_XDECREF(lines[i].value);
    }
    PyMem_Free(lines);
    Py_XDECREF(cache);
    return result;
}

static PyMethodDef bl_methods[] = {
    {"by_line", (PyCFunction)(void (*)(void))by_line, METH_FASTCALL,
     "by_line(entries, indent, text) -> bytes or None: the lines of a by-line JSON object (files/step_recorder.py)"},
    {NULL, NULL, 0, NULL},
};

static int add_by_line(PyObject *m) { return PyModule_AddFunctions(m, bl_methods); }
/* ==================================================================================== end of by-line files */
