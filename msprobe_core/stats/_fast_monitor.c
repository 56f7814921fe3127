/* ========================================================== the monitor's activation hooks in C (s11-mon)
 *
 * #included by _fast_stats.c after the monitor's step values (TensorRows: tr_plain, reduce_row, grow_rows).
 * monitor/module_hooks.py's ``ActivationHooks._on_forward`` and ``_Activation.__call__`` for the usual call,
 * one C call per module call and per activation gradient instead of a dozen Python frames:
 *
 *   ActivationCore(hooks, rows, raw, entries, eps, actv, actv_grad, graph_task_id, get_num_threads,
 *                  ordered_dict, handle_class)
 *        what every hook of one ``ActivationHooks`` shares: the hooks object itself (its ``state``,
 *        ``_generation``, ``_micro``, ``_seen``, read at each call, and ``_on_grad``/``_hook_failed``, its
 *        Python routes), the collector's TensorRows, host rows (bytearray) and entries (list), the kernel's
 *        eps, the row kinds, torch's ``_current_graph_task_id`` (or None), ``get_num_threads``,
 *        ``OrderedDict`` and ``RemovableHandle`` (for the tensor hook entry ``add_tensor_hook`` makes)
 *   Activation(ref, core)
 *        ``_Activation``: an activation seen this step (``ref``: a weak reference to it; ``slot``, ``micro``,
 *        ``state``, ``names`` as there); called with its gradient, records the gradient's row under each of
 *        its names (a tensor TensorRows reads), or hands over to ``hooks._on_grad(activation, grad)``
 *   ForwardSite(core, site, fallback, in_names, out_names)
 *        a module's forward hook (``register_forward_hook(with_kwargs=True)``): the usual call (module
 *        training, the step collecting, not in backward, the first call of the site in its generation, one
 *        plain float tensor TensorRows reads in and one out, no keywords) done here as ``_on_forward`` does
 *        it; every other call goes to ``fallback`` (``partial(hooks._on_forward, site)``), with nothing done
 *        here. in_names/out_names: (forward row name or None, gradient names ((row name, module),) or None)
 *        of the input and the output, the site's usual plan.
 *   state_rows(rows, raw, entries, kind, names, modules, tensors, micro, eps, threads) -> True or None
 *        ``StepCollector.record_columns`` of a batch (weights, gradients, optimizer moments) in one call: every
 *        tensor's row appended to raw and its entry (kind, name, module, micro, numel, row, False, False) to
 *        entries, as the Python route appends them; None, with nothing appended, where TensorRows does not
 *        read one of the tensors (an empty one included) or the columns differ in length: the Python route.
 */

static PyObject *s_training, *s_state, *s_collecting, *s_generation, *s_calls, *s_micro, *s_seen, *s_on_grad,
    *s_hook_failed, *s_one, *s_hooks_generation;

enum { AC_VERSION, AC_REQUIRES_GRAD, AC_DATA_PTR, AC_NUMEL, AC_N };
static const char *const AC_NAMES[AC_N] = {"_version", "requires_grad", "data_ptr", "numel"};

#define AC_OBJECTS(X) X(hooks) X(rows) X(raw) X(entries) X(actv) X(actv_grad) X(graph_task_id) \
                      X(get_num_threads) X(ordered_dict) X(handle_class)

typedef struct {
    PyObject_HEAD
    AC_OBJECTS(RT_DECLARE)
    PyObject *descr[AC_N];
    PyObject *weaklist;
    PyObject *weak; /* a weak reference to this core, the one its activations hold */
    double eps;
    int count;
} ActivationCoreObject;

/* Not tracked by the garbage collector (thousands are made a step and live until its end: tracked, they would
 * bring on full collections of the training's heap): nothing it holds leads back to it (the core only weakly,
 * through the core's one weak reference; the step state, row names and slot hold no activation). */
typedef struct {
    PyObject_HEAD
    PyObject *ref, *core, *slot, *micro, *state, *names;
    int plain; /* made by ForwardSite for a tensor tr_plain accepted (one the Python route made: 0) */
} ActivationObject;

static PyTypeObject ActivationCoreType, ActivationType;

/* ------------------------------------------------------------------------------------------ shared helpers */

/* The same int object for the same row index or element count every step (below MON_INTS; made once, kept for the
 * process): StepCollector.finalize's comparison of a step's entries with the last step's meets the same objects (no
 * int comparison), and no int is made and freed per row. A new reference. */
#define MON_INTS 32768
static PyObject **mon_ints;

static PyObject *mon_int(Py_ssize_t v) {
    if (v < 0 || v >= MON_INTS) return PyLong_FromSsize_t(v);
    if (mon_ints == NULL && (mon_ints = PyMem_Calloc(MON_INTS, sizeof(PyObject *))) == NULL) return PyErr_NoMemory();
    if (mon_ints[v] == NULL && (mon_ints[v] = PyLong_FromSsize_t(v)) == NULL) return NULL;
    return Py_NewRef(mon_ints[v]);
}

