/* ============================================================================================ API call
 * The L1 dump's fast route of one recorded API call in one C call (``pytorch/api_fast.py``: ``FastApi``; its
 * Python ``api_call`` is the same route, kept where this type is not built or turned off). #included by
 * _fast_stats.c, after RecordText (whose text functions it calls directly).
 *
 *   ApiCall(original, key, env)   one per API, made when the patch plan is built; ``key`` is "{prefix}.{api}",
 *                                 ``env`` the service's tuple of what every call reads (ENV_* below, built
 *                                 once by ``FastApi``)
 *     (args, kwargs) -> original(*args, **kwargs), recorded as ``api_call`` records it: the gates (not
 *                       recording, the tool's own work or a backward pass: the original alone; another
 *                       thread: said once, the original alone; autograd on: ``ac_record``'s autograd part
 *                       where ``env`` has it, else ``on_api_call``), the inputs'
 *                       text, the counter and record name, stack and parent, the original with the operator
 *                       mode popped when it is the innermost mode (``ApiPatcher.call``), the output's text
 *                       and ``rec.put_text``; an input the text does not read goes to ``on_api_call``, an
 *                       output it does not read to ``end_dict``, the tool's errors to ``svc._error``.
 * Dynamo never sees this object: the Python function standing for the API (``api_fast``) sends traced calls
 * to the usual wrapper before calling it.
 *
 *   ModePass(funcs, record)       the operator mode's pass-through for the calls it does not record (below) */

enum {
    ENV_SVC, ENV_TLS, ENV_RECORDS, ENV_RT, ENV_PATCHER, ENV_CAPTURE, ENV_INTERNED, ENV_CONSTRUCT, ENV_NO_PARENT,
    ENV_ON_API_CALL, ENV_END_DICT, ENV_GRAPH_TASK, ENV_GRAD_ENABLED, ENV_TF_OFF, ENV_TF_ON,
    ENV_STACK_LEN, ENV_STACK_POP, ENV_STACK_PUSH, ENV_GRAD, ENV_SVC_VARS, ENV_RECORDS_VARS, ENV_PATCHER_VARS, ENV_N
};  /* ENV_GRAD: what a call with autograd on reads (_fast_gradapi.c's G_*), or None: ``on_api_call`` takes it;
     * ENV_SVC_VARS, ENV_RECORDS_VARS, ENV_PATCHER_VARS: the service's, the records' and the patcher's instance dicts,
     * where the attributes read here live (``ac_attr``), or None */

#define AC_MEMO 4 /* the stacks an API was called from lately, known by their keys (``ac_stack``) */

typedef struct {
    uintptr_t *key; /* (PyMem) */
    Py_ssize_t len;
    PyObject *stack; /* NULL: an empty place */
} StackMemo;

#define AC_NAMES_KEPT (1 << 14) /* the record names an API keeps (``ac_name``): its first calls of a step */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *original, *key, *env;
    PyObject *names[2]; /* lists: "{key}.{n}.forward" and "{key}.{n}.backward" at n (``ac_name``) */
    StackMemo memo[AC_MEMO];
    int memo_next; /* the place the next stack takes */
} ApiCallObject;

static PyObject *ac_record(ApiCallObject *self, PyObject **env, PyObject *args, PyObject *kwargs,
                           int autograd);  /* _fast_gradapi.c (it reads the G_* of a call with autograd on) */
static int ag_valid(PyObject *grad);  /* (_fast_gradapi.c) */

static PyObject *S_recording, *S_dumping_thread, *S_other_thread, *S_step_state, *S_counters,
    *S_recorder, *S_open_step, *S_module_stack, *S_mode, *S_reserve, *S_put_text, *S_error, *EMPTY, *ZERO, *ONE;

/* original(*args, **kwargs) */
static PyObject *ac_plain(PyObject *original, PyObject *args, PyObject *kwargs) {
    return PyObject_Call(original, args, PyDict_GET_SIZE(kwargs) ? kwargs : NULL);
}

/* fn() / fn(arg) for the builtins every call makes (torch's stack and grad-mode functions, the torch function
 * guard's __enter__/__exit__): a builtin taking no argument (or, for __exit__, its arguments as a tuple) or one
 * object is called through its C function, without the generic call's dispatch; anything else through
 * PyObject_Call*. */
