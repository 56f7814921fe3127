// msprobe_core.stats._torch_facts: the optional C++ part of the statistics kernel. It answers the questions the
// kernel's readers ask of every tensor they read from the C++ tensor: the monitor's TensorRows (_fast_stats.c:
// is_cpu, layout, dtype, is_contiguous, is_neg, _is_zerotensor, data_ptr, numel) and the dump's RecordText and
// GradText (_version, data_ptr, shape, requires_grad, is_contiguous, is_neg, _is_zerotensor of every tensor of
// every record), for about 1/10 to 1/30 of what the same questions cost through torch's Python API from C (each
// a Python call with torch's error and torch-function handling; 4,800 tensors a step with the monitor on a
// 400-layer model, about three a call at the dump's level L1). It also puts the dump's hook on an autograd node
// as ``node.register_hook`` does, without the handle object (node_hook: about a third of the cost, once per
// hooked call and step at L0 and L1). Exported as the FACTS capsule (_torch_facts.h); _fast_facts.c imports it
// and, without it, the readers ask torch's Python API as before.
//
// Built by setup.py only where torch imports at build time (torch.utils.cpp_extension, optional=True), linked
// against that torch: import torch first. The headers are the narrowest that hold THPVariable (the C++ tensor
// of a Python tensor), torch.dtype's objects, the version macros, THPCppFunction (a C++ node's Python object)
// and THPFunctionClass (torch/extension.h compiles ~1.6x slower).
#include <Python.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/version.h>

#include <cstdint>
#include <cstring>

#include "_torch_facts.h"

// TorchFactsApi.plain. The questions go to the C++ tensor directly, not through torch-function handling: these
// are read-only facts of exact Tensor/Parameter objects (no __torch_function__ of their own), which the tool
// wants as they are even under a user's torch-function mode. Anything torch throws means "ask the Python API".
static int tf_plain(PyObject *o, void **p, Py_ssize_t *n, int *scalar_type) noexcept {
    try {
        if (!THPVariable_CheckExact(o)) return 0;
        const at::Tensor &t = THPVariable_Unpack(o);
        if (!t.defined() || t.is_nested() || !t.has_storage() || !t.is_cpu() || t.layout() != at::kStrided ||
            !t.is_contiguous() || t.is_neg() || t._is_zerotensor())
            return 0;
        void *data = t.data_ptr();
        int64_t numel = t.numel();
        if (data == nullptr || numel <= 0) return 0;
        *p = data;
        *n = static_cast<Py_ssize_t>(numel);
        *scalar_type = static_cast<int>(t.scalar_type());
        return 1;
    } catch (...) {
        return 0;
    }
}

// TorchFactsApi.dtype.
static PyObject *tf_dtype(int scalar_type) noexcept {
    if (scalar_type < 0 || scalar_type >= static_cast<int>(at::ScalarType::NumOptions)) return nullptr;
    try {
        return reinterpret_cast<PyObject *>(torch::getTHPDtype(static_cast<at::ScalarType>(scalar_type)));
    } catch (...) {
        return nullptr;
    }
}

// TorchFactsApi.facts: each fact from the C++ call its Python getter or method makes (_version(), data_ptr(),
// sizes() and numel(), requires_grad(), is_contiguous(), is_neg(), _is_zerotensor()), under the same conditions
// as tf_plain; a tensor with symbolic sizes (a tracer's) is left to the Python API.
static int tf_facts(PyObject *o, int want, TorchTensorFacts *f) noexcept {
    try {
        if (!THPVariable_CheckExact(o)) return 0;
        const at::Tensor &t = THPVariable_Unpack(o);
        if (!t.defined()) return 0;
        if (want & TORCH_FACT_VERSION) f->version = t._version();
        if (want & TORCH_FACT_DATA_PTR) f->data_ptr = reinterpret_cast<uintptr_t>(t.data_ptr());
        if ((want & (TORCH_FACT_SIZES | TORCH_FACT_FLAGS)) && t.unsafeGetTensorImpl()->has_symbolic_sizes_strides())
            return 0;
        if (want & TORCH_FACT_SIZES) {
            at::IntArrayRef sizes = t.sizes();
            if (sizes.size() > TORCH_FACTS_MAX_DIMS) return 0;
            f->dims = static_cast<int>(sizes.size());
            for (size_t i = 0; i < sizes.size(); i++) f->sizes[i] = sizes[i];
            f->numel = t.numel();
        }
        if (want & TORCH_FACT_FLAGS) {
            f->requires_grad = t.requires_grad();
            f->is_contiguous = t.is_contiguous();
            f->is_neg = t.is_neg();
            f->is_zerotensor = t._is_zerotensor();
        }
        return 1;
    } catch (...) {
        return 0;
    }
}