/* The row of a tensor tr_plain accepted (p, n, code) appended to the core's host rows: its index. */
static PyObject *acore_row(ActivationCoreObject *core, void *p, Py_ssize_t n, long code) {
    long threads = 1;
    double r[ROW_WIDTH];
    if (n >= PARALLEL_MIN) {  /* only then does the thread count matter (reduce_row) */
        PyObject *t = PyObject_CallNoArgs(core->get_num_threads);
        if (t == NULL) return NULL;
        threads = PyLong_AsLong(t);
        Py_DECREF(t);
        if (threads == -1 && PyErr_Occurred()) return NULL;
        Py_BEGIN_ALLOW_THREADS
        reduce_row(p, n, code, core->eps, core->count, threads, r);
        Py_END_ALLOW_THREADS
    } else {
        reduce_row(p, n, code, core->eps, core->count, threads, r);
    }
    Py_ssize_t first;
    if (grow_rows(core->raw, 1, &first) < 0) return NULL;
    memcpy((double *)PyByteArray_AS_STRING(core->raw) + first * ROW_WIDTH, r, sizeof(r));
    return mon_int(first);
}

/* Room for `extra` more items in StepCollector's flat entries list (a list exactly), its storage grown by doubling
 * where it is full (a step's entries, tens of thousands of items, are moved a few times, not at every eighth that
 * list.append or a slice assignment adds). 0, or -1 with an error. */