static PyObject *ac_call(PyObject *fn, PyObject *arg) {
    if (PyCFunction_CheckExact(fn)) {
        PyCFunction meth = PyCFunction_GET_FUNCTION(fn);
        PyObject *self = PyCFunction_GET_SELF(fn);
        int flags = PyCFunction_GET_FLAGS(fn) & (METH_VARARGS | METH_KEYWORDS | METH_NOARGS | METH_O | METH_FASTCALL);
        if (arg == NULL && flags == METH_NOARGS) return meth(self, NULL);
        if (arg == NULL && flags == METH_VARARGS) return meth(self, EMPTY);
        if (arg != NULL && flags == METH_O) return meth(self, arg);
    }
    return arg == NULL ? PyObject_CallNoArgs(fn) : PyObject_CallOneArg(fn, arg);
}

/* obj.name, a new reference: read from obj's instance dict (vars, when ``FastApi`` found that class defines no data
 * descriptor of the name: what getattr would find there) when it holds the name, else by getattr. */
static PyObject *ac_attr(PyObject *obj, PyObject *vars, PyObject *name) {
    if (vars != Py_None) {
        PyObject *v = PyDict_GetItemWithError(vars, name);
        if (v != NULL) return Py_NewRef(v);
        if (PyErr_Occurred()) return NULL;
    }
    return PyObject_GetAttr(obj, name);
}

/* The pending exception, if an ``Exception``, goes to svc._error(name, e) and 0 is returned; anything else
 * (KeyboardInterrupt...) stays pending: -1. */
