/* ==================================================================================== L0 module hooks (s11-l0)
 * A module call's records at level L0 in one C call per hook, planned when the hooks go in
 * (``CallRecords.hook_module`` in ``dump/call_records.py``; made by ``pytorch/dump_service.py`` and
 * ``pytorch/backward_capture.usual_capture``):
 *
 *   ModuleHooks(records, service, text, base, pre, post, call, skipped, tensor, parameter, graph_task_id,
 *               grad_enabled, mode_enabled, tls, capture_stack, backward, hook_own_grads, input_edges,
 *               sequence_nr, interned=None, no_torch_function=None)
 *     .pre(module, args, kwargs)          -> None: ``CallRecords._module_pre``'s work (``pre``: the Python route)
 *     .post(module, args, kwargs, output) -> None: ``_module_post``'s (``post``: the Python route)
 *   OwnGrads(..., step_hooks=None)(call, out) -> ``DumpService._hook_own_grads`` (``capture``) of the usual call
 *   SingleEdge(...)(grad_inputs, grad_outputs) -> ``backward_capture._SingleEdge``, the call's node hook
 *   CallGrads(...)(context, index, received, sent) -> ``CallRecords.on_call_grads``: the backward record
 *   ParamGrad(...)(grad)                  -> ``CallRecords._on_param_grad``: one parameter's gradient
 *   remove_hooks(flat)                    -> ``StepHooks.remove``'s loop
 *   plan_valid(root, modules)             -> ``HookPlan.still_valid``'s loop
 *
 * The usual call: the dumping thread, recording, no TorchFunctionMode but the dump's own (the mix level's operator
 * mode), positional inputs that are plain tensors (``tensor``, ``parameter``: the exact types) and one plain tensor
 * as output made by the call's one node with one edge to one input; its record text made by ``text`` (a
 * ``RecordText``) at once. The records, the ``Call`` left in the step's state, stacks, construct.json parents and
 * journal frames are the Python route's, byte for byte: the Python route takes any call that is not the usual one
 * before anything of it is done (a post hook then finishes whatever the pre hook began: the same ``Call``). An
 * error once something is done goes to ``records._error`` (the user's call goes on), as the Python route's. */

typedef struct {
    PyObject_HEAD
    PyObject *records, *service, *text, *base, *pre, *post, *call, *skipped, *tensor, *parameter;
    PyObject *graph_task_id, *grad_enabled, *mode_enabled, *tls, *capture_stack, *backward;
    PyObject *hook_own_grads, *input_edges, *sequence_nr;
    PyObject *interned;  /* ``StackCapture.interned`` of ``capture_stack``'s capture, or Py_None */
    PyObject *quiet_enter, *quiet_exit;  /* ``no_torch_function``'s __enter__ and __exit__, or NULL (``l0_quiet``) */
    PyObject *names;     /* list: the n-th call's ("<base>.forward.<n>", "<base>.backward.<n>"), made once */
    Py_ssize_t call_slots[10];  /* ``l0_layout``: where a ``Call``'s fields are, or call_slots[0] = -1 */
    Py_ssize_t edges_slots[5];  /* the same for ``InputEdges`` (``input_edges``, when it is a ``FieldsNew``: its class) */
} ModuleHooksObject;

/* ``Call``'s fields (``dump/call.py``), in their order, by their index */
static const char *const L0_CALL_FIELDS[10] = {"name", "backward", "seq", "record", "save", "parent", "grad", "edges",
                                               "stack", "by_node"};
enum { F_NAME, F_BACKWARD, F_SEQ, F_RECORD, F_SAVE, F_PARENT, F_GRAD, F_EDGES, F_STACK, F_BY_NODE };

/* ``InputEdges``' fields (``pytorch/backward_capture.py``), the same way */
static const char *const L0_EDGES_FIELDS[5] = {"begin", "slots", "alive", "leaf", "output"};
enum { E_BEGIN, E_SLOTS, E_ALIVE, E_LEAF, E_OUTPUT };

#define L0_MAX_FIELDS 10

/* Where the instances of ``cls`` keep their ``n`` fields ``names``, in ``slots``, when it is a class of exactly
 * those slots made by ``object.__new__`` whose ``__init__`` only sets them (a dataclass without ``__post_init__``)
 * and whose attributes are read and set the generic way: its instances are then made here without the Python
 * ``__init__`` frame (``l0_new_call``, ``FieldsNew``), their fields read and set in their slots (``l0_field``,
 * ``l0_set_field``). 1, 0 (made by calling ``cls``, fields as attributes). */
static int l0_layout(PyTypeObject *cls, const char *const *fields, int n, Py_ssize_t *slots) {
    if (Py_TYPE(cls) != &PyType_Type || cls->tp_new != PyBaseObject_Type.tp_new || cls->tp_alloc != PyType_GenericAlloc
        || cls->tp_getattro != PyObject_GenericGetAttr || cls->tp_setattro != PyObject_GenericSetAttr
        || !PyDict_Check(cls->tp_dict) || PyDict_GetItemString(cls->tp_dict, "__post_init__") != NULL
        || PyDict_GetItemString(cls->tp_dict, "__dataclass_fields__") == NULL)
        return 0;
    PyObject *names = PyDict_GetItemString(cls->tp_dict, "__slots__");  /* borrowed */
    if (names == NULL || !PyTuple_CheckExact(names) || PyTuple_GET_SIZE(names) != n) return 0;
    for (int i = 0; i < n; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        if (!PyUnicode_Check(name) || PyUnicode_CompareWithASCIIString(name, fields[i]) != 0) return 0;
        PyObject *d = PyDict_GetItemWithError(cls->tp_dict, name);
        if (d == NULL || Py_TYPE(d) != &PyMemberDescr_Type) { PyErr_Clear(); return 0; }
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type != T_OBJECT_EX || (m->flags & READONLY)) return 0;
        slots[i] = m->offset;
    }
    return 1;
}

/* A new ``Call`` of the 10 field values ``v``: NULL with an error. */
static PyObject *l0_new_call(ModuleHooksObject *self, PyObject *const *v) {
    if (self->call_slots[0] < 0) return PyObject_Vectorcall(self->call, v, 7, NULL);  /* (the defaults set the rest) */
    PyTypeObject *cls = (PyTypeObject *)self->call;
    PyObject *call = cls->tp_alloc(cls, 0);
    if (call != NULL)
        for (int i = 0; i < 10; i++) *(PyObject **)((char *)call + self->call_slots[i]) = Py_NewRef(v[i]);
    return call;
}

/* Names made once per number and kept (step after step a module's calls take the same numbers): at most */
#define L0_NAMES_KEPT 4096

/* attribute names, interned once */
enum { A_STEP_STATE, A_MODULE_CALLS, A_COUNTERS, A_MODULE_STACK, A_RECORDER, A_OPEN_STEP, A_RESERVE, A_PUT_TEXT,
       A_STACK, A_BWD_SIZES, A_RECORDED_MODULES, A_EDGES, A_BY_NODE, A_RECORDING, A_DUMPING_THREAD,
       A_PARAMETERS, A_ERROR, A_INPUT_RECORD, A_NAME, A_BACKWARD, A_SEQ, A_RECORD, A_PARENT, A_OUTPUT,
       A_REQUIRES_GRAD, A_HOOK_OUTPUTS, A_PUT_STACK, A_DATA, A_ON_CALL_GRADS, A_TENSOR_TEXT, A_PUT_TEXT_FIELD,
       A_SYNC, A_PARAM_GRAD_DICT, A_BEGIN, A_SLOTS, A_LEAF, A_GRAD_FN, A_OUTPUT_NR, A_SEQUENCE_NR, A_SAVE,
       A_REGISTER_HOOK, A_ID, A_EXTRA_DICT_REF, A_HOOKS_DICT_REF, A_NEXT_FUNCTIONS, A_VARIABLE, A_MODULES,
       A_BACKWARD_HOOKS, A_REGISTER_HOOK_DICT, A_NEXT_ID, N_ATTRS };
static const char *const L0_ATTR_NAMES[N_ATTRS] = {
    "step_state", "module_calls", "counters", "module_stack", "recorder", "_open_step", "reserve", "put_text",
    "stack", "bwd_sizes", "recorded_modules", "edges", "by_node", "_recording", "dumping_thread",
    "_parameters", "_error", "_input_record", "name", "backward", "seq", "record", "parent", "output",
    "requires_grad", "_hook_outputs", "put_stack", "data", "on_call_grads", "_tensor_text", "put_text_field",
    "_sync", "_param_grad_dict", "begin", "slots", "leaf", "grad_fn", "output_nr", "_sequence_nr", "save",
    "register_hook", "id", "extra_dict_ref", "hooks_dict_ref", "next_functions", "variable", "_modules",
    "_backward_hooks", "_register_hook_dict", "next_id"};
static PyObject *l0_attr[N_ATTRS];
static PyObject *l0_no_sizes;  /* (0, 0) */

/* A backward record's sizes (inputs, outputs) are a pair of small ints: made once and shared (a tuple per call
 * kept until the backward pass is an object more for the garbage collector to count, then untrack) */
#define L0_PAIRS 4
static PyObject *l0_pairs[L0_PAIRS][L0_PAIRS];

/* (a, n): a new reference, or NULL with an error. ``a`` an int object (any object: a tuple made for it). */
static PyObject *l0_pair(PyObject *a, Py_ssize_t n) {
    int overflow = 0;
    long v = PyLong_CheckExact(a) ? PyLong_AsLongAndOverflow(a, &overflow) : -1;
    if (v >= 0 && v < L0_PAIRS && !overflow && n >= 0 && n < L0_PAIRS) return Py_NewRef(l0_pairs[v][n]);
    return Py_BuildValue("(On)", a, n);
}

#define L0_GET(obj, a) PyObject_GetAttr((obj), l0_attr[a])

/* Field ``f`` (attribute ``a``) of ``obj``, an instance of the class whose layout ``slots`` holds (``l0_layout``;
 * slots[0] < 0: none, the attribute is read): a new reference, or NULL with an error (an unset slot: the
 * attribute's error). */
static PyObject *l0_field(PyObject *obj, const Py_ssize_t *slots, int f, int a) {
    PyObject *v = slots[0] >= 0 ? *(PyObject **)((char *)obj + slots[f]) : NULL;
    return v != NULL ? Py_NewRef(v) : L0_GET(obj, a);
}

/* obj.<field f> = v, as ``l0_field`` reads it: 0, or -1 with an error. */
static int l0_set_field(PyObject *obj, const Py_ssize_t *slots, int f, int a, PyObject *v) {
    if (slots[0] < 0) return PyObject_SetAttr(obj, l0_attr[a], v);
    Py_XSETREF(*(PyObject **)((char *)obj + slots[f]), Py_NewRef(v));
    return 0;
}

/* A class's layout (``l0_layout``), found once per class: the class it is for (held), or NULL. */
typedef struct {
    PyObject *type;
    Py_ssize_t slots[L0_MAX_FIELDS];
} L0Layout;

/* The layout of ``obj``'s class (the ``n`` fields ``names``), kept in ``kept`` for the next object of that class. */
static const Py_ssize_t *l0_layout_of(L0Layout *kept, PyObject *obj, const char *const *names, int n) {
    PyObject *type = (PyObject *)Py_TYPE(obj);
    if (type != kept->type) {
        if (!l0_layout((PyTypeObject *)type, names, n, kept->slots)) kept->slots[0] = -1;
        Py_XSETREF(kept->type, Py_NewRef(type));
    }
    return kept->slots;
}

static const Py_ssize_t l0_no_layout[1] = {-1};  /* no layout known: fields as attributes */