// ------------------------------------------------------------------------------------ TorchFactsApi.node_hook
// ``node.register_hook(hook)`` of a C++ node is torch's registerFunctionHook: it finds the node's hook dict (the
// one its PyFunctionPostHook holds), or gives the node a PyFunctionPostHook holding a new one, and has the Python
// ``torch.autograd.Function._register_hook(dict, hook)`` make a RemovableHandle (weak references to the dict)
// and put the hook in under its id: ~12.7k instructions, once per hooked call and step at the dump's L0 and L1.
// libtorch_python exports no PyFunctionPostHook (its constructor and type are hidden), so only
// registerFunctionHook can give a node one. It looks ``_register_hook`` up on the exported THPFunctionClass
// (torch.autograd.Function; read by registerFunctionHook and registerFunctionPreHook alone, torch 2.6 to 2.13),
// so tf_node_hook has it call tf_registrar there for the hook it puts in: the entry made here, under the key
// taken here, and no handle. The swap holds only within registerFunctionHook, with the GIL; registrations it
// does not make (another thread's, switched to by a finalizer run meanwhile, or a prehook's) go to torch's own.

// What tf_node_hook asks tf_registrar to put in (one per call under way in a thread: a finalizer run within
// registerFunctionHook can nest a second); dict: set by tf_registrar, a new reference.
struct TfPending {
    PyObject *hook, *key, *dict;
};
static thread_local TfPending *tf_pending = nullptr;

static PyObject *tf_registrar = nullptr;   // THPFunctionClass's stand-in, also the hook tf_node_hook registers
static PyObject *tf_register_fn = nullptr; // its ``_register_hook``: tf_register_hook
static PyObject *tf_handles = nullptr;     // torch.utils.hooks.RemovableHandle (its next_id)
static PyObject *tf_next_id = nullptr;     // "next_id"
static PyObject *tf_torch_class = nullptr; // THPFunctionClass as torch set it (tf_registrar passes on to it)
static int tf_swaps = 0;                   // tf_node_hook calls within registerFunctionHook (all threads)

// ``_register_hook(dict, hook)`` called by registerFunctionHook while tf_registrar stands in: for tf_node_hook's
// registration (the hook is tf_registrar itself, which no one else has) the pending hook under the pending key,
// in the dict given or (None: the node has none) a new OrderedDict as torch's, returned as (dict, None); for
// any other, torch.autograd.Function's. The tuple first: nothing is put in that the caller does not get back.
static PyObject *tf_register_hook(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    TfPending *p = tf_pending;
    if (nargs != 2 || args[1] != tf_registrar || p == nullptr) {
        PyObject *f = PyObject_GetAttrString(tf_torch_class, "_register_hook");
        PyObject *r = f == nullptr ? nullptr : PyObject_Vectorcall(f, args, nargs, nullptr);
        Py_XDECREF(f);
        return r;
    }
    PyObject *dict = args[0] == Py_None ? PyODict_New() : Py_NewRef(args[0]);
    PyObject *r = dict == nullptr ? nullptr : PyTuple_Pack(2, dict, Py_None);
    if (r == nullptr || PyObject_SetItem(dict, p->key, p->hook) < 0) {
        Py_XDECREF(r);
        Py_XDECREF(dict);
        return nullptr;
    }
    p->dict = dict;
    return r;
}