static int ac_report(PyObject *svc, PyObject *name) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    PyErr_NormalizeException(&et, &ev, &etb);
    if (etb != NULL && ev != NULL) PyException_SetTraceback(ev, etb);
    PyObject *r = PyObject_CallMethodObjArgs(svc, S_error, name, ev != NULL ? ev : Py_None, NULL);
    Py_XDECREF(et); Py_XDECREF(ev); Py_XDECREF(etb);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* Torch functions off (``on`` 0, ``fn`` the shared guard's __enter__: 0, or -1 with an error) or back on (``on`` 1,
 * ``fn`` its __exit__: an error already raised is kept and ``rc`` returned; -1, its own error set, when __exit__
 * fails) around the tool's own work (``with DisableTorchFunction()``, the Python route's ``_quiet``): its tensor reads
 * skip every TorchFunctionMode, and no tensor property is set through the operator mode (torch leaks a reference to
 * None at each). One guard serves every call (its __enter__ and __exit__ in ``env``, ``ApiGrad``'s fields): the
 * dumping thread alone comes here, never nested, and nothing here calls an API of the plan. */
static int ac_tf(PyObject *fn, int on, int rc) {
    PyObject *et = NULL, *ev = NULL, *etb = NULL;
    if (on) PyErr_Fetch(&et, &ev, &etb);
    PyObject *r = ac_call(fn, NULL);
    if (r == NULL) { Py_XDECREF(et); Py_XDECREF(ev); Py_XDECREF(etb); return -1; }
    Py_DECREF(r);
    if (on) PyErr_Restore(et, ev, etb);
    return on ? rc : 0;
}

/* The inputs' text (``put_inputs``: out NULL) or, after it, the output's and the record's end (``put_output``) into b,
 * with torch functions off (``ac_tf``): 0, NO_TEXT, or -1 with an error. */
static int ac_text(PyObject **env, text_t *b, PyObject *args, PyObject *kwargs, PyObject *out) {
    if (ac_tf(env[ENV_TF_OFF], 0, 0) < 0) return -1;
    RecordTextObject *rt = (RecordTextObject *)env[ENV_RT];
    return ac_tf(env[ENV_TF_ON], 1, out == NULL ? put_inputs(rt, b, args, kwargs) : put_output(rt, b, out));
}

/* The recorder whose ``put_text`` is its kernel ``TextJournal``'s (a weak reference, NULL for none) and that journal:
 * found by ``ac_put_text`` once per recorder, forgotten when the recorder goes (``ac_forget``). */
static PyObject *ac_journal_rec, *ac_journal, *ac_forget_fn;

/* The weak reference's callback: the recorder is gone, its journal no longer held here. */
static PyObject *ac_forget(PyObject *unused, PyObject *ref) {
    if (ref == ac_journal_rec) {
        Py_CLEAR(ac_journal);
        Py_CLEAR(ac_journal_rec);
    }
    Py_RETURN_NONE;
}

static PyMethodDef ac_forget_def = {"forget", (PyCFunction)ac_forget, METH_O, "a recorder's journal forgotten"};

/* rec.put_text(name, text, None, stack, parent), a new reference: the kernel's ``TextJournal.put_text`` called
 * without a method call where it is rec's (looked at once per recorder: the instance's ``put_text``), else the
 * method. */
static PyObject *ac_put_text(PyObject *rec, PyObject *name, PyObject *text, PyObject *stack, PyObject *parent) {
    PyObject *argv[5] = {name, text, Py_None, stack, parent};
    if (ac_journal_rec == NULL || PyWeakref_GetObject(ac_journal_rec) != rec) {
        PyObject *m = PyObject_GetAttr(rec, S_put_text);
        if (m == NULL) return NULL;
        if (PyCFunction_Check(m) && PyCFunction_GET_FUNCTION(m) == (PyCFunction)(void (*)(void))tj_put_text
            && PyCFunction_GET_SELF(m) != NULL && PyObject_TypeCheck(PyCFunction_GET_SELF(m), &TextJournalType)) {
            PyObject *ref = PyWeakref_NewRef(rec, ac_forget_fn);
            if (ref == NULL) { Py_DECREF(m); return NULL; }
            Py_XSETREF(ac_journal_rec, ref);  /* (the old reference dropped: its callback never comes) */
            Py_XSETREF(ac_journal, Py_NewRef(PyCFunction_GET_SELF(m)));
        } else {
            PyObject *r = PyObject_Vectorcall(m, argv, 5, NULL);
            Py_DECREF(m);
            return r;
        }
        Py_DECREF(m);
    }
    PyObject *journal = Py_NewRef(ac_journal);  /* (held: put_text may run Python code that drops the recorder) */
    PyObject *r = tj_put_text((TextJournalObject *)journal, argv, 5, NULL);
    Py_DECREF(journal);
    return r;
}

/* original(*args, **kwargs) with the operator mode popped while it is the innermost TorchFunctionMode (it would
 * only pass the call through again): ``ApiPatcher.call``. */
static PyObject *ac_original(PyObject **env, PyObject *original, PyObject *args, PyObject *kwargs) {
    PyObject *mode = ac_attr(env[ENV_PATCHER], env[ENV_PATCHER_VARS], S_mode);
    if (mode == NULL) return NULL;
    int popped = 0;
    if (mode != Py_None) {
        PyObject *n = ac_call(env[ENV_STACK_LEN], NULL);
        Py_ssize_t depth = n == NULL ? -1 : PyLong_AsSsize_t(n);
        Py_XDECREF(n);
        if (depth < 0) { Py_DECREF(mode); return NULL; }
        if (depth > 0) {  /* the innermost mode, popped; pushed back at once if it is another one */
            PyObject *top = ac_call(env[ENV_STACK_POP], NULL);
            if (top == NULL) { Py_DECREF(mode); return NULL; }
            popped = top == mode;
            PyObject *r = popped ? Py_NewRef(Py_None) : ac_call(env[ENV_STACK_PUSH], top);
            Py_DECREF(top);
            if (r == NULL) { Py_DECREF(mode); return NULL; }
            Py_DECREF(r);
        }
    }
    PyObject *out = ac_plain(original, args, kwargs);
    if (popped) {  /* a ``finally``: the mode goes back whatever happened */
        PyObject *et, *ev, *etb;
        PyErr_Fetch(&et, &ev, &etb);
        PyObject *r = ac_call(env[ENV_STACK_PUSH], mode);
        if (r == NULL) {
            Py_CLEAR(out);
            Py_XDECREF(et); Py_XDECREF(ev); Py_XDECREF(etb);
        } else {
            Py_DECREF(r);
            PyErr_Restore(et, ev, etb);
        }
    }
    Py_DECREF(mode);
    return out;
}

/* Which way a call goes: 0 the original alone, 1 the fast route, 2 ``on_api_call``; -1 an error. */
static int ac_gate(PyObject **env) {
    PyObject *svc = env[ENV_SVC];
    PyObject *v = ac_attr(svc, env[ENV_SVC_VARS], S_recording);
    int on = v == NULL ? -1 : PyObject_IsTrue(v);
    Py_XDECREF(v);
    if (on <= 0) return on;
    v = tool_depth_get(env[ENV_TLS]);
    on = v == NULL ? -1 : PyObject_IsTrue(v);
    Py_XDECREF(v);
    if (on != 0) return on < 0 ? -1 : 0;
    v = ac_call(env[ENV_GRAPH_TASK], NULL);
    if (v == NULL) return -1;
    long task = PyLong_AsLong(v);
    Py_DECREF(v);
    if (task == -1 && PyErr_Occurred()) return -1;
    if (task != -1) return 0;
    v = ac_attr(svc, env[ENV_SVC_VARS], S_dumping_thread);
    if (v == NULL) return -1;
    unsigned long thread = PyLong_AsUnsignedLong(v);
    Py_DECREF(v);
    if (thread == (unsigned long)-1 && PyErr_Occurred()) return -1;
    if (thread != PyThread_get_thread_ident()) {
        v = PyObject_CallMethodNoArgs(svc, S_other_thread);
        if (v == NULL) return -1;
        Py_DECREF(v);
        return 0;
    }
    v = ac_call(env[ENV_GRAD_ENABLED], NULL);
    on = v == NULL ? -1 : PyObject_IsTrue(v);
    Py_XDECREF(v);
    return on < 0 ? -1 : on ? 2 : 1;
}

/* "{key}.{n}.forward" (backward 0) or "{key}.{n}.backward" (1), a new reference: made at n the first time and kept
 * at n in the API's list of names (None where none was made yet), the same str every step since (its hash computed
 * once: the record's dicts would hash a new one at every insert); a count that is no int from 0 on, or from
 * ``AC_NAMES_KEPT`` on, made by a format string each time. NULL with an error. */
static PyObject *ac_name_at(ApiCallObject *self, PyObject *n, int backward) {
    PyObject *key = PyTuple_GET_ITEM(self->key, 0), *names = self->names[backward];
    long long c = PyLong_Check(n) ? PyLong_AsLongLong(n) : -1;
    if (c == -1 && PyErr_Occurred()) PyErr_Clear();
    if (c >= 0 && c < PyList_GET_SIZE(names) && PyList_GET_ITEM(names, c) != Py_None)
        return Py_NewRef(PyList_GET_ITEM(names, c));
    Py_ssize_t klen;
    const char *k = PyUnicode_AsUTF8AndSize(key, &klen);
    if (k == NULL) return NULL;
    if (c < 0 || c >= AC_NAMES_KEPT || klen >= 200)
        return PyUnicode_FromFormat(backward ? "%U.%S.backward" : "%U.%S.forward", key, n);
    static const char forward_tail[] = ".forward", backward_tail[] = ".backward";
    const char *tail = backward ? backward_tail : forward_tail;
    Py_ssize_t ntail = backward ? (Py_ssize_t)sizeof(backward_tail) - 1 : (Py_ssize_t)sizeof(forward_tail) - 1;
    char digits[24], buf[256];
    int nd = 0;
    for (long long d = c; nd == 0 || d > 0; d /= 10) digits[nd++] = (char)('0' + d % 10);
    Py_ssize_t len = klen;
    memcpy(buf, k, klen);
    buf[len++] = '.';
    while (nd > 0) buf[len++] = digits[--nd];
    memcpy(buf + len, tail, (size_t)ntail);
    len += ntail;
    PyObject *name;
    if (PyUnicode_IS_ASCII(key)) {  /* the usual key: the text as it is, not decoded */
        name = PyUnicode_New(len, 127);
        if (name != NULL) memcpy(PyUnicode_1BYTE_DATA(name), buf, (size_t)len);
    } else {
        name = PyUnicode_DecodeUTF8(buf, len, NULL);
    }
    if (name == NULL) return NULL;
    while (PyList_GET_SIZE(names) <= c)
        if (PyList_Append(names, Py_None) < 0) { Py_DECREF(name); return NULL; }
    PyList_SetItem(names, c, Py_NewRef(name));  /* (in range: it cannot fail) */
    return name;
}

/* The record's name "{key}.{n}.forward" (``ac_name_at``), the step's counter of key taken (n). */
static PyObject *ac_name(ApiCallObject *self, PyObject **env, PyObject **n) {
    PyObject *key = PyTuple_GET_ITEM(self->key, 0);
    PyObject *state = ac_attr(env[ENV_RECORDS], env[ENV_RECORDS_VARS], S_step_state);
    if (state == NULL) return NULL;
    PyObject *counters = PyObject_GetAttr(state, S_counters);
    Py_DECREF(state);
    if (counters == NULL) return NULL;
    PyObject *name = NULL, *count = NULL, *next = NULL;
    if (PyDict_CheckExact(counters)) {
        count = PyDict_GetItemWithError(counters, key);
        if (count == NULL && PyErr_Occurred()) goto done;
        Py_XINCREF(count);
    } else {
        count = PyObject_GetItem(counters, key);
        if (count == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_KeyError)) goto done;
            PyErr_Clear();
        }
    }
    if (count == NULL) count = Py_NewRef(ZERO);
    next = PyNumber_Add(count, ONE);
    if (next == NULL || (PyDict_CheckExact(counters) ? PyDict_SetItem(counters, key, next)
                                                     : PyObject_SetItem(counters, key, next)) < 0) goto done;
    name = ac_name_at(self, count, 0);
    if (name != NULL) { *n = count; count = NULL; }