/* ``FieldsNew``: ``cls(*values)`` of a class whose layout is known (``l0_layout``) and whose fields after the first
 * ``given`` default to None, made with its slots set, without the Python ``__init__`` frame (``ModuleHooks``'
 * ``InputEdges``, made by ``_fast_gradapi.c``'s ``ag_edges_of``); any other call is the class's own. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *cls;
    int n, given;
    Py_ssize_t slots[L0_MAX_FIELDS];
} FieldsNewObject;

static PyObject *fn_call(FieldsNewObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != self->given || kwnames != NULL)
        return PyObject_Vectorcall(self->cls, args, nargsf, kwnames);
    PyTypeObject *cls = (PyTypeObject *)self->cls;
    PyObject *obj = cls->tp_alloc(cls, 0);
    if (obj != NULL)
        for (int i = 0; i < self->n; i++)
            *(PyObject **)((char *)obj + self->slots[i]) = Py_NewRef(i < self->given ? args[i] : Py_None);
    return obj;
}

static int fn_traverse(FieldsNewObject *self, visitproc visit, void *arg) { Py_VISIT(self->cls); return 0; }
static int fn_clear(FieldsNewObject *self) { Py_CLEAR(self->cls); return 0; }
static void fn_dealloc(FieldsNewObject *self) {
    PyObject_GC_UnTrack(self);
    fn_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject FieldsNewType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "msprobe_core.stats._fast_stats.FieldsNew",
    .tp_basicsize = sizeof(FieldsNewObject),
    .tp_vectorcall_offset = offsetof(FieldsNewObject, vectorcall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "a plain slots dataclass's instances made without its __init__ frame (see _fast_l0.c)",
    .tp_call = PyVectorcall_Call,
    .tp_dealloc = (destructor)fn_dealloc,
    .tp_traverse = (traverseproc)fn_traverse,
    .tp_clear = (inquiry)fn_clear,
};

/* A ``FieldsNew`` of ``cls`` (its ``n`` fields ``names``, the first ``given`` of them passed) where its layout is
 * known (set in ``slots``) and its dataclass fields after the first ``given`` default to None; else ``cls`` itself
 * (slots[0] = -1). A new reference, or NULL with an error. */
static PyObject *l0_fields_new(PyObject *cls, const char *const *names, int n, int given, Py_ssize_t *slots) {
    if (!PyType_Check(cls) || !l0_layout((PyTypeObject *)cls, names, n, slots)) {
        slots[0] = -1;
        return Py_NewRef(cls);
    }
    PyObject *fields = PyDict_GetItemString(((PyTypeObject *)cls)->tp_dict, "__dataclass_fields__");  /* borrowed */
    int none = fields != NULL && PyDict_Check(fields);
    for (int i = given; i < n && none; i++) {
        PyObject *field = PyDict_GetItemString(fields, names[i]);  /* borrowed */
        PyObject *dflt = field == NULL ? NULL : PyObject_GetAttrString(field, "default");
        none = dflt == Py_None;
        Py_XDECREF(dflt);
    }
    PyErr_Clear();  /* (a field without a default: the class called) */
    FieldsNewObject *maker = none ? PyObject_GC_New(FieldsNewObject, &FieldsNewType) : NULL;
    if (maker == NULL) {
        slots[0] = -1;
        return none ? NULL : Py_NewRef(cls);
    }
    maker->vectorcall = (vectorcallfunc)fn_call;
    maker->cls = Py_NewRef(cls);
    maker->n = n;
    maker->given = given;
    memcpy(maker->slots, slots, sizeof(Py_ssize_t) * n);
    PyObject_GC_Track(maker);
    return (PyObject *)maker;
}

/* ``tls.depth`` += delta of a hook object's ``tls`` (the tool's own work, as ``_own``): _fast_depth.c's, in the
 * thread's dict of it; a pending error kept (the failure paths' restore). */
#define l0_depth(self, delta) tool_depth_add((self)->tls, (delta))

/* The value of a no-argument callable as a C truth value: 1, 0, or -1 with an error. */
static int l0_call_true(PyObject *fn) {
    PyObject *v = PyObject_CallNoArgs(fn);
    if (v == NULL) return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* The raised error to ``records._error(name, exc)``, as the Python route's ``except Exception``; a
 * BaseException that is no Exception (KeyboardInterrupt) stays raised: -1. */
static int l0_report_to(PyObject *records, PyObject *name) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL) PyException_SetTraceback(value, tb);
    PyObject *r = PyObject_CallMethodObjArgs(records, l0_attr[A_ERROR], name, value ? value : Py_None, NULL);
    Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(tb);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

#define l0_report(self) l0_report_to((self)->records, (self)->base)

/* Every torch function off while the usual call's work reads its tensors' attributes (``on`` 1), or back as it was
 * (0), where the hooks were given ``no_torch_function`` (a ``torch._C.DisableTorchFunction``: the Python route's
 * ``_no_torch_function``). The usual call runs under no TorchFunctionMode but the dump's own operator mode
 * (``mode_enabled``), which passes those reads through unchanged, but only after torch has called it for each
 * (``grad_fn``, ``output_nr``: ~9k instructions a read). 0, or -1 with an error; one already raised is kept (and
 * -1 returned), as ``tool_depth_add``. */
static int l0_quiet(ModuleHooksObject *self, int on) {
    if (self->quiet_enter == NULL) return PyErr_Occurred() ? -1 : 0;
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    PyObject *none3[3] = {Py_None, Py_None, Py_None};
    PyObject *r = on ? PyObject_CallNoArgs(self->quiet_enter) : PyObject_Vectorcall(self->quiet_exit, none3, 3, NULL);
    Py_XDECREF(r);
    if (et == NULL) return r == NULL ? -1 : 0;
    if (r == NULL) PyErr_Clear();
    PyErr_Restore(et, ev, etb);
    return -1;
}

/* Is this call the dumping thread's, while recording, outside the tool's work, a backward pass and any
 * TorchFunctionMode but the dump's own operator mode (``mode_enabled``; ``DumpService.should_record`` for the
 * thread that records)? 1, 0, -1 with an error. */
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
    PyObject *d = tool_depth_get(self->tls);
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

static long long og_long(PyObject *obj, int a, int call);

static PyObject *ag_edges_of(PyObject *cls, PyObject *sequence_nr, PyObject *tensors);  /* (_fast_gradapi.c) */

/* ``InputEdges.of(list(args))`` (``backward_capture``) of plain tensors: a new reference (Py_None: no input
 * requires grad), or NULL with an error. */
static PyObject *l0_edges(ModuleHooksObject *self, PyObject *args) {
    return ag_edges_of(self->input_edges, self->sequence_nr, args);
}

/* The layout of ``edges`` when ``l0_edges`` made it here (``FieldsNew``): its fields read and set in their slots. */
static const Py_ssize_t *l0_edges_layout(ModuleHooksObject *self, PyObject *edges) {
    return self->edges_slots[0] >= 0 && (PyObject *)Py_TYPE(edges) == ((FieldsNewObject *)self->input_edges)->cls
           ? self->edges_slots : l0_no_layout;
}

/* The stack of the hook's caller (``capture_stack()``): looked up by its frame key in ``interned`` (the
 * capture's table, as ``_fast_api.c``'s ``ac_stack``), made by ``capture_stack`` only the first time. */
static PyObject *l0_stack(ModuleHooksObject *self) {
    if (PyDict_CheckExact(self->interned)) {
        PyFrameObject *f = PyEval_GetFrame();  /* the Python function that called the hook (borrowed) */
        Py_XINCREF(f);
        PyObject *key = stack_key(f);
        if (key == NULL) return NULL;
        PyObject *stack = PyDict_GetItemWithError(self->interned, key);
        Py_DECREF(key);
        if (stack != NULL) return Py_NewRef(stack);
        if (PyErr_Occurred()) return NULL;
    }
    return PyObject_CallNoArgs(self->capture_stack);
}

/* ``_begin_record`` of the usual call, after ``calls`` got its place: the new Call, or NULL with an error. */
static PyObject *l0_begin(ModuleHooksObject *self, PyObject *state, PyObject *module, PyObject *args,
                          PyObject *kwargs, PyObject *name, PyObject *backward, PyObject *parent) {
    PyObject *rec = NULL, *seq = NULL, *params = NULL, *record = NULL, *call = NULL;
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
    int grad = self->backward == Py_True ? l0_call_true(self->grad_enabled) : 0;
    if (grad < 0) goto done;
    PyObject *cargs[10] = {name, backward, seq, record, Py_False, parent, grad ? Py_True : Py_False, Py_None, Py_None,
                           Py_False};
    call = l0_new_call(self, cargs);
    if (call == NULL) goto done;
    if (grad) {  /* its backward record's sizes; its inputs' gradient edges (``_prepare_backward``) */
        PyObject *sizes = L0_GET(state, A_BWD_SIZES);
        if (sizes == NULL) goto fail;
        PyObject *old = PyDict_GetItemWithError(sizes, backward);
        if (old == NULL && PyErr_Occurred()) { Py_DECREF(sizes); goto fail; }
        PyObject *first = old != NULL && PyTuple_Check(old) && PyTuple_GET_SIZE(old) == 2 ? PyTuple_GET_ITEM(old, 0)
                                                                                           : PyTuple_GET_ITEM(l0_no_sizes, 0);
        PyObject *size = l0_pair(first, PyTuple_GET_SIZE(args));
        int rc = size == NULL ? -1 : PyDict_SetItem(sizes, backward, size);
        Py_XDECREF(size);
        Py_DECREF(sizes);
        if (rc < 0) goto fail;
        PyObject *edges = l0_edges(self, args);
        if (edges == NULL || (edges != Py_None && l0_set_field(call, self->call_slots, F_EDGES, A_EDGES, edges) < 0)) {
            Py_XDECREF(edges);
            goto fail;
        }
        Py_DECREF(edges);
    }
    if (self->capture_stack != Py_None) {
        PyObject *stack = l0_stack(self);
        if (stack == NULL) goto fail;
        int rc;
        if (PyUnicode_Check(record)) {  /* journaled with the record at its end; its place in stack.json kept now */
            PyObject *stacks = L0_GET(rec, A_STACK);
            rc = stacks == NULL || PyObject_SetItem(stacks, name, stack) < 0
                 || l0_set_field(call, self->call_slots, F_STACK, A_STACK, stack) < 0 ? -1 : 0;
            Py_XDECREF(stacks);
        } else {
            PyObject *r = PyObject_CallMethodObjArgs(rec, l0_attr[A_PUT_STACK], name, stack, NULL);
            rc = r == NULL ? -1 : 0;
            Py_XDECREF(r);
        }
        Py_DECREF(stack);
        if (rc < 0) goto fail;
    }
    if (l0_set_field(call, self->call_slots, F_BY_NODE, A_BY_NODE, Py_True) < 0) goto fail;
    goto done;
fail:
    Py_CLEAR(call);
done:
    Py_XDECREF(rec); Py_XDECREF(seq); Py_XDECREF(params); Py_XDECREF(record);
    return call;
}

