/* ==================================================================================== L0 module hooks (s11-l0)
 * A module call's forward record at level L0 in one C call per hook (``CallRecords.hook_module`` in
 * ``dump/call_records.py`` plans it, ``pytorch/dump_service.py`` makes it): the pre hook's and the post hook's
 * work of ``CallRecords._module_pre`` / ``_module_post`` for the usual call, the Python route for every other.
 *
 *   ModuleHooks(records, service, text, base, pre, post, call, skipped, tensor, parameter, graph_task_id,
 *               grad_enabled, mode_enabled, tls, capture_stack, prepare_backward, hook_own_grads)
 *     .pre(module, args, kwargs)          -> None: ``_module_pre``'s work (``pre``: the Python route)
 *     .post(module, args, kwargs, output) -> None: ``_module_post``'s work (``post``: the Python route)
 *
 * The usual call: the dumping thread, recording, no TorchFunctionMode, positional inputs that are plain
 * tensors (``tensor``, ``parameter``: the exact types) and one plain tensor as output; its record text made by
 * ``text`` (a ``RecordText``) at once. The record, the ``Call`` left in the step's state, stack, construct.json
 * parent and journal frame are the Python route's, byte for byte: the Python route takes any call that is not
 * the usual one before anything of it is done (a post hook then finishes whatever the pre hook began: the same
 * ``Call``). An error once something is done goes to ``records._error`` (the user's call goes on). */

typedef struct {
    PyObject_HEAD
    PyObject *records, *service, *text, *base, *pre, *post, *call, *skipped, *tensor, *parameter;
    PyObject *graph_task_id, *grad_enabled, *mode_enabled, *tls, *capture_stack, *prepare_backward;
    PyObject *hook_own_grads;
} ModuleHooksObject;

/* attribute names, interned once */
enum { A_STEP_STATE, A_MODULE_CALLS, A_COUNTERS, A_MODULE_STACK, A_RECORDER, A_OPEN_STEP, A_RESERVE, A_PUT_TEXT,
       A_STACK, A_BWD_SIZES, A_RECORDED_MODULES, A_EDGES, A_BY_NODE, A_DEPTH, A_RECORDING, A_DUMPING_THREAD,
       A_PARAMETERS, A_ERROR, A_INPUT_RECORD, A_NAME, A_BACKWARD, A_SEQ, A_RECORD, A_PARENT, A_OUTPUT,
       A_REQUIRES_GRAD, A_HOOK_OUTPUTS, A_PUT_STACK, N_ATTRS };
static const char *const L0_ATTR_NAMES[N_ATTRS] = {
    "step_state", "module_calls", "counters", "module_stack", "recorder", "_open_step", "reserve", "put_text",
    "stack", "bwd_sizes", "recorded_modules", "edges", "by_node", "depth", "_recording", "dumping_thread",
    "_parameters", "_error", "_input_record", "name", "backward", "seq", "record", "parent", "output",
    "requires_grad", "_hook_outputs", "put_stack"};
static PyObject *l0_attr[N_ATTRS];
static PyObject *l0_no_sizes;  /* (0, 0) */

#define L0_GET(obj, a) PyObject_GetAttr((obj), l0_attr[a])

/* TOOL.depth += delta (the tool's own work, as ``_own``). */
static int l0_depth(ModuleHooksObject *self, long delta) {
    PyObject *d = L0_GET(self->tls, A_DEPTH);
    if (d == NULL) return -1;
    long v = PyLong_AsLong(d);
    Py_DECREF(d);
    if (v == -1 && PyErr_Occurred()) return -1;
    PyObject *n = PyLong_FromLong(v + delta);
    if (n == NULL) return -1;
    int rc = PyObject_SetAttr(self->tls, l0_attr[A_DEPTH], n);
    Py_DECREF(n);
    return rc;
}

/* The value of a no-argument callable as a C truth value: 1, 0, or -1 with an error. */
static int l0_call_true(PyObject *fn) {
    PyObject *v = PyObject_CallNoArgs(fn);
    if (v == NULL) return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* The raised error to ``records._error(base, exc)``, as the Python route's ``except Exception``; a
 * BaseException that is no Exception (KeyboardInterrupt) stays raised: -1. */
static int l0_report(ModuleHooksObject *self) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL) PyException_SetTraceback(value, tb);
    PyObject *r = PyObject_CallMethodObjArgs(self->records, l0_attr[A_ERROR], self->base,
                                             value ? value : Py_None, NULL);
    Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(tb);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* Is this call the dumping thread's, while recording, outside the tool's work, a backward pass and any
 * TorchFunctionMode (``DumpService.should_record`` for the thread that records)? 1, 0, -1 with an error. */
