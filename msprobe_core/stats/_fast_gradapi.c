/* ================================================================================ API call with autograd on
 * The L1 dump's fast route of a recorded API call made with autograd on (``ApiCall``'s third way, see
 * _fast_api.c; ``pytorch/api_fast.py`` builds what it reads) and the gradient records of its backward.
 * #included by _fast_stats.c after _fast_l0.c (whose ``OwnGrads``/``SingleEdge`` it reuses).
 *
 *   ac_record(..., autograd) ``CallRecords.on_api_call`` of such a call in one C call: the inputs' text, name,
 *                           stack and parent, the backward record's sizes and the inputs' gradient edges
 *                           (``_begin_record`` with ``call.grad``), the original, the record's text and its
 *                           journal frame (``_text_record``), a gradient hook on each output that requires
 *                           grad (``_hook_outputs``) and the call's own nodes hooked (``_hook_own_grads``:
 *                           the one-edge call in C through ``OwnGrads``' hooks, any other by
 *                           ``backward_capture.capture``). The same records, frames and hooks as the Python
 *                           route; an input or output the C text does not read takes the Python route. The
 *                           call's hooks reach ``StepHooks`` in one ``keep_keys`` call (no handle objects); its
 *                           stateless hooks are made once per call site and used again in later steps.
 *   ApiGrad(records, service, text, field, fields, construct, no_parent, grad_enabled, dumping_thread_of,
 *           tf_off, tf_on)
 *   NodeEdges               the hook of a call's node whose inputs' edges start there (made by ac_record)
 *     (context, index, grad) -> None: ``CallRecords.on_grad(*context[:1], field, index, *context[1:], grad)`` of
 *                           a gradient whose text the kernel makes at once (``_put_grad_text``); anything else
 *                           (autograd recording the backward, another thread, a summary not known at once)
 *                           goes to ``records.on_grad`` itself. */

enum {
    G_BACKWARD, G_KEEP_OUT, G_KEEP_IN, G_TENSORS_IN, G_EDGES, G_REPORT_IN, G_REPORT_OUT, G_PARTIAL,
    G_HOOK_TENSOR, G_CAPTURE, G_FAIL, G_KEEP, G_HOOKS, G_OWN, G_SEQUENCE_NR, G_ACCUMULATE, G_TENSOR, G_KEEP_KEYS,
    G_HANDLE, G_ORDERED_DICT, G_COLLECT, G_N
};  /* G_EDGES: the ``InputEdges`` class (``ag_edges_of`` makes its ``of``); G_COLLECT: True where G_TENSORS_IN is
     * ``summarize.tensors_in`` (then ``ag_tensors_in`` collects in C); G_KEEP_KEYS: ``keep_keys(flat)`` holds hooks put in without a handle (``StepHooks.keep_keys``' form) for their
     * removal when the step ends; G_HANDLE: ``RemovableHandle`` (its ``next_id``); G_ORDERED_DICT: the hook dicts' type */

enum { AS_BWD_SIZES, AS_SLOTS, AS_BEGIN, AS_LEAF, AS_GRAD_FN, AS_OUTPUT_NR, AS_SEQUENCE_NR, AS_REQUIRES_GRAD,
       AS_REGISTER_HOOK, AS_ON_GRAD, AS_PUT_TEXT_FIELD, AS_SYNC, AS_ERROR, AS_GET, AS_BACKWARD_SUFFIX, AS_FORWARD_SUFFIX,
       AS_ID, AS_HOOKS_DICT_REF, AS_EXTRA_DICT_REF, AS_N };
static const char *const AG_NAMES[AS_N] = {"bwd_sizes", "slots", "begin", "leaf", "grad_fn", "output_nr",
    "_sequence_nr", "requires_grad", "register_hook", "on_grad", "put_text_field", "_sync", "_error", "get",
    ".backward", ".forward", "id", "hooks_dict_ref", "extra_dict_ref"};
static PyObject *ag_s[AS_N];  /* attribute names and suffixes, interned once (AS_*) */
static PyObject *ag_no_sizes;  /* (0, 0) */
#define AGR_VISIT(f) Py_VISIT(self->f);
#define AGR_CLEAR(f) Py_CLEAR(self->f);

/* sizes[backward] = (first, second), each given or (when NULL) kept from the old entry (``_NO_SIZES`` without
 * one): 0, -1 with an error. */
static int ag_sizes(PyObject *records, PyObject *backward, PyObject *first, PyObject *second) {
    PyObject *state = PyObject_GetAttr(records, S_step_state);
    PyObject *sizes = state == NULL ? NULL : PyObject_GetAttr(state, ag_s[AS_BWD_SIZES]);
    Py_XDECREF(state);
    if (sizes == NULL) return -1;
    PyObject *old = PyDict_Check(sizes) ? PyDict_GetItemWithError(sizes, backward) : NULL;
    int rc = -1;
    if (old == NULL && PyErr_Occurred()) goto done;
    if (old == NULL || !PyTuple_Check(old) || PyTuple_GET_SIZE(old) != 2) old = ag_no_sizes;
    PyObject *size = PyTuple_Pack(2, first != NULL ? first : PyTuple_GET_ITEM(old, 0),
                                  second != NULL ? second : PyTuple_GET_ITEM(old, 1));
    rc = size == NULL ? -1 : PyObject_SetItem(sizes, backward, size);
    Py_XDECREF(size);
done:
    Py_DECREF(sizes);
    return rc;
}

/* t.requires_grad: 1, 0, -1 with an error. An exact Tensor/Parameter's from its C++ tensor (_fast_facts.c; the
 * attribute's getter answers the same: these reads run with torch functions off), anything else's by getattr. */
static int ag_requires_grad(PyObject *t) {
    TorchTensorFacts f;
    int known = ff_facts(t, TORCH_FACT_FLAGS, &f);
    if (known) return known < 0 ? -1 : f.requires_grad;
    PyObject *v = PyObject_GetAttr(t, ag_s[AS_REQUIRES_GRAD]);
    int r = v == NULL ? -1 : PyObject_IsTrue(v);
    Py_XDECREF(v);
    return r;
}