/* The number after the stem: "<base>.forward.<n>" and "<base>.backward.<n>" (made once per n: ``names``), the
 * counter moved on. */
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
    if (n >= 0 && n < PyList_GET_SIZE(self->names)) {
        PyObject *pair = PyList_GET_ITEM(self->names, n);
        *name = Py_NewRef(PyTuple_GET_ITEM(pair, 0));
        *backward = Py_NewRef(PyTuple_GET_ITEM(pair, 1));
        return 0;
    }
    *name = PyUnicode_FromFormat("%U.forward.%zd", self->base, n);
    *backward = *name == NULL ? NULL : PyUnicode_FromFormat("%U.backward.%zd", self->base, n);
    if (*backward == NULL) { Py_CLEAR(*name); return -1; }
    if (n == PyList_GET_SIZE(self->names) && n < L0_NAMES_KEPT) {  /* the next number: kept for the next steps */
        PyObject *pair = PyTuple_Pack(2, *name, *backward);
        if (pair == NULL || PyList_Append(self->names, pair) < 0) {
            Py_XDECREF(pair);
            Py_CLEAR(*name); Py_CLEAR(*backward);
            return -1;
        }
        Py_DECREF(pair);
    }
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
    if (!PyList_Check(calls)) {
        PyErr_SetString(PyExc_TypeError, "the step's module_calls entry is not a list");
        goto fail;
    }
    if (PyList_Append(calls, self->skipped) < 0) goto fail;  /* replaced once set up */
    if (l0_depth(self, 1) < 0) goto fail;
    if (l0_quiet(self, 1) < 0) { (void)l0_depth(self, -1); goto fail; }
    if (l0_names(self, state, &name, &backward) == 0) {
        stack = L0_GET(state, A_MODULE_STACK);
        if (stack != NULL) {
            Py_ssize_t depth = PyList_Check(stack) ? PyList_GET_SIZE(stack) : -1;
            PyObject *parent = depth > 0 ? PyList_GET_ITEM(stack, depth - 1) : Py_None;
            Py_INCREF(parent);
            if (depth < 0)
                PyErr_SetString(PyExc_TypeError, "the step's module_stack is not a list");
            else
                call = l0_begin(self, state, module, inputs, args[2], name, backward, parent);
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
    if (l0_quiet(self, 0) < 0) Py_CLEAR(call);
    int failed = call == NULL;
    if (failed && l0_report(self) < 0) { (void)l0_depth(self, -1); goto fail; }
    if (l0_depth(self, -1) < 0) goto fail;
    Py_XDECREF(state); Py_XDECREF(module_calls); Py_XDECREF(key); Py_XDECREF(calls); Py_XDECREF(name);
    Py_XDECREF(backward); Py_XDECREF(stack); Py_XDECREF(call);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(state); Py_XDECREF(module_calls); Py_XDECREF(key); Py_XDECREF(calls); Py_XDECREF(name);
    Py_XDECREF(backward); Py_XDECREF(stack); Py_XDECREF(call);
    return NULL;
}

/* ``end_record`` + ``_hook_own_grads`` of the usual call (its record text ``text`` made): 0, -1 with an error. */
static int l0_end(ModuleHooksObject *self, PyObject *state, PyObject *call, PyObject *out, PyObject *text) {
    PyObject *rec = l0_recorder(self);
    if (rec == NULL) return -1;
    const Py_ssize_t *slots = self->call_slots;
    PyObject *name = l0_field(call, slots, F_NAME, A_NAME), *seq = l0_field(call, slots, F_SEQ, A_SEQ);
    PyObject *stack = l0_field(call, slots, F_STACK, A_STACK), *parent = l0_field(call, slots, F_PARENT, A_PARENT);
    PyObject *pargs[6] = {rec, name, text, seq, stack, parent};  /* (a vector call: no bound method made) */
    PyObject *r = name && seq && stack && parent
                  ? PyObject_VectorcallMethod(l0_attr[A_PUT_TEXT], pargs, 6 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL) : NULL;
    Py_XDECREF(name); Py_XDECREF(seq); Py_XDECREF(stack); Py_XDECREF(parent);
    Py_DECREF(rec);
    if (r == NULL) return -1;
    Py_DECREF(r);
    if (self->backward != Py_True) return 0;
    int grad = l0_call_true(self->grad_enabled);
    if (grad <= 0) return grad;
    /* ``_hook_outputs``: the output's gradient from the call's own node when its edges are known */
    PyObject *edges = l0_field(call, slots, F_EDGES, A_EDGES);
    if (edges == NULL) return -1;
    int by_node = edges != Py_None ? tensor_flag((RecordTextObject *)self->text, out, D_REQUIRES_GRAD) : 0;
    int rc = by_node;
    if (by_node > 0) {
        PyObject *backward = l0_field(call, slots, F_BACKWARD, A_BACKWARD), *sizes = L0_GET(state, A_BWD_SIZES);
        PyObject *old = backward && sizes ? PyDict_GetItemWithError(sizes, backward) : NULL;
        rc = backward && sizes && (old != NULL || !PyErr_Occurred()) ? 0 : -1;
        if (rc == 0) {
            PyObject *second = old != NULL && PyTuple_Check(old) && PyTuple_GET_SIZE(old) == 2 ? PyTuple_GET_ITEM(old, 1)
                                                                                               : PyTuple_GET_ITEM(l0_no_sizes, 1);
            Py_ssize_t n = PyLong_CheckExact(second) ? PyLong_AsSsize_t(second) : -1;
            if (n == -1 && PyErr_Occurred()) PyErr_Clear();  /* (not a small int: a tuple made for it) */
            PyObject *size = n >= 0 && n < L0_PAIRS ? Py_NewRef(l0_pairs[1][n]) : Py_BuildValue("(iO)", 1, second);
            rc = size == NULL || PyDict_SetItem(sizes, backward, size) < 0
                 || l0_set_field(edges, l0_edges_layout(self, edges), E_OUTPUT, A_OUTPUT, out) < 0 ? -1 : 0;
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
        PyObject *oargs[2] = {call, out};
        r = PyObject_Vectorcall(self->hook_own_grads, oargs, 2, NULL);
        rc = r == NULL ? -1 : 0;
        Py_XDECREF(r);
    }
    Py_DECREF(edges);
    return rc;
}

static PyObject *mh_post(ModuleHooksObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || Py_TYPE(args[3]) != (PyTypeObject *)self->tensor)  /* (a Parameter output: tensor hooks) */
        return PyObject_Vectorcall(self->post, args, nargs, NULL);
    int usual = l0_recording(self);
    if (usual < 0) return NULL;
    if (!usual) return PyObject_Vectorcall(self->post, args, nargs, NULL);
    PyObject *state = L0_GET(self->records, A_STEP_STATE);
    if (state == NULL) return NULL;
    PyObject *module_calls = L0_GET(state, A_MODULE_CALLS);
    PyObject *key = module_calls == NULL ? NULL : PyLong_FromVoidPtr(args[0]);
    /* the list and its last call held: the text below may run Python code (a collection's finalizers) */
    PyObject *calls = key == NULL ? NULL : Py_XNewRef(PyDict_GetItemWithError(module_calls, key));
    PyObject *call = calls != NULL && PyList_Check(calls) && PyList_GET_SIZE(calls)
                     ? Py_NewRef(PyList_GET_ITEM(calls, PyList_GET_SIZE(calls) - 1)) : NULL;
    PyObject *head = call != NULL && Py_TYPE(call) == (PyTypeObject *)self->call
                     ? l0_field(call, self->call_slots, F_RECORD, A_RECORD) : NULL;
    PyObject *text = NULL;
    if (head != NULL && PyUnicode_Check(head)) {
        PyObject *rargs[2] = {head, args[3]};
        text = rt_record((RecordTextObject *)self->text, rargs, 2);
        if (text == Py_None) Py_CLEAR(text);
    }
    Py_XDECREF(head);
    if (text == NULL) {  /* not the usual call, or its output's summary is not known at once: the Python route */
        Py_XDECREF(state); Py_XDECREF(module_calls); Py_XDECREF(key); Py_XDECREF(calls); Py_XDECREF(call);
        if (PyErr_Occurred()) return NULL;
        return PyObject_Vectorcall(self->post, args, nargs, NULL);
    }
    /* the call is still the list's last (nothing recorded in between takes a module call of this module) */
    Py_ssize_t size = PyList_GET_SIZE(calls);
    int rc = size && PyList_GET_ITEM(calls, size - 1) == call ? PyList_SetSlice(calls, size - 1, size, NULL) : -1;
    if (rc < 0 && !PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "the module's open calls changed");
    if (rc == 0 && PyList_GET_SIZE(calls) == 0) rc = PyDict_DelItem(module_calls, key);
    PyObject *result = NULL;
    if (rc == 0 && l0_depth(self, 1) == 0) {
        PyObject *stack = L0_GET(state, A_MODULE_STACK);
        rc = stack == NULL ? -1 : 0;
        if (rc == 0 && PyList_Check(stack) && PyList_GET_SIZE(stack))
            rc = PyList_SetSlice(stack, PyList_GET_SIZE(stack) - 1, PyList_GET_SIZE(stack), NULL);
        Py_XDECREF(stack);
        if (rc == 0 && (rc = l0_quiet(self, 1)) == 0) {
            rc = l0_end(self, state, call, args[3], text);
            if (l0_quiet(self, 0) < 0) rc = -1;
        }
        if (rc < 0) rc = l0_report(self);
        if (rc < 0) (void)l0_depth(self, -1);
        else if (l0_depth(self, -1) < 0) rc = -1;
        if (rc == 0) result = Py_NewRef(Py_None);
    }
    Py_DECREF(call); Py_DECREF(calls);
    Py_DECREF(text);
    Py_XDECREF(state); Py_XDECREF(module_calls); Py_XDECREF(key);
    return result;
}

#define MH_OBJECTS(X) X(records) X(service) X(text) X(base) X(pre) X(post) X(call) X(skipped) X(tensor) X(parameter) \
                      X(graph_task_id) X(grad_enabled) X(mode_enabled) X(tls) X(capture_stack) X(backward) \
                      X(hook_own_grads) X(input_edges) X(sequence_nr) X(interned) X(names) X(quiet_enter) X(quiet_exit)

static PyObject *mh_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"records", "service", "text", "base", "pre", "post", "call", "skipped", "tensor", "parameter",
                         "graph_task_id", "grad_enabled", "mode_enabled", "tls", "capture_stack", "backward",
                         "hook_own_grads", "input_edges", "sequence_nr", "interned", "no_torch_function", NULL};
    PyObject *o[21];
    o[19] = o[20] = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO!UOOOOOOOOOOOOOOO|OO:ModuleHooks", kw, &o[0], &o[1],
                                     &RecordTextType, &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &o[8], &o[9], &o[10],
                                     &o[11], &o[12], &o[13], &o[14], &o[15], &o[16], &o[17], &o[18], &o[19], &o[20]))
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
                          &self->backward, &self->hook_own_grads, &self->input_edges, &self->sequence_nr,
                          &self->interned};
    for (int i = 0; i < 20; i++) *slots[i] = Py_NewRef(o[i]);
    self->names = PyList_New(0);
    if (self->names == NULL) { Py_DECREF(self); return NULL; }
    if (o[20] != Py_None && ((self->quiet_enter = PyObject_GetAttrString(o[20], "__enter__")) == NULL
                             || (self->quiet_exit = PyObject_GetAttrString(o[20], "__exit__")) == NULL)) {
        Py_DECREF(self);
        return NULL;
    }
    if (!l0_layout((PyTypeObject *)self->call, L0_CALL_FIELDS, 10, self->call_slots)) self->call_slots[0] = -1;
    /* ``InputEdges`` made without its ``__init__`` frame (four fields given, ``output`` None) */
    PyObject *edges_new = l0_fields_new(self->input_edges, L0_EDGES_FIELDS, 5, 4, self->edges_slots);
    if (edges_new == NULL) { Py_DECREF(self); return NULL; }
    Py_SETREF(self->input_edges, edges_new);
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


/* ----------------------------------------------------------------------------------------- backward records
 *   CallGrads(records, service, grad_text, grad_enabled, mode_enabled, tls)
 *     (context, index, received, sent) -> bool: ``CallRecords.on_call_grads(*context, index, received, sent)``
 *   SingleEdge(report, fail, context, index, edge, report_output, out_nr, report_both)
 *     (grad_inputs, grad_outputs) -> None: ``backward_capture._SingleEdge`` (the same object, in C)
 *   ParamGrad(records, service, grad_text, grad_enabled, mode_enabled, tls, base, pname, count, fallback, fields,
 *             text_fields=None)
 *     (grad) -> None: ``CallRecords._on_param_grad(base, pname, count, grad)``
 * Where autograd records (create_graph) or a TorchFunctionMode other than the dump's own is on, or a gradient's text
 * is not known at once, they take the Python route (``records``' methods) for the whole gradient. */

typedef struct {
    PyObject_HEAD
    PyObject *records, *service, *grad_text, *grad_enabled, *mode_enabled, *tls;
} CallGradsObject;

/* May the gradients be read here without ``_quiet()`` (autograd off, no TorchFunctionMode but the dump's own
 * operator mode: ``mode_enabled``)? 1, 0, -1. */
static int g_quiet(CallGradsObject *self) {
    int on = l0_call_true(self->grad_enabled);
    if (on != 0) return on < 0 ? -1 : 0;
    on = l0_call_true(self->mode_enabled);
    return on < 0 ? -1 : !on;
}