static int entries_reserve(PyListObject *entries, Py_ssize_t extra) {
    Py_ssize_t need = Py_SIZE(entries) + extra;
    if (need <= entries->allocated) return 0;
    Py_ssize_t cap = 2 * need;
    PyObject **items = PyMem_Realloc(entries->ob_item, (size_t)cap * sizeof(PyObject *));
    if (items == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    entries->ob_item = items;
    entries->allocated = cap;
    return 0;
}

/* One entry (StepCollector's flat list: kind, name, module, micro, numel, slot, alias, external) appended: its
 * eight items set in place (entries_reserve). */
static int acore_entry(ActivationCoreObject *core, PyObject *kind, PyObject *name, PyObject *module, PyObject *micro,
                    Py_ssize_t n, PyObject *slot, int alias, int external) {
    PyListObject *entries = (PyListObject *)core->entries;
    Py_ssize_t at = Py_SIZE(entries);
    if (entries_reserve(entries, 8) < 0) return -1;
    PyObject *numel = mon_int(n);
    if (numel == NULL) return -1;
    PyObject *items[8] = {Py_NewRef(kind), Py_NewRef(name), Py_NewRef(module), Py_NewRef(micro), numel,
                          Py_NewRef(slot), Py_NewRef(alias ? Py_True : Py_False), Py_NewRef(external ? Py_True : Py_False)};
    for (int i = 0; i < 8; i++) entries->ob_item[at + i] = items[i];
    Py_SET_SIZE(entries, at + 8);
    return 0;
}

/* Hand an error to the hooks' Python reporter (logged once, the training goes on): forward 1 for a forward
 * hook, 0 for a gradient hook. */
static void acore_failed(ActivationCoreObject *core, int forward, PyObject *name) {
    PyObject *exc_type, *exc, *tb;
    PyErr_Fetch(&exc_type, &exc, &tb);
    PyErr_NormalizeException(&exc_type, &exc, &tb);
    if (exc != NULL && tb != NULL) PyException_SetTraceback(exc, tb);
    PyObject *r = PyObject_CallMethodObjArgs(core->hooks, s_hook_failed, forward ? Py_True : Py_False,
                                             name ? name : Py_None, exc ? exc : Py_None, NULL);
    if (r == NULL) PyErr_Clear();
    Py_XDECREF(r);
    Py_XDECREF(exc_type);
    Py_XDECREF(exc);
    Py_XDECREF(tb);
}

/* ------------------------------------------------------------------------------------------ ActivationCore */

static PyObject *acore_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"hooks", "rows", "raw", "entries", "eps", "actv", "actv_grad", "graph_task_id",
                         "get_num_threads", "ordered_dict", "handle_class", "tensor_base", NULL};
    PyObject *hooks, *rows, *raw, *entries, *actv, *actv_grad, *task, *threads, *od, *handle, *base;
    double eps;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!O!O!dOOOOOOO:ActivationCore", kw, &hooks, &TensorRowsType, &rows,
                                     &PyByteArray_Type, &raw, &PyList_Type, &entries, &eps, &actv, &actv_grad, &task,
                                     &threads, &od, &handle, &base))
        return NULL;
    if (!PyType_Check(base)) {
        PyErr_SetString(PyExc_TypeError, "tensor_base must be a type");
        return NULL;
    }
    ActivationCoreObject *self = (ActivationCoreObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->hooks = Py_NewRef(hooks);
    self->rows = Py_NewRef(rows);
    self->raw = Py_NewRef(raw);
    self->entries = Py_NewRef(entries);
    self->actv = Py_NewRef(actv);
    self->actv_grad = Py_NewRef(actv_grad);
    self->graph_task_id = Py_NewRef(task);
    self->get_num_threads = Py_NewRef(threads);
    self->ordered_dict = Py_NewRef(od);
    self->handle_class = Py_NewRef(handle);
    self->count = eps >= 0;
    self->eps = self->count ? eps : 0.0;
    if (load_descriptors(base, AC_NAMES, AC_N, self->descr) < 0 ||
        (self->weak = PyWeakref_NewRef((PyObject *)self, NULL)) == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int acore_traverse(ActivationCoreObject *self, visitproc visit, void *arg) {
    AC_OBJECTS(RT_VISIT)
    for (int i = 0; i < AC_N; i++) Py_VISIT(self->descr[i]);
    Py_VISIT(self->weak);
    return 0;
}

static int acore_clear(ActivationCoreObject *self) {
    AC_OBJECTS(RT_CLEAR)
    for (int i = 0; i < AC_N; i++) Py_CLEAR(self->descr[i]);
    Py_CLEAR(self->weak);
    return 0;
}

static void acore_dealloc(ActivationCoreObject *self) {
    PyObject_GC_UnTrack(self);
    if (self->weak != NULL) PyObject_ClearWeakRefs((PyObject *)self);
    acore_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject ActivationCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "msprobe_core.stats._fast_stats.ActivationCore",
    .tp_basicsize = sizeof(ActivationCoreObject),
    .tp_weaklistoffset = offsetof(ActivationCoreObject, weaklist),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "What the C activation hooks of one ActivationHooks share (monitor/module_hooks.py)",
    .tp_new = acore_new,
    .tp_traverse = (traverseproc)acore_traverse,
    .tp_clear = (inquiry)acore_clear,
    .tp_dealloc = (destructor)acore_dealloc,
};

/* ------------------------------------------------------------------------------------------ Activation */

static ActivationObject *act_make(PyObject *ref, PyObject *core) {
    ActivationObject *self = PyObject_New(ActivationObject, &ActivationType);
    if (self == NULL) return NULL;
    self->ref = Py_NewRef(ref);
    self->core = Py_NewRef(((ActivationCoreObject *)core)->weak);
    self->slot = Py_NewRef(Py_None);
    self->micro = PyLong_FromLong(0);
    self->state = Py_NewRef(Py_None);
    self->names = PyTuple_New(0);
    self->plain = 0;
    if (self->micro == NULL || self->names == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return self;
}

static PyObject *act_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *ref, *core;
    static char *kw[] = {"ref", "core", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!:Activation", kw, &ref, &ActivationCoreType, &core))
        return NULL;
    if (!PyWeakref_CheckRef(ref)) {
        PyErr_SetString(PyExc_TypeError, "Activation: ref must be a weak reference");
        return NULL;
    }
    return (PyObject *)act_make(ref, core);
}

static PyObject *act_record(ActivationObject *self, ActivationCoreObject *core, PyObject *grad);

/* ``_Activation.__call__``: a gradient TensorRows reads recorded here, anything else by ``hooks._on_grad``. */
static PyObject *act_call(ActivationObject *self, PyObject *args, PyObject *kwds) {
    PyObject *grad;
    if (!PyArg_UnpackTuple(args, "Activation", 1, 1, &grad)) return NULL;
    ActivationCoreObject *core = (ActivationCoreObject *)PyWeakref_GetObject(self->core);  /* borrowed */
    if ((PyObject *)core == Py_None) Py_RETURN_NONE;  /* the hooks are gone */
    Py_INCREF(core);
    PyObject *ret = act_record(self, core, grad);
    Py_DECREF(core);
    return ret;
}

static PyObject *act_record(ActivationObject *self, ActivationCoreObject *core, PyObject *grad) {
    if (self->state == NULL || self->micro == NULL || self->names == NULL)  /* an attribute deleted: Python says */
        return PyObject_CallMethodObjArgs(core->hooks, s_on_grad, (PyObject *)self, grad, NULL);
    PyObject *state = PyObject_GetAttr(core->hooks, s_state);
    if (state == NULL) goto failed;
    int mine = state == self->state;
    Py_DECREF(state);
    if (!mine) Py_RETURN_NONE;
    PyObject *collecting = PyObject_GetAttr(self->state, s_collecting);
    if (collecting == NULL) goto failed;
    int on = PyObject_IsTrue(collecting);
    Py_DECREF(collecting);
    if (on < 0) goto failed;
    if (!on) Py_RETURN_NONE;
    void *p = NULL;
    Py_ssize_t n = 0;
    long code = 0;
    int plain = tr_plain((TensorRowsObject *)core->rows, grad, &p, &n, &code);
    if (plain < 0) goto failed;
    if (plain == 0 || !PyTuple_CheckExact(self->names)) {
        return PyObject_CallMethodObjArgs(core->hooks, s_on_grad, (PyObject *)self, grad, NULL);
    }
    PyObject *slot = acore_row(core, p, n, code);
    if (slot == NULL) goto failed;
    Py_ssize_t k = PyTuple_GET_SIZE(self->names);
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *pair = PyTuple_GET_ITEM(self->names, i);
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "an activation's names are (row name, module) pairs");
            Py_DECREF(slot);
            goto failed;
        }
        if (acore_entry(core, core->actv_grad, PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1), self->micro, n,
                     slot, i > 0, 0) < 0) {
            Py_DECREF(slot);
            goto failed;
        }
    }
    Py_DECREF(slot);
    Py_RETURN_NONE;