/* An attribute (or, with ``call``, a method's result) as a C long long; -1 with an error. */
static long long ag_long(PyObject *obj, int a, int call) {
    PyObject *v = call ? PyObject_CallMethodNoArgs(obj, ag_s[a]) : PyObject_GetAttr(obj, ag_s[a]);
    if (v == NULL) return -1;
    long long r = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return r;
}

/* ------------------------------------------------------------------------------------ hooks of a call
 * A call's hooks are kept for their removal as ``StepHooks`` keeps them (key, number of dicts, the dicts, ...: no
 * handle object), gathered in one list per call (``flat``) and handed to ``keep_keys`` once. Stateless hooks
 * (the outputs' partials, ``NodeEdges``) are kept in ``hooks`` by what they hold and used again by the same call
 * site in later steps: a step's calls then leave no new objects for Python's garbage collector to carry into its
 * oldest generation (whose full collections cost ~100 ms with torch loaded). */

/* The hook kept under ``key`` (a new reference), or NULL: none (no error: make it and ``ag_kept_put`` it). */
static PyObject *ag_kept(PyObject **g, PyObject *key) {
    PyObject *hook = g[G_OWN] == Py_None ? NULL : PyDict_GetItemWithError(g[G_HOOKS], key);
    return Py_XNewRef(hook);
}

/* ``hook`` kept under ``key`` for the next steps (``hooks`` bounded as ``OwnGrads`` bounds it): 0, -1 an error. */
static int ag_kept_put(PyObject **g, PyObject *key, PyObject *hook) {
    if (g[G_OWN] == Py_None) return 0;  /* (no ``OwnGrads``: no bound known, nothing kept) */
    if (PyDict_GET_SIZE(g[G_HOOKS]) >= ((OwnGradsObject *)g[G_OWN])->max_hooks) PyDict_Clear(g[G_HOOKS]);
    return PyDict_SetItem(g[G_HOOKS], key, hook);
}

/* ``StepHooks.keep(handle)`` into ``flat``: the handle's key and hook dicts (the handle itself dropped). 0, -1. */
static int ag_keep_handle(PyObject *flat, PyObject *handle) {
    PyObject *id = PyObject_GetAttr(handle, ag_s[AS_ID]);
    PyObject *ref = id == NULL ? NULL : PyObject_GetAttr(handle, ag_s[AS_HOOKS_DICT_REF]);
    PyObject *hooks = ref == NULL ? NULL : PyObject_CallNoArgs(ref);
    PyObject *extra = hooks == NULL ? NULL : PyObject_GetAttr(handle, ag_s[AS_EXTRA_DICT_REF]);
    int truth = extra == NULL ? -1 : PyObject_IsTrue(extra);
    PyObject *refs = truth <= 0 ? NULL : PySequence_Fast(extra, "extra_dict_ref is no sequence");
    Py_ssize_t n = refs == NULL ? 0 : PySequence_Fast_GET_SIZE(refs);
    PyObject *count = truth < 0 || (truth && refs == NULL) ? NULL : PyLong_FromSsize_t(1 + n);
    int rc = count == NULL || PyList_Append(flat, id) < 0 || PyList_Append(flat, count) < 0
             || PyList_Append(flat, hooks) < 0 ? -1 : 0;
    for (Py_ssize_t i = 0; i < n && rc == 0; i++) {
        PyObject *d = PyObject_CallNoArgs(PySequence_Fast_GET_ITEM(refs, i));
        rc = d == NULL || PyList_Append(flat, d) < 0 ? -1 : 0;
        Py_XDECREF(d);
    }
    Py_XDECREF(id); Py_XDECREF(ref); Py_XDECREF(hooks); Py_XDECREF(extra); Py_XDECREF(refs); Py_XDECREF(count);
    return rc;
}

/* ``node.register_hook(hook)``, its key and dicts into ``flat`` (without the handle object where ``l0_node_hook``
 * can): 0, -1 with an error. */
static int ag_node_hook(PyObject *flat, PyObject *node, PyObject *hook) {
    int done = l0_node_hook(flat, node, hook);
    if (done != 0) return done < 0 ? -1 : 0;
    PyObject *handle = PyObject_CallMethodOneArg(node, ag_s[AS_REGISTER_HOOK], hook);
    int rc = handle == NULL ? -1 : ag_keep_handle(flat, handle);
    Py_XDECREF(handle);
    return rc;
}

/* ``t.register_hook(hook)`` held for the step's end (``StepHooks.tensor_hook``): for a plain tensor the entry
 * ``add_tensor_hook`` makes (the key ``next_hook_id`` takes, at the end of the tensor's ``_backward_hooks``, the
 * dict made and given to its ``grad_fn`` on first use) into ``flat``; anything else by ``_hook_tensor_grad``
 * (a subclass may route ``register_hook`` elsewhere). 0, -1 with an error. */
static int ag_tensor_hook(PyObject **g, PyObject *flat, PyObject *t, PyObject *hook) {
    if (Py_TYPE(t) == (PyTypeObject *)g[G_TENSOR]) return tensor_hook_add(t, hook, g[G_ORDERED_DICT], g[G_HANDLE], flat);
    PyObject *r = PyObject_CallFunctionObjArgs(g[G_HOOK_TENSOR], t, hook, NULL);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* ------------------------------------------------------------------------------------------ NodeEdges
 * The post hook of one node of a call whose every input's edges all start at one node, one edge each
 * (``backward_capture._OwnGrads`` / ``_NodeHook`` when no sum is needed: ``F.linear``'s two nodes):
 *   (grad_inputs, grad_outputs) -> None: report(context, index, grad_inputs[edge]) for each (indices, edge) of
 *   ``pairs`` whose gradient is defined (each index of a tuple of indices), the first error to fail(context, exc). */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *report, *fail, *context, *pairs;
} NodeEdgesObject;

static PyObject *ne_report(NodeEdgesObject *self, PyObject *grads) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(self->pairs); i++) {
        PyObject *pair = PyTuple_GET_ITEM(self->pairs, i), *indices = PyTuple_GET_ITEM(pair, 0);
        PyObject *grad = PySequence_GetItem(grads, PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 1)));
        if (grad == NULL) return NULL;
        int many = PyTuple_Check(indices);
        Py_ssize_t n = grad == Py_None ? 0 : many ? PyTuple_GET_SIZE(indices) : 1;
        for (Py_ssize_t k = 0; k < n; k++) {
            PyObject *a[3] = {self->context, many ? PyTuple_GET_ITEM(indices, k) : indices, grad};
            PyObject *r = PyObject_Vectorcall(self->report, a, 3, NULL);
            if (r == NULL) { Py_DECREF(grad); return NULL; }
            Py_DECREF(r);
        }
        Py_DECREF(grad);
    }
    Py_RETURN_NONE;
}

