/* ========================================================================================= the tool's depth
 * ``tls.depth`` (``common/tool_guard.TOOL``, a ``threading.local``: above 0 while the tool's own work runs on the
 * thread), read and changed by the compiled hooks (_fast_api.c, _fast_gradapi.c) in the calling thread's dict of
 * it directly. Through the thread-local's attribute hooks each access costs a thread-dict lookup, a module lookup
 * and a generic attribute lookup (about 600 instructions; two to six per recorded call). Done for a tls whose
 * class keeps ``threading.local``'s attribute access and ``depth`` as a plain class attribute (no descriptor),
 * read there as generic attribute access reads it: the thread's dict, else the class's value; any other tls is
 * read and set by getattr and setattr. The dict is kept with the thread-state dict it was found for (both held:
 * another thread has another one). #included by _fast_stats.c before its users. */

static PyObject *td_local_type;               /* ``_thread._local``; NULL: every tls read the usual way */
static PyObject *td_tls, *td_tsdict, *td_dict; /* the tls last asked, the thread-state dict it was asked on, its dict */
static PyObject *td_depth_name, *td_dict_name; /* "depth", "__dict__" */

/* The calling thread's dict of tls (borrowed), or NULL without an error for a tls read the usual way. */
static PyObject *td_dict_of(PyObject *tls) {
    PyObject *tsd = PyThreadState_GetDict();  /* borrowed */
    if (tsd == NULL || td_local_type == NULL) return NULL;
    if (tls == td_tls && tsd == td_tsdict) return td_dict;
    PyTypeObject *type = Py_TYPE(tls), *local = (PyTypeObject *)td_local_type;
    if (!PyType_IsSubtype(type, local) || type->tp_getattro != local->tp_getattro
        || type->tp_setattro != local->tp_setattro)
        return NULL;
    PyObject *cls_depth = _PyType_Lookup(type, td_depth_name);  /* borrowed */
    if (cls_depth == NULL || Py_TYPE(cls_depth)->tp_descr_get != NULL || Py_TYPE(cls_depth)->tp_descr_set != NULL)
        return NULL;
    PyObject *dict = PyObject_GetAttr(tls, td_dict_name);
    if (dict == NULL || !PyDict_CheckExact(dict)) {
        Py_XDECREF(dict);
        PyErr_Clear();
        return NULL;
    }
    Py_XSETREF(td_tls, Py_NewRef(tls));
    Py_XSETREF(td_tsdict, Py_NewRef(tsd));
    Py_XSETREF(td_dict, dict);
    return dict;
}

/* ``tls.depth``: a new reference, or NULL with an error. */
static PyObject *tool_depth_get(PyObject *tls) {
    PyObject *dict = td_dict_of(tls);
    PyObject *d = dict == NULL ? NULL : PyDict_GetItemWithError(dict, td_depth_name);
    if (d == NULL && dict != NULL && !PyErr_Occurred())
        d = _PyType_Lookup(Py_TYPE(tls), td_depth_name);  /* the class's */
    if (d == NULL && !PyErr_Occurred()) return PyObject_GetAttr(tls, td_depth_name);
    return Py_XNewRef(d);
}

/* tls.depth += delta (the tool's own work begins: 1, or ends: -1): 0, or -1 with an error. An exception already
 * raised is kept (a ``finally``: that one wins, and -1 is returned). */
static int tool_depth_add(PyObject *tls, long delta) {
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    int rc = -1;
    PyObject *d = tool_depth_get(tls);
    long v = d == NULL ? -1 : PyLong_AsLong(d);
    Py_XDECREF(d);
    PyObject *n = d == NULL || (v == -1 && PyErr_Occurred()) ? NULL : PyLong_FromLong(v + delta);
    if (n != NULL) {
        PyObject *dict = td_dict_of(tls);
        rc = dict != NULL ? PyDict_SetItem(dict, td_depth_name, n) : PyObject_SetAttr(tls, td_depth_name, n);
        Py_DECREF(n);
    }
    if (et == NULL) return rc;
    if (rc < 0) PyErr_Clear();
    PyErr_Restore(et, ev, etb);
    return -1;
}

/* The names and the thread-local type it reads: 0, or -1 with an error. */
static int add_tool_depth(void) {
    if (td_depth_name == NULL && (td_depth_name = PyUnicode_InternFromString("depth")) == NULL) return -1;
    if (td_dict_name == NULL && (td_dict_name = PyUnicode_InternFromString("__dict__")) == NULL) return -1;
    if (td_local_type == NULL) {  /* (without it every tls is read the usual way) */
        PyObject *thread = PyImport_ImportModule("_thread");
        td_local_type = thread == NULL ? NULL : PyObject_GetAttrString(thread, "_local");
        Py_XDECREF(thread);
        if (td_local_type != NULL && !PyType_Check(td_local_type)) Py_CLEAR(td_local_type);
        PyErr_Clear();
    }
    return 0;
}
/* ================================================================================== end of the tool's depth */