static int l0_recording(ModuleHooksObject *self) {
    PyObject *thread = L0_GET(self->service, A_DUMPING_THREAD);
    if (thread == NULL) return -1;
    unsigned long id = PyLong_AsUnsignedLong(thread);
    Py_DECREF(thread);
    if (PyErr_Occurred()) return -1;
    if (id != PyThread_get_thread_ident()) return 0;
    PyObject *rec = L0_GET(self->service, A_RECORDING);
    if (rec == NULL) return -1;
    int on = rec == Py_True;
    Py_DECREF(rec);
    if (!on) return 0;
    PyObject *d = L0_GET(self->tls, A_DEPTH);
    if (d == NULL) return -1;
    int zero = PyLong_CheckExact(d) && PyLong_AsLong(d) == 0;
    Py_DECREF(d);
    if (!zero) return 0;
    PyObject *task = PyObject_CallNoArgs(self->graph_task_id);
    if (task == NULL) return -1;
    long t = PyLong_AsLong(task);
    Py_DECREF(task);
    if (t != -1) return 0;
    if (PyErr_Occurred()) return -1;
    int modes = l0_call_true(self->mode_enabled);
    return modes < 0 ? -1 : !modes;
}

/* Is obj a plain tensor (the exact tensor or parameter type)? */
static inline int l0_plain(ModuleHooksObject *self, PyObject *obj) {
    PyTypeObject *t = Py_TYPE(obj);
    return t == (PyTypeObject *)self->tensor || t == (PyTypeObject *)self->parameter;
}

/* The record's JSON text up to its output (``CallRecords._text_inputs`` with the module's own parameters,
 * ``params``: a dict), or Py_None when a summary is not known at once. */
static PyObject *l0_head(ModuleHooksObject *self, PyObject *args, PyObject *params) {
    RecordTextObject *rt = (RecordTextObject *)self->text;
    text_t b;
    text_init(&b);
    int rc = PUT_LIT(&b, "{\"input_args\": ");
    if (rc == 0) rc = put_object(rt, &b, args);
    if (rc == 0) rc = PUT_LIT(&b, ", \"input_kwargs\": {}, \"parameters\": ");
    if (rc == 0) rc = put_object(rt, &b, params);
    return finish(&b, rc);
}

/* The module's parameters that are set, as a new dict (``_own_parameters``), or NULL with an error. */
static PyObject *l0_parameters(PyObject *module) {
    PyObject *own = PyObject_GetAttr(module, l0_attr[A_PARAMETERS]);
    if (own == NULL) return NULL;
    PyObject *params = PyDict_New();
    if (params != NULL && PyDict_Check(own)) {
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(own, &pos, &k, &v))
            if (v != Py_None && PyDict_SetItem(params, k, v) < 0) { Py_CLEAR(params); break; }
    } else if (params != NULL) {
        Py_CLEAR(params);
        PyErr_SetString(PyExc_TypeError, "module._parameters is not a dict");
    }
    Py_DECREF(own);
    return params;
}

/* The recorder of the open step (``service.recorder or service._open_step()``): a new reference or NULL. */
static PyObject *l0_recorder(ModuleHooksObject *self) {
    PyObject *rec = L0_GET(self->service, A_RECORDER);
    if (rec == Py_None) {
        Py_DECREF(rec);
        rec = PyObject_CallMethodNoArgs(self->service, l0_attr[A_OPEN_STEP]);
    }
    return rec;
}