static PyObject *ne_call(NodeEdgesObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 2 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "NodeEdges takes (grad_inputs, grad_outputs)");
        return NULL;
    }
    PyObject *r = ne_report(self, args[0]);
    if (r != NULL || !PyErr_ExceptionMatches(PyExc_Exception)) return r;
    PyObject *type, *value, *tb;  /* the tool never breaks the user's backward */
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL) PyException_SetTraceback(value, tb);
    PyObject *fa[2] = {self->context, value ? value : Py_None};
    r = PyObject_Vectorcall(self->fail, fa, 2, NULL);
    Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(tb);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

#define NE_OBJECTS(X) X(report) X(fail) X(context) X(pairs)
static int ne_traverse(NodeEdgesObject *self, visitproc visit, void *arg) { NE_OBJECTS(AGR_VISIT) return 0; }
static int ne_clear(NodeEdgesObject *self) { NE_OBJECTS(AGR_CLEAR) return 0; }
static void ne_dealloc(NodeEdgesObject *self) {
    PyObject_GC_UnTrack(self);
    ne_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject NodeEdgesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "msprobe_core.stats._fast_stats.NodeEdges",
    .tp_basicsize = sizeof(NodeEdgesObject),
    .tp_vectorcall_offset = offsetof(NodeEdgesObject, vectorcall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "the post hook of a call's node whose inputs' edges all start there (see _fast_gradapi.c)",
    .tp_call = PyVectorcall_Call,
    .tp_dealloc = (destructor)ne_dealloc,
    .tp_traverse = (traverseproc)ne_traverse,
    .tp_clear = (inquiry)ne_clear,
};

/* A NodeEdges hook for the node's hits ``((key, (edge,)), ...)`` (``slots``: key -> indices), or Py_None when an
 * input's edges do not all start at this node, one each (``counts``: key -> its edges in the call). */
static PyObject *ne_make(PyObject **g, PyObject *context, PyObject *node_hits, PyObject *slots, PyObject *counts) {
    Py_ssize_t n = PyTuple_GET_SIZE(node_hits);
    PyObject *pairs = PyTuple_New(n);
    if (pairs == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key_edges = PyTuple_GET_ITEM(node_hits, i), *key = PyTuple_GET_ITEM(key_edges, 0);
        PyObject *edge_list = PyTuple_GET_ITEM(key_edges, 1);
        PyObject *indices = PyDict_GetItemWithError(slots, key), *count = PyDict_GetItemWithError(counts, key);
        if (indices == NULL || count == NULL || PyTuple_GET_SIZE(edge_list) != 1 || PyLong_AsLong(count) != 1) {
            Py_DECREF(pairs);
            if (PyErr_Occurred()) return NULL;
            Py_RETURN_NONE;
        }
        PyObject *pair = PyTuple_Pack(2, indices, PyTuple_GET_ITEM(edge_list, 0));
        if (pair == NULL) { Py_DECREF(pairs); return NULL; }
        PyTuple_SET_ITEM(pairs, i, pair);
    }
    PyObject *key = PyTuple_Pack(2, context, pairs);  /* the call site's hook of an earlier step, if kept */
    PyObject *kept = key == NULL ? NULL : ag_kept(g, key);
    if (kept != NULL || key == NULL || PyErr_Occurred()) { Py_DECREF(pairs); Py_XDECREF(key); return kept; }
    NodeEdgesObject *self = PyObject_GC_New(NodeEdgesObject, &NodeEdgesType);
    if (self == NULL) { Py_DECREF(pairs); Py_DECREF(key); return NULL; }
    self->report = Py_NewRef(g[G_REPORT_OUT]);
    self->fail = Py_NewRef(g[G_FAIL]);
    self->context = Py_NewRef(context);
    self->pairs = pairs;
    self->vectorcall = (vectorcallfunc)ne_call;
    PyObject_GC_Track(self);
    if (ag_kept_put(g, key, (PyObject *)self) < 0) Py_CLEAR(self);
    Py_DECREF(key);
    return (PyObject *)self;
}

/* Each node of ``hits`` hooked by its NodeEdges, in order: 1 done, 0 a node that needs sums (nothing done:
 * ``capture`` takes the call), -1 an error. */
static int ne_hook_all(PyObject **g, PyObject *flat, PyObject *context, PyObject *hits, PyObject *slots,
                       PyObject *counts) {
    Py_ssize_t n = PyList_GET_SIZE(hits);
    PyObject *made = PyList_New(n);
    if (made == NULL) return -1;
    int rc = 1;
    for (Py_ssize_t i = 0; i < n && rc == 1; i++) {
        PyObject *hook = ne_make(g, context, PyTuple_GET_ITEM(PyList_GET_ITEM(hits, i), 1), slots, counts);
        if (hook == NULL) rc = -1;
        else if (hook == Py_None) { Py_DECREF(hook); rc = 0; }
        else PyList_SET_ITEM(made, i, hook);
    }
    for (Py_ssize_t i = 0; i < n && rc == 1; i++) {
        if (ag_node_hook(flat, PyTuple_GET_ITEM(PyList_GET_ITEM(hits, i), 0), PyList_GET_ITEM(made, i)) < 0) rc = -1;
    }
    Py_DECREF(made);
    return rc;
}

/* ``capture`` in C where no gradient needs a sum: the call's one node sends one edge to one input (its hook from
 * ``OwnGrads``' table, made once per call site), or each input's one edge starts at one of the call's nodes
 * (``NodeEdges``). 1 done, 0 another shape (nothing done: ``capture`` takes it), -1 an error. */
static int ag_own_edges(PyObject **g, PyObject *flat, PyObject *edges, PyObject *outs, PyObject *context) {
    if (g[G_OWN] == Py_None) return 0;
    PyObject *slots = PyObject_GetAttr(edges, ag_s[AS_SLOTS]), *end = NULL, *roots = NULL, *walked = NULL;
    PyObject *skip = NULL, *b = NULL, *leaf = NULL;
    int rc = -1;
    if (slots == NULL) return -1;
    if (!PyDict_CheckExact(slots)) { rc = 0; goto done; }
    long long begin = ag_long(edges, AS_BEGIN, 0);
    if (begin == -1 && PyErr_Occurred()) goto done;
    end = PyObject_CallNoArgs(g[G_SEQUENCE_NR]);
    long long stop = end == NULL ? -1 : PyLong_AsLongLong(end);
    if (PyErr_Occurred() || (roots = PyList_New(0)) == NULL) goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(outs); i++) {
        PyObject *t = PyList_GET_ITEM(outs, i);
        int grad = ag_requires_grad(t);
        if (grad <= 0) { if (grad < 0) goto done; continue; }
        PyObject *fn = PyObject_GetAttr(t, ag_s[AS_GRAD_FN]);
        if (fn == NULL) goto done;
        long long nr = fn == Py_None ? -1 : ag_long(t, AS_OUTPUT_NR, 0);
        PyObject *key = nr == -1 && PyErr_Occurred() ? NULL : fn == Py_None ? edge_key(t, 0) : edge_key(fn, (long)nr + 1);
        int passed = key == NULL ? -1 : PyDict_Contains(slots, key);
        Py_XDECREF(key);
        if (passed != 0) { Py_DECREF(fn); rc = passed < 0 ? -1 : 0; goto done; }  /* an output that is an input */
        if (fn != Py_None) {
            long long seq = ag_long(fn, AS_SEQUENCE_NR, 1);
            if ((seq == -1 && PyErr_Occurred()) || (begin <= seq && seq < stop && PyList_Append(roots, fn) < 0)) {
                Py_DECREF(fn);
                goto done;
            }
        }
        Py_DECREF(fn);
    }
    leaf = PyObject_GetAttr(edges, ag_s[AS_LEAF]);
    skip = leaf == NULL ? NULL : PyDict_New();
    b = skip == NULL ? NULL : PyLong_FromLongLong(begin);
    if (b == NULL) goto done;
    PyObject *wargs[7] = {roots, slots, skip, b, end, leaf, g[G_ACCUMULATE]};
    walked = walk(NULL, wargs, 7);
    if (walked == NULL) goto done;
    PyObject *hits = PyTuple_GET_ITEM(walked, 0);
    rc = 0;
    if (PyList_GET_SIZE(hits) == 0) { rc = 1; goto done; }  /* nothing of the call sends to its inputs */
    PyObject *hit = PyList_GET_ITEM(hits, 0), *node_hits = PyTuple_GET_ITEM(hit, 1);
    if (PyList_GET_SIZE(hits) != 1 || PyTuple_GET_SIZE(node_hits) != 1) {  /* several inputs or nodes */
        rc = ne_hook_all(g, flat, context, hits, slots, PyTuple_GET_ITEM(walked, 1));
        goto done;
    }
    PyObject *key_edges = PyTuple_GET_ITEM(node_hits, 0), *edge_list = PyTuple_GET_ITEM(key_edges, 1);
    PyObject *slot = PyDict_GetItemWithError(slots, PyTuple_GET_ITEM(key_edges, 0));
    if (slot == NULL) { rc = PyErr_Occurred() ? -1 : 0; goto done; }
    if (PyTuple_GET_SIZE(edge_list) != 1 || !PyLong_CheckExact(slot)) goto done;
    Py_ssize_t edge = PyLong_AsSsize_t(PyTuple_GET_ITEM(edge_list, 0));
    if (edge == -1 && PyErr_Occurred()) { rc = -1; goto done; }
    PyObject *hook = og_single_edge((OwnGradsObject *)g[G_OWN], context, slot, edge, -1);
    rc = hook == NULL || ag_node_hook(flat, PyTuple_GET_ITEM(hit, 0), hook) < 0 ? -1 : 1;
    Py_XDECREF(hook);
done:
    Py_XDECREF(slots); Py_XDECREF(end); Py_XDECREF(roots); Py_XDECREF(walked); Py_XDECREF(skip); Py_XDECREF(b);
    Py_XDECREF(leaf);
    return rc;
}