/* Is obj the int v? (no error: an int too large for a C long is not v) */
static inline int g_is_long(PyObject *obj, long v) {
    int overflow = 0;
    return PyLong_CheckExact(obj) && PyLong_AsLongAndOverflow(obj, &overflow) == v && !overflow;
}

/* A gradient's summary text (``GradText.text``, else ``records._tensor_text``): a new str, Py_None, or NULL. */
static PyObject *g_text(CallGradsObject *self, PyObject *grad, int remember) {
    PyObject *a[2] = {grad, remember ? Py_True : Py_False};
    PyObject *text = gt_text((GradTextObject *)self->grad_text, a, 2);
    if (text == Py_None) {
        Py_DECREF(text);
        text = PyObject_CallMethodOneArg(self->records, l0_attr[A_TENSOR_TEXT], grad);
    }
    return text;
}

/* ``service.recorder``'s record named ``name`` is there already? 1, 0, -1. */
static int g_has(PyObject *rec, PyObject *name) {
    PyObject *data = L0_GET(rec, A_DATA);
    if (data == NULL) return -1;
    int r = PySequence_Contains(data, name);
    Py_DECREF(data);
    return r;
}

/* ``{"input": [<received>], "output": [<sent>]}`` of two summary texts: a new str, or NULL with an error. Two
 * ASCII texts (the summaries always are) are copied in place, without PyUnicode_FromFormat's parsing. */
static PyObject *g_pair_text(PyObject *received, PyObject *sent) {
    static const char head[] = "{\"input\": [", middle[] = "], \"output\": [", tail[] = "]}";
    if (!PyUnicode_Check(received) || !PyUnicode_Check(sent)) {
        PyErr_SetString(PyExc_TypeError, "a gradient's summary text is no str");
        return NULL;
    }
    if (!PyUnicode_IS_ASCII(received) || !PyUnicode_IS_ASCII(sent))
        return PyUnicode_FromFormat("{\"input\": [%U], \"output\": [%U]}", received, sent);
    Py_ssize_t n1 = PyUnicode_GET_LENGTH(received), n2 = PyUnicode_GET_LENGTH(sent);
    Py_ssize_t a = sizeof head - 1, b = sizeof middle - 1, c = sizeof tail - 1;
    PyObject *text = PyUnicode_New(a + n1 + b + n2 + c, 127);
    if (text == NULL) return NULL;
    char *p = (char *)PyUnicode_1BYTE_DATA(text);
    memcpy(p, head, a);
    memcpy(p += a, PyUnicode_1BYTE_DATA(received), n1);
    memcpy(p += n1, middle, b);
    memcpy(p += b, PyUnicode_1BYTE_DATA(sent), n2);
    memcpy(p + n2, tail, c);
    return text;
}

static PyObject *cg_call(CallGradsObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 4 || kwnames != NULL || !PyTuple_CheckExact(args[0]) || PyTuple_GET_SIZE(args[0]) != 3) {
        PyErr_SetString(PyExc_TypeError, "CallGrads takes (context, index, received, sent)");
        return NULL;
    }
    PyObject *backward = PyTuple_GET_ITEM(args[0], 0), *save = PyTuple_GET_ITEM(args[0], 1);
    PyObject *parent = PyTuple_GET_ITEM(args[0], 2);
    int quiet = g_quiet(self);
    if (quiet <= 0) {
        if (quiet < 0) return NULL;
        PyObject *a[7] = {self->records, backward, save, parent, args[1], args[2], args[3]};
        return PyObject_VectorcallMethod(l0_attr[A_ON_CALL_GRADS], a, 7 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    }
    PyObject *rec = L0_GET(self->service, A_RECORDER);
    if (rec == NULL) return NULL;
    int usual = rec != Py_None && save == Py_False && g_is_long(args[1], 0);
    if (usual) {
        int has = g_has(rec, backward);
        if (has < 0) { Py_DECREF(rec); return NULL; }
        usual = !has;
    }
    if (usual) {  /* its backward record's sizes are (1, 1) */
        PyObject *state = L0_GET(self->records, A_STEP_STATE);
        PyObject *sizes = state == NULL ? NULL : L0_GET(state, A_BWD_SIZES);
        PyObject *size = sizes == NULL ? NULL : PyDict_GetItemWithError(sizes, backward);
        usual = size != NULL && PyTuple_CheckExact(size) && PyTuple_GET_SIZE(size) == 2
                && g_is_long(PyTuple_GET_ITEM(size, 0), 1) && g_is_long(PyTuple_GET_ITEM(size, 1), 1);
        Py_XDECREF(state);
        Py_XDECREF(sizes);
        if (PyErr_Occurred()) { Py_DECREF(rec); return NULL; }
    }
    if (!usual) {
        Py_DECREF(rec);
        Py_RETURN_FALSE;
    }
    if (l0_depth(self, 1) < 0) { Py_DECREF(rec); return NULL; }
    PyObject *result = NULL, *received = NULL, *sent = NULL;
    received = g_text(self, args[2], 0);
    sent = received == NULL || received == Py_None ? NULL : g_text(self, args[3], 1);
    if (received == Py_None || sent == Py_None) {
        result = Py_NewRef(Py_False);
    } else if (sent != NULL) {
        PyObject *text = g_pair_text(received, sent);
        /* seq None: its place in execution order taken now (``reserve`` and ``put_text`` in one call) */
        PyObject *pargs[6] = {rec, backward, text, Py_None, Py_None, parent};
        PyObject *r = text == NULL ? NULL
                      : PyObject_VectorcallMethod(l0_attr[A_PUT_TEXT], pargs, 6 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_XDECREF(text);
        if (r != NULL) {
            Py_DECREF(r);
            result = Py_NewRef(Py_True);
        }
    }
    Py_XDECREF(received); Py_XDECREF(sent);
    Py_DECREF(rec);
    if (result == NULL) (void)l0_depth(self, -1);
    else if (l0_depth(self, -1) < 0) Py_CLEAR(result);
    return result;
}

#define CG_OBJECTS(X) X(records) X(service) X(grad_text) X(grad_enabled) X(mode_enabled) X(tls)

static PyObject *cg_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"records", "service", "grad_text", "grad_enabled", "mode_enabled", "tls", NULL};
    PyObject *o[6];
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO!OOO:CallGrads", kw, &o[0], &o[1], &GradTextType, &o[2], &o[3],
                                     &o[4], &o[5]))
        return NULL;
    CallGradsObject *self = (CallGradsObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    PyObject **slots[] = {&self->records, &self->service, &self->grad_text, &self->grad_enabled, &self->mode_enabled,
                          &self->tls};
    for (int i = 0; i < 6; i++) *slots[i] = Py_NewRef(o[i]);
    return (PyObject *)self;
}

static PyObject *cg_tp_call(PyObject *self, PyObject *args, PyObject *kwds) {
    return PyVectorcall_Call(self, args, kwds);
}

#define CG_VISIT(f) Py_VISIT(self->f);
#define CG_CLEAR(f) Py_CLEAR(self->f);
static int cg_traverse(CallGradsObject *self, visitproc visit, void *arg) { CG_OBJECTS(CG_VISIT) return 0; }
static int cg_clear(CallGradsObject *self) { CG_OBJECTS(CG_CLEAR) return 0; }

typedef struct {
    CallGradsObject head;
    vectorcallfunc vectorcall;
} CallGradsCallObject;

static PyObject *cgc_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    CallGradsCallObject *self = (CallGradsCallObject *)cg_new(type, args, kwds);
    if (self != NULL) self->vectorcall = (vectorcallfunc)cg_call;
    return (PyObject *)self;
}

static void cg_dealloc(CallGradsObject *self) {
    PyObject_GC_UnTrack(self);
    cg_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject CallGradsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "msprobe_core.stats._fast_stats.CallGrads",
    .tp_basicsize = sizeof(CallGradsCallObject),
    .tp_vectorcall_offset = offsetof(CallGradsCallObject, vectorcall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "CallRecords.on_call_grads in C for L0 (see _fast_l0.c)",
    .tp_new = cgc_new,
    .tp_call = cg_tp_call,
    .tp_dealloc = (destructor)cg_dealloc,
    .tp_traverse = (traverseproc)cg_traverse,
    .tp_clear = (inquiry)cg_clear,
};

/* ``_on_param_grad`` */
typedef struct {
    CallGradsObject head;
    vectorcallfunc vectorcall;
    PyObject *base, *pname, *count, *key, *fallback, *fields;
    PyObject *text_fields;  /* the ``TextFields`` type ``fields`` makes, or Py_None */
    PyObject *names;        /* list: "<base>.parameters_grad.<k>" of each k, made once (``L0_NAMES_KEPT``) */
} ParamGradObject;

/* The parameter's slot in the module's ``parameters_grad`` record when the record is there as ``TextFields``
 * without it (its other parameters' gradients came first): ``[None]`` as ``put_text_field`` makes it, so that
 * the kernel's ``put_text_field`` takes the gradient (it leaves a new field to the Python route). 0, -1. */
static int pg_slot(ParamGradObject *self, PyObject *rec, PyObject *name) {
    if (self->text_fields == Py_None) return 0;
    PyObject *data = L0_GET(rec, A_DATA);
    if (data == NULL) return -1;
    PyObject *record = PyDict_CheckExact(data) ? PyDict_GetItemWithError(data, name) : NULL;  /* borrowed */
    int rc = record == NULL && PyErr_Occurred() ? -1 : 0;
    if (record != NULL && Py_TYPE(record) == (PyTypeObject *)self->text_fields) {
        PyObject *slots = PyDict_GetItemWithError(record, self->pname);
        if (slots == NULL && !PyErr_Occurred()) {
            PyObject *fresh = PyList_New(1);
            if (fresh != NULL) PyList_SET_ITEM(fresh, 0, Py_NewRef(Py_None));
            rc = fresh == NULL ? -1 : PyDict_SetItem(record, self->pname, fresh);
            Py_XDECREF(fresh);
        } else if (slots == NULL) {
            rc = -1;
        }
    }
    Py_DECREF(data);
    return rc;
}

/* "<base>.parameters_grad.<k>": a new reference (made once per k), or NULL. */
static PyObject *pg_name(ParamGradObject *self, Py_ssize_t k) {
    if (k >= 0 && k < PyList_GET_SIZE(self->names)) return Py_NewRef(PyList_GET_ITEM(self->names, k));
    PyObject *name = PyUnicode_FromFormat("%U.parameters_grad.%zd", self->base, k);
    if (name != NULL && k == PyList_GET_SIZE(self->names) && k < L0_NAMES_KEPT && PyList_Append(self->names, name) < 0)
        Py_CLEAR(name);
    return name;
}

static PyObject *pg_call(ParamGradObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    CallGradsObject *g = &self->head;
    if (nargs != 1 || kwnames != NULL) return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    PyObject *grad = args[0];
    int quiet = g_quiet(g);
    if (quiet <= 0) return quiet < 0 ? NULL : PyObject_Vectorcall(self->fallback, args, nargsf, NULL);
    PyObject *rec = L0_GET(g->service, A_RECORDER);
    if (rec == NULL) return NULL;
    if (rec == Py_None || grad == Py_None) { Py_DECREF(rec); Py_RETURN_NONE; }
    PyObject *state = L0_GET(g->records, A_STEP_STATE), *recorded = NULL, *counters = NULL, *name = NULL;
    PyObject *result = NULL;
    recorded = state == NULL ? NULL : L0_GET(state, A_RECORDED_MODULES);
    int in = recorded == NULL ? -1 : PySequence_Contains(recorded, self->base);
    if (in <= 0) {
        if (in == 0) result = Py_NewRef(Py_None);
        goto done;
    }
    counters = L0_GET(state, A_COUNTERS);
    PyObject *old = counters == NULL ? NULL : PyDict_GetItemWithError(counters, self->key);
    if (counters == NULL || (old == NULL && PyErr_Occurred())) goto done;
    Py_ssize_t k = old != NULL ? PyLong_AsSsize_t(old) : 0;
    if (k == -1 && PyErr_Occurred()) goto done;
    PyObject *next = PyLong_FromSsize_t(k + 1);
    int rc = next == NULL ? -1 : PyDict_SetItem(counters, self->key, next);
    Py_XDECREF(next);
    if (rc < 0 || (name = pg_name(self, k)) == NULL) goto done;
    if (l0_depth(g, 1) < 0) goto done;
    PyObject *text = g_text(g, grad, 0);
    if (text == Py_None) {  /* the dict route for this gradient (``_param_grad_dict``) */
        Py_DECREF(text);
        if (l0_depth(g, -1) < 0) goto done;
        PyObject *a[7] = {g->records, rec, self->base, name, self->pname, self->count, grad};
        result = PyObject_VectorcallMethod(l0_attr[A_PARAM_GRAD_DICT], a, 7 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        goto done;
    }
    PyObject *r = NULL;
    if (text != NULL) {
        PyObject *a[8] = {rec, name, self->pname, PyTuple_GET_ITEM(l0_no_sizes, 0), text, self->fields, self->count,
                          Py_False};
        r = pg_slot(self, rec, name) < 0 ? NULL : PyObject_VectorcallMethod(l0_attr[A_PUT_TEXT_FIELD], a, 8 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(text);
        if (r != NULL && PyObject_IsTrue(r)) {
            Py_DECREF(r);
            r = PyObject_CallMethodNoArgs(g->service, l0_attr[A_SYNC]);
        }
    }
    int ok = r != NULL || l0_report_to(g->records, name) == 0;
    Py_XDECREF(r);
    if (!ok) (void)l0_depth(g, -1);
    else if (l0_depth(g, -1) == 0) result = Py_NewRef(Py_None);
done:
    Py_XDECREF(rec); Py_XDECREF(state); Py_XDECREF(recorded); Py_XDECREF(counters); Py_XDECREF(name);
    return result;
}

static PyObject *pg_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"records", "service", "grad_text", "grad_enabled", "mode_enabled", "tls", "base", "pname",
                         "count", "fallback", "fields", "text_fields", NULL};
    PyObject *a[12];
    a[11] = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO!OOOUUO!OO|O:ParamGrad", kw, &a[0], &a[1], &GradTextType, &a[2],
                                     &a[3], &a[4], &a[5], &a[6], &a[7], &PyLong_Type, &a[8], &a[9], &a[10], &a[11]))
        return NULL;
    if (a[11] != Py_None && !PyType_Check(a[11])) {
        PyErr_SetString(PyExc_TypeError, "text_fields must be a type or None");
        return NULL;
    }
    ParamGradObject *self = (ParamGradObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    PyObject **slots[] = {&self->head.records, &self->head.service, &self->head.grad_text, &self->head.grad_enabled,
                          &self->head.mode_enabled, &self->head.tls, &self->base, &self->pname, &self->count,
                          &self->fallback, &self->fields, &self->text_fields};
    for (int i = 0; i < 12; i++) *slots[i] = Py_NewRef(a[i]);
    self->key = PyUnicode_FromFormat("%U#%U", self->base, self->pname);
    self->names = PyList_New(0);
    if (self->key == NULL || self->names == NULL) { Py_DECREF(self); return NULL; }
    self->vectorcall = (vectorcallfunc)pg_call;
    return (PyObject *)self;
}