/* ``_begin_record`` of the usual call, after ``calls`` got its place: the new Call, or NULL with an error. */
static PyObject *l0_begin(ModuleHooksObject *self, PyObject *state, PyObject *module, PyObject *args,
                          PyObject *kwargs, PyObject *name, PyObject *backward, PyObject *parent) {
    PyObject *rec = NULL, *seq = NULL, *params = NULL, *record = NULL, *call = NULL, *pylist = NULL;
    rec = l0_recorder(self);
    if (rec == NULL) goto done;
    seq = PyObject_CallMethodOneArg(rec, l0_attr[A_RESERVE], name);
    if (seq == NULL) goto done;
    params = l0_parameters(module);
    if (params == NULL) goto done;
    record = l0_head(self, args, params);
    if (record == Py_None) {  /* a summary not known at once: the record as a dict (``_input_record``) */
        Py_DECREF(record);
        PyObject *items = PyDict_Items(params);
        record = items == NULL ? NULL : PyObject_CallMethodObjArgs(self->records, l0_attr[A_INPUT_RECORD], name, args,
                                                                   kwargs, items, Py_False, NULL);
        Py_XDECREF(items);
    }
    if (record == NULL) goto done;
    int grad = self->prepare_backward != Py_None ? l0_call_true(self->grad_enabled) : 0;
    if (grad < 0) goto done;
    PyObject *cargs[7] = {name, backward, seq, record, Py_False, parent, grad ? Py_True : Py_False};
    call = PyObject_Vectorcall(self->call, cargs, 7, NULL);
    if (call == NULL) goto done;
    if (grad) {  /* its backward record's sizes; its inputs' gradient edges (``_prepare_backward``) */
        PyObject *sizes = L0_GET(state, A_BWD_SIZES);
        if (sizes == NULL) goto fail;
        PyObject *old = PyDict_GetItemWithError(sizes, backward);
        if (old == NULL && PyErr_Occurred()) { Py_DECREF(sizes); goto fail; }
        PyObject *first = old != NULL && PyTuple_Check(old) && PyTuple_GET_SIZE(old) == 2 ? PyTuple_GET_ITEM(old, 0)
                                                                                           : PyTuple_GET_ITEM(l0_no_sizes, 0);
        PyObject *size = Py_BuildValue("(On)", first, PyTuple_GET_SIZE(args));
        int rc = size == NULL ? -1 : PyDict_SetItem(sizes, backward, size);
        Py_XDECREF(size);
        Py_DECREF(sizes);
        if (rc < 0) goto fail;
        pylist = PySequence_List(args);
        PyObject *r = pylist == NULL ? NULL : PyObject_CallFunctionObjArgs(self->prepare_backward, call, pylist, NULL);
        if (r == NULL) goto fail;
        Py_DECREF(r);
    }
    if (self->capture_stack != Py_None) {
        PyObject *stack = PyObject_CallNoArgs(self->capture_stack);
        if (stack == NULL) goto fail;
        int rc;
        if (PyUnicode_Check(record)) {  /* journaled with the record at its end; its place in stack.json kept now */
            PyObject *stacks = L0_GET(rec, A_STACK);
            rc = stacks == NULL || PyObject_SetItem(stacks, name, stack) < 0
                 || PyObject_SetAttr(call, l0_attr[A_STACK], stack) < 0 ? -1 : 0;
            Py_XDECREF(stacks);
        } else {
            PyObject *r = PyObject_CallMethodObjArgs(rec, l0_attr[A_PUT_STACK], name, stack, NULL);
            rc = r == NULL ? -1 : 0;
            Py_XDECREF(r);
        }
        Py_DECREF(stack);
        if (rc < 0) goto fail;
    }
    if (PyObject_SetAttr(call, l0_attr[A_BY_NODE], Py_True) < 0) goto fail;
    goto done;
fail:
    Py_CLEAR(call);
done:
    Py_XDECREF(rec); Py_XDECREF(seq); Py_XDECREF(params); Py_XDECREF(record); Py_XDECREF(pylist);
    return call;
}

/* The number after the stem: "<base>.forward.<n>" and "<base>.backward.<n>", the counter moved on. */
static int l0_names(ModuleHooksObject *self, PyObject *state, PyObject **name, PyObject **backward) {
    PyObject *counters = L0_GET(state, A_COUNTERS);
    if (counters == NULL) return -1;
    PyObject *old = PyDict_GetItemWithError(counters, self->base);
    Py_ssize_t n = 0;
    if (old != NULL) n = PyLong_AsSsize_t(old);
    if (PyErr_Occurred()) { Py_DECREF(counters); return -1; }
    PyObject *next = PyLong_FromSsize_t(n + 1);
    int rc = next == NULL ? -1 : PyDict_SetItem(counters, self->base, next);
    Py_XDECREF(next);
    Py_DECREF(counters);
    if (rc < 0) return -1;
    *name = PyUnicode_FromFormat("%U.forward.%zd", self->base, n);
    *backward = *name == NULL ? NULL : PyUnicode_FromFormat("%U.backward.%zd", self->base, n);
    if (*backward == NULL) { Py_CLEAR(*name); return -1; }
    return 0;
}