// tf_registrar's attributes: ``_register_hook`` is tf_register_hook; any other, torch.autograd.Function's.
static PyObject *tf_registrar_getattr(PyObject *, PyObject *name) {
    if (PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, "_register_hook") == 0)
        return Py_NewRef(tf_register_fn);
    return PyObject_GetAttr(tf_torch_class, name);
}

// The next RemovableHandle id, taken as RemovableHandle() takes it (before registering: nothing run meanwhile can
// take it too). A new reference, or nullptr with an error.
static PyObject *tf_take_key() {
    PyObject *key = PyObject_GetAttr(tf_handles, tf_next_id);
    PyObject *one = key == nullptr ? nullptr : PyLong_FromLong(1);
    PyObject *next = one == nullptr ? nullptr : PyNumber_Add(key, one);
    int rc = next == nullptr ? -1 : PyObject_SetAttr(tf_handles, tf_next_id, next);
    Py_XDECREF(one);
    Py_XDECREF(next);
    if (rc < 0) Py_CLEAR(key);
    return key;
}

// TorchFactsApi.node_hook.
static int tf_node_hook(PyObject *node, PyObject *hook, PyObject **dict, PyObject **key) noexcept {
#ifdef Py_GIL_DISABLED
    return 0;  // (the swap of a global needs the GIL)
#else
    try {
        if (tf_registrar == nullptr || !torch::autograd::THPCppFunction_Check(node)) return 0;
    } catch (...) {
        return 0;
    }
    TfPending pending = {hook, tf_take_key(), nullptr};
    if (pending.key == nullptr) return -1;
    TfPending *outer = tf_pending;
    tf_pending = &pending;
    if (tf_swaps++ == 0) {
        tf_torch_class = THPFunctionClass;
        THPFunctionClass = tf_registrar;
    }
    PyObject *none = nullptr;  // the handle returned: tf_register_hook's None
    try {
        none = torch::autograd::registerFunctionHook(*reinterpret_cast<torch::autograd::THPCppFunction *>(node)->cdata,
                                                     tf_registrar);
    } catch (...) {  // (registerFunctionHook's own C++ allocations)
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_MemoryError, "registerFunctionHook failed");
    }
    if (--tf_swaps == 0) THPFunctionClass = tf_torch_class;
    tf_pending = outer;
    if (none == nullptr) {
        if (pending.dict != nullptr) {  // (put in by tf_register_hook, the node not holding it: taken out again)
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            if (PyDict_DelItem(pending.dict, pending.key) < 0) PyErr_Clear();
            PyErr_Restore(type, value, tb);
            Py_DECREF(pending.dict);
        }
        Py_DECREF(pending.key);
        return -1;
    }
    Py_DECREF(none);
    *dict = pending.dict;
    *key = pending.key;
    return 1;
#endif
}

static PyMethodDef tf_register_def = {
    "_register_hook", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(tf_register_hook)), METH_FASTCALL,
    "torch.autograd.Function._register_hook while tf_node_hook's registration is under way (_torch_facts.cpp)"};
static PyType_Slot tf_registrar_slots[] = {{Py_tp_getattro, reinterpret_cast<void *>(tf_registrar_getattr)},
                                           {0, nullptr}};
static PyType_Spec tf_registrar_spec = {"msprobe_core.stats._torch_facts.Registrar", sizeof(PyObject), 0,
                                        Py_TPFLAGS_DEFAULT, tf_registrar_slots};