/* ``_hook_outputs`` + ``_hook_own_grads`` of the call (``end_record``'s end with autograd on): 0, -1 an error. */
static int ag_hooks(PyObject **g, PyObject *records, PyObject *backward, PyObject *parent, PyObject *out,
                    PyObject *edges) {
    PyObject *outs = NULL, *context = NULL, *bparent = NULL, *count = NULL, *false_ = Py_False;
    PyObject *flat = PyList_New(0);  /* the call's hooks, for their removal when the step ends */
    int rc = -1;
    if (flat == NULL) return -1;
    if (Py_TYPE(out) == (PyTypeObject *)g[G_TENSOR]) {  /* ``tensors_in`` of a plain tensor */
        outs = PyList_New(1);
        if (outs == NULL) goto done;
        PyList_SET_ITEM(outs, 0, Py_NewRef(out));
    } else {
        outs = PyObject_CallOneArg(g[G_TENSORS_IN], out);
        if (outs == NULL) goto done;
        if (!PyList_CheckExact(outs)) { PyErr_SetString(PyExc_TypeError, "tensors_in gave no list"); goto done; }
    }
    int set = parent == Py_None ? 0 : PyObject_IsTrue(parent);  /* ``Call.backward_parent`` */
    bparent = set < 0 ? NULL : !set ? Py_NewRef(Py_None) : PyUnicode_Replace(parent, ag_s[AS_FORWARD_SUFFIX], ag_s[AS_BACKWARD_SUFFIX], -1);
    context = bparent == NULL ? NULL : PyTuple_Pack(3, backward, false_, bparent);
    count = context == NULL ? NULL : PyLong_FromSsize_t(PyList_GET_SIZE(outs));
    if (count == NULL || ag_sizes(records, backward, count, NULL) < 0) goto done;
    if (g[G_KEEP_IN] == Py_True) {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(outs); i++) {
            PyObject *t = PyList_GET_ITEM(outs, i);
            int grad = ag_requires_grad(t);
            if (grad <= 0) { if (grad < 0) goto done; continue; }
            PyObject *index = PyLong_FromSsize_t(i);
            PyObject *key = index == NULL ? NULL : PyTuple_Pack(2, context, index);
            PyObject *hook = key == NULL ? NULL : ag_kept(g, key);
            if (hook == NULL && key != NULL && !PyErr_Occurred()) {  /* the call site's first step */
                hook = PyObject_CallFunctionObjArgs(g[G_PARTIAL], g[G_REPORT_IN], context, index, NULL);
                if (hook != NULL && ag_kept_put(g, key, hook) < 0) Py_CLEAR(hook);
            }
            int added = hook == NULL ? -1 : ag_tensor_hook(g, flat, t, hook);
            Py_XDECREF(index); Py_XDECREF(key); Py_XDECREF(hook);
            if (added < 0) goto done;
        }
    }
    if (edges != Py_None) {
        int done = ag_own_edges(g, flat, edges, outs, context);
        if (done < 0) goto done;
        if (!done) {  /* another shape of graph: ``capture`` */
            PyObject *a[10] = {edges, outs, g[G_REPORT_OUT], g[G_FAIL], context, g[G_KEEP], Py_None, Py_None,
                               g[G_HOOKS], Py_None};
            PyObject *r = PyObject_Vectorcall(g[G_CAPTURE], a, 10, NULL);
            if (r == NULL) goto done;
            Py_DECREF(r);
        }
    }
    rc = 0;