#define PG_OBJECTS(X) X(base) X(pname) X(count) X(key) X(fallback) X(fields) X(text_fields) X(names)
#define PG_VISIT(f) Py_VISIT(self->f);
#define PG_CLEAR(f) Py_CLEAR(self->f);
static int pg_traverse(ParamGradObject *self, visitproc visit, void *arg) {
    PG_OBJECTS(PG_VISIT)
    return cg_traverse(&self->head, visit, arg);
}
static int pg_clear(ParamGradObject *self) {
    PG_OBJECTS(PG_CLEAR)
    return cg_clear(&self->head);
}
static void pg_dealloc(ParamGradObject *self) {
    PyObject_GC_UnTrack(self);
    pg_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject ParamGradType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "msprobe_core.stats._fast_stats.ParamGrad",
    .tp_basicsize = sizeof(ParamGradObject),
    .tp_vectorcall_offset = offsetof(ParamGradObject, vectorcall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "CallRecords._on_param_grad in C for L0 (see _fast_l0.c)",
    .tp_new = pg_new,
    .tp_call = cg_tp_call,
    .tp_dealloc = (destructor)pg_dealloc,
    .tp_traverse = (traverseproc)pg_traverse,
    .tp_clear = (inquiry)pg_clear,
};

/* ``backward_capture._SingleEdge`` */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *report, *fail, *context, *index, *report_output, *report_both;
    Py_ssize_t edge, out_nr;
} SingleEdgeObject;

/* fn(context, *args), its error to fail(context, exc) (the tool never breaks the user's backward): the result
 * (a new reference), or NULL when it raised (reported) or failing failed (error set). */
static PyObject *se_try(SingleEdgeObject *self, PyObject *fn, PyObject *const *args, Py_ssize_t n, int *failed) {
    PyObject *a[4] = {self->context, n > 0 ? args[0] : NULL, n > 1 ? args[1] : NULL, n > 2 ? args[2] : NULL};
    PyObject *r = PyObject_Vectorcall(fn, a, 1 + n, NULL);
    *failed = 0;
    if (r != NULL) return r;
    if (!PyErr_ExceptionMatches(PyExc_Exception)) { *failed = -1; return NULL; }
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL) PyException_SetTraceback(value, tb);
    PyObject *fa[2] = {self->context, value ? value : Py_None};
    PyObject *f = PyObject_Vectorcall(self->fail, fa, 2, NULL);
    Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(tb);
    *failed = f == NULL ? -1 : 1;
    Py_XDECREF(f);
    return NULL;
}

static PyObject *se_call(SingleEdgeObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 2 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "SingleEdge takes (grad_inputs, grad_outputs)");
        return NULL;
    }
    PyObject *grad = PySequence_GetItem(args[0], self->edge);
    if (grad == NULL) return NULL;
    int failed = 0;
    PyObject *r;
    if (self->out_nr >= 0) {
        PyObject *received = PySequence_GetItem(args[1], self->out_nr);
        if (received == NULL) { Py_DECREF(grad); return NULL; }
        if (grad != Py_None && received != Py_None && self->report_both != Py_None) {
            PyObject *a[3] = {self->index, received, grad};
            r = se_try(self, self->report_both, a, 3, &failed);
            int took = r == NULL ? 0 : PyObject_IsTrue(r);
            Py_XDECREF(r);
            if (failed || took) {
                Py_DECREF(received); Py_DECREF(grad);
                if (failed < 0 || took < 0) return NULL;
                Py_RETURN_NONE;
            }
        }
        if (received != Py_None) {  /* ``_report_output`` */
            PyObject *a[2] = {PyTuple_GET_ITEM(l0_no_sizes, 0), received};
            r = se_try(self, self->report_output, a, 2, &failed);
            Py_XDECREF(r);
        }
        Py_DECREF(received);
        if (failed < 0) { Py_DECREF(grad); return NULL; }
    }
    if (grad != Py_None) {
        PyObject *a[2] = {self->index, grad};
        r = se_try(self, self->report, a, 2, &failed);
        Py_XDECREF(r);
    }
    Py_DECREF(grad);
    if (failed < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *se_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"report", "fail", "context", "index", "edge", "report_output", "out_nr", "report_both", NULL};
    PyObject *report, *fail, *context, *index, *report_output, *report_both;
    Py_ssize_t edge, out_nr;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO!nOnO:SingleEdge", kw, &report, &fail, &context, &PyLong_Type,
                                     &index, &edge, &report_output, &out_nr, &report_both))
        return NULL;
    SingleEdgeObject *self = (SingleEdgeObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->report = Py_NewRef(report);
    self->fail = Py_NewRef(fail);
    self->context = Py_NewRef(context);
    self->index = Py_NewRef(index);
    self->report_output = Py_NewRef(report_output);
    self->report_both = Py_NewRef(out_nr >= 0 ? report_both : Py_None);
    self->edge = edge;
    self->out_nr = out_nr;
    self->vectorcall = (vectorcallfunc)se_call;
    return (PyObject *)self;
}

#define SE_OBJECTS(X) X(report) X(fail) X(context) X(index) X(report_output) X(report_both)
#define SE_VISIT(f) Py_VISIT(self->f);
#define SE_CLEAR(f) Py_CLEAR(self->f);
static int se_traverse(SingleEdgeObject *self, visitproc visit, void *arg) { SE_OBJECTS(SE_VISIT) return 0; }
static int se_clear(SingleEdgeObject *self) { SE_OBJECTS(SE_CLEAR) return 0; }
static void se_dealloc(SingleEdgeObject *self) {
    PyObject_GC_UnTrack(self);
    se_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject SingleEdgeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "msprobe_core.stats._fast_stats.SingleEdge",
    .tp_basicsize = sizeof(SingleEdgeObject),
    .tp_vectorcall_offset = offsetof(SingleEdgeObject, vectorcall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "backward_capture._SingleEdge in C (see _fast_l0.c)",
    .tp_new = se_new,
    .tp_call = cg_tp_call,
    .tp_dealloc = (destructor)se_dealloc,
    .tp_traverse = (traverseproc)se_traverse,
    .tp_clear = (inquiry)se_clear,
};

/* ``DumpService._hook_own_grads`` + ``backward_capture.capture`` of the usual call
 *   OwnGrads(fallback, sequence_nr, accumulate_grad, report, fail, report_output, report_both, keep, hooks, max_hooks,
 *            step_hooks=None)
 *     (call, out) -> None
 * The usual call: one plain output made by the call's one node with one edge to one of its inputs; its node
 * gets its ``SingleEdge`` (made once per call site and kept in ``hooks``, as ``_single_edge`` does). Any
 * other call: ``fallback(call, out)`` (nothing of it done here). With ``step_hooks=`` (the ``StepHooks`` that
 * ``keep`` fills), a node hook goes into it here (``og_node_hook``) once it holds hooks of the step. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fallback, *sequence_nr, *accumulate_grad, *report, *fail, *report_output, *report_both, *keep, *hooks;
    PyObject *step_hooks;  /* the ``StepHooks`` that ``keep`` fills, or Py_None */
    PyObject *sites;       /* dict: a call's backward name -> (its parent, its hook): ``og_site`` */
    L0Layout call_layout, edges_layout;  /* of the classes of the calls and edges taken */
    Py_ssize_t max_hooks;
} OwnGradsObject;

static PyObject *dot_forward, *dot_backward;  /* ".forward", ".backward" */
static PyObject *og_no_skip;                  /* {}: no edge left out of the usual call's walk */
static PyObject *og_32;                       /* 32: an edge key's shift */

/* The number an object's attribute holds (a C long long); -1 with an error (also for a non-int). */
static long long og_long(PyObject *obj, int a, int call) {
    PyObject *v = call ? PyObject_CallMethodNoArgs(obj, l0_attr[a]) : L0_GET(obj, a);
    if (v == NULL) return -1;
    long long r = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return r;
}

/* The hook of the call site (context, index, edge, out_nr): the one made before, or a new one. */
static PyObject *og_single_edge(OwnGradsObject *self, PyObject *context, PyObject *index, Py_ssize_t edge,
                                Py_ssize_t out_nr) {
    PyObject *key = Py_BuildValue("(OOnn)", context, index, edge, out_nr);
    if (key == NULL) return NULL;
    PyObject *hook = PyDict_GetItemWithError(self->hooks, key);
    if (hook != NULL || PyErr_Occurred()) {
        Py_XINCREF(hook);
        Py_DECREF(key);
        return hook;
    }
    SingleEdgeObject *se = (SingleEdgeObject *)SingleEdgeType.tp_alloc(&SingleEdgeType, 0);
    if (se != NULL) {
        se->report = Py_NewRef(self->report);
        se->fail = Py_NewRef(self->fail);
        se->context = Py_NewRef(context);
        se->index = Py_NewRef(index);
        se->report_output = Py_NewRef(self->report_output);
        se->report_both = Py_NewRef(out_nr >= 0 ? self->report_both : Py_None);
        se->edge = edge;
        se->out_nr = out_nr;
        se->vectorcall = (vectorcallfunc)se_call;
        if (PyDict_GET_SIZE(self->hooks) >= self->max_hooks) PyDict_Clear(self->hooks);
        if (PyDict_SetItem(self->hooks, key, (PyObject *)se) < 0) Py_CLEAR(se);
    }
    Py_DECREF(key);
    return (PyObject *)se;
}