done:
    Py_DECREF(counters);
    Py_XDECREF(count);
    Py_XDECREF(next);
    return name;
}

/* stack, the interned stack of key[0..len), kept in the memo's next place: 0, or -1 with an error. */
static int ac_memo_put(ApiCallObject *self, const uintptr_t *key, Py_ssize_t len, PyObject *stack) {
    StackMemo *m = &self->memo[self->memo_next];
    uintptr_t *copy = PyMem_Malloc(len * sizeof(uintptr_t));
    if (copy == NULL) { PyErr_NoMemory(); return -1; }
    memcpy(copy, key, len * sizeof(uintptr_t));
    PyMem_Free(m->key);
    m->key = copy;
    m->len = len;
    Py_XSETREF(m->stack, Py_NewRef(stack));
    self->memo_next = (self->memo_next + 1) % AC_MEMO;
    return 0;
}

/* The caller's interned stack (``StackCapture.capture(1)`` from the Python function that called this): its key
 * compared with those of the stacks this API was called from lately (the memo: an API is mostly called from a few
 * places, the same each step), else looked up in the capture's table (and kept in the memo: the table holds the
 * code objects of its keys, so that no key found there ever names another stack), and made by ``capture`` only the
 * first time. */
static PyObject *ac_stack(ApiCallObject *self, PyObject **env) {
    if (env[ENV_CAPTURE] == Py_None) return Py_NewRef(Py_None);
    PyFrameObject *f = PyEval_GetFrame();  /* the Python function standing for the API */
    Py_XINCREF(f);
    uintptr_t small[STACK_KEY_SMALL], *buf = small;
    Py_ssize_t len = stack_walk(f, &buf);
    PyObject *stack = NULL, *key = NULL;
    if (len < 0) goto done;
    for (int i = 0; i < AC_MEMO; i++) {
        StackMemo *m = &self->memo[i];
        if (m->stack != NULL && m->len == len && memcmp(m->key, buf, len * sizeof(uintptr_t)) == 0) {
            stack = Py_NewRef(m->stack);
            goto done;
        }
    }
    key = PyBytes_FromStringAndSize((const char *)buf, len * (Py_ssize_t)sizeof(uintptr_t));
    if (key == NULL) goto done;
    stack = Py_XNewRef(PyDict_GetItemWithError(env[ENV_INTERNED], key));
    if (stack != NULL) {
        if (ac_memo_put(self, buf, len, stack) < 0) Py_CLEAR(stack);
    } else if (!PyErr_Occurred()) {
        stack = PyObject_CallNoArgs(env[ENV_CAPTURE]);
    }
done:
    Py_XDECREF(key);
    if (buf != small) PyMem_Free(buf);
    return stack;
}