static PyObject *mh_pre(ModuleHooksObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyTuple_CheckExact(args[1]) || !PyDict_CheckExact(args[2]) || PyDict_GET_SIZE(args[2]))
        return PyObject_Vectorcall(self->pre, args, nargs, NULL);
    PyObject *inputs = args[1];
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(inputs); i++)
        if (!l0_plain(self, PyTuple_GET_ITEM(inputs, i))) return PyObject_Vectorcall(self->pre, args, nargs, NULL);
    int usual = l0_recording(self);
    if (usual < 0) return NULL;
    if (!usual) return PyObject_Vectorcall(self->pre, args, nargs, NULL);
    PyObject *module = args[0];
    PyObject *state = NULL, *calls = NULL, *key = NULL, *name = NULL, *backward = NULL, *stack = NULL;
    PyObject *call = NULL, *module_calls = NULL;
    int placed = 0;
    state = L0_GET(self->records, A_STEP_STATE);
    if (state == NULL) return NULL;
    module_calls = L0_GET(state, A_MODULE_CALLS);
    key = module_calls == NULL ? NULL : PyLong_FromVoidPtr(module);
    if (key == NULL) goto fail;
    calls = PyDict_GetItemWithError(module_calls, key);
    if (calls != NULL) {
        Py_INCREF(calls);
    } else {
        if (PyErr_Occurred() || (calls = PyList_New(0)) == NULL || PyDict_SetItem(module_calls, key, calls) < 0)
            goto fail;
    }
    if (!PyList_Check(calls) || PyList_Append(calls, self->skipped) < 0) goto fail;  /* replaced once set up */
    placed = 1;
    if (l0_depth(self, 1) < 0) goto fail;
    if (l0_names(self, state, &name, &backward) == 0) {
        stack = L0_GET(state, A_MODULE_STACK);
        if (stack != NULL) {
            Py_ssize_t depth = PyList_Check(stack) ? PyList_GET_SIZE(stack) : -1;
            PyObject *parent = depth > 0 ? PyList_GET_ITEM(stack, depth - 1) : Py_None;
            Py_INCREF(parent);
            call = depth < 0 ? NULL : l0_begin(self, state, module, inputs, args[2], name, backward, parent);
            Py_DECREF(parent);
            if (call != NULL) {
                PyObject *recorded = L0_GET(state, A_RECORDED_MODULES);
                int rc = recorded == NULL ? -1 : PySet_Add(recorded, self->base);
                Py_XDECREF(recorded);
                if (rc < 0 || PyList_SetItem(calls, PyList_GET_SIZE(calls) - 1, Py_NewRef(call)) < 0
                    || PyList_Append(stack, name) < 0)
                    Py_CLEAR(call);
            }
        }
    }
    int failed = call == NULL;
    if (failed && l0_report(self) < 0) { l0_depth(self, -1); goto fail; }
    if (l0_depth(self, -1) < 0) goto fail;
    Py_XDECREF(state); Py_XDECREF(module_calls); Py_XDECREF(key); Py_XDECREF(calls); Py_XDECREF(name);
    Py_XDECREF(backward); Py_XDECREF(stack); Py_XDECREF(call);
    Py_RETURN_NONE;
fail:
    (void)placed;
    Py_XDECREF(state); Py_XDECREF(module_calls); Py_XDECREF(key); Py_XDECREF(calls); Py_XDECREF(name);
    Py_XDECREF(backward); Py_XDECREF(stack); Py_XDECREF(call);
    return NULL;
}