failed:
    {
        PyObject *first = NULL;
        if (self->names != NULL && PyTuple_Check(self->names) && PyTuple_GET_SIZE(self->names) > 0) {
            PyObject *pair = PyTuple_GET_ITEM(self->names, 0);
            if (PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) > 0) first = PyTuple_GET_ITEM(pair, 0);
        }
        Py_XINCREF(first);
        acore_failed(core, 0, first);
        Py_XDECREF(first);
    }
    Py_RETURN_NONE;
}

static void act_dealloc(ActivationObject *self) {
    Py_XDECREF(self->ref);
    Py_XDECREF(self->core);
    Py_XDECREF(self->slot);
    Py_XDECREF(self->micro);
    Py_XDECREF(self->state);
    Py_XDECREF(self->names);
    PyObject_Free(self);
}

static PyMemberDef act_members[] = {
    {"ref", T_OBJECT, offsetof(ActivationObject, ref), READONLY, "the tensor, weakly"},
    {"core", T_OBJECT, offsetof(ActivationObject, core), READONLY, "its ActivationCore, weakly"},
    {"slot", T_OBJECT, offsetof(ActivationObject, slot), 0, "where its forward statistics are (None: not computed)"},
    {"micro", T_OBJECT, offsetof(ActivationObject, micro), 0, "its micro-batch"},
    {"state", T_OBJECT, offsetof(ActivationObject, state), 0, "the step that registered its gradient hook"},
    {"names", T_OBJECT, offsetof(ActivationObject, names), 0, "(row name, module) pairs of its gradient"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject ActivationType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "msprobe_core.stats._fast_stats.Activation",
    .tp_basicsize = sizeof(ActivationObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Activation(ref, core): module_hooks._Activation, its gradient hook's usual call in C",
    .tp_new = act_new,
    .tp_call = (ternaryfunc)act_call,
    .tp_dealloc = (destructor)act_dealloc,
    .tp_members = act_members,
};

/* ------------------------------------------------------------------------------------------ ForwardSite */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *core, *site, *fallback, *name;
    PyObject *fwd[2], *bwd[2]; /* the input's and the output's forward row name and gradient names (or NULL) */
    Py_ssize_t chunk;
} ForwardSiteObject;

/* The facts of ``want`` of t into *f (TORCH_FACT_DATA_PTR, TORCH_FACT_VERSION, TORCH_FACT_SIZES: its numel,
 * TORCH_FACT_FLAGS: its requires_grad): the C++ tensor's (ff_facts), else torch's Python API's through the core's
 * descriptors. 0, or -1 with an error. */
static int fs_facts(ActivationCoreObject *core, PyObject *t, int want, TorchTensorFacts *f) {
    int known = ff_facts(t, want, f);
    if (known) return known < 0 ? -1 : 0;
    static const int bits[] = {TORCH_FACT_DATA_PTR, TORCH_FACT_VERSION, TORCH_FACT_SIZES, TORCH_FACT_FLAGS};
    static const int descr[] = {AC_DATA_PTR, AC_VERSION, AC_NUMEL, AC_REQUIRES_GRAD};
    for (int i = 0; i < 4; i++) {
        if (!(want & bits[i])) continue;
        PyObject *v = descr_get(core->descr[descr[i]], t);
        if (v == NULL) return -1;
        switch (bits[i]) {
            case TORCH_FACT_DATA_PTR: f->data_ptr = PyLong_AsUnsignedLongLong(v); break;
            case TORCH_FACT_VERSION: f->version = (long long)PyLong_AsUnsignedLongLongMask(v); break;
            case TORCH_FACT_SIZES: f->numel = PyLong_AsSsize_t(v); break;
            default: f->requires_grad = v == Py_True; break;
        }
        Py_DECREF(v);
        if (PyErr_Occurred()) return -1;
    }
    return 0;
}

/* module_hooks._identity of a plain tensor whose data pointer is ptr: id << 96 | data_ptr << 32 | (version &
 * 0xFFFFFFFF), one int. */
static PyObject *fs_identity(ActivationCoreObject *core, PyObject *t, unsigned long long ptr) {
    TorchTensorFacts f;
    if (fs_facts(core, t, TORCH_FACT_VERSION, &f) < 0) return NULL;
    unsigned long long version = (unsigned long long)f.version, id = (unsigned long long)(uintptr_t)t;
    unsigned char b[20];
    for (int i = 0; i < 4; i++) b[i] = (unsigned char)(version >> (8 * i));
    for (int i = 0; i < 8; i++) b[4 + i] = (unsigned char)(ptr >> (8 * i));
    for (int i = 0; i < 8; i++) b[12 + i] = (unsigned char)(id >> (8 * i));
    return _PyLong_FromByteArray(b, sizeof(b), 1, 0);
}

/* step_hooks.add_tensor_hook for a plain tensor (keep the two alike): the hook at the end of the tensor's
 * ``_backward_hooks`` (``tensor_hooks_dict``) under the next RemovableHandle id. */
static int fs_tensor_hook(ActivationCoreObject *core, PyObject *t, PyObject *hook) {
    return tensor_hook_add(t, hook, core->ordered_dict, core->handle_class, NULL);  /* (_fast_l0.c) */
}

/* The work of one leaf of the usual call (``_on_forward``'s loop body), key its identity (a new reference, taken
 * here): 0, or -1 with an error. p is NULL for a known activation whose memory is not read again (fs_known); found:
 * the activation fs_known found under key (a strong reference, kept by the caller), not looked up again, or NULL. */
static int fs_leaf(ForwardSiteObject *s, PyObject *seen, PyObject *state, PyObject *micro, PyObject *t, int i,
                   void *p, Py_ssize_t n, long code, PyObject *key, ActivationObject *found) {
    ActivationCoreObject *core = (ActivationCoreObject *)s->core;
    ActivationObject *known = found != NULL ? found : (ActivationObject *)PyDict_GetItemWithError(seen, key);
    if (known == NULL && PyErr_Occurred()) { Py_DECREF(key); return -1; }
    if (known != NULL && Py_TYPE(known) == &ActivationType && PyWeakref_GetObject(known->ref) == t) {
        Py_INCREF(known);
    } else if (known != NULL && Py_TYPE(known) != &ActivationType) {
        PyErr_SetString(PyExc_TypeError, "an activation of another kind in the step's seen dict");
        Py_DECREF(key);
        return -1;
    } else {
        PyObject *ref = PyWeakref_NewRef(t, NULL);
        if (ref == NULL) { Py_DECREF(key); return -1; }
        /* a weak reference without a callback refers to nothing the collector could follow: untracked, the step's
         * thousands of them do not bring on collections */
        if (PyObject_GC_IsTracked(ref) && Py_TYPE(ref) == &_PyWeakref_RefType && PyWeakref_CheckRefExact(ref) &&
            ((PyWeakReference *)ref)->wr_callback == NULL)
            PyObject_GC_UnTrack(ref);
        known = act_make(ref, s->core);
        Py_DECREF(ref);
        if (known != NULL) known->plain = p != NULL;
        if (known == NULL || PyDict_SetItem(seen, key, (PyObject *)known) < 0) {
            Py_XDECREF(known);
            Py_DECREF(key);
            return -1;
        }
    }
    Py_DECREF(key);
    int rc = -1;
    if (known->slot == NULL || known->micro == NULL || known->state == NULL || known->names == NULL) {
        PyErr_SetString(PyExc_AttributeError, "an activation's attribute was deleted");
        goto done;
    }
    TorchTensorFacts f;
    if (fs_facts(core, t, TORCH_FACT_FLAGS, &f) < 0) goto done;
    int requires_grad = f.requires_grad;
    if (s->fwd[i] != NULL) {
        if (known->slot == Py_None) {
            if (p == NULL) {  /* fs_call takes a known tensor's memory as read only where its row is made */
                PyErr_SetString(PyExc_RuntimeError, "ForwardSite: a known activation without its row");
                goto done;
            }
            PyObject *slot = acore_row(core, p, n, code);
            if (slot == NULL) goto done;
            Py_SETREF(known->slot, slot);
            if (acore_entry(core, core->actv, s->fwd[i], s->name, micro, n, slot, 0, !requires_grad) < 0) goto done;
        } else if (acore_entry(core, core->actv, s->fwd[i], s->name, micro, n, known->slot, 1, !requires_grad) < 0) {
            goto done;
        }
    }
    if (s->bwd[i] != NULL && requires_grad) {
        if (PyTuple_Check(known->names) && PyTuple_GET_SIZE(known->names) > 0) {
            PyObject *names = PySequence_Concat(known->names, s->bwd[i]);
            if (names == NULL) goto done;
            Py_SETREF(known->names, names);
        } else {
            Py_SETREF(known->micro, Py_NewRef(micro));
            Py_SETREF(known->state, Py_NewRef(state));
            Py_SETREF(known->names, Py_NewRef(s->bwd[i]));
            if (fs_tensor_hook(core, t, (PyObject *)known) < 0) goto done;
        }
    }
    rc = 0;
done:
    Py_DECREF(known);
    return rc;
}

/* Whether t is an activation this step knows already, as a tensor tr_plain accepted (fs_leaf made it), with its
 * row there where the site wants one: then its memory is not read again and tr_plain not asked (the facts of one
 * tensor object at one data pointer and version). 1 with *n its element count (asked again, as the Python route
 * asks), 0 where not, -1 with an error; *key: its identity (a new reference), or NULL. */
static int fs_known(ForwardSiteObject *s, PyObject *seen, PyObject *t, PyObject **key, Py_ssize_t *n,
                    ActivationObject **found) {
    ActivationCoreObject *core = (ActivationCoreObject *)s->core;
    TensorRowsObject *rows = (TensorRowsObject *)core->rows;
    if (!PyDict_CheckExact(seen) || ((PyObject *)Py_TYPE(t) != rows->tensor && (PyObject *)Py_TYPE(t) != rows->parameter))
        return 0;
    TorchTensorFacts f;
    if (fs_facts(core, t, TORCH_FACT_DATA_PTR, &f) < 0 || (*key = fs_identity(core, t, f.data_ptr)) == NULL) return -1;
    ActivationObject *known = (ActivationObject *)PyDict_GetItemWithError(seen, *key);  /* borrowed */
    if (known == NULL) return PyErr_Occurred() ? -1 : 0;
    if (Py_TYPE(known) != &ActivationType || !known->plain || PyWeakref_GetObject(known->ref) != t ||
        known->slot == NULL || (s->fwd[0] != NULL && known->slot == Py_None))
        return 0;
    if (fs_facts(core, t, TORCH_FACT_SIZES, &f) < 0) return -1;
    *n = (Py_ssize_t)f.numel;
    if (*n <= 0) return 0;
    *found = (ActivationObject *)Py_NewRef(known);
    return 1;
}

static PyObject *fs_fallback(ForwardSiteObject *s, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return PyObject_Vectorcall(s->fallback, args, nargsf, kwnames);
}

/* 1 where obj is true, 0 where not, -1 with an error; obj is a new reference (NULL: an error), released. */
static int fs_truth(PyObject *obj) {
    if (obj == NULL) return -1;
    int r = obj == Py_True ? 1 : obj == Py_False ? 0 : PyObject_IsTrue(obj);
    Py_DECREF(obj);
    return r;
}

static PyObject *fs_call(ForwardSiteObject *s, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 4 || kwnames != NULL) return fs_fallback(s, args, nargsf, kwnames);
    ActivationCoreObject *core = (ActivationCoreObject *)s->core;
    PyObject *module = args[0], *in = args[1], *kwargs = args[2], *out = args[3];
    PyObject *state = NULL, *seen = NULL, *micro = NULL, *gen = NULL, *ret = NULL, *keys[2] = {NULL, NULL};
    ActivationObject *found = NULL; /* the input's activation, where fs_known found it */
    int on = fs_truth(PyObject_GetAttr(module, s_training));
    if (on <= 0) return on < 0 ? fs_fallback(s, args, nargsf, kwnames) : Py_NewRef(Py_None);
    if (!PyTuple_CheckExact(in) || PyTuple_GET_SIZE(in) != 1 || !PyDict_CheckExact(kwargs) ||
        PyDict_GET_SIZE(kwargs) != 0)
        return fs_fallback(s, args, nargsf, kwnames);
    state = PyObject_GetAttr(core->hooks, s_state);
    if (state == NULL) goto fallback;
    on = fs_truth(PyObject_GetAttr(state, s_collecting));
    if (on <= 0) {
        if (on < 0) goto fallback;
        Py_DECREF(state);
        Py_RETURN_NONE;
    }
    if (core->graph_task_id != Py_None) {  /* in_backward(): activation recomputation */
        PyObject *task = PyObject_CallNoArgs(core->graph_task_id);
        if (task == NULL) goto fallback;
        long id = PyLong_AsLong(task);
        Py_DECREF(task);
        if (id == -1 && PyErr_Occurred()) goto fallback;
        if (id != -1) {
            Py_DECREF(state);
            Py_RETURN_NONE;
        }
    }
    /* the first call of the site in this generation? */
    gen = PyObject_GetAttr(core->hooks, s_hooks_generation);
    if (gen == NULL) goto fallback;
    PyObject *site_gen = PyObject_GetAttr(s->site, s_generation);
    if (site_gen == NULL) goto fallback;
    int same = PyObject_RichCompareBool(site_gen, gen, Py_EQ);
    Py_DECREF(site_gen);
    if (same != 0) goto fallback;
    /* both tensors read by the kernel as they are (a plain float tensor, dense, on the CPU); the input is, as a
     * rule, the output of the call before, known this step: then it is not asked again (fs_known) */
    seen = PyObject_GetAttr(core->hooks, s_seen);
    if (seen == NULL) goto fallback;
    PyObject *x = PyTuple_GET_ITEM(in, 0), *tensors[2] = {x, out};
    void *p[2] = {NULL, NULL};
    Py_ssize_t n[2] = {0, 0};
    long code[2] = {0, 0};
    int plain = 1;
    if (s->fwd[0] != NULL || s->bwd[0] != NULL) {
        plain = fs_known(s, seen, x, &keys[0], &n[0], &found);
        if (plain == 0) plain = tr_plain((TensorRowsObject *)core->rows, x, &p[0], &n[0], &code[0]);
        else if (plain < 0) plain = 0;  /* the Python route answers (or fails) as it would */
    } else {
        plain = tr_plain((TensorRowsObject *)core->rows, x, &p[0], &n[0], &code[0]);
    }
    if (plain > 0) plain = tr_plain((TensorRowsObject *)core->rows, out, &p[1], &n[1], &code[1]);
    if (plain <= 0) goto fallback;
    /* from here on this call is the usual one: _on_forward's work, an error reported as it reports one */
    if (PyObject_SetAttr(s->site, s_generation, gen) < 0 || PyObject_SetAttr(s->site, s_calls, s_one) < 0)
        goto failed;
    PyObject *micros = PyObject_GetAttr(core->hooks, s_micro);
    if (micros == NULL) goto failed;
    micro = PySequence_GetItem(micros, s->chunk);
    Py_DECREF(micros);
    if (micro == NULL) goto failed;
    if (PyLong_Check(micro) && _PyLong_Sign(micro) < 0) Py_SETREF(micro, PyLong_FromLong(0));
    if (micro == NULL) goto failed;
    if (!PyDict_CheckExact(seen)) {
        PyErr_SetString(PyExc_TypeError, "the step's seen activations must be a dict");
        goto failed;
    }
    for (int i = 0; i < 2; i++) {
        if (s->fwd[i] == NULL && s->bwd[i] == NULL) continue;
        PyObject *key = keys[i];
        keys[i] = NULL;
        if (key == NULL) key = fs_identity(core, tensors[i], (unsigned long long)(uintptr_t)p[i]);
        if (key == NULL || fs_leaf(s, seen, state, micro, tensors[i], i, p[i], n[i], code[i], key,
                                   i == 0 ? found : NULL) < 0)
            goto failed;
    }
    ret = Py_NewRef(Py_None);
    goto done;
failed:
    acore_failed(core, 1, s->name);
    ret = Py_NewRef(Py_None);
    goto done;
fallback:
    /* not the usual call (or a question torch refused): the Python route decides, from the start */
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) goto done;
        PyErr_Clear();
    }
    ret = fs_fallback(s, args, nargsf, kwnames);