/* rec, stack and parent of the record: svc.recorder or svc._open_step(), capture() or None, the innermost
 * module (construct.json) or NO_PARENT. -1 with an exception set. */
static int ac_where(ApiCallObject *self, PyObject **env, PyObject **rec, PyObject **stack, PyObject **parent) {
    PyObject *svc = env[ENV_SVC];
    *rec = ac_attr(svc, env[ENV_SVC_VARS], S_recorder);
    if (*rec == NULL) return -1;
    int ok = PyObject_IsTrue(*rec);
    if (ok < 0) return -1;
    if (!ok) {
        Py_SETREF(*rec, PyObject_CallMethodNoArgs(svc, S_open_step));
        if (*rec == NULL) return -1;
    }
    *stack = ac_stack(self, env);
    if (*stack == NULL) return -1;
    ok = PyObject_IsTrue(env[ENV_CONSTRUCT]);
    if (ok < 0) return -1;
    if (!ok) {
        *parent = Py_NewRef(env[ENV_NO_PARENT]);
        return 0;
    }
    PyObject *state = ac_attr(env[ENV_RECORDS], env[ENV_RECORDS_VARS], S_step_state);
    if (state == NULL) return -1;
    PyObject *modules = PyObject_GetAttr(state, S_module_stack);
    Py_DECREF(state);
    if (modules == NULL) return -1;
    ok = PyObject_IsTrue(modules);
    if (ok < 0) { Py_DECREF(modules); return -1; }
    if (ok) {
        PyObject *at = PyLong_FromLong(-1);
        *parent = at == NULL ? NULL : PyObject_GetItem(modules, at);
        Py_XDECREF(at);
    } else {
        *parent = Py_NewRef(Py_None);
    }
    Py_DECREF(modules);
    return *parent == NULL ? -1 : 0;
}