/* ``end_record`` + ``_hook_own_grads`` of the usual call (its record text ``text`` made): 0, -1 with an error. */
static int l0_end(ModuleHooksObject *self, PyObject *state, PyObject *call, PyObject *out, PyObject *text) {
    PyObject *rec = l0_recorder(self);
    if (rec == NULL) return -1;
    PyObject *name = L0_GET(call, A_NAME), *seq = L0_GET(call, A_SEQ), *stack = L0_GET(call, A_STACK);
    PyObject *parent = L0_GET(call, A_PARENT);
    PyObject *r = name && seq && stack && parent
                  ? PyObject_CallMethodObjArgs(rec, l0_attr[A_PUT_TEXT], name, text, seq, stack, parent, NULL) : NULL;
    Py_XDECREF(name); Py_XDECREF(seq); Py_XDECREF(stack); Py_XDECREF(parent);
    Py_DECREF(rec);
    if (r == NULL) return -1;
    Py_DECREF(r);
    if (self->prepare_backward == Py_None) return 0;
    int grad = l0_call_true(self->grad_enabled);
    if (grad <= 0) return grad;
    /* ``_hook_outputs``: the output's gradient from the call's own node when its edges are known */
    PyObject *edges = L0_GET(call, A_EDGES);
    if (edges == NULL) return -1;
    int by_node = edges != Py_None ? tensor_flag((RecordTextObject *)self->text, out, D_REQUIRES_GRAD) : 0;
    int rc = by_node;
    if (by_node > 0) {
        PyObject *backward = L0_GET(call, A_BACKWARD), *sizes = L0_GET(state, A_BWD_SIZES);
        PyObject *old = backward && sizes ? PyDict_GetItemWithError(sizes, backward) : NULL;
        rc = backward && sizes && (old != NULL || !PyErr_Occurred()) ? 0 : -1;
        if (rc == 0) {
            PyObject *second = old != NULL && PyTuple_Check(old) && PyTuple_GET_SIZE(old) == 2 ? PyTuple_GET_ITEM(old, 1)
                                                                                               : PyTuple_GET_ITEM(l0_no_sizes, 1);
            PyObject *size = Py_BuildValue("(iO)", 1, second);
            rc = size == NULL || PyDict_SetItem(sizes, backward, size) < 0
                 || PyObject_SetAttr(edges, l0_attr[A_OUTPUT], out) < 0 ? -1 : 0;
            Py_XDECREF(size);
        }
        Py_XDECREF(backward); Py_XDECREF(sizes);
    } else if (by_node == 0) {  /* tensor hooks (Python route) */
        PyObject *outs = PyList_New(1);
        if (outs != NULL) PyList_SET_ITEM(outs, 0, Py_NewRef(out));
        r = outs == NULL ? NULL : PyObject_CallMethodObjArgs(self->records, l0_attr[A_HOOK_OUTPUTS], call, outs, NULL);
        Py_XDECREF(outs);
        rc = r == NULL ? -1 : 0;
        Py_XDECREF(r);
    }
    if (rc == 0 && edges != Py_None) {
        r = PyObject_CallFunctionObjArgs(self->hook_own_grads, call, out, NULL);
        rc = r == NULL ? -1 : 0;
        Py_XDECREF(r);
    }
    Py_DECREF(edges);
    return rc;
}

static PyObject *mh_post(ModuleHooksObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !l0_plain(self, args[3])) return PyObject_Vectorcall(self->post, args, nargs, NULL);
    int usual = l0_recording(self);
    if (usual < 0) return NULL;
    if (!usual) return PyObject_Vectorcall(self->post, args, nargs, NULL);
    PyObject *state = L0_GET(self->records, A_STEP_STATE);
    if (state == NULL) return NULL;
    PyObject *module_calls = L0_GET(state, A_MODULE_CALLS);
    PyObject *key = module_calls == NULL ? NULL : PyLong_FromVoidPtr(args[0]);
    PyObject *calls = key == NULL ? NULL : PyDict_GetItemWithError(module_calls, key);  /* borrowed */
    PyObject *call = calls != NULL && PyList_Check(calls) && PyList_GET_SIZE(calls)
                     ? PyList_GET_ITEM(calls, PyList_GET_SIZE(calls) - 1) : NULL;
    PyObject *head = call != NULL && Py_TYPE(call) == (PyTypeObject *)self->call ? L0_GET(call, A_RECORD) : NULL;
    PyObject *text = NULL;
    if (head != NULL && PyUnicode_Check(head)) {
        PyObject *rargs[2] = {head, args[3]};
        text = rt_record((RecordTextObject *)self->text, rargs, 2);
        if (text == Py_None) Py_CLEAR(text);
    }
    Py_XDECREF(head);
    if (text == NULL) {  /* not the usual call, or its output's summary is not known at once: the Python route */
        Py_XDECREF(state); Py_XDECREF(module_calls); Py_XDECREF(key);
        if (PyErr_Occurred()) return NULL;
        return PyObject_Vectorcall(self->post, args, nargs, NULL);
    }
    Py_INCREF(call);
    int rc = PyList_SetSlice(calls, PyList_GET_SIZE(calls) - 1, PyList_GET_SIZE(calls), NULL);
    if (rc == 0 && PyList_GET_SIZE(calls) == 0) rc = PyDict_DelItem(module_calls, key);
    PyObject *result = NULL;
    if (rc == 0 && l0_depth(self, 1) == 0) {
        PyObject *stack = L0_GET(state, A_MODULE_STACK);
        rc = stack == NULL ? -1 : 0;
        if (rc == 0 && PyList_Check(stack) && PyList_GET_SIZE(stack))
            rc = PyList_SetSlice(stack, PyList_GET_SIZE(stack) - 1, PyList_GET_SIZE(stack), NULL);
        Py_XDECREF(stack);
        if (rc == 0) rc = l0_end(self, state, call, args[3], text);
        if (rc < 0) rc = l0_report(self);
        if (l0_depth(self, -1) < 0) rc = -1;
        if (rc == 0) result = Py_NewRef(Py_None);
    }
    Py_DECREF(call);
    Py_DECREF(text);
    Py_XDECREF(state); Py_XDECREF(module_calls); Py_XDECREF(key);
    return result;
}

