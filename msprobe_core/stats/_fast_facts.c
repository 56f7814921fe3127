/* _fast_facts.c: the tensor questions of the kernel's readers answered by the optional C++ extension
 * msprobe_core.stats._torch_facts (its FACTS capsule, _torch_facts.h) instead of torch's Python API, 10x to 30x
 * cheaper. #included into _fast_stats.c before the readers that ask (plain_cpu_facts, the version, address,
 * shape and flags of every tensor of the dump's RecordText and GradText, the monitor's TensorRows), and the
 * dump's node hooks put in without torch's handle object (ff_node_hook, for L0's OwnGrads and L1's calls). The
 * extension is imported once, at the first question (torch is imported by then: the extension links against it);
 * without it (not built, built for another torch, or its import failing) ff_plain, ff_facts and ff_node_hook say 0
 * and the caller asks torch's Python API as before. */
#include "_torch_facts.h"

static const TorchFactsApi *ff_api = NULL;
static int ff_tried = 0;

/* The FACTS capsule's functions into ff_api, once; NULL where there are none. 0, or -1 with an error that is not
 * an Exception (KeyboardInterrupt...: left raised, the import tried again next time). */
static int ff_load(void) {
    PyObject *mod = PyImport_ImportModule("msprobe_core.stats._torch_facts");
    PyObject *cap = mod != NULL && PyObject_HasAttrString(mod, "FACTS") ? PyObject_GetAttrString(mod, "FACTS") : NULL;
    if (cap != NULL) ff_api = (const TorchFactsApi *)PyCapsule_GetPointer(cap, TORCH_FACTS_CAPSULE);
    Py_XDECREF(cap);
    Py_XDECREF(mod);
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
        PyErr_Clear();
    }
    ff_tried = 1;
    return 0;
}

/* 1 with t's data address, element count and torch.dtype (borrowed) where the C++ tensor of t (an exact
 * torch.Tensor or torch.nn.Parameter) is a plain CPU tensor (TorchFactsApi.plain); 0 where it is not or there is
 * no extension (ask torch's Python API); -1 with an error (ff_load's). */
static int ff_plain(PyObject *t, void **p, Py_ssize_t *n, PyObject **dtype) {
    if (!ff_tried && ff_load() < 0) return -1;
    int scalar_type;
    if (ff_api == NULL || !ff_api->plain(t, p, n, &scalar_type)) return 0;
    *dtype = ff_api->dtype(scalar_type);
    return *dtype != NULL;
}

/* 1 with the facts of want (TORCH_FACT_* bits) of t's C++ tensor in *f (TorchFactsApi.facts: an exact torch.Tensor
 * or torch.nn.Parameter that answers them all); 0 where it does not or there is no extension (ask torch's Python
 * API); -1 with an error (ff_load's). */
static int ff_facts(PyObject *t, int want, TorchTensorFacts *f) {
    if (!ff_tried && ff_load() < 0) return -1;
    return ff_api != NULL && ff_api->facts(t, want, f);
}

/* 1 with ``hook`` among node's post hooks as ``node.register_hook(hook)`` puts it, without the handle object, and
 * the hook dict and key to remove it by in *dict and *key (new references) where node is a C++ autograd node
 * (TorchFactsApi.node_hook); 0, nothing done, for another node or without the extension (call
 * ``node.register_hook``); -1 with an error. */
static int ff_node_hook(PyObject *node, PyObject *hook, PyObject **dict, PyObject **key) {
    if (!ff_tried && ff_load() < 0) return -1;
    return ff_api == NULL ? 0 : ff_api->node_hook(node, hook, dict, key);
}