static PyObject *ac_vectorcall(ApiCallObject *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 2 || kwnames != NULL || !PyTuple_Check(argv[0]) || !PyDict_Check(argv[1])) {
        PyErr_SetString(PyExc_TypeError, "ApiCall(args, kwargs) takes a tuple and a dict");
        return NULL;
    }
    PyObject **env = &PyTuple_GET_ITEM(self->env, 0);
    PyObject *out = NULL;
    switch (ac_gate(env)) {
    case 0: out = ac_plain(self->original, argv[0], argv[1]); break;
    case 1: out = ac_record(self, env, argv[0], argv[1], 0); break;
    case 2:
        if (env[ENV_GRAD] != Py_None) {
            out = ac_record(self, env, argv[0], argv[1], 1);
            break;
        }
        out = PyObject_CallFunctionObjArgs(env[ENV_ON_API_CALL], self->original, PyTuple_GET_ITEM(self->key, 1),
                                           PyTuple_GET_ITEM(self->key, 2), argv[0], argv[1], NULL);
    }
    return out;
}

/* ApiCall(original, (key, prefix, api), env) */
static PyObject *ac_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *original, *key, *env;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "ApiCall takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OO!O!:ApiCall", &original, &PyTuple_Type, &key, &PyTuple_Type, &env)) return NULL;
    if (PyTuple_GET_SIZE(key) != 3 || !PyUnicode_Check(PyTuple_GET_ITEM(key, 0)) || PyTuple_GET_SIZE(env) != ENV_N
        || !PyObject_TypeCheck(PyTuple_GET_ITEM(env, ENV_RT), &RecordTextType) || !PyCallable_Check(original)
        || !PyDict_Check(PyTuple_GET_ITEM(env, ENV_INTERNED))
        || (PyTuple_GET_ITEM(env, ENV_SVC_VARS) != Py_None && !PyDict_Check(PyTuple_GET_ITEM(env, ENV_SVC_VARS)))
        || (PyTuple_GET_ITEM(env, ENV_RECORDS_VARS) != Py_None && !PyDict_Check(PyTuple_GET_ITEM(env, ENV_RECORDS_VARS)))
        || (PyTuple_GET_ITEM(env, ENV_PATCHER_VARS) != Py_None && !PyDict_Check(PyTuple_GET_ITEM(env, ENV_PATCHER_VARS)))
        || (PyTuple_GET_ITEM(env, ENV_GRAD) != Py_None && !ag_valid(PyTuple_GET_ITEM(env, ENV_GRAD)))) {
        PyErr_SetString(PyExc_TypeError, "ApiCall(original, (key, prefix, api), env): see _fast_api.c");
        return NULL;
    }
    ApiCallObject *self = (ApiCallObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->vectorcall = (vectorcallfunc)ac_vectorcall;
    self->original = Py_NewRef(original);
    self->key = Py_NewRef(key);
    self->env = Py_NewRef(env);
    if ((self->names[0] = PyList_New(0)) == NULL || (self->names[1] = PyList_New(0)) == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    /* (the memo's places empty: tp_alloc zeroes the object) */
    return (PyObject *)self;
}

static int ac_traverse(ApiCallObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->original); Py_VISIT(self->key); Py_VISIT(self->env);
    Py_VISIT(self->names[0]); Py_VISIT(self->names[1]);
    for (int i = 0; i < AC_MEMO; i++) Py_VISIT(self->memo[i].stack);
    return 0;
}

static int ac_clear(ApiCallObject *self) {
    Py_CLEAR(self->original); Py_CLEAR(self->key); Py_CLEAR(self->env);
    Py_CLEAR(self->names[0]); Py_CLEAR(self->names[1]);
    for (int i = 0; i < AC_MEMO; i++) {
        PyMem_Free(self->memo[i].key);
        self->memo[i].key = NULL;
        Py_CLEAR(self->memo[i].stack);
    }
    return 0;
}