#define OG_NODES 32  /* the nodes of a call walked by ``og_one_input`` at most (more: the generic walk) */

/* ``walk``'s answer for a call with one input edge, ``(id, low)`` (its key ``id << 32 | low``), as the usual call
 * needs it, without the generic walk's dicts, lists and keys: 1 when the only edge to the input from the nodes made
 * during the call (from ``fn`` on, sequence numbers in [begin, end)) is one edge of ``fn`` itself (its index set in
 * *edge), 0 for any other graph (or more than ``OG_NODES`` nodes), -1 with an error. */
static int og_one_input(OwnGradsObject *self, PyObject *fn, void *id, long long low, int leaf, long long begin,
                        long long end, Py_ssize_t *edge) {
    PyObject *nodes[OG_NODES];  /* borrowed: each is held by its parent's next_functions, held below */
    PyObject *held[OG_NODES];   /* the next_functions tuples walked (new references) */
    int n_nodes = 1, n_held = 0, hits = 0, rc = 0;
    nodes[0] = fn;
    for (int at = 0; at < n_nodes && rc == 0; at++) {
        PyObject *node = nodes[at];
        PyObject *next = L0_GET(node, A_NEXT_FUNCTIONS);
        if (next == NULL) { rc = -1; break; }
        held[n_held++] = next;
        if (!PyTuple_CheckExact(next)) { rc = 0; hits = -1; break; }
        for (Py_ssize_t e = 0; e < PyTuple_GET_SIZE(next); e++) {
            PyObject *pair = PyTuple_GET_ITEM(next, e);
            if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2) { hits = -1; break; }
            PyObject *nxt = PyTuple_GET_ITEM(pair, 0);
            if (nxt == Py_None) continue;
            int hit;
            if ((PyObject *)Py_TYPE(nxt) == self->accumulate_grad) {
                if (!leaf || low != 0) continue;
                PyObject *var = L0_GET(nxt, A_VARIABLE);
                if (var == NULL) { rc = -1; break; }
                hit = (void *)var == id;
                Py_DECREF(var);
            } else {
                long long nr = PyLong_AsLongLong(PyTuple_GET_ITEM(pair, 1));
                if (nr == -1 && PyErr_Occurred()) { rc = -1; break; }
                hit = (void *)nxt == id && nr + 1 == low;
                if (!hit) {  /* a node of the call is walked (once) */
                    int known = 0;
                    for (int i = 0; i < n_nodes && !known; i++) known = nodes[i] == nxt;
                    if (known) continue;
                    long long seq = og_long(nxt, A_SEQUENCE_NR, 1);
                    if (seq == -1 && PyErr_Occurred()) { rc = -1; break; }
                    if (begin <= seq && seq < end) {
                        if (n_nodes == OG_NODES || n_held == OG_NODES) { hits = -1; break; }
                        nodes[n_nodes++] = nxt;
                    }
                    continue;
                }
            }
            if (!hit) continue;
            if (node != fn || hits) { hits = -1; break; }  /* another node's edge, or a second edge */
            hits = 1;
            *edge = e;
        }
        if (hits < 0) break;
    }
    for (int i = 0; i < n_held; i++) Py_DECREF(held[i]);
    return rc < 0 ? -1 : hits == 1;
}

/* The usual call's node and edge: 1 found (node, index, edge, out_nr set; node a new reference), 0 another shape
 * of graph, -1 with an error. Nothing of the call's state is changed. */
static int og_find(OwnGradsObject *self, PyObject *edges, const Py_ssize_t *eslots, PyObject *out, PyObject **node,
                   PyObject **index, Py_ssize_t *edge, Py_ssize_t *out_nr) {
    PyObject *slots = l0_field(edges, eslots, E_SLOTS, A_SLOTS), *fn = NULL, *walked = NULL, *roots = NULL, *end = NULL;
    int rc = -1;
    if (slots == NULL) return -1;
    if (!PyDict_CheckExact(slots)) { rc = 0; goto done; }
    PyObject *first = l0_field(edges, eslots, E_BEGIN, A_BEGIN);
    long long begin = first == NULL ? -1 : PyLong_AsLongLong(first);
    Py_XDECREF(first);
    if (begin == -1 && PyErr_Occurred()) goto done;
    end = PyObject_CallNoArgs(self->sequence_nr);
    if (end == NULL) goto done;
    fn = L0_GET(out, A_GRAD_FN);
    if (fn == NULL) goto done;
    if (fn == Py_None) { rc = 0; goto done; }  /* a leaf output */
    long long nr = og_long(out, A_OUTPUT_NR, 0);
    if (nr == -1 && PyErr_Occurred()) goto done;
    PyObject *key = edge_key(fn, (long)nr + 1);
    int passed = key == NULL ? -1 : PyDict_Contains(slots, key);
    Py_XDECREF(key);
    if (passed != 0) { rc = passed < 0 ? -1 : 0; goto done; }  /* an output that is an input */
    long long seq = og_long(fn, A_SEQUENCE_NR, 1);
    long long stop = PyLong_AsLongLong(end);
    if (PyErr_Occurred()) goto done;
    if (!(begin <= seq && seq < stop)) { rc = 0; goto done; }
    if (PyDict_GET_SIZE(slots) == 1) {  /* one input tensor (the usual call): its key's id and low part */
        Py_ssize_t pos = 0;
        PyObject *k, *slot;
        PyDict_Next(slots, &pos, &k, &slot);
        PyObject *high = PyLong_CheckExact(k) && PyLong_CheckExact(slot) ? PyNumber_Rshift(k, og_32) : NULL;
        if (high == NULL) { rc = PyErr_Occurred() ? -1 : 0; goto done; }
        void *id = PyLong_AsVoidPtr(high);
        unsigned long long low = PyLong_AsUnsignedLongLongMask(k) & 0xffffffffULL;
        Py_DECREF(high);
        if (PyErr_Occurred()) goto done;
        PyObject *leaf = l0_field(edges, eslots, E_LEAF, A_LEAF);
        int is_leaf = leaf == NULL ? -1 : PyObject_IsTrue(leaf);
        Py_XDECREF(leaf);
        if (is_leaf < 0) goto done;
        rc = og_one_input(self, fn, id, (long long)low, is_leaf, begin, stop, edge);
        if (rc == 1) {
            *out_nr = (Py_ssize_t)nr;
            *node = Py_NewRef(fn);
            *index = Py_NewRef(slot);
        }
        goto done;
    }
    PyObject *leaf = l0_field(edges, eslots, E_LEAF, A_LEAF);
    PyObject *skip = leaf == NULL ? NULL : Py_NewRef(og_no_skip);  /* (walk only reads it) */
    PyObject *b = skip == NULL ? NULL : PyLong_FromLongLong(begin);
    roots = b == NULL ? NULL : PyList_New(1);
    if (roots != NULL) {
        PyList_SET_ITEM(roots, 0, Py_NewRef(fn));
        PyObject *wargs[7] = {roots, slots, skip, b, end, leaf, self->accumulate_grad};
        walked = walk(NULL, wargs, 7);
    }
    Py_XDECREF(leaf); Py_XDECREF(skip); Py_XDECREF(b);
    if (walked == NULL) goto done;
    PyObject *hits = PyTuple_GET_ITEM(walked, 0);
    rc = 0;
    if (PyList_GET_SIZE(hits) != 1) goto done;
    PyObject *hit = PyList_GET_ITEM(hits, 0);                       /* (node, ((key, edges), ...)) */
    PyObject *node_hits = PyTuple_GET_ITEM(hit, 1);
    if (PyTuple_GET_ITEM(hit, 0) != fn || PyTuple_GET_SIZE(node_hits) != 1) goto done;
    PyObject *key_edges = PyTuple_GET_ITEM(node_hits, 0);
    PyObject *edge_list = PyTuple_GET_ITEM(key_edges, 1);
    PyObject *slot = PyDict_GetItemWithError(slots, PyTuple_GET_ITEM(key_edges, 0));
    if (slot == NULL) { rc = PyErr_Occurred() ? -1 : 0; goto done; }
    if (PyTuple_GET_SIZE(edge_list) != 1 || !PyLong_CheckExact(slot)) goto done;
    *edge = PyLong_AsSsize_t(PyTuple_GET_ITEM(edge_list, 0));
    *out_nr = (Py_ssize_t)nr;
    if (*edge == -1 && PyErr_Occurred()) { rc = -1; goto done; }
    *node = Py_NewRef(fn);
    *index = Py_NewRef(slot);
    rc = 1;
done:
    Py_XDECREF(slots); Py_XDECREF(fn); Py_XDECREF(walked); Py_XDECREF(roots); Py_XDECREF(end);
    return rc;
}

/* ``(call.backward, call.save, call.backward_parent())`` of a call's ``backward``, ``save`` and ``parent``: a new
 * tuple or NULL. */
static PyObject *og_context(PyObject *backward, PyObject *save, PyObject *parent) {
    PyObject *context = NULL, *bparent = NULL;
    int set = PyObject_IsTrue(parent);
    bparent = set < 0 ? NULL : !set ? Py_NewRef(Py_None) : PyUnicode_Replace(parent, dot_forward, dot_backward, -1);
    if (bparent != NULL) context = PyTuple_Pack(3, backward, save, bparent);
    Py_XDECREF(bparent);
    return context;
}

/* Is ``a`` the same value as ``b`` (identity first)? 1, 0, -1 with an error. */
static inline int og_same(PyObject *a, PyObject *b) {
    return a == b ? 1 : PyObject_RichCompareBool(a, b, Py_EQ);
}

/* The hook made before for the call site of ``backward`` (``sites``) when it was made for the same parent, save,
 * index, edge and out_nr (step after step the same call site: its context tuple and hook key not built again):
 * a new reference, NULL without an error when there is none, NULL with an error. */
static PyObject *og_site(OwnGradsObject *self, PyObject *backward, PyObject *save, PyObject *parent, PyObject *index,
                         Py_ssize_t edge, Py_ssize_t out_nr) {
    PyObject *site = PyDict_GetItemWithError(self->sites, backward);  /* borrowed: (parent, hook) */
    if (site == NULL || !PyTuple_CheckExact(site) || PyTuple_GET_SIZE(site) != 2) return NULL;
    SingleEdgeObject *se = (SingleEdgeObject *)PyTuple_GET_ITEM(site, 1);
    if (Py_TYPE(se) != &SingleEdgeType || se->edge != edge || se->out_nr != out_nr || !PyTuple_CheckExact(se->context)
        || PyTuple_GET_SIZE(se->context) != 3 || PyTuple_GET_ITEM(se->context, 1) != save)
        return NULL;
    Py_INCREF(site);  /* (the comparisons below may run Python code) */
    int same = og_same(PyTuple_GET_ITEM(site, 0), parent);
    if (same > 0) same = og_same(PyTuple_GET_ITEM(se->context, 0), backward);
    if (same > 0) same = og_same(se->index, index);
    PyObject *hook = same > 0 ? Py_NewRef((PyObject *)se) : NULL;
    Py_DECREF(site);
    return hook;
}

/* The hook of the call (its ``backward``, ``save``, ``parent``) at the site (index, edge, out_nr): ``og_site``'s,
 * else ``og_single_edge``'s, then kept in ``sites``. A new reference, or NULL with an error. */