done:
    if (PyList_GET_SIZE(flat)) {  /* every hook that went in is removed at the step's end, an error or not */
        PyObject *et, *ev, *etb;
        PyErr_Fetch(&et, &ev, &etb);
        PyObject *r = PyObject_CallOneArg(g[G_KEEP_KEYS], flat);
        if (r == NULL) {
            rc = -1;
            if (et != NULL) PyErr_Clear();
        }
        Py_XDECREF(r);
        if (et != NULL) PyErr_Restore(et, ev, etb);
    }
    Py_DECREF(flat); Py_XDECREF(outs); Py_XDECREF(context); Py_XDECREF(bparent); Py_XDECREF(count);
    return rc;
}

/* ``summarize._collect`` in C: the instances of ``type`` in the exact list or tuple ``seq`` and in the exact lists,
 * tuples and dicts nested in it (a dict by its values), in order, appended to ``found``. 1 done, 0 a container of
 * another type met (a subclass may iterate its own way: the Python ``tensors_in`` then takes the whole call), -1
 * with an error. */
static int ag_collect(PyObject *seq, PyObject *found, PyObject *type) {
    if (Py_EnterRecursiveCall(" in tensors_in")) return -1;
    PyObject *fast = PySequence_Fast(seq, "");  /* (an exact list or tuple: a new reference to itself) */
    int rc = fast == NULL ? -1 : 1;
    for (Py_ssize_t i = 0; rc == 1 && i < PySequence_Fast_GET_SIZE(fast); i++) {
        PyObject *v = PySequence_Fast_GET_ITEM(fast, i);
        if (PyObject_TypeCheck(v, (PyTypeObject *)type)) {
            rc = PyList_Append(found, v) < 0 ? -1 : 1;
        } else if (PyList_CheckExact(v) || PyTuple_CheckExact(v)) {
            rc = ag_collect(v, found, type);
        } else if (PyDict_CheckExact(v)) {
            PyObject *values = PyDict_Values(v);
            rc = values == NULL ? -1 : ag_collect(values, found, type);
            Py_XDECREF(values);
        } else if (v != Py_None && !PyLong_CheckExact(v) && !PyFloat_CheckExact(v) && !PyBool_Check(v)
                   && !PyUnicode_CheckExact(v)) {  /* anything else as ``isinstance`` sees it */
            int is = PyObject_IsInstance(v, type);
            if (is == 0) {
                int container = PyList_Check(v) || PyTuple_Check(v) || PyDict_Check(v);
                is = container ? 2 : PyObject_IsInstance(v, (PyObject *)&PyList_Type);
                if (is == 0) is = PyObject_IsInstance(v, (PyObject *)&PyTuple_Type);
                if (is == 0) is = PyObject_IsInstance(v, (PyObject *)&PyDict_Type);
                rc = is < 0 ? -1 : is ? 0 : 1;
            } else {
                rc = is < 0 || PyList_Append(found, v) < 0 ? -1 : 1;
            }
        }
    }
    Py_XDECREF(fast);
    Py_LeaveRecursiveCall();
    return rc;
}

/* The call's tensor inputs in record order (``tensors_in((args, kwargs))``): in C where G_COLLECT allows it and
 * every container is a plain list, tuple or dict, else by G_TENSORS_IN. A new list, or NULL with an error. */