done:
    Py_XDECREF(state);
    Py_XDECREF(gen);
    Py_XDECREF(micro);
    Py_XDECREF(seen);
    Py_XDECREF(keys[0]);
    Py_XDECREF(keys[1]);
    Py_XDECREF(found);
    return ret;
}

static PyObject *fs_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return fs_call((ForwardSiteObject *)self, args, nargsf, kwnames);
}

/* (row name or None, gradient names or None) of one leaf of the usual plan. */
static int fs_names(PyObject *pair, PyObject **fwd, PyObject **bwd) {
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
        PyErr_SetString(PyExc_TypeError, "ForwardSite: in_names and out_names are (row name, gradient names) pairs");
        return -1;
    }
    PyObject *f = PyTuple_GET_ITEM(pair, 0), *b = PyTuple_GET_ITEM(pair, 1);
    if ((f != Py_None && !PyUnicode_Check(f)) || (b != Py_None && !PyTuple_CheckExact(b))) {
        PyErr_SetString(PyExc_TypeError, "ForwardSite: a row name is a str, gradient names a tuple");
        return -1;
    }
    *fwd = f == Py_None ? NULL : Py_NewRef(f);
    *bwd = b == Py_None ? NULL : Py_NewRef(b);
    return 0;
}

static PyObject *fs_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"core", "site", "fallback", "name", "chunk", "in_names", "out_names", NULL};
    PyObject *core, *site, *fallback, *name, *ins, *outs;
    Py_ssize_t chunk;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OOUnOO:ForwardSite", kw, &ActivationCoreType, &core, &site,
                                     &fallback, &name, &chunk, &ins, &outs))
        return NULL;
    ForwardSiteObject *self = (ForwardSiteObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->vectorcall = fs_vectorcall;
    self->core = Py_NewRef(core);
    self->site = Py_NewRef(site);
    self->fallback = Py_NewRef(fallback);
    self->name = Py_NewRef(name);
    self->chunk = chunk;
    if (fs_names(ins, &self->fwd[0], &self->bwd[0]) < 0 || fs_names(outs, &self->fwd[1], &self->bwd[1]) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int fs_traverse(ForwardSiteObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->core);
    Py_VISIT(self->site);
    Py_VISIT(self->fallback);
    Py_VISIT(self->name);
    for (int i = 0; i < 2; i++) {
        Py_VISIT(self->fwd[i]);
        Py_VISIT(self->bwd[i]);
    }
    return 0;
}

static int fs_clear(ForwardSiteObject *self) {
    Py_CLEAR(self->core);
    Py_CLEAR(self->site);
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->name);
    for (int i = 0; i < 2; i++) {
        Py_CLEAR(self->fwd[i]);
        Py_CLEAR(self->bwd[i]);
    }
    return 0;
}