static void ac_dealloc(ApiCallObject *self) {
    PyObject_GC_UnTrack(self);
    ac_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef ac_members[] = {
    {"__wrapped__", T_OBJECT, offsetof(ApiCallObject, original), READONLY, "the API this call records"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject ApiCallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "msprobe_core.stats._fast_stats.ApiCall",
    .tp_basicsize = sizeof(ApiCallObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "The L1 dump's fast route of one API's calls (see _fast_api.c, pytorch/api_fast.py)",
    .tp_new = ac_new,
    .tp_dealloc = (destructor)ac_dealloc,
    .tp_traverse = (traverseproc)ac_traverse,
    .tp_clear = (inquiry)ac_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(ApiCallObject, vectorcall),
    .tp_members = ac_members,
};

/* ---------------------------------------------------------------------------------------- ModePass
 *   ModePass(funcs, record, dynamo=None)
 *                             the operator mode's __torch_function__ (``pytorch/api_patch._DunderMode``), set
 *                             on the mode instance: torch calls it for every overridable call while the dump is
 *                             on; ``funcs`` is the plan's dict of the functions the mode records, ``record`` the
 *                             mode's Python method (its ``__self__``, the mode, is this one's: torch checks it)
 *     (func, types, args=(), kwargs=None) -> func(*args, **kwargs) for a function not in ``funcs`` (no Python
 *                             frame), the fast route's wrapper of a function that has one (``funcs[func][2]``)
 *                             while no Dynamo callback runs (``dynamo``: torch's ``get_eval_frame_callback``),
 *                             ``record(func, types, args, kwargs)`` (the Python method, which Dynamo never
 *                             traces) for the others and for anything unusual. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *funcs, *record, *owner, *dynamo;
} ModePassObject;

/* Does no Dynamo callback run on this thread (``dynamo()``, torch's ``get_eval_frame_callback``, gives None)? Only
 * then may the fast route's wrapper be called from here: inside compiled code, the mode's method (which Dynamo
 * skips, with everything it calls) must stand between Dynamo and that wrapper, or Dynamo compiles the wrapper's
 * frame. 0 (with no error left) otherwise. */
static int mp_eager(ModePassObject *self) {
    if (self->dynamo == Py_None) return 0;
    PyObject *cb = PyObject_CallNoArgs(self->dynamo);
    if (cb == NULL) { PyErr_Clear(); return 0; }
    Py_DECREF(cb);
    return cb == Py_None;
}

static PyObject *mp_vectorcall(ModePassObject *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (kwnames == NULL && nargs >= 2 && nargs <= 4) {
        PyObject *entry = PyDict_GetItemWithError(self->funcs, argv[0]);
        /* outside the plan: the function itself; a function of the plan with the fast route's wrapper (``entry[2]``,
         * which decides itself whether to record): that wrapper, as the Python method calls it */
        PyObject *fn = entry == NULL ? (PyErr_Occurred() ? NULL : argv[0])
                       : PyTuple_CheckExact(entry) && PyTuple_GET_SIZE(entry) == 3
                         && PyTuple_GET_ITEM(entry, 2) != Py_None && mp_eager(self) ? PyTuple_GET_ITEM(entry, 2) : NULL;
        if (fn != NULL) {
            PyObject *args = nargs > 2 ? argv[2] : NULL, *kwargs = nargs > 3 ? argv[3] : Py_None;
            if ((args == NULL || PyTuple_Check(args)) && (kwargs == Py_None || PyDict_Check(kwargs))) {
                Py_INCREF(fn);  /* (borrowed from the plan's dict) */
                PyObject *out = args == NULL ? PyObject_CallNoArgs(fn)
                    : PyObject_Call(fn, args, kwargs != Py_None && PyDict_GET_SIZE(kwargs) ? kwargs : NULL);
                Py_DECREF(fn);
                return out;
            }
        }
        PyErr_Clear();  /* an unhashable func: the Python method says so */
    }
    return PyObject_Vectorcall(self->record, argv, nargsf, kwnames);
}
static PyObject *S_torch_function;

/* The mode class's ``tp_getattr`` (set by ``mp_new``): getattr(obj, name) with the name as a str, the interned
 * "__torch_function__" for that one. torch looks the mode's ``__torch_function__`` up by a C string for every call
 * the mode sees (``PyObject_FastGetAttrString``), through ``tp_getattr`` where the type has one, else with a new
 * str each time: hashed anew, missing the type's attribute cache, the mode's classes searched one by one (about
 * 1,000 instructions a call). The answer is getattr's either way. */
static PyObject *mp_mode_getattr(PyObject *obj, char *name) {
    PyObject *s = strcmp(name, "__torch_function__") == 0 ? Py_NewRef(S_torch_function) : PyUnicode_FromString(name);
    if (s == NULL) return NULL;
    PyObject *r = PyObject_GetAttr(obj, s);  /* (by tp_getattro: a str's getattr never comes back here) */
    Py_DECREF(s);
    return r;
}

static PyObject *mp_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *funcs, *record, *dynamo = Py_None;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "ModePass takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O!O|O:ModePass", &PyDict_Type, &funcs, &record, &dynamo)) return NULL;
    if (!PyCallable_Check(record)) {
        PyErr_SetString(PyExc_TypeError, "ModePass(funcs, record): record must be callable");
        return NULL;
    }
    ModePassObject *self = (ModePassObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->vectorcall = (vectorcallfunc)mp_vectorcall;
    self->funcs = Py_NewRef(funcs);
    self->record = Py_NewRef(record);
    self->dynamo = Py_NewRef(dynamo);
    self->owner = PyObject_GetAttrString(record, "__self__");  /* torch checks handler.__self__ is the mode */
    if (self->owner == NULL) { Py_DECREF(self); return NULL; }
    PyTypeObject *mode = Py_TYPE(self->owner);  /* a Python class (a C type keeps its own slots) */
    if (PyType_HasFeature(mode, Py_TPFLAGS_HEAPTYPE) && mode->tp_getattr == NULL && mode->tp_getattro != NULL)
        mode->tp_getattr = mp_mode_getattr;
    return (PyObject *)self;
}

static int mp_traverse(ModePassObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->funcs); Py_VISIT(self->record); Py_VISIT(self->owner); Py_VISIT(self->dynamo);
    return 0;
}