#define MH_OBJECTS(X) X(records) X(service) X(text) X(base) X(pre) X(post) X(call) X(skipped) X(tensor) X(parameter) \
                      X(graph_task_id) X(grad_enabled) X(mode_enabled) X(tls) X(capture_stack) X(prepare_backward) \
                      X(hook_own_grads)

static PyObject *mh_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"records", "service", "text", "base", "pre", "post", "call", "skipped", "tensor", "parameter",
                         "graph_task_id", "grad_enabled", "mode_enabled", "tls", "capture_stack", "prepare_backward",
                         "hook_own_grads", NULL};
    PyObject *o[17];
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO!UOOOOOOOOOOOOO:ModuleHooks", kw, &o[0], &o[1], &RecordTextType,
                                     &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &o[8], &o[9], &o[10], &o[11], &o[12],
                                     &o[13], &o[14], &o[15], &o[16]))
        return NULL;
    if (!PyType_Check(o[6]) || !PyType_Check(o[8]) || !PyType_Check(o[9])) {
        PyErr_SetString(PyExc_TypeError, "call, tensor and parameter must be types");
        return NULL;
    }
    ModuleHooksObject *self = (ModuleHooksObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    PyObject **slots[] = {&self->records, &self->service, &self->text, &self->base, &self->pre, &self->post,
                          &self->call, &self->skipped, &self->tensor, &self->parameter, &self->graph_task_id,
                          &self->grad_enabled, &self->mode_enabled, &self->tls, &self->capture_stack,
                          &self->prepare_backward, &self->hook_own_grads};
    for (int i = 0; i < 17; i++) *slots[i] = Py_NewRef(o[i]);
    return (PyObject *)self;
}

#define MH_VISIT(f) Py_VISIT(self->f);
#define MH_CLEAR(f) Py_CLEAR(self->f);
static int mh_traverse(ModuleHooksObject *self, visitproc visit, void *arg) { MH_OBJECTS(MH_VISIT) return 0; }
static int mh_clear(ModuleHooksObject *self) { MH_OBJECTS(MH_CLEAR) return 0; }

static void mh_dealloc(ModuleHooksObject *self) {
    PyObject_GC_UnTrack(self);
    mh_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef mh_methods[] = {
    {"pre", (PyCFunction)(void (*)(void))mh_pre, METH_FASTCALL,
     "pre(module, args, kwargs) -> None: the module's forward pre hook (CallRecords._module_pre)"},
    {"post", (PyCFunction)(void (*)(void))mh_post, METH_FASTCALL,
     "post(module, args, kwargs, output) -> None: the module's forward hook (CallRecords._module_post)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ModuleHooksType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "msprobe_core.stats._fast_stats.ModuleHooks",
    .tp_basicsize = sizeof(ModuleHooksObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A module's L0 forward hooks in C (see _fast_l0.c)",
    .tp_new = mh_new,
    .tp_dealloc = (destructor)mh_dealloc,
    .tp_traverse = (traverseproc)mh_traverse,
    .tp_clear = (inquiry)mh_clear,
    .tp_methods = mh_methods,
};

/* Adds ModuleHooks to the module. */
static int add_module_hooks(PyObject *m) {
    for (int i = 0; i < N_ATTRS; i++)
        if (l0_attr[i] == NULL && (l0_attr[i] = PyUnicode_InternFromString(L0_ATTR_NAMES[i])) == NULL) return -1;
    if (l0_no_sizes == NULL && (l0_no_sizes = Py_BuildValue("(ii)", 0, 0)) == NULL) return -1;
    if (PyType_Ready(&ModuleHooksType) < 0) return -1;
    Py_INCREF(&ModuleHooksType);
    if (PyModule_AddObject(m, "ModuleHooks", (PyObject *)&ModuleHooksType) < 0) {
        Py_DECREF(&ModuleHooksType);
        return -1;
    }
    return 0;
}
/* ============================================================================== end of L0 module hooks */