// tf_node_hook's objects, made once (torch imported): 0, or -1 with an error.
static int tf_node_hook_init() {
    tf_torch_class = THPFunctionClass;
    PyObject *type = tf_torch_class == nullptr ? nullptr : PyType_FromSpec(&tf_registrar_spec);
    tf_registrar = type == nullptr ? nullptr : PyObject_CallNoArgs(type);
    Py_XDECREF(type);
    PyObject *hooks = tf_registrar == nullptr ? nullptr : PyImport_ImportModule("torch.utils.hooks");
    tf_handles = hooks == nullptr ? nullptr : PyObject_GetAttrString(hooks, "RemovableHandle");
    Py_XDECREF(hooks);
    tf_register_fn = tf_handles == nullptr ? nullptr : PyCFunction_New(&tf_register_def, nullptr);
    tf_next_id = tf_register_fn == nullptr ? nullptr : PyUnicode_InternFromString("next_id");
    if (tf_next_id != nullptr) return 0;
    if (tf_torch_class == nullptr) PyErr_SetString(PyExc_ImportError, "torch.autograd.Function is not set up");
    Py_CLEAR(tf_registrar);  // (tf_node_hook declines without it)
    Py_CLEAR(tf_handles);
    Py_CLEAR(tf_register_fn);
    return -1;
}

static const TorchFactsApi tf_api = {tf_plain, tf_dtype, tf_facts, tf_node_hook};

// Whether torch version string v (torch.__version__) is the release this file was compiled against: the same
// TORCH_VERSION, alone or with a local tag ("2.13.0+cpu"). The capsule reads torch's C++ objects by their
// layout in the headers used at build time; under another torch (an upgrade after the build, a wheel built for
// another release) that layout may differ and the reads would be wrong memory, so no capsule is exported then.
static bool tf_version_matches(const char *v) {
    size_t len = std::strlen(TORCH_VERSION);
    return std::strncmp(v, TORCH_VERSION, len) == 0 && (v[len] == '\0' || v[len] == '+');
}

static PyObject *tf_version_matches_py(PyObject *, PyObject *arg) {
    const char *v = PyUnicode_AsUTF8(arg);
    if (v == nullptr) return nullptr;
    return PyBool_FromLong(tf_version_matches(v));
}

// 1 where the running torch is the one compiled against, 0 where not, -1 with an error.
static int tf_torch_matches() {
    PyObject *torch = PyImport_ImportModule("torch");
    PyObject *version = torch ? PyObject_GetAttrString(torch, "__version__") : nullptr;
    Py_XDECREF(torch);
    if (version == nullptr) return -1;
    const char *v = PyUnicode_Check(version) ? PyUnicode_AsUTF8(version) : nullptr;
    int ok = v != nullptr && tf_version_matches(v);
    Py_DECREF(version);
    if (PyErr_Occurred()) return -1;
    return ok;
}

static PyMethodDef tf_methods[] = {
    {"version_matches", tf_version_matches_py, METH_O,
     "version_matches(version) -> whether a torch version string is the release this module was built for "
     "(FACTS is exported only where torch.__version__ is)"},
    {nullptr, nullptr, 0, nullptr},
};

static struct PyModuleDef tf_module = {
    PyModuleDef_HEAD_INIT, "_torch_facts",
    "A tensor's facts read from torch's C++ tensor for the statistics kernel (the FACTS capsule, where the running "
    "torch is BUILT_FOR).",
    -1, tf_methods};

PyMODINIT_FUNC PyInit__torch_facts(void) {
    PyObject *m = PyModule_Create(&tf_module);
    if (m == nullptr) return nullptr;
    if (PyModule_AddStringConstant(m, "BUILT_FOR", TORCH_VERSION) < 0) {
        Py_DECREF(m);
        return nullptr;
    }
    int matches = tf_torch_matches();
    if (matches > 0 && tf_registrar == nullptr && tf_node_hook_init() < 0) matches = -1;
    if (matches > 0) {
        PyObject *cap = PyCapsule_New(const_cast<TorchFactsApi *>(&tf_api), TORCH_FACTS_CAPSULE, nullptr);
        if (cap == nullptr || PyModule_AddObject(m, "FACTS", cap) < 0) {
            Py_XDECREF(cap);
            matches = -1;
        }
    }
    if (matches < 0) Py_CLEAR(m);
    return m;
}