static void fs_dealloc(ForwardSiteObject *self) {
    PyObject_GC_UnTrack(self);
    fs_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef fs_members[] = {
    {"site", T_OBJECT, offsetof(ForwardSiteObject, site), READONLY, "the module_hooks._Site"},
    {"fallback", T_OBJECT, offsetof(ForwardSiteObject, fallback), READONLY, "the Python route of every other call"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject ForwardSiteType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "msprobe_core.stats._fast_stats.ForwardSite",
    .tp_basicsize = sizeof(ForwardSiteObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "ForwardSite(core, site, fallback, name, chunk, in_names, out_names): a monitored module's forward "
              "hook, its usual call in C (module_hooks.ActivationHooks._on_forward)",
    .tp_new = fs_new,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(ForwardSiteObject, vectorcall),
    .tp_traverse = (traverseproc)fs_traverse,
    .tp_clear = (inquiry)fs_clear,
    .tp_dealloc = (destructor)fs_dealloc,
    .tp_members = fs_members,
};

/* ------------------------------------------------------------------------------------------ state_rows */

static PyObject *mon_state_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError,
                        "state_rows(rows, raw, entries, kind, names, modules, tensors, micro, eps, threads) takes 10 "
                        "arguments");
        return NULL;
    }
    if (!PyObject_TypeCheck(args[0], &TensorRowsType) || !PyByteArray_CheckExact(args[1]) ||
        !PyList_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "state_rows: rows must be a TensorRows, raw a bytearray, entries a list");
        return NULL;
    }
    PyObject *raw = args[1], *kind = args[3], *micro = args[7];
    PyListObject *entries = (PyListObject *)args[2];
    PyObject *names = NULL, *modules = NULL, *ts = NULL, *start = NULL, *ret = NULL;
    Py_ssize_t first = 0, m = 0, size = Py_SIZE(entries);
    if ((names = PySequence_Fast(args[4], "names must be a sequence")) == NULL ||
        (modules = PySequence_Fast(args[5], "modules must be a sequence")) == NULL ||
        (ts = PySequence_Fast(args[6], "tensors must be a sequence")) == NULL)
        goto done;
    m = PySequence_Fast_GET_SIZE(ts);
    if (PySequence_Fast_GET_SIZE(names) != m || PySequence_Fast_GET_SIZE(modules) != m) {
        ret = Py_NewRef(Py_None);
        goto done;
    }
    /* TensorRows.rows appends every row or none; a row's last value is its element count */
    PyObject *rows_args[4] = {raw, ts, args[8], args[9]};
    start = tr_rows((TensorRowsObject *)args[0], rows_args, 4);
    if (start == NULL || start == Py_None) {
        ret = start;
        start = NULL;
        goto done;
    }
    first = PyLong_AsSsize_t(start);
    if (first == -1 && PyErr_Occurred()) goto done;
    /* the entries written in place (entries_reserve), no list of them made and copied over */
    if (entries_reserve(entries, 8 * m) < 0) goto undo;
    const double *row = (const double *)PyByteArray_AS_STRING(raw) + first * ROW_WIDTH;
    for (Py_ssize_t i = 0; i < m; i++, row += ROW_WIDTH) {
        PyObject *numel = mon_int((Py_ssize_t)row[ROW_WIDTH - 1]), *slot = mon_int(first + i);
        if (numel == NULL || slot == NULL) {
            Py_XDECREF(numel);
            Py_XDECREF(slot);
            goto undo;
        }
        PyObject *items[8] = {Py_NewRef(kind), Py_NewRef(PySequence_Fast_GET_ITEM(names, i)),
                              Py_NewRef(PySequence_Fast_GET_ITEM(modules, i)), Py_NewRef(micro), numel, slot,
                              Py_NewRef(Py_False), Py_NewRef(Py_False)};
        for (int j = 0; j < 8; j++) entries->ob_item[size + 8 * i + j] = items[j];
        Py_SET_SIZE(entries, size + 8 * (i + 1));
    }
    ret = Py_NewRef(Py_True);
    goto done;
