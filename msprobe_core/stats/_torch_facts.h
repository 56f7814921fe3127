/* The contract between _torch_facts.cpp (the optional C++ extension msprobe_core.stats._torch_facts, built only
 * where torch and a C++ compiler were there at install) and _fast_facts.c (its user in _fast_stats): the module's
 * FACTS capsule, named TORCH_FACTS_CAPSULE, holds a TorchFactsApi. Change the struct or a function's meaning
 * only with a new capsule name, so that an extension built before the change is never read as the new one. */
#ifndef MSPROBE_TORCH_FACTS_H
#define MSPROBE_TORCH_FACTS_H

#include <Python.h>

#define TORCH_FACTS_CAPSULE "msprobe_core.stats._torch_facts.FACTS_1"

typedef struct {
    /* 1 with t's data address, element count and ScalarType where t, an exact torch.Tensor or
     * torch.nn.Parameter, is a defined CPU tensor, strided and contiguous, with no lazy negation, not a zero
     * tensor, with data and at least one element; 0 otherwise (another type, or torch refused a question).
     * Never raises; the GIL held. */
    int (*plain)(PyObject *t, void **p, Py_ssize_t *n, int *scalar_type);
    /* the torch.dtype of a ScalarType (borrowed; torch keeps it for the process), NULL (no error) for none */
    PyObject *(*dtype)(int scalar_type);
} TorchFactsApi;

#endif