static int mp_clear(ModePassObject *self) {
    Py_CLEAR(self->funcs); Py_CLEAR(self->record); Py_CLEAR(self->owner); Py_CLEAR(self->dynamo);
    return 0;
}

static void mp_dealloc(ModePassObject *self) {
    PyObject_GC_UnTrack(self);
    mp_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef mp_members[] = {
    {"__self__", T_OBJECT, offsetof(ModePassObject, owner), READONLY, "the mode (record's __self__)"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject ModePassType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "msprobe_core.stats._fast_stats.ModePass",
    .tp_basicsize = sizeof(ModePassObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "The L1 operator mode's pass-through (see _fast_api.c, pytorch/api_patch.py)",
    .tp_new = mp_new,
    .tp_dealloc = (destructor)mp_dealloc,
    .tp_traverse = (traverseproc)mp_traverse,
    .tp_clear = (inquiry)mp_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(ModePassObject, vectorcall),
    .tp_members = mp_members,
};

/* Adds ApiCall and ModePass to the module (and interns the attribute names it reads). */
static int add_api_call(PyObject *m) {
#define INTERN(var, s) if ((var = PyUnicode_InternFromString(s)) == NULL) return -1;
    INTERN(S_recording, "_recording") INTERN(S_dumping_thread, "dumping_thread")
    INTERN(S_other_thread, "_other_thread") INTERN(S_step_state, "step_state") INTERN(S_counters, "counters")
    INTERN(S_recorder, "recorder") INTERN(S_open_step, "_open_step") INTERN(S_module_stack, "module_stack")
    INTERN(S_mode, "_mode") INTERN(S_reserve, "reserve")
    INTERN(S_put_text, "put_text") INTERN(S_error, "_error") INTERN(S_torch_function, "__torch_function__")
#undef INTERN
    if ((ac_forget_fn = PyCFunction_New(&ac_forget_def, NULL)) == NULL) return -1;
    if (add_tool_depth() < 0 || (EMPTY = PyTuple_New(0)) == NULL || (ZERO = PyLong_FromLong(0)) == NULL
        || (ONE = PyLong_FromLong(1)) == NULL) return -1;
    if (PyType_Ready(&ApiCallType) < 0 || PyType_Ready(&ModePassType) < 0) return -1;
    Py_INCREF(&ApiCallType);
    if (PyModule_AddObject(m, "ApiCall", (PyObject *)&ApiCallType) < 0) { Py_DECREF(&ApiCallType); return -1; }
    Py_INCREF(&ModePassType);
    if (PyModule_AddObject(m, "ModePass", (PyObject *)&ModePassType) < 0) { Py_DECREF(&ModePassType); return -1; }
    return 0;
}
/* ===================================================================================== end of API call */