static PyObject *ag_tensors_in(PyObject **g, PyObject *args, PyObject *kwargs) {
    if (g[G_COLLECT] == Py_True && PyTuple_CheckExact(args) && PyDict_CheckExact(kwargs)) {
        PyObject *found = PyList_New(0), *values = found == NULL ? NULL : PyDict_Values(kwargs);
        int rc = values == NULL ? -1 : ag_collect(args, found, g[G_TENSOR]);
        if (rc == 1) rc = ag_collect(values, found, g[G_TENSOR]);
        Py_XDECREF(values);
        if (rc == 1) return found;
        Py_XDECREF(found);
        if (rc < 0) return NULL;
    }
    PyObject *both = PyTuple_Pack(2, args, kwargs);
    PyObject *tensors = both == NULL ? NULL : PyObject_CallOneArg(g[G_TENSORS_IN], both);
    Py_XDECREF(both);
    return tensors;
}

/* ``InputEdges.of(tensors)`` (``backward_capture``; ``tensors`` a list or tuple, ``cls`` the ``InputEdges`` class,
 * ``sequence_nr`` autograd's ``_get_sequence_nr``): a new reference (Py_None: no input requires grad), or NULL with
 * an error. */
static PyObject *ag_edges_of(PyObject *cls, PyObject *sequence_nr, PyObject *tensors) {
    PyObject *fast = PySequence_Fast(tensors, "InputEdges.of takes a sequence");
    PyObject *slots = fast == NULL ? NULL : PyDict_New(), *alive = slots == NULL ? NULL : PyList_New(0);
    PyObject *result = NULL;
    int leaf = 0;
    if (alive == NULL) goto done;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(fast, i);
        int grad = ag_requires_grad(t);
        if (grad <= 0) { if (grad < 0) goto done; continue; }
        PyObject *fn = PyObject_GetAttr(t, ag_s[AS_GRAD_FN]), *key = NULL, *obj = fn;  /* ``_key`` */
        if (fn == NULL) goto done;
        if (fn == Py_None) {
            key = edge_key(t, 0);
            obj = t;
        } else {
            long long nr = ag_long(t, AS_OUTPUT_NR, 0);
            key = nr == -1 && PyErr_Occurred() ? NULL : edge_key(fn, (long)nr + 1);
        }
        PyObject *index = key == NULL ? NULL : PyLong_FromSsize_t(i);
        PyObject *had = index == NULL ? NULL : PyDict_GetItemWithError(slots, key);
        int rc = index == NULL || (had == NULL && PyErr_Occurred()) ? -1 : 0;
        if (rc == 0 && had == NULL) {
            rc = PyDict_SetItem(slots, key, index) < 0 || PyList_Append(alive, obj) < 0 ? -1 : 0;
            leaf = leaf || obj == t;
        } else if (rc == 0) {  /* the same tensor again: the tuple of its indices */
            PyObject *prev = PyTuple_Check(had) ? Py_NewRef(had) : PyTuple_Pack(1, had);
            PyObject *one = prev == NULL ? NULL : PyTuple_Pack(1, index);
            PyObject *indices = one == NULL ? NULL : PySequence_Concat(prev, one);
            rc = indices == NULL || PyDict_SetItem(slots, key, indices) < 0 ? -1 : 0;
            Py_XDECREF(prev); Py_XDECREF(one); Py_XDECREF(indices);
        }
        Py_DECREF(fn); Py_XDECREF(key); Py_XDECREF(index);
        if (rc < 0) goto done;
    }
    if (!PyDict_GET_SIZE(slots)) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    PyObject *begin = PyObject_CallNoArgs(sequence_nr);
    if (begin == NULL) goto done;
    PyObject *a[4] = {begin, slots, alive, leaf ? Py_True : Py_False};
    result = PyObject_Vectorcall(cls, a, 4, NULL);
    Py_DECREF(begin);
done:
    Py_XDECREF(fast); Py_XDECREF(slots); Py_XDECREF(alive);
    return result;
}

/* The inputs' tensors counted for the backward record's sizes and their gradient edges (``_begin_record`` with
 * ``call.grad``): *edges (a reference the caller holds) replaced by them (Py_None: none kept). 0, -1 with an
 * error. */
static int ag_begin(PyObject **g, PyObject *records, PyObject *backward, PyObject *args, PyObject *kwargs,
                    PyObject **edges) {
    PyObject *tensors = ag_tensors_in(g, args, kwargs);
    if (tensors == NULL) return -1;
    Py_ssize_t n = PyObject_Length(tensors);
    PyObject *count = n < 0 ? NULL : PyLong_FromSsize_t(n);
    int rc = count == NULL ? -1 : ag_sizes(records, backward, NULL, count);
    Py_XDECREF(count);
    if (rc == 0) {
        PyObject *e = g[G_KEEP_OUT] == Py_True ? ag_edges_of(g[G_EDGES], g[G_SEQUENCE_NR], tensors)
                      : Py_NewRef(Py_None);
        if (e == NULL) rc = -1;
        else Py_SETREF(*edges, e);
    }
    Py_DECREF(tensors);
    return rc;
}

/* Is ``grad`` the tuple ac_record reads (G_*)? */
static int ag_valid(PyObject *grad) {
    return PyTuple_Check(grad) && PyTuple_GET_SIZE(grad) == G_N && PyType_Check(PyTuple_GET_ITEM(grad, G_TENSOR))
           && PyDict_Check(PyTuple_GET_ITEM(grad, G_HOOKS))
           && (PyTuple_GET_ITEM(grad, G_OWN) == Py_None || Py_TYPE(PyTuple_GET_ITEM(grad, G_OWN)) == &OwnGradsType);
}

/* The fast route of a call that passed the gates (``api_call`` after its gates): ``autograd``, a call autograd
 * records (``ApiCall``'s third way: the backward record's sizes, edges and hooks as well). */