static PyObject *og_hook(OwnGradsObject *self, PyObject *backward, PyObject *save, PyObject *parent, PyObject *index,
                         Py_ssize_t edge, Py_ssize_t out_nr) {
    PyObject *hook = og_site(self, backward, save, parent, index, edge, out_nr);
    if (hook != NULL || PyErr_Occurred()) return hook;
    PyObject *context = og_context(backward, save, parent);
    hook = context == NULL ? NULL : og_single_edge(self, context, index, edge, out_nr);
    Py_XDECREF(context);
    if (hook == NULL) return NULL;
    PyObject *site = PyUnicode_CheckExact(backward) ? PyTuple_Pack(2, parent, hook) : NULL;
    if (site != NULL) {
        if (PyDict_GET_SIZE(self->sites) >= self->max_hooks) PyDict_Clear(self->sites);
        int rc = PyDict_SetItem(self->sites, backward, site);
        Py_DECREF(site);
        if (rc == 0) return hook;
    }
    if (PyErr_Occurred()) Py_CLEAR(hook);
    return hook;
}

static PyObject *step_hooks_flat, *step_hooks_one;  /* "_flat", 1 */

/* A hook put in for the step in ``StepHooks``' form (``remove_hooks`` takes it out): its key, 1 and its dict
 * appended to ``flat``. 0, or -1 with an error. */
static int step_hooks_add(PyObject *flat, PyObject *key, PyObject *hooks) {
    return PyList_Append(flat, key) < 0 || PyList_Append(flat, step_hooks_one) < 0 || PyList_Append(flat, hooks) < 0
           ? -1 : 0;
}

/* ``node.register_hook(hook)`` put in without the handle object where the C++ extension can (``ff_node_hook``: a
 * C++ node), its key, 1 and its dict appended to ``flat`` (``StepHooks``' form, for ``remove``): 1; 0, nothing
 * done, where it cannot (call ``node.register_hook``); -1 with an error. */
static int l0_node_hook(PyObject *flat, PyObject *node, PyObject *hook) {
    PyObject *hooks, *key;
    int done = ff_node_hook(node, hook, &hooks, &key);
    if (done <= 0) return done;
    done = step_hooks_add(flat, key, hooks) < 0 ? -1 : 1;
    Py_DECREF(hooks);
    Py_DECREF(key);
    return done;
}

/* ``keep(handle)``, or what ``StepHooks.keep`` does with it, done here: with ``flat`` (``step_hooks._flat``, when
 * it already holds hooks of the step: ``og_node_hook``), the handle's key, 1 and its hook dict appended to it
 * where the handle has no extra dicts (a node's hook). 0, -1. */
static int og_keep(OwnGradsObject *self, PyObject *flat, PyObject *handle) {
    if (flat != NULL) {
        int rc = 1;  /* 1: not taken here */
        PyObject *id = L0_GET(handle, A_ID), *extra = L0_GET(handle, A_EXTRA_DICT_REF);
        PyObject *ref = L0_GET(handle, A_HOOKS_DICT_REF);
        PyObject *hooks = id && extra && ref && PyTuple_CheckExact(extra) && !PyTuple_GET_SIZE(extra)
                          ? PyObject_CallNoArgs(ref) : NULL;
        if (hooks != NULL)
            rc = step_hooks_add(flat, id, hooks);
        else if (PyErr_Occurred())
            rc = -1;
        Py_XDECREF(id); Py_XDECREF(extra); Py_XDECREF(ref); Py_XDECREF(hooks);
        if (rc <= 0) return rc;
    }
    PyObject *r = PyObject_CallOneArg(self->keep, handle);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* ``keep(node.register_hook(hook))``: once ``step_hooks._flat`` holds hooks of the step (so ``keep`` has put it
 * among the step's handles: ``DumpService._keep_hook``), the hook goes into it without a handle where it can
 * (``l0_node_hook``); else torch's handle, to ``og_keep``. 0, -1 with an error. */
static int og_node_hook(OwnGradsObject *self, PyObject *node, PyObject *hook) {
    PyObject *flat = NULL;
    if (self->step_hooks != Py_None) {
        if ((flat = PyObject_GetAttr(self->step_hooks, step_hooks_flat)) == NULL) return -1;
        if (!PyList_CheckExact(flat) || !PyList_GET_SIZE(flat)) Py_CLEAR(flat);
    }
    int rc = flat == NULL ? 0 : l0_node_hook(flat, node, hook);
    if (rc == 0) {
        PyObject *handle = PyObject_CallMethodOneArg(node, l0_attr[A_REGISTER_HOOK], hook);
        rc = handle == NULL ? -1 : og_keep(self, flat, handle);
        Py_XDECREF(handle);
    }
    Py_XDECREF(flat);
    return rc < 0 ? -1 : 0;
}

static PyObject *og_call(OwnGradsObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 2 || kwnames != NULL) return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    PyObject *call = args[0], *out = args[1];
    const Py_ssize_t *slots = l0_layout_of(&self->call_layout, call, L0_CALL_FIELDS, 10);
    PyObject *edges = l0_field(call, slots, F_EDGES, A_EDGES);
    if (edges == NULL) return NULL;
    if (edges == Py_None) { Py_DECREF(edges); Py_RETURN_NONE; }
    const Py_ssize_t *eslots = l0_layout_of(&self->edges_layout, edges, L0_EDGES_FIELDS, 5);
    PyObject *output = l0_field(edges, eslots, E_OUTPUT, A_OUTPUT);
    PyObject *node = NULL, *index = NULL;
    Py_ssize_t edge = 0, out_nr = -1;
    int found = output == NULL ? -1 : output != out ? 0 : og_find(self, edges, eslots, out, &node, &index, &edge, &out_nr);
    Py_XDECREF(output);
    if (found <= 0) {
        Py_DECREF(edges);
        return found < 0 ? NULL : PyObject_Vectorcall(self->fallback, args, 2, NULL);
    }
    PyObject *result = NULL, *backward = NULL, *save = NULL, *parent = NULL, *hook = NULL;
    if (l0_set_field(call, slots, F_EDGES, A_EDGES, Py_None) < 0 || l0_set_field(edges, eslots, E_OUTPUT, A_OUTPUT, Py_None) < 0)
        goto done;
    backward = l0_field(call, slots, F_BACKWARD, A_BACKWARD);
    save = backward == NULL ? NULL : l0_field(call, slots, F_SAVE, A_SAVE);
    parent = save == NULL ? NULL : l0_field(call, slots, F_PARENT, A_PARENT);
    hook = parent == NULL ? NULL : og_hook(self, backward, save, parent, index, edge, out_nr);
    result = hook == NULL || og_node_hook(self, node, hook) < 0 ? NULL : Py_NewRef(Py_None);
done:
    Py_DECREF(edges); Py_XDECREF(node); Py_XDECREF(index); Py_XDECREF(backward); Py_XDECREF(save); Py_XDECREF(parent);
    Py_XDECREF(hook);
    return result;
}

static PyObject *og_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"fallback", "sequence_nr", "accumulate_grad", "report", "fail", "report_output", "report_both",
                         "keep", "hooks", "max_hooks", "step_hooks", NULL};
    PyObject *a[9], *step_hooks = Py_None;
    Py_ssize_t max_hooks;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOOOO!n|O:OwnGrads", kw, &a[0], &a[1], &a[2], &a[3], &a[4], &a[5],
                                     &a[6], &a[7], &PyDict_Type, &a[8], &max_hooks, &step_hooks))
        return NULL;
    OwnGradsObject *self = (OwnGradsObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    PyObject **slots[] = {&self->fallback, &self->sequence_nr, &self->accumulate_grad, &self->report, &self->fail,
                          &self->report_output, &self->report_both, &self->keep, &self->hooks};
    for (int i = 0; i < 9; i++) *slots[i] = Py_NewRef(a[i]);
    self->step_hooks = Py_NewRef(step_hooks);
    self->max_hooks = max_hooks;
    self->sites = PyDict_New();
    if (self->sites == NULL) { Py_DECREF(self); return NULL; }
    self->vectorcall = (vectorcallfunc)og_call;
    return (PyObject *)self;
}

#define OG_OBJECTS(X) X(fallback) X(sequence_nr) X(accumulate_grad) X(report) X(fail) X(report_output) X(report_both) \
                      X(keep) X(hooks) X(step_hooks) X(sites) X(call_layout.type) \
                      X(edges_layout.type)
static int og_traverse(OwnGradsObject *self, visitproc visit, void *arg) { OG_OBJECTS(SE_VISIT) return 0; }
static int og_clear(OwnGradsObject *self) { OG_OBJECTS(SE_CLEAR) return 0; }
static void og_dealloc(OwnGradsObject *self) {
    PyObject_GC_UnTrack(self);
    og_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject OwnGradsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "msprobe_core.stats._fast_stats.OwnGrads",
    .tp_basicsize = sizeof(OwnGradsObject),
    .tp_vectorcall_offset = offsetof(OwnGradsObject, vectorcall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "DumpService._hook_own_grads of the usual call in C (see _fast_l0.c)",
    .tp_new = og_new,
    .tp_call = cg_tp_call,
    .tp_dealloc = (destructor)og_dealloc,
    .tp_traverse = (traverseproc)og_traverse,
    .tp_clear = (inquiry)og_clear,
};

/* ``StepHooks.remove``'s loop (``pytorch/step_hooks.py``) over its ``flat`` list (key, number of dicts, the dicts,
 * key, ...): ``hooks.pop(key, None)`` of each dict that is not None, in order. A dict that only the list still
 * holds (the hook dict of a node whose graph autograd has freed) is left alone: nothing can see it any more.
 *   remove_hooks(flat) -> None */
static PyObject *l0_remove_hooks(PyObject *mod, PyObject *flat) {
    if (!PyList_CheckExact(flat)) {
        PyErr_SetString(PyExc_TypeError, "remove_hooks takes a list");
        return NULL;
    }
    Py_ssize_t i = 0;
    while (i < PyList_GET_SIZE(flat)) {  /* (the size read again: a hook freed below may run Python code) */
        if (i + 1 >= PyList_GET_SIZE(flat)) {
            PyErr_SetString(PyExc_IndexError, "remove_hooks: a key without its number of dicts");
            return NULL;
        }
        PyObject *key = Py_NewRef(PyList_GET_ITEM(flat, i));
        Py_ssize_t n = PyLong_AsSsize_t(PyList_GET_ITEM(flat, i + 1));
        if (n < 0) {
            Py_DECREF(key);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "remove_hooks: a negative number of dicts");
            return NULL;
        }
        i += 2;
        for (Py_ssize_t end = i + n; i < end && i < PyList_GET_SIZE(flat); i++) {
            PyObject *hooks = PyList_GET_ITEM(flat, i);
            if (hooks == Py_None || Py_REFCNT(hooks) == 1) continue;
            Py_INCREF(hooks);
            int rc = 0;
            if (PyDict_CheckExact(hooks) || PyODict_CheckExact(hooks)) {  /* ``pop(key, None)`` without the call */
                rc = PyObject_DelItem(hooks, key);
                if (rc < 0 && PyErr_ExceptionMatches(PyExc_KeyError)) {
                    PyErr_Clear();
                    rc = 0;
                }
            } else {
                PyObject *r = PyObject_CallMethod(hooks, "pop", "OO", key, Py_None);
                rc = r == NULL ? -1 : 0;
                Py_XDECREF(r);
            }
            Py_DECREF(hooks);
            if (rc < 0) { Py_DECREF(key); return NULL; }
        }
        Py_DECREF(key);
    }
    Py_RETURN_NONE;
}

/* ``_same(mine, kept)`` of two plain dicts: 1, 0; -2 for another kind of mapping (the Python route decides). */
static int l0_same(PyObject *mine, PyObject *kept) {
    if (!PyDict_CheckExact(mine) || !PyDict_CheckExact(kept)) return -2;
    if (PyDict_GET_SIZE(mine) != PyDict_GET_SIZE(kept)) return 0;
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(mine, &pos, &k, &v)) {
        if (!PyUnicode_CheckExact(k)) return -2;  /* (a str key's lookup runs no Python code) */
        if (PyDict_GetItemWithError(kept, k) != v) return PyErr_Occurred() ? -1 : 0;
    }
    return 1;
}