undo:  /* the rows and entries appended go again (raw holds no row without its entry); the error stays the first */
    {
        PyObject *exc_type, *exc, *tb;
        PyErr_Fetch(&exc_type, &exc, &tb);
        if (PyByteArray_Resize(raw, first * ROW_WIDTH * (Py_ssize_t)sizeof(double)) < 0) PyErr_Clear();
        while (Py_SIZE(entries) > size) {
            Py_SET_SIZE(entries, Py_SIZE(entries) - 1);
            Py_DECREF(entries->ob_item[Py_SIZE(entries)]);
        }
        PyErr_Restore(exc_type, exc, tb);
    }
done:
    Py_XDECREF(start);
    Py_XDECREF(names);
    Py_XDECREF(modules);
    Py_XDECREF(ts);
    return ret;
}

static PyMethodDef mon_methods[] = {
    {"state_rows", (PyCFunction)(void (*)(void))mon_state_rows, METH_FASTCALL,
     "state_rows(rows, raw, entries, kind, names, modules, tensors, micro, eps, threads) -> True, or None (nothing "
     "appended) where the Python route records the batch"},
    {NULL, NULL, 0, NULL},
};

static int add_fast_monitor(PyObject *m) {
    struct { PyObject **s; const char *text; } strings[] = {
        {&s_training, "training"}, {&s_state, "state"}, {&s_collecting, "collecting"}, {&s_generation, "generation"}, {&s_hooks_generation, "_generation"},
        {&s_calls, "calls"}, {&s_micro, "_micro"}, {&s_seen, "_seen"}, {&s_on_grad, "_on_grad"},
        {&s_hook_failed, "_hook_failed"},
    };
    for (size_t i = 0; i < sizeof(strings) / sizeof(strings[0]); i++) {
        if (*strings[i].s == NULL && (*strings[i].s = PyUnicode_InternFromString(strings[i].text)) == NULL) return -1;
    }
    if (s_one == NULL && (s_one = PyLong_FromLong(1)) == NULL) return -1;
    if (PyModule_AddFunctions(m, mon_methods) < 0) return -1;
    PyTypeObject *types[] = {&ActivationCoreType, &ActivationType, &ForwardSiteType};
    const char *names[] = {"ActivationCore", "Activation", "ForwardSite"};
    for (int i = 0; i < 3; i++) {
        if (PyType_Ready(types[i]) < 0) return -1;
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(types[i]);
            return -1;
        }
    }
    return 0;
}
/* ====================================================== end of the monitor's activation hooks in C (s11-mon) */