static PyObject *ac_record(ApiCallObject *self, PyObject **env, PyObject *args, PyObject *kwargs, int autograd) {
    PyObject *svc = env[ENV_SVC], *tls = env[ENV_TLS], **g = autograd ? &PyTuple_GET_ITEM(env[ENV_GRAD], 0) : NULL;
    if (tool_depth_add(tls, 1) < 0) return NULL;  /* the tool's own work, as in ``on_api_call`` */
    text_t b;  /* the record's text: the inputs' (its head, ``inputs``), then the output's (``record``) */
    text_init(&b);
    int rc = ac_text(env, &b, args, kwargs, NULL);
    if (rc < 0) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) { text_free(&b); tool_depth_add(tls, -1); return NULL; }
        PyErr_Clear();  /* the usual route says what went wrong */
    }
    if (rc != 0) {  /* an argument the C text does not read: the usual record */
        text_free(&b);
        if (tool_depth_add(tls, -1) < 0) return NULL;
        return PyObject_CallFunctionObjArgs(env[ENV_ON_API_CALL], self->original, PyTuple_GET_ITEM(self->key, 1),
                                            PyTuple_GET_ITEM(self->key, 2), args, kwargs, NULL);
    }
    Py_ssize_t head_len = b.len;
    int recording = 1;  /* 0: the tool failed before the call, which is made alone */
    PyObject *key = PyTuple_GET_ITEM(self->key, 0);
    PyObject *n = NULL, *rec = NULL, *stack = NULL, *parent = NULL, *out = NULL, *backward = NULL;
    PyObject *edges = Py_NewRef(Py_None);
    int grad = autograd && g[G_BACKWARD] == Py_True;
    PyObject *name = ac_name(self, env, &n);
    if (name == NULL) goto fail;
    if (ac_where(self, env, &rec, &stack, &parent) < 0
        || (autograd && (backward = ac_name_at(self, n, 1)) == NULL)
        || (grad && (ac_tf(env[ENV_TF_OFF], 0, 0) < 0
                     || ac_tf(env[ENV_TF_ON], 1, ag_begin(g, env[ENV_RECORDS], backward, args, kwargs, &edges)) < 0))) {
        if (ac_report(svc, name) < 0) goto fail;  /* the tool must never break the user's call */
        recording = 0;
    }
    out = ac_original(env, self->original, args, kwargs);
    if (out == NULL) {  /* what the usual route leaves of a call that raised: its place and stack */
        if (recording) {
            PyObject *et, *ev, *etb;
            PyErr_Fetch(&et, &ev, &etb);
            PyObject *r = PyObject_CallMethodObjArgs(rec, S_reserve, name, stack, NULL);
            int failed = r != NULL ? 0 : ac_report(svc, name);
            Py_XDECREF(r);
            if (failed < 0) { Py_XDECREF(et); Py_XDECREF(ev); Py_XDECREF(etb); }
            else PyErr_Restore(et, ev, etb);
        }
        goto fail;
    }
    if (recording) {
        rc = ac_text(env, &b, NULL, NULL, out);
        PyObject *r = NULL;
        if (rc == NO_TEXT) {  /* an output the C text does not read: the usual end makes it a dict */
            PyObject *head = text_str(&b, head_len);
            if (head != NULL)
                r = PyObject_CallFunctionObjArgs(env[ENV_END_DICT], key, name, n, head, rec, stack, parent, out,
                                                 edges, grad ? Py_True : Py_False, NULL);
            Py_XDECREF(head);
        } else if (rc == 0) {  /* nothing was recorded during the call: its place is taken now */
            PyObject *text = text_str(&b, b.len);
            r = text == NULL ? NULL : ac_put_text(rec, name, text, stack, parent);
            Py_XDECREF(text);
            if (r != NULL && grad) {
                Py_DECREF(r);
                PyObject *p = parent == env[ENV_NO_PARENT] ? Py_None : parent;
                r = ac_tf(env[ENV_TF_OFF], 0, 0) < 0
                    || ac_tf(env[ENV_TF_ON], 1, ag_hooks(g, env[ENV_RECORDS], backward, p, out, edges)) < 0
                    ? NULL : Py_NewRef(Py_None);
            }
        }
        if (r == NULL && ac_report(svc, name) < 0) { Py_CLEAR(out); goto fail; }
        Py_XDECREF(r);
    }
fail:
    text_free(&b);
    Py_XDECREF(n); Py_XDECREF(name); Py_XDECREF(backward); Py_XDECREF(edges);
    Py_XDECREF(rec); Py_XDECREF(stack); Py_XDECREF(parent);
    if (tool_depth_add(tls, -1) < 0) Py_CLEAR(out);
    return out;
}

/* ------------------------------------------------------------------------------------------- ApiGrad */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *records, *service, *text, *field, *fields, *no_parent, *grad_enabled, *tls, *tf_off, *tf_on;
    int construct;
} ApiGradObject;