/* The dict torch's ``register_hook`` puts a plain tensor's hooks in (``pytorch/step_hooks.add_tensor_hook``, the
 * monitor's ``fs_tensor_hook``): ``t._backward_hooks``, made by ``odict`` (the ``OrderedDict`` class) and given to
 * its ``grad_fn`` on first use. A new reference, or NULL with an error. */
static PyObject *tensor_hooks_dict(PyObject *t, PyObject *odict) {
    PyObject *hooks = L0_GET(t, A_BACKWARD_HOOKS);
    if (hooks == Py_None) {
        Py_DECREF(hooks);
        hooks = PyObject_CallNoArgs(odict);
        PyObject *fn = hooks == NULL || PyObject_SetAttr(t, l0_attr[A_BACKWARD_HOOKS], hooks) < 0 ? NULL
                       : L0_GET(t, A_GRAD_FN);
        PyObject *r = fn == NULL ? NULL : fn == Py_None ? Py_NewRef(Py_None)
                      : PyObject_CallMethodOneArg(fn, l0_attr[A_REGISTER_HOOK_DICT], t);
        Py_XDECREF(fn);
        if (r == NULL) Py_CLEAR(hooks);
        Py_XDECREF(r);
    }
    return hooks;
}

/* ``RemovableHandle``'s next id (``handles``: the class), taken as a new handle takes it (``next_id`` advanced): a
 * new reference, or NULL with an error. */
static PyObject *take_hook_id(PyObject *handles) {
    PyObject *key = L0_GET(handles, A_NEXT_ID);
    PyObject *next = key == NULL ? NULL : PyNumber_Add(key, ONE);
    int rc = next == NULL ? -1 : PyObject_SetAttr(handles, l0_attr[A_NEXT_ID], next);
    Py_XDECREF(next);
    if (rc < 0) Py_CLEAR(key);
    return key;
}

/* ``step_hooks.add_tensor_hook(t, hook)`` for a plain tensor, one at a time (the monitor's forward sites, L1's
 * calls): the hook at the end of t's hook dict (``tensor_hooks_dict``, made by ``odict``) under the next
 * ``RemovableHandle`` id (``take_hook_id`` of ``handles``); with ``flat``, in ``StepHooks``' form there too
 * (``step_hooks_add``). 0, or -1 with an error. */
static int tensor_hook_add(PyObject *t, PyObject *hook, PyObject *odict, PyObject *handles, PyObject *flat) {
    PyObject *hooks = tensor_hooks_dict(t, odict);
    PyObject *key = hooks == NULL ? NULL : take_hook_id(handles);
    int rc = key == NULL || PyObject_SetItem(hooks, key, hook) < 0
             || (flat != NULL && step_hooks_add(flat, key, hooks) < 0) ? -1 : 0;
    Py_XDECREF(key);
    Py_XDECREF(hooks);
    return rc;
}

/* ``add_tensor_hook(t, hook)`` (``pytorch/step_hooks.py``) of a plain tensor with the key ``key``: the entry torch's
 * ``register_hook`` makes (``tensor_hooks_dict``), its key, 1 and its dict appended to ``flat``. 0, or -1 with an
 * error. */
static int l0_add_tensor_hook(PyObject *t, PyObject *hook, long long key, PyObject *flat, PyObject *odict) {
    PyObject *hooks = tensor_hooks_dict(t, odict);
    if (hooks == NULL) return -1;
    PyObject *k = PyLong_FromLongLong(key);
    int rc = k == NULL || PyObject_SetItem(hooks, k, hook) < 0 || step_hooks_add(flat, k, hooks) < 0 ? -1 : 0;
    Py_XDECREF(k);
    Py_DECREF(hooks);
    return rc;
}

/* handles.next_id = key, a pending error kept: 0, or -1 with an error. */
static int l0_set_next_id(PyObject *handles, long long key) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *k = PyLong_FromLongLong(key);
    int rc = k == NULL ? -1 : PyObject_SetAttr(handles, l0_attr[A_NEXT_ID], k);
    Py_XDECREF(k);
    if (type != NULL) {  /* (the first error is the one raised) */
        if (rc < 0) PyErr_Clear();
        PyErr_Restore(type, value, tb);
        return -1;
    }
    return rc;
}

/* ``StepHooks.tensor_hooks``' loop (``pytorch/step_hooks.py``): ``add_tensor_hook(t, hook)`` of each (t, hook) of
 * ``pairs`` that is a plain tensor (``tensor``, ``parameter``: the exact types) requiring grad, held in ``flat``;
 * ``other(t, hook)`` for each that is not a plain tensor. The keys are ``handles.next_id`` on (``RemovableHandle``'s),
 * as ``add_tensor_hook`` takes them, the counter written back once at the end and around each ``other`` call (the
 * only Python code run in the loop). ``odict``: the ``OrderedDict`` class.
 *   tensor_hooks(flat, pairs, other, tensor, parameter, handles, odict) -> None */
static PyObject *l0_tensor_hooks(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 || !PyList_CheckExact(args[0]) || !PyList_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "tensor_hooks(flat, pairs, other, tensor, parameter, handles, odict)");
        return NULL;
    }
    PyObject *flat = args[0], *pairs = args[1], *other = args[2], *handles = args[5], *odict = args[6];
    long long key = og_long(handles, A_NEXT_ID, 0);
    if (key == -1 && PyErr_Occurred()) return NULL;
    int rc = 0, held = 0;  /* held: handles.next_id is the counter (``other`` raised after it was written) */
    for (Py_ssize_t i = 0; rc == 0 && i < PyList_GET_SIZE(pairs); i++) {
        PyObject *pair = PyList_GET_ITEM(pairs, i);
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "tensor_hooks: pairs holds (tensor, hook) tuples");
            rc = -1;
            break;
        }
        Py_INCREF(pair);  /* (``other`` may change the list) */
        PyObject *t = PyTuple_GET_ITEM(pair, 0), *hook = PyTuple_GET_ITEM(pair, 1);
        if ((PyObject *)Py_TYPE(t) != args[3] && (PyObject *)Py_TYPE(t) != args[4]) {
            PyObject *oargs[2] = {t, hook};
            rc = l0_set_next_id(handles, key);
            if (rc == 0) {
                PyObject *r = PyObject_Vectorcall(other, oargs, 2, NULL);
                Py_XDECREF(r);
                held = 1;  /* (until the counter is read back) */
                if (r == NULL || ((key = og_long(handles, A_NEXT_ID, 0)) == -1 && PyErr_Occurred())) rc = -1;
                else held = 0;
            }
        } else {
            PyObject *grad = L0_GET(t, A_REQUIRES_GRAD);
            int on = grad == NULL ? -1 : PyObject_IsTrue(grad);
            Py_XDECREF(grad);
            rc = on <= 0 ? on : l0_add_tensor_hook(t, hook, key, flat, odict);
            if (on > 0 && rc == 0) key++;
        }
        Py_DECREF(pair);
    }
    if ((!held && l0_set_next_id(handles, key) < 0) || rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *l0_compiled_attr;  /* "_compiled_call_impl" */

/* ``HookPlan.still_valid``'s loop (``pytorch/step_hooks.py``) over its ``modules``: is each (module, class,
 * children, parameters) (module None: ``root``) still of that class, not compiled, with exactly those children
 * and parameters (the same objects)? True, False, or None for anything but plain dicts and str keys (the
 * Python loop then decides).
 *   plan_valid(root, modules) -> bool or None */
static PyObject *l0_plan_valid(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_CheckExact(args[1])) Py_RETURN_NONE;
    PyObject *modules = args[1];
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(modules); i++) {
        PyObject *entry = PyList_GET_ITEM(modules, i);
        if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 4) Py_RETURN_NONE;
        Py_INCREF(entry);  /* (a module's attributes may run Python code) */
        PyObject *m = PyTuple_GET_ITEM(entry, 0);
        if (m == Py_None) m = args[0];
        int same = (PyObject *)Py_TYPE(m) == PyTuple_GET_ITEM(entry, 1);
        if (same) {
            PyObject *compiled = PyObject_GetAttr(m, l0_compiled_attr);
            if (compiled == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {  /* getattr(m, name, None) */
                PyErr_Clear();
                compiled = Py_NewRef(Py_None);
            }
            same = compiled == NULL ? -1 : compiled == Py_None;
            Py_XDECREF(compiled);
        }
        for (int a = 0; a < 2 && same == 1; a++) {
            PyObject *mine = L0_GET(m, a == 0 ? A_MODULES : A_PARAMETERS);
            same = mine == NULL ? -1 : l0_same(mine, PyTuple_GET_ITEM(entry, 2 + a));
            Py_XDECREF(mine);
        }
        Py_DECREF(entry);
        if (same == -1) return NULL;
        if (same == -2) Py_RETURN_NONE;
        if (!same) Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static PyMethodDef l0_functions[] = {
    {"remove_hooks", (PyCFunction)l0_remove_hooks, METH_O,
     "remove_hooks(flat) -> None: StepHooks.remove's loop (hooks.pop(key, None) of each kept hook)"},
    {"tensor_hooks", (PyCFunction)(void (*)(void))l0_tensor_hooks, METH_FASTCALL,
     "tensor_hooks(flat, pairs, other, tensor, parameter, handles, odict) -> None: StepHooks.tensor_hooks' loop"},
    {"plan_valid", (PyCFunction)(void (*)(void))l0_plan_valid, METH_FASTCALL,
     "plan_valid(root, modules) -> bool or None: HookPlan.still_valid's loop (None: the Python loop decides)"},
    {NULL, NULL, 0, NULL},
};

/* Adds ModuleHooks, CallGrads, ParamGrad, SingleEdge and OwnGrads (and remove_hooks) to the module. */
static int add_module_hooks(PyObject *m) {
    for (int i = 0; i < N_ATTRS; i++)
        if (l0_attr[i] == NULL && (l0_attr[i] = PyUnicode_InternFromString(L0_ATTR_NAMES[i])) == NULL) return -1;
    if (l0_no_sizes == NULL && (l0_no_sizes = Py_BuildValue("(ii)", 0, 0)) == NULL) return -1;
    for (int a = 0; a < L0_PAIRS; a++)
        for (int b = 0; b < L0_PAIRS; b++)
            if (l0_pairs[a][b] == NULL && (l0_pairs[a][b] = Py_BuildValue("(ii)", a, b)) == NULL) return -1;
    if (dot_forward == NULL && (dot_forward = PyUnicode_InternFromString(".forward")) == NULL) return -1;
    if (dot_backward == NULL && (dot_backward = PyUnicode_InternFromString(".backward")) == NULL) return -1;
    if (step_hooks_flat == NULL && (step_hooks_flat = PyUnicode_InternFromString("_flat")) == NULL) return -1;
    if (step_hooks_one == NULL && (step_hooks_one = PyLong_FromLong(1)) == NULL) return -1;
    if (og_no_skip == NULL && (og_no_skip = PyDict_New()) == NULL) return -1;
    if (og_32 == NULL && (og_32 = PyLong_FromLong(32)) == NULL) return -1;
    if (l0_compiled_attr == NULL && (l0_compiled_attr = PyUnicode_InternFromString("_compiled_call_impl")) == NULL)
        return -1;
    if (PyModule_AddFunctions(m, l0_functions) < 0) return -1;
    if (add_tool_depth() < 0) return -1;
    if (PyType_Ready(&FieldsNewType) < 0) return -1;  /* (made by ModuleHooks only) */
    PyTypeObject *types[] = {&ModuleHooksType, &CallGradsType, &ParamGradType, &SingleEdgeType, &OwnGradsType};
    const char *names[] = {"ModuleHooks", "CallGrads", "ParamGrad", "SingleEdge", "OwnGrads"};
    for (int i = 0; i < 5; i++) {
        if (PyType_Ready(types[i]) < 0) return -1;
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *)types[i]) < 0) { Py_DECREF(types[i]); return -1; }
    }
    return 0;
}
/* ============================================================================== end of L0 module hooks */
