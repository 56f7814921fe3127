/* The contract between _torch_facts.cpp (the optional C++ extension msprobe_core.stats._torch_facts, built only
 * where torch and a C++ compiler were there at install) and _fast_facts.c (its user in _fast_stats): the module's
 * FACTS capsule, named TORCH_FACTS_CAPSULE, holds a TorchFactsApi. Change the struct or a function's meaning
 * only with a new capsule name, so that an extension built before the change is never read as the new one. */
#ifndef MSPROBE_TORCH_FACTS_H
#define MSPROBE_TORCH_FACTS_H

#include <Python.h>

#define TORCH_FACTS_CAPSULE "msprobe_core.stats._torch_facts.FACTS_3"

/* What TorchFactsApi.facts is asked (bits of ``want``), each the value of the Python API named */
enum {
    TORCH_FACT_VERSION = 1,  /* t._version */
    TORCH_FACT_DATA_PTR = 2, /* t.data_ptr() */
    TORCH_FACT_SIZES = 4,    /* t.shape (its sizes) and t.numel() */
    TORCH_FACT_FLAGS = 8,    /* t.requires_grad, t.is_contiguous(), t.is_neg(), t._is_zerotensor() */
};

#define TORCH_FACTS_MAX_DIMS 16 /* a tensor of more dimensions has no SIZES here */

typedef struct {
    long long version;
    unsigned long long data_ptr;
    int dims;
    long long sizes[TORCH_FACTS_MAX_DIMS]; /* sizes[0..dims) */
    long long numel;
    int requires_grad, is_contiguous, is_neg, is_zerotensor;
} TorchTensorFacts;

typedef struct {
    /* 1 with t's data address, element count and ScalarType where t, an exact torch.Tensor or
     * torch.nn.Parameter, is a defined CPU tensor, strided and contiguous, with no lazy negation, not a zero
     * tensor, with data and at least one element; 0 otherwise (another type, or torch refused a question).
     * Never raises; the GIL held. */
    int (*plain)(PyObject *t, void **p, Py_ssize_t *n, int *scalar_type);
    /* the torch.dtype of a ScalarType (borrowed; torch keeps it for the process), NULL (no error) for none */
    PyObject *(*dtype)(int scalar_type);
    /* 1 with the facts of ``want`` (TORCH_FACT_* bits) in *f where t is an exact torch.Tensor or
     * torch.nn.Parameter whose C++ tensor answers them all as torch's Python API would (with no torch function
     * in the way); 0 otherwise (another type, symbolic sizes, more than TORCH_FACTS_MAX_DIMS dimensions, or a
     * question torch refuses: an inference tensor's version, the data of a tensor without storage), *f then
     * partly written. Never raises; the GIL held. */
    int (*facts)(PyObject *t, int want, TorchTensorFacts *f);
    /* 1 where ``node`` is a C++ autograd node (a THPCppFunction, not a Python autograd.Function's node) and
     * ``hook`` is now among its post hooks as ``node.register_hook(hook)`` puts it, without the handle object:
     * in the node's hook dict (the one torch's registerFunctionHook finds, or a new OrderedDict it gives the
     * node) under the key a new ``torch.utils.hooks.RemovableHandle`` would have taken (``next_id``, advanced);
     * *dict and *key then new references, to remove it by (``StepHooks.remove``). 0 (nothing done, no error)
     * for any other node: ask ``node.register_hook``. -1 with an error. The GIL held. */
    int (*node_hook)(PyObject *node, PyObject *hook, PyObject **dict, PyObject **key);
} TorchFactsApi;

#endif
