// msprobe_core.stats._torch_facts: the optional C++ part of the statistics kernel. It answers the questions the
// kernel's readers ask of every tensor they read from the C++ tensor: the monitor's TensorRows (_fast_stats.c:
// is_cpu, layout, dtype, is_contiguous, is_neg, _is_zerotensor, data_ptr, numel) and the dump's RecordText and
// GradText (_version, data_ptr, shape, requires_grad, is_contiguous, is_neg, _is_zerotensor of every tensor of
// every record), for about 1/10 to 1/30 of what the same questions cost through torch's Python API from C (each
// a Python call with torch's error and torch-function handling; 4,800 tensors a step with the monitor on a
// 400-layer model, about three a call at the dump's level L1). Exported as the FACTS capsule (_torch_facts.h);
// _fast_facts.c imports it and, without it, the readers ask torch's Python API as before.
//
// Built by setup.py only where torch imports at build time (torch.utils.cpp_extension, optional=True), linked
// against that torch: import torch first. The headers are the narrowest that hold THPVariable (the C++ tensor
// of a Python tensor), torch.dtype's objects and the version macros (torch/extension.h compiles ~1.6x slower).
#include <Python.h>
#include <torch/csrc/DynamicTypes.h>
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

static const TorchFactsApi tf_api = {tf_plain, tf_dtype, tf_facts};

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