/* records.on_grad(backward, field, index, save, parent, grad): the Python route of one gradient. */
static PyObject *agr_python(ApiGradObject *self, PyObject *context, PyObject *index, PyObject *grad) {
    PyObject *a[7] = {self->records, PyTuple_GET_ITEM(context, 0), self->field, index, PyTuple_GET_ITEM(context, 1),
                      PyTuple_GET_ITEM(context, 2), grad};
    return PyObject_VectorcallMethod(ag_s[AS_ON_GRAD], a, 7 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* The text of ``grad`` set as slot ``index`` of the record (``_put_grad_text`` from its ``put_text_field``), the
 * record synced when complete: 0, -1 with an error. */
static int agr_put(ApiGradObject *self, PyObject *rec, PyObject *context, PyObject *index, PyObject *text) {
    PyObject *backward = PyTuple_GET_ITEM(context, 0);
    PyObject *state = PyObject_GetAttr(self->records, S_step_state);
    PyObject *sizes = state == NULL ? NULL : PyObject_GetAttr(state, ag_s[AS_BWD_SIZES]);
    PyObject *size = sizes == NULL ? NULL : PyObject_CallMethodOneArg(sizes, ag_s[AS_GET], backward);
    PyObject *r = NULL;
    if (size != NULL) {
        PyObject *a[8] = {rec, backward, self->field, index, text, self->fields, size,
                          self->construct ? PyTuple_GET_ITEM(context, 2) : self->no_parent};
        r = PyObject_VectorcallMethod(ag_s[AS_PUT_TEXT_FIELD], a, 8 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        int complete = r == NULL ? 0 : PyObject_IsTrue(r);
        if (complete) {
            Py_DECREF(r);
            r = complete < 0 ? NULL : PyObject_CallMethodNoArgs(self->service, ag_s[AS_SYNC]);
        }
    }
    Py_XDECREF(state); Py_XDECREF(sizes); Py_XDECREF(size);
    int rc = r == NULL ? -1 : 0;
    Py_XDECREF(r);
    return rc;
}

static PyObject *agr_call(ApiGradObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 3 || kwnames != NULL || !PyTuple_CheckExact(args[0])
        || PyTuple_GET_SIZE(args[0]) != 3) {
        PyErr_SetString(PyExc_TypeError, "ApiGrad takes (context, index, grad)");
        return NULL;
    }
    PyObject *context = args[0], *index = args[1], *grad = args[2];
    PyObject *backward = PyTuple_GET_ITEM(context, 0);
    if (PyTuple_GET_ITEM(context, 1) != Py_False) return agr_python(self, context, index, grad);
    PyObject *v = PyObject_GetAttr(self->service, S_dumping_thread);
    if (v == NULL) return NULL;
    unsigned long thread = PyLong_AsUnsignedLong(v);
    Py_DECREF(v);
    if (thread == (unsigned long)-1 && PyErr_Occurred()) return NULL;
    int quiet = thread == PyThread_get_thread_ident();
    if (quiet) {  /* autograd recording the backward (create_graph): the Python route's ``_quiet`` */
        v = PyObject_CallNoArgs(self->grad_enabled);
        quiet = v == NULL ? -1 : !PyObject_IsTrue(v);
        Py_XDECREF(v);
        if (quiet < 0) return NULL;
    }
    if (!quiet) return agr_python(self, context, index, grad);
    PyObject *rec = PyObject_GetAttr(self->service, S_recorder);
    if (rec == NULL) return NULL;
    if (rec == Py_None || grad == Py_None) { Py_DECREF(rec); Py_RETURN_NONE; }
    PyObject *result = NULL;
    if (tool_depth_add(self->tls, 1) < 0) goto done;  /* the tool's own work, as ``_put_grad_text`` */
    if (ac_tf(self->tf_off, 0, 0) < 0) { tool_depth_add(self->tls, -1); goto done; }
    PyObject *text = rt_tensor((RecordTextObject *)self->text, grad);
    int rc = text == NULL || text == Py_None ? 0 : agr_put(self, rec, context, index, text);
    int failed = text == NULL || rc < 0;
    if (failed && ac_report(self->service, backward) == 0) failed = 0;  /* the tool never breaks the backward */
    if (ac_tf(self->tf_on, 1, 0) < 0) failed = 1;  /* (a ``finally``: an error already raised is kept) */
    if (tool_depth_add(self->tls, -1) < 0) failed = 1;
    if (!failed)  /* a summary not known at once: the Python route for the whole gradient */
        result = text == Py_None ? agr_python(self, context, index, grad) : Py_NewRef(Py_None);
    Py_XDECREF(text);
done:
    Py_DECREF(rec);
    return result;
}

#define AGR_OBJECTS(X) X(records) X(service) X(text) X(field) X(fields) X(no_parent) X(grad_enabled) X(tls) X(tf_off) \
                       X(tf_on)

static PyObject *agr_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"records", "service", "text", "field", "fields", "construct", "no_parent", "grad_enabled",
                         "tls", "tf_off", "tf_on", NULL};
    PyObject *o[11];
    int construct;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO!UOpOOOOO:ApiGrad", kw, &o[0], &o[1], &RecordTextType, &o[2],
                                     &o[3], &o[4], &construct, &o[5], &o[6], &o[7], &o[8], &o[9]))
        return NULL;
    ApiGradObject *self = (ApiGradObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    PyObject **slots[] = {&self->records, &self->service, &self->text, &self->field, &self->fields,
                          &self->no_parent, &self->grad_enabled, &self->tls, &self->tf_off, &self->tf_on};
    for (int i = 0; i < 10; i++) *slots[i] = Py_NewRef(o[i]);
    self->construct = construct;
    self->vectorcall = (vectorcallfunc)agr_call;
    return (PyObject *)self;
}

static int agr_traverse(ApiGradObject *self, visitproc visit, void *arg) { AGR_OBJECTS(AGR_VISIT) return 0; }
static int agr_clear(ApiGradObject *self) { AGR_OBJECTS(AGR_CLEAR) return 0; }
static void agr_dealloc(ApiGradObject *self) {
    PyObject_GC_UnTrack(self);
    agr_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject ApiGradType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "msprobe_core.stats._fast_stats.ApiGrad",
    .tp_basicsize = sizeof(ApiGradObject),
    .tp_vectorcall_offset = offsetof(ApiGradObject, vectorcall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "CallRecords.on_grad of an L1 API's backward record in C (see _fast_gradapi.c)",
    .tp_new = agr_new,
    .tp_call = PyVectorcall_Call,
    .tp_dealloc = (destructor)agr_dealloc,
    .tp_traverse = (traverseproc)agr_traverse,
    .tp_clear = (inquiry)agr_clear,
};

/* Adds ApiGrad to the module (and interns the names the route reads). */
static int add_grad_api(PyObject *m) {
    for (int i = 0; i < AS_N; i++)
        if (ag_s[i] == NULL && (ag_s[i] = PyUnicode_InternFromString(AG_NAMES[i])) == NULL) return -1;
    if (ag_no_sizes == NULL && (ag_no_sizes = Py_BuildValue("(ii)", 0, 0)) == NULL) return -1;
    if (PyType_Ready(&ApiGradType) < 0 || PyType_Ready(&NodeEdgesType) < 0) return -1;
    Py_INCREF(&ApiGradType);
    if (PyModule_AddObject(m, "ApiGrad", (PyObject *)&ApiGradType) < 0) { Py_DECREF(&ApiGradType); return -1; }
    return 0;
}
/* ========================================================================= end of API call with autograd on */
