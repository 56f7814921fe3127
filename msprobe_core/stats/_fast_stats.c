/* One-pass statistics of a contiguous CPU buffer, for the dump service and the monitor.
 *
 * torch needs one kernel per statistic (amax, amin, sum, vector_norm: four passes over the data, four
 * dispatches); this reads the data once and returns host floats directly. Built by `pip install` as an
 * optional extension: without a C compiler the toolkit falls back to torch's own reductions.
 *
 *   stats(address, numel, code, eps, threads=1) -> (max, min, sum, sum_of_squares, count |x| <= eps, count NaN)
 *
 *   copy_stats(dst, src, numel, code, eps, threads=1) -> the same, while copying the buffer to dst
 *   buffer(address, nbytes)             -> read-only memoryview over the bytes (for checksums)
 *   stats_many(addresses, numels, codes, eps, threads, out) -> stats() of many buffers, into out (below)
 *   frame_key(depth)                    -> bytes naming the caller's call stack from `depth` frames up: each
 *                                          frame's code object address and instruction offset (the dump's
 *                                          stack.json interns stacks by it; files/call_stack.py)
 *
 * With eps < 0 the zero count is skipped (0) and NaNs are only counted when the sums come out non-finite
 * (a finite sum of squares proves there is none): one pass in the common case.
 *
 * code: 0 float32, 1 float64, 2 bfloat16, 3 int64, 4 int32, 5 int16, 6 int8, 7 uint8, 8 bool.
 * Max and Min are NaN when the buffer holds a NaN (as torch.amax/amin). Floats are reduced in float lanes
 * per block of BLOCK elements and the block sums added in double (a double's accuracy at float speed);
 * integers in double. For bool, max/min are any/all and the sums count the true elements. The GIL is
 * released while reducing. Buffers of PARALLEL_MIN elements or more are split over `threads` OpenMP
 * threads: the extension links libgomp.so.1, which resolves to the copy torch has already loaded, so
 * it shares torch's thread pool (pass torch.get_num_threads(), which is 1 in a forked child).
 *
 * copy_stats serves tensors that are saved to files: it copies BLOCK elements at a time and reduces each
 * block from the copy while it is in the L1 cache, so the statistics cost no second read of the tensor.
 * Block results are merged in order (the same value whatever the thread count).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct { double mx, mn, sum, sumsq, zeros, nans; } acc_t;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

#define BLOCK 4096
#define PARALLEL_MIN (1 << 17) /* below this a second thread costs more than it saves */

static inline float f32_of(float v) { return v; }
static inline float bf16_of(uint16_t v) {
    uint32_t b = (uint32_t)v << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* Max, min, sum and sum of squares of p[lo:hi] in float lanes. */
#define REDUCE_BLOCK(p, lo, hi, TO_F, bmx, bmn, bs, bss)                                         \
    _Pragma("omp simd reduction(max:bmx) reduction(min:bmn) reduction(+:bs,bss)")                \
    for (Py_ssize_t i = lo; i < hi; i++) {                                                       \
        float v = TO_F(p[i]);                                                                    \
        bmx = v > bmx ? v : bmx;                                                                 \
        bmn = v < bmn ? v : bmn;                                                                 \
        bs += v;                                                                                 \
        bss += v * v;                                                                            \
    }

/* Elements of p[lo:hi] with |x| <= e, and NaNs. */
#define COUNT_BLOCK(p, lo, hi, TO_F, e, zeros, nans)                                             \
    _Pragma("omp simd reduction(+:zeros,nans)")                                                  \
    for (Py_ssize_t i = lo; i < hi; i++) {                                                       \
        float v = TO_F(p[i]);                                                                    \
        zeros += fabsf(v) <= e;                                                                  \
        nans += v != v;                                                                          \
    }

/* copy_stats' step for one block: copy it, then reduce the copy while it is in the L1 cache. */
#define COPY_BLOCK(NAME, T, TO_F)                                                                \
    CLONES static void NAME(T *dst, const T *src, Py_ssize_t m, float e, int count, acc_t *r) {  \
        memcpy(dst, src, (size_t)m * sizeof(T));                                                 \
        float bmx = -INFINITY, bmn = INFINITY, bs = 0.f, bss = 0.f;                              \
        REDUCE_BLOCK(dst, 0, m, TO_F, bmx, bmn, bs, bss);                                        \
        Py_ssize_t zeros = 0, nans = 0;                                                          \
        if (count || !isfinite(bs) || !isfinite(bss)) {                                         \
            COUNT_BLOCK(dst, 0, m, TO_F, e, zeros, nans);                                        \
        }                                                                                        \
        r->mx = bmx; r->mn = bmn; r->sum = bs; r->sumsq = bss; r->zeros = (double)zeros; r->nans = (double)nans; \
    }

COPY_BLOCK(copy_f32, float, f32_of)
COPY_BLOCK(copy_bf16, uint16_t, bf16_of)

/* One thread's reduction of p[0:n], block by block in order, with no OpenMP region (a region costs about a
 * microsecond even on one thread, as much as reducing a 64 x 64 float32 tensor). NaNs and |x| <= eps are
 * counted in a second pass, only when asked (count) or when the sums say a NaN may be there. */
#define SERIAL_FLOAT_KERNEL(NAME, T, TO_F)                                                       \
    CLONES static void NAME(const T *p, Py_ssize_t n, double eps, int count, acc_t *a) {          \
        float mx = -INFINITY, mn = INFINITY;                                                     \
        double s = 0.0, ss = 0.0;                                                                \
        for (Py_ssize_t lo = 0; lo < n; lo += BLOCK) {                                           \
            Py_ssize_t hi = lo + BLOCK < n ? lo + BLOCK : n;                                     \
            float bmx = -INFINITY, bmn = INFINITY, bs = 0.f, bss = 0.f;                          \
            REDUCE_BLOCK(p, lo, hi, TO_F, bmx, bmn, bs, bss);                                    \
            mx = bmx > mx ? bmx : mx;                                                            \
            mn = bmn < mn ? bmn : mn;                                                            \
            s += bs;                                                                             \
            ss += bss;                                                                           \
        }                                                                                        \
        Py_ssize_t zeros = 0, nans = 0;                                                          \
        if (count || !isfinite(s) || !isfinite(ss)) {                                           \
            float e = (float)eps;                                                                \
            for (Py_ssize_t lo = 0; lo < n; lo += BLOCK) {                                       \
                Py_ssize_t hi = lo + BLOCK < n ? lo + BLOCK : n;                                 \
                COUNT_BLOCK(p, lo, hi, TO_F, e, zeros, nans);                                    \
            }                                                                                    \
        }                                                                                        \
        a->mx = mx; a->mn = mn; a->sum = s; a->sumsq = ss; a->zeros = (double)zeros; a->nans = (double)nans; \
    }

SERIAL_FLOAT_KERNEL(serial_f32, float, f32_of)
SERIAL_FLOAT_KERNEL(serial_bf16, uint16_t, bf16_of)

/* Several threads: each reduces a contiguous run of whole blocks with SERIAL, and the runs are merged in
 * thread order (the same value for the same thread count). One thread: SERIAL itself. */
#define FLOAT_KERNEL(NAME, SERIAL, T)                                                            \
    CLONES static void NAME(const T *p, Py_ssize_t n, double eps, int count, int threads, acc_t *a) { \
        if (threads <= 1) {                                                                      \
            SERIAL(p, n, eps, count, a);                                                         \
            return;                                                                              \
        }                                                                                        \
        Py_ssize_t per = ((n + BLOCK - 1) / BLOCK + threads - 1) / threads * BLOCK;              \
        acc_t part[threads];                                                                     \
        _Pragma("omp parallel for num_threads(threads) schedule(static, 1)")                     \
        for (int t = 0; t < threads; t++) {                                                      \
            Py_ssize_t lo = t * per < n ? t * per : n, hi = lo + per < n ? lo + per : n;         \
            SERIAL(p + lo, hi - lo, eps, count, &part[t]);                                       \
        }                                                                                        \
        *a = part[0];                                                                            \
        for (int t = 1; t < threads; t++) {                                                      \
            a->mx = part[t].mx > a->mx ? part[t].mx : a->mx;                                     \
            a->mn = part[t].mn < a->mn ? part[t].mn : a->mn;                                     \
            a->sum += part[t].sum; a->sumsq += part[t].sumsq;                                    \
            a->zeros += part[t].zeros; a->nans += part[t].nans;                                  \
        }                                                                                        \
    }

FLOAT_KERNEL(k_f32, serial_f32, float)
FLOAT_KERNEL(k_bf16, serial_bf16, uint16_t)

CLONES static void k_f64(const double *p, Py_ssize_t n, double eps, int count, int threads, acc_t *a) {
    double mx = -INFINITY, mn = INFINITY, s = 0.0, ss = 0.0;
    Py_ssize_t zeros = 0, nans = 0;
#pragma omp parallel for simd num_threads(threads) if(threads > 1) reduction(max:mx) reduction(min:mn) reduction(+:s,ss)
    for (Py_ssize_t i = 0; i < n; i++) {
        double v = p[i];
        mx = v > mx ? v : mx;
        mn = v < mn ? v : mn;
        s += v;
        ss += v * v;
    }
    if (count || !isfinite(s) || !isfinite(ss)) {
#pragma omp parallel for simd num_threads(threads) if(threads > 1) reduction(+:zeros,nans)
        for (Py_ssize_t i = 0; i < n; i++) {
            zeros += fabs(p[i]) <= eps;
            nans += p[i] != p[i];
        }
    }
    a->mx = mx; a->mn = mn; a->sum = s; a->sumsq = ss; a->zeros = (double)zeros; a->nans = (double)nans;
}

#define INT_KERNEL(NAME, T)                                                                      \
    CLONES static void NAME(const T *p, Py_ssize_t n, double eps, int count, int threads, acc_t *a) { \
        double mx = -INFINITY, mn = INFINITY, s = 0.0, ss = 0.0;                                 \
        Py_ssize_t zeros = 0;                                                                    \
        _Pragma("omp parallel for simd num_threads(threads) if(threads > 1) reduction(max:mx) reduction(min:mn) reduction(+:s,ss,zeros)") \
        for (Py_ssize_t i = 0; i < n; i++) {                                                     \
            double v = (double)p[i];                                                             \
            mx = v > mx ? v : mx;                                                                \
            mn = v < mn ? v : mn;                                                                \
            s += v;                                                                              \
            ss += v * v;                                                                         \
            zeros += fabs(v) <= eps;                                                             \
        }                                                                                        \
        a->mx = mx; a->mn = mn; a->sum = s; a->sumsq = ss; a->zeros = (double)zeros; a->nans = 0; \
    }

INT_KERNEL(k_i64, int64_t)
INT_KERNEL(k_i32, int32_t)
INT_KERNEL(k_i16, int16_t)
INT_KERNEL(k_i8, int8_t)
INT_KERNEL(k_u8, uint8_t)

static void k_bool(const uint8_t *p, Py_ssize_t n, double eps, int count, int threads, acc_t *a) {
    Py_ssize_t trues = 0;
    for (Py_ssize_t i = 0; i < n; i++) trues += p[i] != 0;
    a->mx = trues > 0; a->mn = trues == n; a->sum = (double)trues; a->sumsq = (double)trues;
    a->zeros = (double)(n - trues); a->nans = 0;
}

typedef void (*kernel_t)(const void *, Py_ssize_t, double, int, int, acc_t *);
static const kernel_t KERNELS[] = {
    (kernel_t)k_f32, (kernel_t)k_f64, (kernel_t)k_bf16, (kernel_t)k_i64, (kernel_t)k_i32,
    (kernel_t)k_i16, (kernel_t)k_i8, (kernel_t)k_u8, (kernel_t)k_bool,
};
#define N_KERNELS ((long)(sizeof(KERNELS) / sizeof(KERNELS[0])))

static const size_t ELEM_SIZE[] = {4, 8, 2, 8, 4, 2, 1, 1, 1};

static int parse_common(long *code, double *eps, int *count, void *p, Py_ssize_t n) {
    if (PyErr_Occurred()) return -1;
    if (p == NULL || n <= 0) {
        PyErr_SetString(PyExc_ValueError, "address must be non-null and numel positive");
        return -1;
    }
    if (*code < 0 || *code >= N_KERNELS) {
        PyErr_Format(PyExc_ValueError, "dtype code %ld; allowed: 0..%ld", *code, N_KERNELS - 1);
        return -1;
    }
    *count = *eps >= 0;
    if (!*count) *eps = 0.0;
    return 0;
}

static PyObject *result(acc_t a, int count) {
    if (!count) a.zeros = 0;
    if (a.nans > 0) a.mx = a.mn = NAN;
    return Py_BuildValue("(dddddd)", a.mx, a.mn, a.sum, a.sumsq, a.zeros, a.nans);
}

static PyObject *stats(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 && nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "stats(address, numel, code, eps, threads=1) takes 4 or 5 arguments");
        return NULL;
    }
    long threads = nargs == 5 ? PyLong_AsLong(args[4]) : 1;
    void *p = PyLong_AsVoidPtr(args[0]);
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    long code = PyLong_AsLong(args[2]);
    double eps = PyFloat_AsDouble(args[3]);
    int count;
    if (parse_common(&code, &eps, &count, p, n) < 0) return NULL;
    kernel_t k = KERNELS[code];
    if (threads < 1 || n < PARALLEL_MIN) threads = 1;
    acc_t a;
    Py_BEGIN_ALLOW_THREADS
    k(p, n, eps, count, (int)threads, &a);
    Py_END_ALLOW_THREADS
    return result(a, count);
}

static PyObject *copy_stats(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 && nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "copy_stats(dst, src, numel, code, eps, threads=1) takes 5 or 6 arguments");
        return NULL;
    }
    char *dst = PyLong_AsVoidPtr(args[0]);
    const char *src = PyLong_AsVoidPtr(args[1]);
    Py_ssize_t n = PyLong_AsSsize_t(args[2]);
    long code = PyLong_AsLong(args[3]);
    double eps = PyFloat_AsDouble(args[4]);
    long threads = nargs == 6 ? PyLong_AsLong(args[5]) : 1;
    int count;
    if (dst == NULL) {
        PyErr_SetString(PyExc_ValueError, "dst must be non-null");
        return NULL;
    }
    if (parse_common(&code, &eps, &count, (void *)src, n) < 0) return NULL;
    if (threads < 1 || n < PARALLEL_MIN) threads = 1;
    kernel_t k = KERNELS[code];
    size_t es = ELEM_SIZE[code];
    Py_ssize_t blocks = (n + BLOCK - 1) / BLOCK;
    acc_t *parts = PyMem_RawMalloc((size_t)blocks * sizeof(acc_t));
    if (parts == NULL) return PyErr_NoMemory();
    acc_t a = {-INFINITY, INFINITY, 0.0, 0.0, 0.0, 0.0};
    Py_BEGIN_ALLOW_THREADS
    if (code == 0 || code == 2) {  /* float32, bfloat16: block kernels without a nested parallel region */
        float e = (float)eps;
#pragma omp parallel for num_threads(threads) if(threads > 1) schedule(static)
        for (Py_ssize_t b = 0; b < blocks; b++) {
            Py_ssize_t lo = b * BLOCK, m = lo + BLOCK < n ? BLOCK : n - lo;
            if (code == 0)
                copy_f32((float *)dst + lo, (const float *)src + lo, m, e, count, &parts[b]);
            else
                copy_bf16((uint16_t *)dst + lo, (const uint16_t *)src + lo, m, e, count, &parts[b]);
        }
    } else {
        for (Py_ssize_t b = 0; b < blocks; b++) {
            Py_ssize_t lo = b * BLOCK, m = lo + BLOCK < n ? BLOCK : n - lo;
            memcpy(dst + lo * es, src + lo * es, (size_t)m * es);
            k(dst + lo * es, m, eps, count, 1, &parts[b]);
        }
    }
    for (Py_ssize_t b = 0; b < blocks; b++) {
        a.mx = parts[b].mx > a.mx ? parts[b].mx : a.mx;
        a.mn = parts[b].mn < a.mn ? parts[b].mn : a.mn;
        a.sum += parts[b].sum;
        a.sumsq += parts[b].sumsq;
        a.zeros += parts[b].zeros;
        a.nans += parts[b].nans;
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(parts);
    return result(a, count);
}

/* buffer(address, nbytes) -> a read-only memoryview over raw memory (the caller keeps its owner alive). */
static PyObject *buffer(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "buffer(address, nbytes) takes 2 arguments");
        return NULL;
    }
    void *p = PyLong_AsVoidPtr(args[0]);
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    if (PyErr_Occurred()) return NULL;
    if (p == NULL || n < 0) {
        PyErr_SetString(PyExc_ValueError, "address must be non-null and nbytes non-negative");
        return NULL;
    }
    return PyMemoryView_FromMemory((char *)p, n, PyBUF_READ);
}

static PyObject *stats_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
static PyObject *append_row(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
static PyObject *append_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
static PyObject *csv_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
static PyObject *raw_ops(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
static int add_tensor_rows(PyObject *m);
static int add_fast_monitor(PyObject *m); /* _fast_monitor.c, #included after the monitor's step values */

#define STACK_KEY_SMALL 256 /* the entries of a caller's own array for ``stack_walk`` */

/* The key of the stack from frame f (a reference taken over) outward into *buf: each frame's code address and
 * instruction offset. *buf is the caller's array of STACK_KEY_SMALL entries, replaced for a deep stack by a larger
 * one from PyMem_Malloc (the caller frees it where it is not its own array, an error or not). The key's length in
 * entries, or -1 with an error. */
static Py_ssize_t stack_walk(PyFrameObject *f, uintptr_t **buf) {
    uintptr_t *own = *buf;
    Py_ssize_t cap = STACK_KEY_SMALL, used = 0;
    while (f != NULL) {
        if (used + 2 > cap) {  /* a deep stack: grow on the heap */
            uintptr_t *bigger = PyMem_Malloc(2 * cap * sizeof(uintptr_t));
            if (bigger == NULL) { Py_DECREF(f); PyErr_NoMemory(); return -1; }
            memcpy(bigger, *buf, used * sizeof(uintptr_t));
            if (*buf != own) PyMem_Free(*buf);
            *buf = bigger;
            cap *= 2;
        }
        PyCodeObject *code = PyFrame_GetCode(f);
        (*buf)[used++] = (uintptr_t)code;
        Py_DECREF(code);
        (*buf)[used++] = (uintptr_t)PyFrame_GetLasti(f);
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    return used;
}

/* The bytes naming the stack from frame f (a reference taken over) outward (``stack_walk``'s key). */
static PyObject *stack_key(PyFrameObject *f) {
    uintptr_t key[STACK_KEY_SMALL], *buf = key;
    Py_ssize_t used = stack_walk(f, &buf);
    PyObject *out = used < 0 ? NULL
                             : PyBytes_FromStringAndSize((const char *)buf, used * (Py_ssize_t)sizeof(uintptr_t));
    if (buf != key) PyMem_Free(buf);
    return out;
}

static PyObject *frame_key(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "frame_key(depth) takes 1 argument");
        return NULL;
    }
    long depth = PyLong_AsLong(args[0]);
    if (depth == -1 && PyErr_Occurred()) return NULL;
    PyFrameObject *f = PyEval_GetFrame();  /* borrowed */
    Py_XINCREF(f);
    for (long i = 0; i < depth && f != NULL; i++) {
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    return stack_key(f);
}

#include <structmember.h>

/* ======================================================================================== record text
 * The dump's forward records as JSON text, for the common case in one C call (``Summarizer._record_text`` in
 * ``pytorch/summarize.py``, used by ``dump/call_records.py``):
 * dense plain CPU tensors of the kernel's dtypes, summarized with their statistics once per tensor version. A
 * known tensor updated in place (an optimizer's step) has its entry moved to the new version: of all it asked
 * torch the first time, only its version, memory, shape, contiguity and requires_grad are read again.
 *
 *   Entry(ref, version, ptr)  -> what the summarizer knows of one tensor version (``pytorch/summarize.py``):
 *                                members ref, version, ptr, stats, crc, file, text
 *   RecordText(cache, saved, combined, prefixes, prefix, fallback, encode_string, tensor, parameter,
 *              descriptors, codes, dtype_bool, layout_strided, statistics, cache_size, get_num_threads)
 *     .text(obj)               -> the JSON text of the summary of obj, or None (``SummarizerBase.text``)
 *     .tensor(t)               -> the JSON text of a plain tensor's summary made here, or None (``tensor_text``'s
 *                                 first try; never the fallback)
 *     .inputs(args, kwargs)    -> '{"input_args": ..., "input_kwargs": ...' or None
 *     .record(head, out)       -> head + ', "output": [...]}' or None
 *
 * The text is the one the Python route writes, byte for byte: floats as Python's repr (NaN and the
 * infinities as JavaScript names them), the cache the summarizer's own dicts (an entry made here is read
 * there and the other way round). Anything unusual (another device, a subclass, float16, a non-contiguous
 * tensor, a value that is not a number, a string or a container) is given to ``fallback`` (the Python
 * route) for that object alone; its None makes the whole answer None. */

typedef struct {
    PyObject_HEAD
    PyObject *ref, *stats, *crc, *file, *text;
    long long version;
    unsigned long long ptr;
    /* The kernel's statistics of this version as a raw row (has_row), kept here instead of a tuple of six floats
     * made (and dropped) per version: ``stats`` reads make that tuple from the row, once, when Python asks. */
    double row[6];
    int has_row;
    /* What an in-place update of the tensor (same object, same memory, a new version) leaves as it was, kept by
     * the C text once it made a body from the kernel (NULL prefix: not known; the Python route never sets them):
     * torch changes neither dtype, layout, device, nor the negation and zero-tensor bits in place (``set_``
     * refuses another dtype and drops those bits), while shape and contiguity (``resize_``, ``transpose_``,
     * ``set_``, ``as_strided_``) are read again for every version. */
    PyObject *prefix, *shape;  /* the summary's text up to its statistics; the shape it was made for */
    Py_ssize_t numel;
    long code;                 /* the kernel's dtype code */
    int is_bool, plain;        /* plain: the kernel reads the memory as it is (no lazy negation, no zero tensor) */
} EntryObject;

static PyMemberDef entry_members[] = {
    {"ref", T_OBJECT, offsetof(EntryObject, ref), 0, "a weak reference to the tensor"},
    {"version", T_LONGLONG, offsetof(EntryObject, version), 0, "its version counter"},
    {"ptr", T_ULONGLONG, offsetof(EntryObject, ptr), 0, "its data pointer"},
    {"crc", T_OBJECT, offsetof(EntryObject, crc), 0, "its checksum"},
    {"file", T_OBJECT, offsetof(EntryObject, file), 0, "the path of its first saved file"},
    {"text", T_OBJECT, offsetof(EntryObject, text), 0, "its summary's JSON text up to requires_grad"},
    {NULL},
};

static PyTypeObject EntryType;

/* ``stats``: the tuple set, or the one made from the kernel's row (kept: the same object on every read), or None. */
static PyObject *entry_get_stats(EntryObject *e, void *closure) {
    if (e->stats == NULL && e->has_row) {
        const double *r = e->row;
        e->stats = Py_BuildValue("(dddddd)", r[0], r[1], r[2], r[3], r[4], r[5]);
        if (e->stats == NULL) return NULL;
    }
    return Py_NewRef(e->stats != NULL ? e->stats : Py_None);
}

static int entry_set_stats(EntryObject *e, PyObject *value, void *closure) {
    Py_XINCREF(value);
    Py_XSETREF(e->stats, value);
    e->has_row = 0;
    return 0;
}

static PyGetSetDef entry_getset[] = {
    {"stats", (getter)entry_get_stats, (setter)entry_set_stats, "its statistics", NULL},
    {NULL},
};

static EntryObject *entry_new(PyObject *ref, long long version, unsigned long long ptr) {
    EntryObject *e = PyObject_New(EntryObject, &EntryType);
    if (e == NULL) return NULL;
    Py_INCREF(ref);
    e->ref = ref;
    e->stats = e->crc = e->file = e->text = e->prefix = e->shape = NULL;
    e->version = version;
    e->ptr = ptr;
    e->numel = 0;
    e->code = -1;
    e->is_bool = e->plain = 0;
    e->has_row = 0;
    return e;
}

static PyObject *entry_tp_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *ref;
    long long version;
    unsigned long long ptr;
    if (!PyArg_ParseTuple(args, "OLK:Entry", &ref, &version, &ptr)) return NULL;
    return (PyObject *)entry_new(ref, version, ptr);
}

static void entry_dealloc(EntryObject *e) {
    Py_XDECREF(e->ref);
    Py_XDECREF(e->stats);
    Py_XDECREF(e->crc);
    Py_XDECREF(e->file);
    Py_XDECREF(e->text);
    Py_XDECREF(e->prefix);
    Py_XDECREF(e->shape);
    PyObject_Free(e);
}

static PyTypeObject EntryType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "msprobe_core.stats._fast_stats.Entry",
    .tp_basicsize = sizeof(EntryObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Entry(ref, version, ptr): what is known about one tensor version (stats, crc, file, text)",
    .tp_new = entry_tp_new,
    .tp_dealloc = (destructor)entry_dealloc,
    .tp_members = entry_members,
    .tp_getset = entry_getset,
};

/* A growing UTF-8 text. ``text_put`` takes ASCII (or bytes never made a str: the journal's frames); the text of a
 * str goes by ``text_put_str``, which notes one that is not ASCII (``wide``). ``text_str`` then makes a str of it
 * as ``PyUnicode_DecodeUTF8`` would, without its pass over every byte when nothing wide was put. ``small``, on the
 * caller's stack, holds a usual record's text and journal frame (about 1 KB) with no allocation. */
typedef struct { char *p; Py_ssize_t len, cap; int wide; char small[4096]; } text_t;

static void text_init(text_t *b) { b->p = b->small; b->len = 0; b->cap = sizeof(b->small); b->wide = 0; }
static void text_free(text_t *b) { if (b->p != b->small) PyMem_Free(b->p); }

/* Room in b for n more bytes: 0, or -1 with an error. */
static int text_room(text_t *b, Py_ssize_t n) {
    if (b->len + n > b->cap) {
        Py_ssize_t cap = b->cap;
        while (b->len + n > cap) cap *= 2;
        char *p = PyMem_Malloc((size_t)cap);
        if (p == NULL) { PyErr_NoMemory(); return -1; }
        memcpy(p, b->p, (size_t)b->len);
        if (b->p != b->small) PyMem_Free(b->p);
        b->p = p;
        b->cap = cap;
    }
    return 0;
}

static int text_put(text_t *b, const char *s, Py_ssize_t n) {
    if (text_room(b, n) < 0) return -1;
    memcpy(b->p + b->len, s, (size_t)n);
    b->len += n;
    return 0;
}

#define PUT_LIT(b, s) text_put((b), (s), (Py_ssize_t)(sizeof(s) - 1))

static int text_put_str(text_t *b, PyObject *s) {
    Py_ssize_t n;
    const char *u = PyUnicode_AsUTF8AndSize(s, &n);
    if (u == NULL) return -1;
    b->wide |= !PyUnicode_IS_ASCII(s);
    return text_put(b, u, n);
}

/* The str of b's first len bytes (a new reference), or NULL with an error. */
static PyObject *text_str(const text_t *b, Py_ssize_t len) {
    if (b->wide) return PyUnicode_DecodeUTF8(b->p, len, NULL);
    PyObject *s = PyUnicode_New(len, 127);
    if (s != NULL) memcpy(PyUnicode_1BYTE_DATA(s), b->p, (size_t)len);
    return s;
}

/* b's str (``text_str``), b freed. */
static PyObject *text_finish(text_t *b) {
    PyObject *s = text_str(b, b->len);
    text_free(b);
    return s;
}

#include "_fast_repr.c"
#include "_fast_facts.c"

/* A float as ``json_text.number`` writes it. */
static int text_put_number(text_t *b, double v) {
    if (isnan(v)) return PUT_LIT(b, "NaN");
    if (isinf(v)) return v > 0 ? PUT_LIT(b, "Infinity") : PUT_LIT(b, "-Infinity");
    return put_repr(b, v);
}

enum { D_VERSION, D_DATA_PTR, D_REQUIRES_GRAD, D_IS_CPU, D_LAYOUT, D_DTYPE, D_SHAPE, D_IS_CONTIGUOUS, D_IS_NEG,
       D_IS_ZERO, N_DESCR };

/* RecordText's object fields (one list for the struct, the garbage collector's visit and the clearing) */
#define RT_OBJECTS(X) X(cache) X(saved) X(combined) X(prefixes) X(prefix) X(fallback) X(encode_string) X(codes) \
                      X(tensor) X(parameter) X(dtype_bool) X(strided) X(get_num_threads)
#define RT_DECLARE(f) PyObject *f;
#define RT_VISIT(f) Py_VISIT(self->f);
#define RT_CLEAR(f) Py_CLEAR(self->f);

typedef struct {
    PyObject_HEAD
    RT_OBJECTS(RT_DECLARE)
    PyObject *descr[N_DESCR];
    int statistics;
    Py_ssize_t cache_size;
    /* Where the cache's last dropped entry stood (``evict_oldest``): the place in the key table it was found in */
    const void *evict_keys;
    Py_ssize_t evict_pos;
} RecordTextObject;

#define NO_TEXT 1 /* the answer is None: the caller takes the Python route for the whole record */

/* d of t: a getset descriptor's value or a method descriptor's call with no argument. A descriptor of t's class (a
 * tensor's questions, several per record) goes straight to its C function: what the generic call would reach after
 * the same class check. */
static PyObject *descr_get(PyObject *d, PyObject *t) {
    if ((Py_TYPE(d) == &PyGetSetDescr_Type || Py_TYPE(d) == &PyMethodDescr_Type)
        && PyObject_TypeCheck(t, PyDescr_TYPE(d))) {
        if (Py_TYPE(d) == &PyGetSetDescr_Type) {
            PyGetSetDef *g = ((PyGetSetDescrObject *)d)->d_getset;
            if (g->get != NULL) return g->get(t, g->closure);
        } else {
            PyMethodDef *m = ((PyMethodDescrObject *)d)->d_method;
            int flags = m->ml_flags & (METH_VARARGS | METH_KEYWORDS | METH_NOARGS | METH_O | METH_FASTCALL);
            if (flags == METH_NOARGS) return m->ml_meth(t, NULL);
            if (flags == (METH_VARARGS | METH_KEYWORDS)) {
                PyObject *none = PyTuple_New(0);  /* (the empty tuple: no allocation) */
                PyObject *r = none == NULL ? NULL : ((PyCFunctionWithKeywords)(void (*)(void))m->ml_meth)(t, none, NULL);
                Py_XDECREF(none);
                return r;
            }
        }
    }
    descrgetfunc get = Py_TYPE(d)->tp_descr_get;
    if (Py_TYPE(d) == &PyMethodDescr_Type || get == NULL) return PyObject_Vectorcall(d, &t, 1, NULL);
    return get(d, t, (PyObject *)Py_TYPE(t));
}

/* The descriptors named by names[0..n) in the tensor C base class's own dict (never patched by the dump's wrappers),
 * new references into out; -1 with an AttributeError naming the first one missing (out's others then cleared). */
static int load_descriptors(PyObject *base, const char *const *names, int n, PyObject **out) {
    PyObject *dict = ((PyTypeObject *)base)->tp_dict;
    for (int i = 0; i < n; i++) {
        PyObject *d = PyDict_GetItemString(dict, names[i]);
        if (d == NULL) {
            PyErr_Format(PyExc_AttributeError, "the tensor base class has no '%s'", names[i]);
            for (int j = 0; j < i; j++) Py_CLEAR(out[j]);
            return -1;
        }
        out[i] = Py_NewRef(d);
    }
    return 0;
}

/* descr[i] of t. */
static PyObject *tensor_get(RecordTextObject *self, PyObject *t, int i) {
    return descr_get(self->descr[i], t);
}

/* A boolean property or method of t: 1, 0, or -1 with an error. Those of TORCH_FACT_FLAGS are asked of the C++
 * tensor first (_fast_facts.c), then, where it does not say, of torch's Python API. */
static int tensor_flag(RecordTextObject *self, PyObject *t, int i) {
    if (i == D_REQUIRES_GRAD || i == D_IS_CONTIGUOUS || i == D_IS_NEG || i == D_IS_ZERO) {
        TorchTensorFacts f;
        int known = ff_facts(t, TORCH_FACT_FLAGS, &f);
        if (known)
            return known < 0 ? -1 : i == D_REQUIRES_GRAD ? f.requires_grad : i == D_IS_CONTIGUOUS ? f.is_contiguous
                                  : i == D_IS_NEG ? f.is_neg : f.is_zerotensor;
    }
    PyObject *v = tensor_get(self, t, i);
    if (v == NULL) return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* t's version and data address (``_version``, ``data_ptr()``) and, where the C++ tensor says them (one question for
 * the three), its requires_grad (else *grad -1: ``tensor_flag`` asks later): 1; 0 where torch refuses one (an
 * inference tensor, a wrapper without storage: the Python route says why; no error left); -1 with an error. */
static int tensor_ident(RecordTextObject *self, PyObject *t, long long *version, unsigned long long *ptr, int *grad) {
    TorchTensorFacts f;
    int known = ff_facts(t, TORCH_FACT_VERSION | TORCH_FACT_DATA_PTR | TORCH_FACT_FLAGS, &f);
    if (known < 0) return -1;
    if (known) {
        *version = f.version;
        *ptr = f.data_ptr;
        *grad = f.requires_grad;
        return 1;
    }
    *grad = -1;
    PyObject *v = tensor_get(self, t, D_VERSION);
    PyObject *address = v ? tensor_get(self, t, D_DATA_PTR) : NULL;
    *version = v ? PyLong_AsLongLong(v) : -1;
    *ptr = address ? PyLong_AsUnsignedLongLong(address) : 0;
    Py_XDECREF(v);
    Py_XDECREF(address);
    if (address == NULL || PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

/* t's shape as a tuple (a plain one made from the C++ tensor's sizes, else torch's torch.Size: equal, with the same
 * hash) and *numel, the product of its sizes: a new reference, or NULL with an error. */
static PyObject *tensor_shape(RecordTextObject *self, PyObject *t, Py_ssize_t *numel) {
    TorchTensorFacts f;
    int known = ff_facts(t, TORCH_FACT_SIZES, &f);
    if (known < 0) return NULL;
    if (known) {
        PyObject *shape = PyTuple_New(f.dims);
        for (int i = 0; shape != NULL && i < f.dims; i++) {
            PyObject *d = PyLong_FromLongLong(f.sizes[i]);
            if (d == NULL) Py_CLEAR(shape);
            else PyTuple_SET_ITEM(shape, i, d);
        }
        *numel = (Py_ssize_t)f.numel;
        return shape;
    }
    PyObject *shape = tensor_get(self, t, D_SHAPE);
    if (shape == NULL) return NULL;
    if (!PyTuple_Check(shape)) {
        Py_DECREF(shape);
        PyErr_SetString(PyExc_TypeError, "shape is no tuple");
        return NULL;
    }
    *numel = 1;  /* the product of the sizes: no numel() call */
    for (Py_ssize_t i = 0, n = PyTuple_GET_SIZE(shape); i < n; i++) {
        Py_ssize_t d = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i));
        if (d < 0) { Py_DECREF(shape); return NULL; }
        *numel *= d;
    }
    return shape;
}

/* What ``plain_cpu_facts`` says of a tensor. */
enum { FACTS_OTHER = 0,  /* another device or layout (or a dtype code out of the kernel's range) */
       FACTS_PLAIN = 1,  /* a CPU strided contiguous tensor of a kernel dtype: the kernel reads its memory as it is */
       FACTS_COPY = 2 }; /* a CPU strided tensor the kernel reads only through a copy (float16, a strided view) */

/* 1 with the kernel code of dtype in codes ({dtype: kernel code}); 0 where it has none (or with an error). */
static int dtype_code(PyObject *codes, PyObject *dtype, long *code) {
    PyObject *c = PyDict_GetItemWithError(codes, dtype);  /* borrowed */
    if (c == NULL) return 0;
    *code = PyLong_AsLong(c);
    return *code >= 0 && *code < N_KERNELS;
}

/* The plain-CPU-tensor questions the kernel's readers ask of t (device, layout, dtype, contiguity; not its lazy
 * negation and zero-tensor bits, asked by ``entry_body`` only before it reads), through descr (the C base class's
 * own descriptors, indexed by D_*), codes ({dtype: kernel code}) and strided (torch.strided): FACTS_* with, for
 * FACTS_PLAIN, *dtype (a new reference) and *code; -1 with an error. Shared by RecordText and GradText. */
static int plain_cpu_facts(PyObject *const *descr, PyObject *codes, PyObject *strided, PyObject *t, PyObject **dtype,
                           long *code) {
    *dtype = NULL;
    void *p;
    Py_ssize_t n;
    PyObject *known;  /* borrowed */
    /* the C++ tensor asked first (_fast_facts.c: exact Tensor/Parameter only); its 0, or a dtype outside codes: the
     * questions below */
    int plain = ff_plain(t, &p, &n, &known);
    if (plain > 0 && dtype_code(codes, known, code)) {
        *dtype = Py_NewRef(known);
        return FACTS_PLAIN;
    }
    if (plain < 0 || PyErr_Occurred()) return -1;
    PyObject *v = descr_get(descr[D_IS_CPU], t);
    int cpu = v == NULL ? -1 : PyObject_IsTrue(v);
    Py_XDECREF(v);
    if (cpu <= 0) return cpu;
    PyObject *layout = descr_get(descr[D_LAYOUT], t);
    if (layout == NULL) return -1;
    Py_DECREF(layout);  /* compared by identity only */
    if (layout != strided) return FACTS_OTHER;
    PyObject *d = descr_get(descr[D_DTYPE], t);
    if (d == NULL) return -1;
    PyObject *code_obj = PyDict_GetItemWithError(codes, d);  /* borrowed */
    if (code_obj == NULL) {
        Py_DECREF(d);
        return PyErr_Occurred() ? -1 : FACTS_COPY;
    }
    v = descr_get(descr[D_IS_CONTIGUOUS], t);
    int contiguous = v == NULL ? -1 : PyObject_IsTrue(v);
    Py_XDECREF(v);
    long c = contiguous > 0 ? PyLong_AsLong(code_obj) : -1;
    if (contiguous < 0 || (c == -1 && PyErr_Occurred())) { Py_DECREF(d); return -1; }
    if (!contiguous) { Py_DECREF(d); return FACTS_COPY; }
    if (c < 0 || c >= N_KERNELS) { Py_DECREF(d); return FACTS_OTHER; }
    *dtype = d;
    *code = c;
    return FACTS_PLAIN;
}

static int put_object(RecordTextObject *self, text_t *b, PyObject *obj);

/* The Python route's text of obj (``fallback``): 0 written, NO_TEXT, or -1 with an error. */
static int put_fallback(RecordTextObject *self, text_t *b, PyObject *obj) {
    PyObject *s = PyObject_CallOneArg(self->fallback, obj);
    if (s == NULL) return -1;
    int rc = s == Py_None ? NO_TEXT : text_put_str(b, s);
    Py_DECREF(s);
    return rc;
}

/* ``stats_text``: "Max": ..., "Min": ..., "Mean": ..., "Norm": ... of the kernel's row. */
static int put_stats(text_t *b, const double *row, int is_bool, Py_ssize_t numel) {
    if (is_bool) {
        if (PUT_LIT(b, "\"Max\": ") < 0 || (row[0] != 0.0 ? PUT_LIT(b, "true") : PUT_LIT(b, "false")) < 0
            || PUT_LIT(b, ", \"Min\": ") < 0 || (row[1] != 0.0 ? PUT_LIT(b, "true") : PUT_LIT(b, "false")) < 0)
            return -1;
        return PUT_LIT(b, ", \"Mean\": null, \"Norm\": null");
    }
    if (PUT_LIT(b, "\"Max\": ") < 0 || text_put_number(b, row[0]) < 0 || PUT_LIT(b, ", \"Min\": ") < 0
        || text_put_number(b, row[1]) < 0 || PUT_LIT(b, ", \"Mean\": ") < 0
        || text_put_number(b, row[2] / (double)numel) < 0 || PUT_LIT(b, ", \"Norm\": ") < 0)
        return -1;
    return text_put_number(b, sqrt(row[3]));
}

/* e's summary text up to '"requires_grad": ' (``Summarizer._text_body``) from its facts (prefix, numel, code,
 * is_bool): a new str, Py_None (NO_TEXT), or NULL with an error. Statistics shared into e->stats are taken as
 * they are; otherwise the kernel reads t's memory, after making sure it holds the values as they are (e then
 * plain: an in-place update keeps it so). */
static PyObject *entry_body(RecordTextObject *self, PyObject *t, EntryObject *e) {
    text_t b;
    text_init(&b);
    if (text_put_str(&b, e->prefix) < 0) goto fail;
    if (e->numel == 0 || !self->statistics) {
        if (PUT_LIT(&b, "\"Max\": null, \"Min\": null, \"Mean\": null, \"Norm\": null") < 0) goto fail;
        e->plain = 1;  /* nothing read, now or for a later version of the same shape */
    } else {
        double row[6];
        if (e->has_row) {  /* this version's row, made by the kernel before */
            memcpy(row, e->row, sizeof(row));
        } else if (e->stats != NULL && e->stats != Py_None) {  /* shared from the input it rearranges, or the dict route's */
            if (!PyTuple_Check(e->stats) || PyTuple_GET_SIZE(e->stats) < 4
                || !PyFloat_CheckExact(PyTuple_GET_ITEM(e->stats, 0))) {  /* statistics on their way from the device */
                text_free(&b);
                Py_RETURN_NONE;
            }
            for (int i = 0; i < 4; i++) {
                row[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(e->stats, i));
                if (row[i] == -1.0 && PyErr_Occurred()) goto fail;
            }
        } else {  /* ``host_stats``: a lazy negation or a zero tensor takes torch's reductions (None) */
            if (!e->plain) {
                int neg = tensor_flag(self, t, D_IS_NEG);
                int zero = neg == 0 ? tensor_flag(self, t, D_IS_ZERO) : 0;
                if (neg < 0 || zero < 0) goto fail;
                if (neg || zero) { text_free(&b); Py_RETURN_NONE; }
            }
            void *p = (void *)(uintptr_t)e->ptr;
            if (p == NULL) { text_free(&b); Py_RETURN_NONE; }
            long threads = 1;
            if (e->numel >= PARALLEL_MIN) {
                PyObject *n = PyObject_CallNoArgs(self->get_num_threads);
                if (n == NULL) goto fail;
                threads = PyLong_AsLong(n);
                Py_DECREF(n);
                if (threads == -1 && PyErr_Occurred()) goto fail;
                if (threads < 1) threads = 1;
            }
            acc_t a;
            if (threads > 1) {
                Py_BEGIN_ALLOW_THREADS
                KERNELS[e->code](p, e->numel, 0.0, 0, (int)threads, &a);
                Py_END_ALLOW_THREADS
            } else {
                KERNELS[e->code](p, e->numel, 0.0, 0, 1, &a);
            }
            if (a.nans > 0) a.mx = a.mn = NAN;  /* as stats() gives them (no zero count) */
            row[0] = a.mx; row[1] = a.mn; row[2] = a.sum; row[3] = a.sumsq; row[4] = 0.0; row[5] = a.nans;
            memcpy(e->row, row, sizeof(row));  /* ``stats`` makes its tuple from it if Python asks */
            Py_CLEAR(e->stats);
            e->has_row = 1;
            e->plain = 1;
        }
        if (put_stats(&b, row, e->is_bool, e->numel) < 0) goto fail;
    }
    if (PUT_LIT(&b, ", \"requires_grad\": ") < 0) goto fail;
    return text_finish(&b);
fail:
    text_free(&b);
    return NULL;
}

/* The summary text up to '"requires_grad": ' of a fresh entry (``Summarizer._text_body``): t's facts read and
 * kept in e, then ``entry_body``. */
static PyObject *make_body(RecordTextObject *self, PyObject *t, EntryObject *e, PyObject *dtype, long code) {
    Py_ssize_t numel;
    PyObject *shape = tensor_shape(self, t, &numel);
    if (shape == NULL) return NULL;
    PyObject *key = PyTuple_Pack(2, dtype, shape);
    if (key == NULL) { Py_DECREF(shape); return NULL; }
    PyObject *prefix = PyDict_GetItemWithError(self->prefixes, key);  /* borrowed */
    Py_XINCREF(prefix);
    if (prefix == NULL && !PyErr_Occurred())
        prefix = PyObject_Call(self->prefix, key, NULL);
    Py_DECREF(key);
    if (prefix == NULL || !PyUnicode_Check(prefix)) {
        if (prefix != NULL) PyErr_SetString(PyExc_TypeError, "a prefix is no str");
        Py_XDECREF(prefix);
        Py_DECREF(shape);
        return NULL;
    }
    Py_XSETREF(e->prefix, prefix);
    Py_XSETREF(e->shape, shape);
    e->numel = numel;
    e->code = code;
    e->is_bool = dtype == self->dtype_bool;
    e->plain = 0;
    return entry_body(self, t, e);
}

/* Is t laid out as when e's facts were read (same shape, still contiguous)? 1, 0, or -1 with an error. */
static int same_layout(RecordTextObject *self, PyObject *t, EntryObject *e) {
    TorchTensorFacts f;  /* the C++ tensor's sizes compared with e's as they are: no shape object made */
    int known = ff_facts(t, TORCH_FACT_SIZES | TORCH_FACT_FLAGS, &f);
    if (known < 0) return -1;
    if (known) {
        if (PyTuple_GET_SIZE(e->shape) != f.dims) return 0;
        for (int i = 0; i < f.dims; i++) {
            long long d = PyLong_AsLongLong(PyTuple_GET_ITEM(e->shape, i));
            if (d == -1 && PyErr_Occurred()) return -1;
            if (d != f.sizes[i]) return 0;
        }
        return f.is_contiguous;
    }
    PyObject *shape = tensor_get(self, t, D_SHAPE);
    if (shape == NULL) return -1;
    int same = PyObject_RichCompareBool(shape, e->shape, Py_EQ);
    Py_DECREF(shape);
    return same == 1 ? tensor_flag(self, t, D_IS_CONTIGUOUS) : same;
}

/* The cached entry c of t, moved to t's new version in place (a known tensor updated in place: no new weak
 * reference and entry, the cache's order as a new entry under the same key leaves it): 1 done, 0 when t must
 * take the fresh entry's route (facts unknown, another layout, a saved file or checksum tied to the old
 * version), -1 with an error. */
static int entry_update(RecordTextObject *self, PyObject *t, EntryObject *c, long long version) {
    if (c->prefix == NULL || !c->plain || c->file != NULL || c->crc != NULL) return 0;
    int same = same_layout(self, t, c);
    if (same <= 0) return same;
    c->version = version;
    Py_CLEAR(c->stats);
    c->has_row = 0;
    Py_CLEAR(c->text);
    return 1;
}

/* The cache's oldest entry dropped (``Summarizer._evict``): 0, or -1 with an error. A dict keeps its entries in
 * insertion order in its key table, a deleted one left there as an empty place until the table is made anew (when
 * it grows, or by clear()): the search for the first entry starts after the place of the one dropped last while
 * the table is the one it was found in (every place before it is empty), instead of stepping over all the empty
 * places from the start again (about 40 on average, with the summarizer's 96 entries). */
static int evict_oldest(RecordTextObject *self) {
    const void *keys = ((PyDictObject *)self->cache)->ma_keys;
    Py_ssize_t pos = keys == self->evict_keys ? self->evict_pos : 0;
    PyObject *oldest, *value;
    if (!PyDict_Next(self->cache, &pos, &oldest, &value)) {
        pos = 0;  /* (nothing after it: the table looked at from the start) */
        if (!PyDict_Next(self->cache, &pos, &oldest, &value)) return 0;
    }
    self->evict_keys = keys;
    self->evict_pos = pos;
    Py_INCREF(oldest);
    int rc = PyDict_DelItem(self->cache, oldest);
    Py_DECREF(oldest);
    return rc;
}

/* ``Summarizer._entry``: the cached entry of this version of t, or a new one (the oldest dropped beyond
 * cache_size). ``absent``: the cache was just seen to hold nothing under key (not looked up again). A new
 * reference, or NULL with an error. */
static EntryObject *find_entry(RecordTextObject *self, PyObject *t, PyObject *key, long long version,
                               unsigned long long ptr, int absent) {
    PyObject *found = absent ? NULL : PyDict_GetItemWithError(self->cache, key);
    if (found == NULL && !PyErr_Occurred()) found = PyDict_GetItemWithError(self->saved, key);
    if (found == NULL && PyErr_Occurred()) return NULL;
    if (found != NULL && Py_TYPE(found) == &EntryType) {
        EntryObject *e = (EntryObject *)found;
        if (PyWeakref_GetObject(e->ref) == t && e->version == version && e->ptr == ptr) {
            Py_INCREF(found);
            return e;
        }
    }
    PyObject *ref = PyWeakref_NewRef(t, NULL);
    if (ref == NULL) return NULL;
    EntryObject *e = entry_new(ref, version, ptr);
    Py_DECREF(ref);
    if (e == NULL) return NULL;
    if (PyDict_SetItem(self->cache, key, (PyObject *)e) < 0) { Py_DECREF(e); return NULL; }
    if (PyDict_GET_SIZE(self->cache) > self->cache_size && evict_oldest(self) < 0) { Py_DECREF(e); return NULL; }
    return e;
}

/* ``Summarizer.tensor_text`` of a plain tensor (torch.Tensor or Parameter); what it does not read is given to
 * ``fallback`` (the Python route) when asked, else NO_TEXT. */
static int put_tensor(RecordTextObject *self, text_t *b, PyObject *t, int fallback) {
    if (PyDict_GET_SIZE(self->combined)) return fallback ? put_fallback(self, b, t) : NO_TEXT;
    long long version;
    unsigned long long ptr;
    int grad;
    int ident = tensor_ident(self, t, &version, &ptr, &grad);
    if (ident <= 0) return ident < 0 ? -1 : fallback ? put_fallback(self, b, t) : NO_TEXT;
    PyObject *key = PyLong_FromVoidPtr(t);
    if (key == NULL) return -1;
    Py_ssize_t start = b->len;
    int rc = -1;
    EntryObject *e = NULL;
    PyObject *dtype = NULL;
    PyObject *found = PyDict_GetItemWithError(self->cache, key);  /* the usual case: this version's text is made */
    if (found != NULL && Py_TYPE(found) == &EntryType) {
        EntryObject *c = (EntryObject *)found;  /* borrowed: held (as e) before torch is asked anything */
        if (c->ptr == ptr && PyWeakref_GetObject(c->ref) == t) {
            if (c->version == version && c->text != NULL && c->text != Py_None) {
                e = c;
                Py_INCREF(e);
            } else if (c->version != version) {  /* updated in place: only its statistics are new */
                e = c;
                Py_INCREF(e);
                int moved = entry_update(self, t, e, version);
                if (moved < 0) goto done;
                if (!moved) {
                    Py_CLEAR(e);
                } else {
                    PyObject *body = entry_body(self, t, e);
                    if (body == NULL) goto done;
                    if (body == Py_None) { Py_DECREF(body); rc = NO_TEXT; goto done; }
                    e->text = body;
                }
            }
        }
    } else if (found == NULL && PyErr_Occurred()) {
        goto done;
    }
    if (e == NULL) {
        long code = -1;
        int facts = plain_cpu_facts(self->descr, self->codes, self->strided, t, &dtype, &code);
        if (facts < 0) goto done;
        if (facts == FACTS_OTHER) { rc = NO_TEXT; goto done; }
        if (facts == FACTS_COPY) {  /* float16, a strided view: the Python route (a copy) */
            Py_DECREF(key);
            return fallback ? put_fallback(self, b, t) : NO_TEXT;
        }
        e = find_entry(self, t, key, version, ptr, found == NULL);
        if (e == NULL) goto done;
        if (e->text == NULL || e->text == Py_None) {
            PyObject *body = make_body(self, t, e, dtype, code);
            if (body == NULL) goto done;
            if (body == Py_None) { Py_DECREF(body); rc = NO_TEXT; goto done; }
            Py_XSETREF(e->text, body);
        }
    }
    if (grad < 0) grad = tensor_flag(self, t, D_REQUIRES_GRAD);
    if (grad < 0 || text_put_str(b, e->text) < 0) goto done;
    rc = grad ? PUT_LIT(b, "true}") : PUT_LIT(b, "false}");
done:
    Py_DECREF(key);
    Py_XDECREF(e);
    Py_XDECREF(dtype);
    if (rc < 0 && PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_Clear();  /* torch refused a question (a tensor without storage...): the Python route says why */
        b->len = start;
        rc = fallback ? put_fallback(self, b, t) : NO_TEXT;
    }
    return rc;
}

/* A dict key as ``json_text.obj`` writes it: encode_string(str(key)). */
static int put_key(RecordTextObject *self, text_t *b, PyObject *key) {
    PyObject *s = PyUnicode_CheckExact(key) ? (Py_INCREF(key), key) : PyObject_Str(key);
    if (s == NULL) return -1;
    int plain = PyUnicode_IS_ASCII(s);
    if (plain) {
        const Py_UCS1 *c = PyUnicode_1BYTE_DATA(s);
        for (Py_ssize_t i = 0, n = PyUnicode_GET_LENGTH(s); i < n && plain; i++)
            plain = c[i] >= 0x20 && c[i] != '"' && c[i] != '\\' && c[i] != 0x7f;
    }
    int rc;
    if (plain) {
        rc = PUT_LIT(b, "\"") < 0 || text_put_str(b, s) < 0 ? -1 : PUT_LIT(b, "\"");
    } else {
        PyObject *encoded = PyObject_CallOneArg(self->encode_string, s);
        rc = encoded == NULL ? -1 : text_put_str(b, encoded);
        Py_XDECREF(encoded);
    }
    Py_DECREF(s);
    return rc;
}

/* ``SummarizerBase.text`` of a sequence's items: "[a, b, ...]". */
static int put_items(RecordTextObject *self, text_t *b, PyObject *const *items, Py_ssize_t n) {
    if (PUT_LIT(b, "[") < 0) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i && PUT_LIT(b, ", ") < 0) return -1;
        int rc = put_object(self, b, items[i]);
        if (rc) return rc;
    }
    return PUT_LIT(b, "]");
}

static int put_object(RecordTextObject *self, text_t *b, PyObject *obj) {
    PyTypeObject *type = Py_TYPE(obj);
    if (type == (PyTypeObject *)self->tensor || type == (PyTypeObject *)self->parameter)
        return put_tensor(self, b, obj, 1);
    if (obj == Py_None) return PUT_LIT(b, "null");
    if (type == &PyFloat_Type) {
        if (PUT_LIT(b, "{\"type\": \"float\", \"value\": ") < 0 || text_put_number(b, PyFloat_AS_DOUBLE(obj)) < 0)
            return -1;
        return PUT_LIT(b, "}");
    }
    if (type == &PyBool_Type)
        return obj == Py_True ? PUT_LIT(b, "{\"type\": \"bool\", \"value\": true}")
                              : PUT_LIT(b, "{\"type\": \"bool\", \"value\": false}");
    if (type == &PyLong_Type) {
        PyObject *s = PyObject_Str(obj);
        if (s == NULL) return -1;
        int rc = PUT_LIT(b, "{\"type\": \"int\", \"value\": ") < 0 || text_put_str(b, s) < 0 ? -1 : PUT_LIT(b, "}");
        Py_DECREF(s);
        return rc;
    }
    if (type == &PyTuple_Type) return put_items(self, b, &PyTuple_GET_ITEM(obj, 0), PyTuple_GET_SIZE(obj));
    if (type == &PyList_Type) {  /* a list the user's code could change meanwhile: its items held while written */
        PyObject *items = PyList_AsTuple(obj);
        if (items == NULL) return -1;
        int rc = put_items(self, b, &PyTuple_GET_ITEM(items, 0), PyTuple_GET_SIZE(items));
        Py_DECREF(items);
        return rc;
    }
    if (type == &PyDict_Type) {
        PyObject *items = PyDict_Items(obj);
        if (items == NULL) return -1;
        int rc = PUT_LIT(b, "{");
        for (Py_ssize_t i = 0, n = PyList_GET_SIZE(items); i < n && rc == 0; i++) {
            PyObject *kv = PyList_GET_ITEM(items, i);
            if ((i && PUT_LIT(b, ", ") < 0) || put_key(self, b, PyTuple_GET_ITEM(kv, 0)) < 0 || PUT_LIT(b, ": ") < 0)
                rc = -1;
            else
                rc = put_object(self, b, PyTuple_GET_ITEM(kv, 1));
        }
        Py_DECREF(items);
        return rc ? rc : PUT_LIT(b, "}");
    }
    return put_fallback(self, b, obj);  /* strings, dtypes, subclasses, torch.Size, ...: as the Python route writes them */
}

/* A finished text, Py_None for NO_TEXT, or NULL. */
static PyObject *finish(text_t *b, int rc) {
    if (rc) {
        text_free(b);
        if (rc < 0) return NULL;
        Py_RETURN_NONE;
    }
    return text_finish(b);
}

static PyObject *rt_text(RecordTextObject *self, PyObject *obj) {
    text_t b;
    text_init(&b);
    return finish(&b, put_object(self, &b, obj));
}

static PyObject *rt_tensor(RecordTextObject *self, PyObject *t) {
    if (Py_TYPE(t) != (PyTypeObject *)self->tensor && Py_TYPE(t) != (PyTypeObject *)self->parameter) Py_RETURN_NONE;
    text_t b;
    text_init(&b);
    return finish(&b, put_tensor(self, &b, t, 0));
}

/* ``inputs``' text of (args, kwargs) into b: 0, NO_TEXT, or -1 with an error. */
static int put_inputs(RecordTextObject *self, text_t *b, PyObject *args, PyObject *kwargs) {
    int rc = PUT_LIT(b, "{\"input_args\": ");
    if (rc == 0) rc = put_object(self, b, args);
    if (rc >= 0) {  /* the kwargs' summaries are made even when the args' are not (the Python route's order) */
        int empty = PyObject_Not(kwargs);
        int kwrc = empty < 0 ? -1 : PUT_LIT(b, ", \"input_kwargs\": ");
        if (kwrc == 0) kwrc = empty ? PUT_LIT(b, "{}") : put_object(self, b, kwargs);
        if (kwrc) rc = rc == 0 || kwrc < 0 ? kwrc : rc;
    }
    return rc;
}

static PyObject *rt_inputs(RecordTextObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "inputs(args, kwargs) takes 2 arguments");
        return NULL;
    }
    text_t b;
    text_init(&b);
    return finish(&b, put_inputs(self, &b, args[0], args[1]));
}

/* ``record``'s text after the head (the inputs' text): the output's, then the record's end, into b: 0, NO_TEXT, or
 * -1 with an error. */
static int put_output(RecordTextObject *self, text_t *b, PyObject *out) {
    int rc = PUT_LIT(b, ", \"output\": ");
    if (rc == 0) {
        if (PyList_CheckExact(out) || PyTuple_CheckExact(out)) {
            rc = put_object(self, b, out);
        } else if (PyList_Check(out) || PyTuple_Check(out)) {  /* list(out), as the Python route takes it */
            PyObject *items = PySequence_List(out);
            rc = items == NULL ? -1 : put_object(self, b, items);
            Py_XDECREF(items);
        } else {
            rc = PUT_LIT(b, "[");
            if (rc == 0) rc = put_object(self, b, out);
            if (rc == 0) rc = PUT_LIT(b, "]");
        }
    }
    return rc == 0 ? PUT_LIT(b, "}") : rc;
}

static PyObject *rt_record(RecordTextObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyUnicode_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "record(head, out) takes a str and the call's output");
        return NULL;
    }
    text_t b;
    text_init(&b);
    int rc = text_put_str(&b, args[0]);
    return finish(&b, rc == 0 ? put_output(self, &b, args[1]) : rc);
}

static const char *const DESCR_NAMES[N_DESCR] = {"_version", "data_ptr", "requires_grad", "is_cpu", "layout", "dtype",
                                           "shape", "is_contiguous", "is_neg", "_is_zerotensor"};

static PyObject *rt_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"cache", "saved", "combined", "prefixes", "prefix", "fallback", "encode_string", "codes",
                         "tensor", "parameter", "tensor_base", "dtype_bool", "strided", "get_num_threads",
                         "statistics", "cache_size", NULL};
    PyObject *cache, *saved, *combined, *prefixes, *prefix, *fallback, *encode_string, *codes, *tensor, *parameter;
    PyObject *base, *dtype_bool, *strided, *get_num_threads;
    int statistics;
    Py_ssize_t cache_size;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!O!O!OOOO!OOOOOOpn:RecordText", kw, &PyDict_Type, &cache,
                                     &PyDict_Type, &saved, &PyDict_Type, &combined, &PyDict_Type, &prefixes, &prefix,
                                     &fallback, &encode_string, &PyDict_Type, &codes, &tensor, &parameter, &base,
                                     &dtype_bool, &strided, &get_num_threads, &statistics, &cache_size))
        return NULL;
    if (!PyType_Check(tensor) || !PyType_Check(parameter) || !PyType_Check(base)) {
        PyErr_SetString(PyExc_TypeError, "tensor, parameter and tensor_base must be types");
        return NULL;
    }
    RecordTextObject *self = (RecordTextObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    PyObject *fields[] = {cache, saved, combined, prefixes, prefix, fallback, encode_string, codes, tensor, parameter,
                          dtype_bool, strided, get_num_threads};
    PyObject **slots[] = {&self->cache, &self->saved, &self->combined, &self->prefixes, &self->prefix,
                          &self->fallback, &self->encode_string, &self->codes, &self->tensor, &self->parameter,
                          &self->dtype_bool, &self->strided, &self->get_num_threads};
    for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++) {
        Py_INCREF(fields[i]);
        *slots[i] = fields[i];
    }
    if (load_descriptors(base, DESCR_NAMES, N_DESCR, self->descr) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    self->statistics = statistics;
    self->cache_size = cache_size;
    return (PyObject *)self;
}

static int rt_traverse(RecordTextObject *self, visitproc visit, void *arg) {
    RT_OBJECTS(RT_VISIT)
    for (int i = 0; i < N_DESCR; i++) Py_VISIT(self->descr[i]);
    return 0;
}

static int rt_clear(RecordTextObject *self) {
    RT_OBJECTS(RT_CLEAR)
    for (int i = 0; i < N_DESCR; i++) Py_CLEAR(self->descr[i]);
    return 0;
}

static void rt_dealloc(RecordTextObject *self) {
    PyObject_GC_UnTrack(self);
    rt_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef rt_methods[] = {
    {"text", (PyCFunction)rt_text, METH_O, "text(obj) -> the JSON text of obj's summary, or None"},
    {"tensor", (PyCFunction)rt_tensor, METH_O,
     "tensor(t) -> the JSON text of the plain tensor t's summary where made here, else None (never the fallback)"},
    {"inputs", (PyCFunction)(void (*)(void))rt_inputs, METH_FASTCALL,
     "inputs(args, kwargs) -> '{\"input_args\": ..., \"input_kwargs\": ...' (no closing brace), or None"},
    {"record", (PyCFunction)(void (*)(void))rt_record, METH_FASTCALL,
     "record(head, out) -> head + ', \"output\": [...]}', or None"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RecordTextType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "msprobe_core.stats._fast_stats.RecordText",
    .tp_basicsize = sizeof(RecordTextObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The dump's forward record text in C (see record_text.py)",
    .tp_new = rt_new,
    .tp_dealloc = (destructor)rt_dealloc,
    .tp_traverse = (traverseproc)rt_traverse,
    .tp_clear = (inquiry)rt_clear,
    .tp_methods = rt_methods,
};

/* Adds Entry, RecordText and repr_check to the module. */
static int add_record_text(PyObject *m) {
    if (PyType_Ready(&EntryType) < 0 || PyType_Ready(&RecordTextType) < 0 || PyModule_AddFunctions(m, repr_methods) < 0)
        return -1;
    Py_INCREF(&EntryType);
    if (PyModule_AddObject(m, "Entry", (PyObject *)&EntryType) < 0) { Py_DECREF(&EntryType); return -1; }
    Py_INCREF(&RecordTextType);
    if (PyModule_AddObject(m, "RecordText", (PyObject *)&RecordTextType) < 0) { Py_DECREF(&RecordTextType); return -1; }
    return 0;
}
/* ==================================================================================== end of record text */

/* ========================================================================================== gradient text
 * The dump's gradients as JSON text without the per-version cache (``Summarizer.grad_text`` in
 * ``pytorch/summarize.py``, used by ``dump/call_records.py`` at level L0): a gradient is read once or twice
 * (as one call's input gradient, then as the next call's output gradient, in two successive hooks), so a
 * cache entry and weak reference per gradient (objects the garbage collector tracks until the step ends)
 * buy nothing. The last gradient read with ``remember`` is kept (a strong reference, until the next one or
 * ``clear``): the next hook reading that same tensor, unchanged, takes its text as it is.
 *
 *   GradText(record_text)
 *     .text(t, remember) -> RecordText's text of one plain dense CPU tensor of the kernel's dtypes, or None
 *                           (anything else: the caller takes ``tensor_text``)
 *     .clear()           -> forget the last gradient */

typedef struct {
    PyObject_HEAD
    RecordTextObject *rt;
    PyObject *last;           /* the last gradient read with remember (NULL: none) */
    PyObject *body;           /* its text up to '"requires_grad": ' */
    long long version;
    unsigned long long ptr;
} GradTextObject;

static PyObject *gt_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *rt;
    if (!PyArg_ParseTuple(args, "O!:GradText", &RecordTextType, &rt)) return NULL;
    GradTextObject *self = (GradTextObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    Py_INCREF(rt);
    self->rt = (RecordTextObject *)rt;
    self->last = self->body = NULL;
    return (PyObject *)self;
}

/* The body of t (a new reference), Py_None when the Python route must say, NULL with an error. */
static PyObject *gt_body(GradTextObject *self, PyObject *t, long long version, unsigned long long ptr) {
    RecordTextObject *rt = self->rt;
    PyObject *dtype;
    long code = -1;
    int facts = plain_cpu_facts(rt->descr, rt->codes, rt->strided, t, &dtype, &code);
    if (facts != FACTS_PLAIN) return facts < 0 ? NULL : Py_NewRef(Py_None);
    EntryObject *e = entry_new(Py_None, version, ptr);  /* for make_body only: never cached */
    PyObject *body = e == NULL ? NULL : make_body(rt, t, e, dtype, code);
    Py_XDECREF(e);
    Py_DECREF(dtype);
    return body;
}

static PyObject *gt_text(GradTextObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "text(t, remember) takes 2 arguments");
        return NULL;
    }
    PyObject *t = args[0];
    int remember = PyObject_IsTrue(args[1]);
    RecordTextObject *rt = self->rt;
    if (remember < 0) return NULL;
    if ((Py_TYPE(t) != (PyTypeObject *)rt->tensor && Py_TYPE(t) != (PyTypeObject *)rt->parameter)
        || PyDict_GET_SIZE(rt->combined))
        Py_RETURN_NONE;
    long long version;
    unsigned long long ptr;
    int grad;
    int ident = tensor_ident(rt, t, &version, &ptr, &grad);
    if (ident <= 0) return ident < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *body;
    if (t == self->last && version == self->version && ptr == self->ptr) {
        body = self->body;
        Py_INCREF(body);
    } else {
        body = gt_body(self, t, version, ptr);
        if (body == NULL) {  /* torch refused a question: the Python route says why */
            if (!PyErr_ExceptionMatches(PyExc_Exception)) return NULL;
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        if (body == Py_None) return body;
        if (remember) {
            Py_INCREF(t);
            Py_XSETREF(self->last, t);
            Py_INCREF(body);
            Py_XSETREF(self->body, body);
            self->version = version;
            self->ptr = ptr;
        }
    }
    if (grad < 0) grad = tensor_flag(rt, t, D_REQUIRES_GRAD);
    if (grad < 0) { Py_DECREF(body); return NULL; }
    text_t b;
    text_init(&b);
    int rc = text_put_str(&b, body);
    Py_DECREF(body);
    if (rc == 0) rc = grad ? PUT_LIT(&b, "true}") : PUT_LIT(&b, "false}");
    return finish(&b, rc);
}

static int gt_clear(GradTextObject *self) {
    Py_CLEAR(self->last);
    Py_CLEAR(self->body);
    return 0;
}

static PyObject *gt_forget(GradTextObject *self, PyObject *unused) {
    gt_clear(self);
    Py_RETURN_NONE;
}

static int gt_traverse(GradTextObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->rt);
    Py_VISIT(self->last);
    return 0;
}

static void gt_dealloc(GradTextObject *self) {
    PyObject_GC_UnTrack(self);
    gt_clear(self);
    Py_CLEAR(self->rt);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef gt_methods[] = {
    {"text", (PyCFunction)(void (*)(void))gt_text, METH_FASTCALL,
     "text(t, remember) -> the JSON text of the gradient t's summary, or None (the caller's Python route)"},
    {"clear", (PyCFunction)gt_forget, METH_NOARGS, "clear() -> forget the last gradient read"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject GradTextType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "msprobe_core.stats._fast_stats.GradText",
    .tp_basicsize = sizeof(GradTextObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The dump's gradient text in C, without the per-version cache (see summarize.py)",
    .tp_new = gt_new,
    .tp_dealloc = (destructor)gt_dealloc,
    .tp_traverse = (traverseproc)gt_traverse,
    .tp_clear = (inquiry)gt_clear,
    .tp_methods = gt_methods,
};

static int add_grad_text(PyObject *m) {
    if (PyType_Ready(&GradTextType) < 0) return -1;
    Py_INCREF(&GradTextType);
    if (PyModule_AddObject(m, "GradText", (PyObject *)&GradTextType) < 0) { Py_DECREF(&GradTextType); return -1; }
    return 0;
}
/* =================================================================================== end of gradient text */

/* ======================================================================================= autograd walk
 * ``backward_capture._walk`` in C (same arguments, same answer; the Python one stays the fallback): a call's
 * nodes with edges to its inputs, found from its output nodes through the nodes made during the call.
 *
 *   walk(roots, slots, skip, begin, end, leaf_inputs, accumulate_grad) -> (hits, counts) */

/* id(obj) << 32 | low, as the Python walk makes its keys (a new reference). */
static PyObject *edge_key(PyObject *obj, long low) {
    PyObject *id = PyLong_FromVoidPtr(obj), *shift = PyLong_FromLong(32), *lo = PyLong_FromLong(low);
    PyObject *high = id && shift ? PyNumber_Lshift(id, shift) : NULL;
    PyObject *key = high && lo ? PyNumber_Or(high, lo) : NULL;
    Py_XDECREF(id); Py_XDECREF(shift); Py_XDECREF(lo); Py_XDECREF(high);
    return key;
}

/* Is node's sequence number within [begin, end)? 1, 0, or -1 with an error. */
static int made_in_call(PyObject *node, long long begin, long long end) {
    PyObject *nr = PyObject_CallMethod(node, "_sequence_nr", NULL);
    if (nr == NULL) return -1;
    long long n = PyLong_AsLongLong(nr);
    Py_DECREF(nr);
    if (n == -1 && PyErr_Occurred()) return -1;
    return begin <= n && n < end;
}

/* One node's edges to the inputs, added to found (key -> [edges]) and counts; nodes of the call to visit next
 * pushed on stack. 0, or -1 with an error. */
static int walk_node(PyObject *node, PyObject *slots, PyObject *skip, long long begin, long long end, int leaf_inputs,
                     PyObject *accumulate, PyObject *stack, PyObject *seen, PyObject *found, PyObject *counts) {
    PyObject *next = PyObject_GetAttrString(node, "next_functions");
    if (next == NULL) return -1;
    PyObject *items = PySequence_Fast(next, "next_functions is no sequence");
    Py_DECREF(next);
    if (items == NULL) return -1;
    int rc = 0;
    for (Py_ssize_t edge = 0, n = PySequence_Fast_GET_SIZE(items); edge < n && rc == 0; edge++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(items, edge);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) { PyErr_SetString(PyExc_TypeError, "an edge is no pair"); rc = -1; break; }
        PyObject *nxt = PyTuple_GET_ITEM(pair, 0);
        if (nxt == Py_None) continue;
        PyObject *key;
        if ((PyObject *)Py_TYPE(nxt) == accumulate) {
            if (!leaf_inputs) continue;
            PyObject *var = PyObject_GetAttrString(nxt, "variable");
            key = var == NULL ? NULL : edge_key(var, 0);
            Py_XDECREF(var);
            if (key == NULL) { rc = -1; break; }
            int in = PyDict_Contains(slots, key);
            if (in <= 0) { Py_DECREF(key); rc = in; continue; }
        } else {
            long nr = PyLong_AsLong(PyTuple_GET_ITEM(pair, 1));
            if (nr == -1 && PyErr_Occurred()) { rc = -1; break; }
            key = edge_key(nxt, nr + 1);
            if (key == NULL) { rc = -1; break; }
            int in = PyDict_Contains(slots, key);
            if (in <= 0) {
                Py_DECREF(key);
                if (in < 0) { rc = -1; break; }
                int known = PySet_Contains(seen, nxt);
                int mine = known == 0 ? made_in_call(nxt, begin, end) : 0;
                if (known < 0 || mine < 0) { rc = -1; break; }
                if (mine && (PySet_Add(seen, nxt) < 0 || PyList_Append(stack, nxt) < 0)) rc = -1;
                continue;
            }
        }
        int skipped = PyDict_Contains(skip, key);
        if (skipped != 0) { Py_DECREF(key); rc = skipped < 0 ? -1 : 0; continue; }
        PyObject *edges = PyDict_GetItemWithError(found, key);  /* borrowed */
        PyObject *index = PyLong_FromSsize_t(edge);
        if (index == NULL || (edges == NULL && PyErr_Occurred())) { Py_XDECREF(index); Py_DECREF(key); rc = -1; break; }
        if (edges == NULL) {
            edges = PyList_New(0);
            if (edges == NULL || PyDict_SetItem(found, key, edges) < 0) { Py_XDECREF(edges); Py_DECREF(index); Py_DECREF(key); rc = -1; break; }
            Py_DECREF(edges);  /* found holds it */
        }
        PyObject *count = PyDict_GetItemWithError(counts, key);
        long c = count == NULL ? 0 : PyLong_AsLong(count);
        PyObject *c1 = PyErr_Occurred() ? NULL : PyLong_FromLong(c + 1);
        if (PyList_Append(edges, index) < 0 || c1 == NULL || PyDict_SetItem(counts, key, c1) < 0) rc = -1;
        Py_XDECREF(c1);
        Py_DECREF(index);
        Py_DECREF(key);
    }
    Py_DECREF(items);
    return rc;
}

/* ((key, (edge, ...)), ...) of found, in its order (a new reference). */
static PyObject *node_hits(PyObject *found) {
    PyObject *out = PyTuple_New(PyDict_GET_SIZE(found));
    Py_ssize_t pos = 0, i = 0;
    PyObject *key, *edges;
    while (out != NULL && PyDict_Next(found, &pos, &key, &edges)) {
        PyObject *t = PyList_AsTuple(edges);
        PyObject *pair = t == NULL ? NULL : PyTuple_Pack(2, key, t);
        Py_XDECREF(t);
        if (pair == NULL) { Py_CLEAR(out); break; }
        PyTuple_SET_ITEM(out, i++, pair);
    }
    return out;
}

static PyObject *walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 || !PyList_Check(args[0]) || !PyDict_Check(args[1]) || !PyDict_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "walk(roots, slots, skip, begin, end, leaf_inputs, accumulate_grad)");
        return NULL;
    }
    PyObject *slots = args[1], *skip = args[2], *accumulate = args[6];
    long long begin = PyLong_AsLongLong(args[3]), end = PyLong_AsLongLong(args[4]);
    int leaf_inputs = PyObject_IsTrue(args[5]);
    if (PyErr_Occurred() || leaf_inputs < 0) return NULL;
    PyObject *stack = PyList_New(0), *seen = PySet_New(NULL), *hits = PyList_New(0), *counts = PyDict_New();
    PyObject *result = NULL;
    if (stack == NULL || seen == NULL || hits == NULL || counts == NULL) goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(args[0]); i++) {  /* outputs of one node share it: walked once */
        PyObject *root = PyList_GET_ITEM(args[0], i);
        int known = PySet_Contains(seen, root);
        if (known < 0 || (!known && (PySet_Add(seen, root) < 0 || PyList_Append(stack, root) < 0))) goto done;
    }
    while (PyList_GET_SIZE(stack)) {
        Py_ssize_t last = PyList_GET_SIZE(stack) - 1;
        PyObject *node = PyList_GET_ITEM(stack, last);
        Py_INCREF(node);
        PyObject *found = PyDict_New();
        int rc = found == NULL || PyList_SetSlice(stack, last, last + 1, NULL) < 0 ? -1
                 : walk_node(node, slots, skip, begin, end, leaf_inputs, accumulate, stack, seen, found, counts);
        if (rc == 0 && PyDict_GET_SIZE(found)) {
            PyObject *nh = node_hits(found);
            PyObject *hit = nh == NULL ? NULL : PyTuple_Pack(2, node, nh);
            Py_XDECREF(nh);
            if (hit == NULL || PyList_Append(hits, hit) < 0) rc = -1;
            Py_XDECREF(hit);
        }
        Py_XDECREF(found);
        Py_DECREF(node);
        if (rc < 0) goto done;
    }
    result = PyTuple_Pack(2, hits, counts);
done:
    Py_XDECREF(stack); Py_XDECREF(seen); Py_XDECREF(hits); Py_XDECREF(counts);
    return result;
}
/* ================================================================================== end of autograd walk */

#include "_fast_journal.c"
#include "_fast_depth.c"
#include "_fast_api.c"
#include "_fast_l0.c"
#include "_fast_files.c"
#include "_fast_gradapi.c"

static PyMethodDef methods[] = {
    {"walk", (PyCFunction)(void (*)(void))walk, METH_FASTCALL,
     "walk(roots, slots, skip, begin, end, leaf_inputs, accumulate_grad) -> (hits, counts): backward_capture._walk"},
    {"stats_many", (PyCFunction)(void (*)(void))stats_many, METH_FASTCALL,
     "stats_many(addresses, numels, codes, eps, threads, out) -> None: stats(...) of many buffers into out"},
    {"frame_key", (PyCFunction)(void (*)(void))frame_key, METH_FASTCALL,
     "frame_key(depth) -> bytes: code address and instruction offset of each frame from depth frames up"},
    {"buffer", (PyCFunction)(void (*)(void))buffer, METH_FASTCALL,
     "buffer(address, nbytes) -> read-only memoryview over that memory (keep its owner alive)"},
    {"copy_stats", (PyCFunction)(void (*)(void))copy_stats, METH_FASTCALL,
     "copy_stats(dst, src, numel, code, eps, threads=1) -> stats(...) of src, copied to dst on the way"},
    {"stats", (PyCFunction)(void (*)(void))stats, METH_FASTCALL,
     "stats(address, numel, code, eps, threads=1) -> (max, min, sum, sum_of_squares, count |x|<=eps, count NaN)"},
    {"append_row", (PyCFunction)(void (*)(void))append_row, METH_FASTCALL,
     "append_row(raw, address, numel, code, eps, threads) -> row index: stats(...) and numel appended to bytearray raw"},
    {"append_rows", (PyCFunction)(void (*)(void))append_rows, METH_FASTCALL,
     "append_rows(raw, addresses, numels, codes, eps, threads) -> first row index: append_row of many buffers"},
    {"csv_rows", (PyCFunction)(void (*)(void))csv_rows, METH_FASTCALL,
     "csv_rows(heads, middle, tails, values, width, ndigits) -> str: the monitor's csv lines, values as '%.{ndigits}g'"},
    {"raw_ops", (PyCFunction)(void (*)(void))raw_ops, METH_FASTCALL,
     "raw_ops(raw, ops) -> bytes: the ops of append_row's rows as doubles of float32 values, row after row"},
    {NULL, NULL, 0, NULL},
};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fast_stats", "One-pass CPU tensor statistics.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__fast_stats(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (add_record_text(m) < 0 || add_grad_text(m) < 0 || add_tensor_rows(m) < 0 || add_fast_monitor(m) < 0 || add_text_journal(m) < 0 || add_api_call(m) < 0 || add_module_hooks(m) < 0 || add_by_line(m) < 0 || add_grad_api(m) < 0))
        Py_CLEAR(m);
    return m;
}

/* result()'s six values, written to r. */
static inline void put_row(acc_t a, int count, double *r) {
    if (!count) a.zeros = 0;
    if (a.nans > 0) a.mx = a.mn = NAN;
    r[0] = a.mx; r[1] = a.mn; r[2] = a.sum; r[3] = a.sumsq; r[4] = a.zeros; r[5] = a.nans;
}

/* stats_many(addresses, numels, codes, eps, threads, out) -> None: stats() of many buffers in one call, for
 * the monitor's per-step batches (thousands of small tensors: one call instead of one per tensor).
 * addresses, numels, codes: equal-length sequences of ints; out: a writable buffer of at least
 * 6 * len(addresses) doubles, filled with stats()'s six values per buffer, in order (the same numbers as
 * stats(address, numel, code, eps, threads) of each). The buffers are reduced one after the other (small
 * buffers are memory-bound: a second thread per buffer does not pay), float32 and bfloat16 ones below
 * PARALLEL_MIN on one thread without an OpenMP region (SERIAL_FLOAT_KERNEL). */
static PyObject *stats_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "stats_many(addresses, numels, codes, eps, threads, out) takes 6 arguments");
        return NULL;
    }
    double eps = PyFloat_AsDouble(args[3]);
    long threads = PyLong_AsLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    PyObject *ps = PySequence_Fast(args[0], "addresses must be a sequence");
    PyObject *ns = ps ? PySequence_Fast(args[1], "numels must be a sequence") : NULL;
    PyObject *cs = ns ? PySequence_Fast(args[2], "codes must be a sequence") : NULL;
    PyObject *ret = NULL;
    Py_buffer out = {0};
    void **p = NULL;
    Py_ssize_t *n = NULL;
    long *code = NULL;
    if (cs == NULL) goto done;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(ps);
    if (PySequence_Fast_GET_SIZE(ns) != m || PySequence_Fast_GET_SIZE(cs) != m) {
        PyErr_SetString(PyExc_ValueError, "addresses, numels and codes must have the same length");
        goto done;
    }
    if (PyObject_GetBuffer(args[5], &out, PyBUF_WRITABLE) < 0) goto done;
    if (out.len < (Py_ssize_t)(6 * sizeof(double)) * m) {
        PyErr_Format(PyExc_ValueError, "out holds %zd bytes; %zd needed", out.len, (Py_ssize_t)(6 * sizeof(double)) * m);
        goto done;
    }
    p = PyMem_RawMalloc((size_t)(m ? m : 1) * sizeof(void *));
    n = PyMem_RawMalloc((size_t)(m ? m : 1) * sizeof(Py_ssize_t));
    code = PyMem_RawMalloc((size_t)(m ? m : 1) * sizeof(long));
    if (p == NULL || n == NULL || code == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int count = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        double e = eps;
        p[i] = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(ps, i));
        n[i] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(ns, i));
        code[i] = PyLong_AsLong(PySequence_Fast_GET_ITEM(cs, i));
        if (parse_common(&code[i], &e, &count, p[i], n[i]) < 0) goto done;
    }
    if (!count) eps = 0.0;
    if (threads < 1) threads = 1;
    double *o = (double *)out.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < m; i++) {
        acc_t a;
        KERNELS[code[i]](p[i], n[i], eps, count, n[i] >= PARALLEL_MIN ? (int)threads : 1, &a);
        put_row(a, count, o + 6 * i);
    }
    Py_END_ALLOW_THREADS
    ret = Py_None;
    Py_INCREF(ret);
done:
    if (out.obj != NULL) PyBuffer_Release(&out);
    PyMem_RawFree(p);
    PyMem_RawFree(n);
    PyMem_RawFree(code);
    Py_XDECREF(ps);
    Py_XDECREF(ns);
    Py_XDECREF(cs);
    return ret;
}

/* ---- the monitor's step rows: statistics appended to a bytearray, ROW_WIDTH doubles a buffer ----
 *
 *   append_row(raw, address, numel, code, eps, threads)        -> index of the row appended to raw
 *   append_rows(raw, addresses, numels, codes, eps, threads)   -> index of the first of the rows appended
 *
 * raw: a bytearray holding rows of ROW_WIDTH doubles: stats()'s six values, then the element count (the
 * monitor keeps a step's rows in one buffer and turns them into its ops once per step). One call per
 * tensor (a forward or gradient hook) or per batch (weights, gradients, optimizer moments), no tuple
 * made; the GIL is released only around buffers worth a thread. */
#define ROW_WIDTH 7

static int grow_rows(PyObject *raw, Py_ssize_t m, Py_ssize_t *first) {
    if (!PyByteArray_Check(raw)) {
        PyErr_SetString(PyExc_TypeError, "raw must be a bytearray");
        return -1;
    }
    Py_ssize_t size = PyByteArray_GET_SIZE(raw), row_bytes = ROW_WIDTH * (Py_ssize_t)sizeof(double);
    if (size % row_bytes != 0) {
        PyErr_SetString(PyExc_ValueError, "raw must hold whole rows");
        return -1;
    }
    /* grown by doubling (a resize to twice the size, then back: bytearray keeps what it allocated), not by the
     * eighth bytearray adds by itself: a step's rows (hundreds of kilobytes) are copied a few times, not dozens */
    Py_ssize_t want = size + m * row_bytes;
    if (want >= ((PyByteArrayObject *)raw)->ob_alloc && want > 4096 && PyByteArray_Resize(raw, 2 * want) < 0)
        return -1;
    if (PyByteArray_Resize(raw, want) < 0) return -1;
    *first = size / row_bytes;
    return 0;
}

/* The serial float kernels with the |x| <= eps count taken in the same pass (the monitor counts zeros of every
 * tensor: SERIAL_FLOAT_KERNEL reads the buffer twice for it). The same loop of REDUCE_BLOCK with an int32 count
 * per block beside it (32-bit lanes, as the floats': the same vectorisation, so the same sums, bit for bit, as
 * SERIAL_FLOAT_KERNEL's); NaNs are counted as there, in a second pass only when the sums are not finite. */
#define FUSED_FLOAT_KERNEL(NAME, T, TO_F)                                                        \
    CLONES static void NAME(const T *p, Py_ssize_t n, double eps, acc_t *a) {                    \
        float mx = -INFINITY, mn = INFINITY, e = (float)eps;                                     \
        double s = 0.0, ss = 0.0;                                                                \
        Py_ssize_t zeros = 0, nans = 0;                                                          \
        for (Py_ssize_t lo = 0; lo < n; lo += BLOCK) {                                           \
            Py_ssize_t hi = lo + BLOCK < n ? lo + BLOCK : n;                                     \
            float bmx = -INFINITY, bmn = INFINITY, bs = 0.f, bss = 0.f;                          \
            int32_t bz = 0;                                                                      \
            _Pragma("omp simd reduction(max:bmx) reduction(min:bmn) reduction(+:bs,bss,bz)")     \
            for (Py_ssize_t i = lo; i < hi; i++) {                                               \
                float v = TO_F(p[i]);                                                            \
                bmx = v > bmx ? v : bmx;                                                         \
                bmn = v < bmn ? v : bmn;                                                         \
                bs += v;                                                                         \
                bss += v * v;                                                                    \
                bz += fabsf(v) <= e;                                                             \
            }                                                                                    \
            mx = bmx > mx ? bmx : mx;                                                            \
            mn = bmn < mn ? bmn : mn;                                                            \
            s += bs;                                                                             \
            ss += bss;                                                                           \
            zeros += bz;                                                                         \
        }                                                                                        \
        if (!isfinite(s) || !isfinite(ss)) {                                                     \
            zeros = 0;                                                                           \
            for (Py_ssize_t lo = 0; lo < n; lo += BLOCK) {                                       \
                Py_ssize_t hi = lo + BLOCK < n ? lo + BLOCK : n;                                 \
                COUNT_BLOCK(p, lo, hi, TO_F, e, zeros, nans);                                    \
            }                                                                                    \
        }                                                                                        \
        a->mx = mx; a->mn = mn; a->sum = s; a->sumsq = ss; a->zeros = (double)zeros; a->nans = (double)nans; \
    }

FUSED_FLOAT_KERNEL(fused_f32, float, f32_of)
FUSED_FLOAT_KERNEL(fused_bf16, uint16_t, bf16_of)

/* One row: stats() of a buffer with its element count; a float32 or bfloat16 buffer whose zeros are counted
 * and that one thread reduces goes through the fused kernel. */
static void reduce_row(const void *p, Py_ssize_t n, long code, double eps, int count, long threads, double *r) {
    acc_t a;
    int serial = n < PARALLEL_MIN || threads <= 1;
    if (count && serial && code == 0)
        fused_f32((const float *)p, n, eps, &a);
    else if (count && serial && code == 2)
        fused_bf16((const uint16_t *)p, n, eps, &a);
    else
        KERNELS[code](p, n, eps, count, serial ? 1 : (int)threads, &a);
    put_row(a, count, r);
    r[6] = (double)n;
}

/* reduce_row of m buffers into rows (called without the GIL). A batch of small buffers (an optimizer's
 * parameters, gradients and moments: thousands of tensors of a few thousand elements, each too small to split)
 * is spread over `threads` OpenMP threads, one buffer per thread at a time: each row is still one thread's
 * serial reduction, the same value whatever the thread count. Buffers of PARALLEL_MIN elements or more are
 * reduced afterwards, each split over the threads itself (a parallel region inside another would run on one). */
static void reduce_rows(void *const *p, const Py_ssize_t *n, const long *code, Py_ssize_t m, double eps, int count,
                        long threads, double *rows) {
    Py_ssize_t small = 0;
    for (Py_ssize_t i = 0; i < m; i++) small += n[i] < PARALLEL_MIN ? n[i] : 0;
    int spread = threads > 1 && small >= PARALLEL_MIN;  /* below that a second thread costs more than it saves */
#pragma omp parallel for schedule(dynamic, 8) num_threads(spread ? (int)threads : 1) if (spread)
    for (Py_ssize_t i = 0; i < m; i++)
        if (n[i] < PARALLEL_MIN) reduce_row(p[i], n[i], code[i], eps, count, 1, rows + ROW_WIDTH * i);
    for (Py_ssize_t i = 0; i < m; i++)
        if (n[i] >= PARALLEL_MIN) reduce_row(p[i], n[i], code[i], eps, count, threads, rows + ROW_WIDTH * i);
}

static PyObject *append_row(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "append_row(raw, address, numel, code, eps, threads) takes 6 arguments");
        return NULL;
    }
    void *p = PyLong_AsVoidPtr(args[1]);
    Py_ssize_t n = PyLong_AsSsize_t(args[2]);
    long code = PyLong_AsLong(args[3]);
    double eps = PyFloat_AsDouble(args[4]);
    long threads = PyLong_AsLong(args[5]);
    int count;
    if (parse_common(&code, &eps, &count, p, n) < 0) return NULL;
    double r[ROW_WIDTH];
    if (n >= PARALLEL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        reduce_row(p, n, code, eps, count, threads, r);
        Py_END_ALLOW_THREADS
    } else {
        reduce_row(p, n, code, eps, count, threads, r);
    }
    Py_ssize_t first;
    if (grow_rows(args[0], 1, &first) < 0) return NULL;
    memcpy((double *)PyByteArray_AS_STRING(args[0]) + first * ROW_WIDTH, r, sizeof(r));
    return PyLong_FromSsize_t(first);
}

static PyObject *append_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "append_rows(raw, addresses, numels, codes, eps, threads) takes 6 arguments");
        return NULL;
    }
    double eps = PyFloat_AsDouble(args[4]);
    long threads = PyLong_AsLong(args[5]);
    if (PyErr_Occurred()) return NULL;
    PyObject *ps = PySequence_Fast(args[1], "addresses must be a sequence");
    PyObject *ns = ps ? PySequence_Fast(args[2], "numels must be a sequence") : NULL;
    PyObject *cs = ns ? PySequence_Fast(args[3], "codes must be a sequence") : NULL;
    PyObject *ret = NULL;
    void **p = NULL;
    Py_ssize_t *n = NULL;
    long *code = NULL;
    double *rows = NULL;
    if (cs == NULL) goto done;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(ps);
    if (PySequence_Fast_GET_SIZE(ns) != m || PySequence_Fast_GET_SIZE(cs) != m) {
        PyErr_SetString(PyExc_ValueError, "addresses, numels and codes must have the same length");
        goto done;
    }
    p = PyMem_RawMalloc((size_t)(m ? m : 1) * sizeof(void *));
    n = PyMem_RawMalloc((size_t)(m ? m : 1) * sizeof(Py_ssize_t));
    code = PyMem_RawMalloc((size_t)(m ? m : 1) * sizeof(long));
    rows = PyMem_RawMalloc((size_t)(m ? m : 1) * ROW_WIDTH * sizeof(double));
    if (p == NULL || n == NULL || code == NULL || rows == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int count = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        double e = eps;
        p[i] = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(ps, i));
        n[i] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(ns, i));
        code[i] = PyLong_AsLong(PySequence_Fast_GET_ITEM(cs, i));
        if (parse_common(&code[i], &e, &count, p[i], n[i]) < 0) goto done;
    }
    if (!count) eps = 0.0;
    /* reduced into rows of its own without the GIL, then appended to raw (which may not grow meanwhile) */
    Py_BEGIN_ALLOW_THREADS
    reduce_rows(p, n, code, m, eps, count, threads, rows);
    Py_END_ALLOW_THREADS
    Py_ssize_t first;
    if (grow_rows(args[0], m, &first) < 0) goto done;
    memcpy((double *)PyByteArray_AS_STRING(args[0]) + first * ROW_WIDTH, rows, (size_t)m * ROW_WIDTH * sizeof(double));
    ret = PyLong_FromSsize_t(first);
done:
    PyMem_RawFree(p);
    PyMem_RawFree(n);
    PyMem_RawFree(code);
    PyMem_RawFree(rows);
    Py_XDECREF(ps);
    Py_XDECREF(ns);
    Py_XDECREF(cs);
    return ret;
}

/* csv_rows(heads, middle, tails, values, width, ndigits) -> str: the monitor's csv lines of one kind at one
 * step, line i being heads[i] + middle + tails[i] (tails None: nothing) + ",v" for each of its `width`
 * floats of `values` (a flat list or tuple of floats, or a buffer of C doubles: the step's values as a numpy
 * array, no Python float made) + "\r\n". Each float as Python's "%.{ndigits}g" % v writes it (the same
 * PyOS_double_to_string call: the same bytes, inf, -inf and nan included; a zero, most of the zeros and nans
 * columns, written directly), without Python's format machinery per value (tens of thousands of values a
 * step); the text grows in a ``text_t``. */
#if defined(__SIZEOF_INT128__)
typedef unsigned __int128 u128;

/* floor(V / 2^t) of V = hi 2^64 + lo (hi < 2^90) and t > 0 into *q, and the remainder against 2^(t-1): 1 above
 * it, 0 equal, -1 below. *q is set to `big` where the quotient does not fit (then it is too large anyway). */
static int shift_round(u128 hi, uint64_t lo, int t, u128 big, u128 *q) {
    if (t < 64) {
        if ((hi >> (64 + t)) != 0) {
            *q = big;
            return -1;
        }
        *q = (hi << (64 - t)) | (lo >> t);
        uint64_t r = lo & (((uint64_t)1 << t) - 1), half = (uint64_t)1 << (t - 1);
        return r > half ? 1 : r == half ? 0 : -1;
    }
    int t2 = t - 64;
    if (t2 >= 120) {  /* V < 2^(t-1): the quotient and the rounding are 0 */
        *q = 0;
        return -1;
    }
    *q = hi >> t2;
    if (t2 == 0) return lo > ((uint64_t)1 << 63) ? 1 : lo == ((uint64_t)1 << 63) ? 0 : -1;
    u128 r = hi & (((u128)1 << t2) - 1), half = (u128)1 << (t2 - 1);
    return r > half ? 1 : r < half ? -1 : lo != 0 ? 1 : 0;
}

/* "%.{p}g" of a float32 value x (nonzero, finite, 1 <= p <= 9: the monitor's values) into out, as
 * PyOS_double_to_string writes it, in integer arithmetic: x = m 2^e exactly (m < 2^24), its p significant digits
 * N = x 10^(p-1-k) rounded half to even from the exact quotient, then Python's layout of them (fixed for
 * -4 <= k < p, else d.ddde+XX; trailing zeros dropped). A small x (10^(p-1-k) a large power) is m 5^s 2^(s+e):
 * m 5^s (up to 2^150: two words) shifted right; a large one m 2^e over 10^(k+1-p) (unsigned 128-bit integers hold
 * both). Returns the length written, or 0 where x is no float32 or p out of range (the caller asks Python). */
static int g_float32(double x, int p, char *out) {
    double ax = fabs(x);
    if (p < 1 || p > 9 || !(ax > 0.0 && ax <= FLT_MAX) || (double)(float)x != x) return 0;
    /* ax = m 2^e with 2^23 <= m < 2^24 (frexp's f 2^E, f = m 2^-24, E = e + 24) read off the float32's bits, a
     * subnormal's significand shifted up: no libm call per value */
    float fx = (float)ax;
    uint32_t bits;
    memcpy(&bits, &fx, sizeof(bits));
    int be = (int)(bits >> 23) & 0xFF;
    uint32_t m32 = bits & 0x7FFFFF;
    int e = -149;
    if (be != 0) {
        m32 |= 0x800000;
        e = be - 150;
    }
    while (!(m32 & 0x800000)) {
        m32 <<= 1;
        e--;
    }
    u128 m = m32;
    int E = e + 24;
    /* floor((E - 1) log10(2)) <= log10(ax): k or one below it (78913 / 2^18: floor exact for |E| < 300) */
    int k = ((E - 1) * 78913) >> 18;
    static u128 p10[39], p5[56];  /* 10^38 and 5^55 are below 2^128 */
    if (p10[0] == 0) {
        p10[0] = p5[0] = 1;
        for (int i = 1; i < 39; i++) p10[i] = p10[i - 1] * 10;
        for (int i = 1; i < 56; i++) p5[i] = p5[i - 1] * 5;
    }
    u128 q = 0;
    int half = -1;  /* the remainder against half the divisor: 1 above, 0 equal, -1 below */
    for (int tries = 0; tries < 3; tries++) {
        int sh = p - 1 - k;
        if (sh > 55 || sh < -38) return 0;
        if (sh >= 0) {  /* x 10^sh = m 5^sh 2^(sh+e) */
            int t = -(sh + e);
            u128 a = (u128)(uint64_t)p5[sh] * m, b = (p5[sh] >> 64) * m;
            u128 hi = b + (a >> 64);
            uint64_t lo = (uint64_t)a;
            if (t > 0) {
                half = shift_round(hi, lo, t, p10[p], &q);
            } else {  /* an integer: x 10^sh is at most about 10^10 here */
                if (hi != 0 || -t > 40) return 0;
                q = (u128)lo << -t;
                half = -1;
            }
        } else {  /* x / 10^-sh = m 2^e / 10^-sh (e >= 0: m 2^e < 2^128) */
            u128 num = m, d = p10[-sh];
            if (e >= 0) num <<= e; else d <<= -e;
            q = num / d;
            u128 r = num % d;
            half = 2 * r > d ? 1 : 2 * r == d ? 0 : -1;
        }
        if (q >= p10[p]) k++;
        else if (q < p10[p - 1]) k--;
        else break;
    }
    if (q < p10[p - 1] || q >= p10[p]) return 0;
    if (half > 0 || (half == 0 && (q & 1))) q++;
    if (q == p10[p]) { q = p10[p - 1]; k++; }
    char dig[16] = {0};  /* p >= 1 digits set below (zeroed: the compiler cannot tell) */
    int L = p;
    uint64_t d64 = (uint64_t)q;  /* below 10^9 */
    ryu_digits(d64, p, dig);  /* (_fast_repr.c) */
    while (L > 1 && dig[L - 1] == '0') L--;
    int n = 0;
    if (x < 0) out[n++] = '-';
    if (k >= -4 && k < p) {
        if (k >= 0) {
            for (int i = 0; i <= k; i++) out[n++] = i < L ? dig[i] : '0';
            if (L > k + 1) { out[n++] = '.'; for (int i = k + 1; i < L; i++) out[n++] = dig[i]; }
        } else {
            out[n++] = '0'; out[n++] = '.';
            for (int i = 0; i < -k - 1; i++) out[n++] = '0';
            for (int i = 0; i < L; i++) out[n++] = dig[i];
        }
    } else {
        out[n++] = dig[0];
        if (L > 1) { out[n++] = '.'; for (int i = 1; i < L; i++) out[n++] = dig[i]; }
        out[n++] = 'e';
        out[n++] = k < 0 ? '-' : '+';
        int ak = k < 0 ? -k : k;
        if (ak >= 10) out[n++] = (char)('0' + ak / 10);
        else out[n++] = '0';
        out[n++] = (char)('0' + ak % 10);
    }
    return n;
}
#else
static int g_float32(double x, int p, char *out) { return 0; }
#endif

static int put_g(text_t *t, double x, long ndigits) {
    if (x == 0.0) return signbit(x) ? PUT_LIT(t, ",-0") : PUT_LIT(t, ",0");
    char fast[40];
    int n = g_float32(x, (int)ndigits, fast + 1);
    if (n > 0) {
        fast[0] = ',';
        return text_put(t, fast, n + 1);
    }
    char *s = PyOS_double_to_string(x, 'g', (int)ndigits, 0, NULL);
    if (s == NULL) return -1;
    int bad = PUT_LIT(t, ",") < 0 || text_put(t, s, (Py_ssize_t)strlen(s)) < 0;
    PyMem_Free(s);
    return bad ? -1 : 0;
}

static PyObject *csv_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "csv_rows(heads, middle, tails, values, width, ndigits) takes 6 arguments");
        return NULL;
    }
    Py_ssize_t width = PyLong_AsSsize_t(args[4]);
    long ndigits = PyLong_AsLong(args[5]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer buf = {0};
    int doubles = PyObject_CheckBuffer(args[3]);
    if (doubles && PyObject_GetBuffer(args[3], &buf, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    PyObject *heads = PySequence_Fast(args[0], "heads must be a sequence");
    PyObject *tails = heads && args[2] != Py_None ? PySequence_Fast(args[2], "tails must be a sequence") : NULL;
    PyObject *values = NULL;
    if (heads && (args[2] == Py_None || tails) && !doubles)
        values = PySequence_Fast(args[3], "values must be a sequence");
    PyObject *ret = NULL;
    text_t t;
    text_init(&t);
    if (heads == NULL || (args[2] != Py_None && tails == NULL) || (!doubles && values == NULL)) goto done;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(heads);
    if (doubles && (buf.itemsize != sizeof(double) || buf.format == NULL || strcmp(buf.format, "d") != 0)) {
        PyErr_SetString(PyExc_TypeError, "csv_rows: a values buffer must hold C doubles");
        goto done;
    }
    Py_ssize_t count = doubles ? buf.len / (Py_ssize_t)sizeof(double) : PySequence_Fast_GET_SIZE(values);
    if ((tails && PySequence_Fast_GET_SIZE(tails) != m) || width < 0 || count != m * width) {
        PyErr_SetString(PyExc_ValueError, "csv_rows: heads, tails and values (width per line) disagree");
        goto done;
    }
    const double *d = doubles ? (const double *)buf.buf : NULL;
    PyObject **v = doubles ? NULL : PySequence_Fast_ITEMS(values);
    Py_ssize_t last_start = 0, last_len = -1;  /* the previous line's values' text (from doubles) */
    for (Py_ssize_t i = 0; i < m; i++) {
        if (text_put_str(&t, PySequence_Fast_GET_ITEM(heads, i)) < 0 || text_put_str(&t, args[1]) < 0) goto done;
        if (tails && text_put_str(&t, PySequence_Fast_GET_ITEM(tails, i)) < 0) goto done;
        if (d && last_len >= 0 && memcmp(d + i * width, d + (i - 1) * width, (size_t)width * sizeof(double)) == 0) {
            /* the same values as the line before (an alias: the tensor seen twice): the same text */
            Py_ssize_t start = t.len;
            char small[512], *copy = last_len <= (Py_ssize_t)sizeof(small) ? small : PyMem_Malloc((size_t)last_len);
            if (copy == NULL) { PyErr_NoMemory(); goto done; }
            memcpy(copy, t.p + last_start, (size_t)last_len);  /* text_put may move the text */
            int bad = text_put(&t, copy, last_len) < 0;
            if (copy != small) PyMem_Free(copy);
            if (bad) goto done;
            last_start = start;
            if (PUT_LIT(&t, "\r\n") < 0) goto done;
            continue;
        }
        last_start = t.len;
        for (Py_ssize_t j = 0; j < width; j++) {
            double x = d ? d[i * width + j] : PyFloat_AsDouble(v[i * width + j]);
            if (!d && x == -1.0 && PyErr_Occurred()) goto done;
            if (put_g(&t, x, ndigits) < 0) goto done;
        }
        last_len = t.len - last_start;
        if (PUT_LIT(&t, "\r\n") < 0) goto done;
    }
    ret = text_finish(&t);  /* frees the text */
    text_init(&t);
done:
    text_free(&t);
    if (doubles) PyBuffer_Release(&buf);
    Py_XDECREF(heads);
    Py_XDECREF(tails);
    Py_XDECREF(values);
    return ret;
}

/* ====================================================================== the monitor's step values (s10-mon)
 *
 *   raw_ops(raw, ops) -> bytes: the configured ops of each row of raw (append_row's rows of ROW_WIDTH doubles),
 *                        row after row, each a C double holding the float32 rounding of the op, as the monitor's
 *                        Python ``columns`` computes it (min: the row's min, max, norm: pow(sum of squares, 0.5)
 *                        as Python's float pow, mean: sum / numel, zeros: zero count / numel, nans: the count).
 *                        ops: a sequence of op codes 0 min, 1 max, 2 norm, 3 mean, 4 zeros, 5 nans.
 * One call per step instead of a Python float per value. */
static PyObject *raw_ops(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyByteArray_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "raw_ops(raw, ops) takes a bytearray and a sequence of op codes");
        return NULL;
    }
    PyObject *ops = PySequence_Fast(args[1], "ops must be a sequence");
    if (ops == NULL) return NULL;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(ops), row_bytes = ROW_WIDTH * (Py_ssize_t)sizeof(double);
    Py_ssize_t size = PyByteArray_GET_SIZE(args[0]);
    long code[16];
    PyObject *ret = NULL;
    if (k > 16 || size % row_bytes != 0) {
        PyErr_SetString(PyExc_ValueError, "raw_ops: at most 16 ops, and raw must hold whole rows");
        goto done;
    }
    for (Py_ssize_t j = 0; j < k; j++) {
        code[j] = PyLong_AsLong(PySequence_Fast_GET_ITEM(ops, j));
        if (code[j] < 0 || code[j] > 5) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "raw_ops: op codes are 0..5");
            goto done;
        }
    }
    Py_ssize_t n = size / row_bytes;
    ret = PyBytes_FromStringAndSize(NULL, n * k * (Py_ssize_t)sizeof(double));
    if (ret == NULL) goto done;
    const double *r = (const double *)PyByteArray_AS_STRING(args[0]);
    double *o = (double *)PyBytes_AS_STRING(ret);
    for (Py_ssize_t i = 0; i < n; i++, r += ROW_WIDTH) {
        for (Py_ssize_t j = 0; j < k; j++) {
            double v;
            switch (code[j]) {
                case 0: v = r[1]; break;
                case 1: v = r[0]; break;
                case 2: v = isnan(r[3]) ? r[3] : pow(r[3], 0.5); break;  /* Python's float pow hands a NaN back */
                case 3: v = r[2] / r[6]; break;
                case 4: v = r[4] / r[6]; break;
                default: v = r[5]; break;
            }
            *o++ = (double)(float)v;
        }
    }
done:
    Py_DECREF(ops);
    return ret;
}

/* TensorRows(codes, tensor, parameter, tensor_base, strided): the monitor's kernel rows of plain tensors asked of
 * torch in C (the questions ``tensor_stats.raw_real_values`` asks, through the C base class's own descriptors,
 * as RecordText asks them), with no Python frame per tensor:
 *
 *   row(raw, t, eps, threads)      -> append_row's row of t, or None (nothing appended) where the kernel does
 *                                     not read t directly: a subclass, another device or layout, a dtype not in
 *                                     codes ({dtype: kernel code}), a strided view, a lazy negation, a zero tensor
 *   rows(raw, tensors, eps, threads) -> append_rows' first row of all of tensors, or None (nothing appended)
 *                                     where row() would say None for one of them */
enum { TR_IS_CPU, TR_LAYOUT, TR_DTYPE, TR_IS_CONTIGUOUS, TR_IS_NEG, TR_IS_ZERO, TR_DATA_PTR, TR_NUMEL, TR_N };
static const char *const TR_NAMES[TR_N] = {"is_cpu", "layout", "dtype", "is_contiguous", "is_neg", "_is_zerotensor",
                                     "data_ptr", "numel"};

typedef struct {
    PyObject_HEAD
    PyObject *codes, *tensor, *parameter, *strided;
    PyObject *descr[TR_N];
} TensorRowsObject;

/* 1 with t's address, element count and kernel code where the kernel reads t as it is; 0 where it does not (or
 * torch refused a question: the caller's Python route says why); -1 with an error. */
static int tr_plain(TensorRowsObject *self, PyObject *t, void **p, Py_ssize_t *n, long *code) {
    if ((PyObject *)Py_TYPE(t) != self->tensor && (PyObject *)Py_TYPE(t) != self->parameter) return 0;
    PyObject *v[TR_N] = {NULL};
    PyObject *dtype = NULL;  /* borrowed */
    int ok = ff_plain(t, p, n, &dtype);  /* the C++ tensor asked (_fast_facts.c); 0: ask torch's Python API */
    if (ok != 0) {
        if (ok > 0) ok = dtype_code(self->codes, dtype, code);
        goto done;
    }
    for (int i = 0; i < TR_N; i++) {
        v[i] = descr_get(self->descr[i], t);
        if (v[i] == NULL) goto done;
        int good = 1;
        switch (i) {
            case TR_IS_CPU: case TR_IS_CONTIGUOUS: good = v[i] == Py_True; break;
            case TR_IS_NEG: case TR_IS_ZERO: good = v[i] == Py_False; break;
            case TR_LAYOUT: good = v[i] == self->strided; break;
            case TR_DTYPE: good = dtype_code(self->codes, v[i], code); break;
            default: break;
        }
        if (!good) goto done;
    }
    *p = PyLong_AsVoidPtr(v[TR_DATA_PTR]);
    *n = PyLong_AsSsize_t(v[TR_NUMEL]);
    ok = *p != NULL && *n > 0;
done:
    for (int i = 0; i < TR_N; i++) Py_XDECREF(v[i]);
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
        PyErr_Clear();
        return 0;
    }
    return ok;
}

static int tr_args(PyObject *const *args, Py_ssize_t nargs, const char *name, double *eps, long *threads, int *count) {
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "%s(raw, tensor(s), eps, threads) takes 4 arguments", name);
        return -1;
    }
    *eps = PyFloat_AsDouble(args[2]);
    *threads = PyLong_AsLong(args[3]);
    if (PyErr_Occurred()) return -1;
    *count = *eps >= 0;
    if (!*count) *eps = 0.0;
    return 0;
}

static PyObject *tr_row(TensorRowsObject *self, PyObject *const *args, Py_ssize_t nargs) {
    double eps;
    long threads, code = 0;
    int count;
    if (tr_args(args, nargs, "row", &eps, &threads, &count) < 0) return NULL;
    void *p = NULL;
    Py_ssize_t n = 0;
    int plain = tr_plain(self, args[1], &p, &n, &code);
    if (plain <= 0) return plain < 0 ? NULL : Py_NewRef(Py_None);
    double r[ROW_WIDTH];
    if (n >= PARALLEL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        reduce_row(p, n, code, eps, count, threads, r);
        Py_END_ALLOW_THREADS
    } else {
        reduce_row(p, n, code, eps, count, threads, r);
    }
    Py_ssize_t first;
    if (grow_rows(args[0], 1, &first) < 0) return NULL;
    memcpy((double *)PyByteArray_AS_STRING(args[0]) + first * ROW_WIDTH, r, sizeof(r));
    return PyLong_FromSsize_t(first);
}

static PyObject *tr_rows(TensorRowsObject *self, PyObject *const *args, Py_ssize_t nargs) {
    double eps;
    long threads;
    int count;
    if (tr_args(args, nargs, "rows", &eps, &threads, &count) < 0) return NULL;
    PyObject *ts = PySequence_Fast(args[1], "tensors must be a sequence");
    if (ts == NULL) return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(ts);
    void **p = PyMem_RawMalloc((size_t)(m ? m : 1) * sizeof(void *));
    Py_ssize_t *n = PyMem_RawMalloc((size_t)(m ? m : 1) * sizeof(Py_ssize_t));
    long *code = PyMem_RawMalloc((size_t)(m ? m : 1) * sizeof(long));
    double *rows = PyMem_RawMalloc((size_t)(m ? m : 1) * ROW_WIDTH * sizeof(double));
    PyObject *ret = NULL;
    if (p == NULL || n == NULL || code == NULL || rows == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        int plain = tr_plain(self, PySequence_Fast_GET_ITEM(ts, i), &p[i], &n[i], &code[i]);
        if (plain <= 0) {
            if (plain == 0) ret = Py_NewRef(Py_None);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    reduce_rows(p, n, code, m, eps, count, threads, rows);
    Py_END_ALLOW_THREADS
    Py_ssize_t first;
    if (grow_rows(args[0], m, &first) < 0) goto done;
    memcpy((double *)PyByteArray_AS_STRING(args[0]) + first * ROW_WIDTH, rows, (size_t)m * ROW_WIDTH * sizeof(double));
    ret = PyLong_FromSsize_t(first);
done:
    PyMem_RawFree(p);
    PyMem_RawFree(n);
    PyMem_RawFree(code);
    PyMem_RawFree(rows);
    Py_DECREF(ts);
    return ret;
}

static PyObject *tr_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"codes", "tensor", "parameter", "tensor_base", "strided", NULL};
    PyObject *codes, *tensor, *parameter, *base, *strided;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OOOO:TensorRows", kw, &PyDict_Type, &codes, &tensor, &parameter,
                                     &base, &strided))
        return NULL;
    if (!PyType_Check(tensor) || !PyType_Check(parameter) || !PyType_Check(base)) {
        PyErr_SetString(PyExc_TypeError, "tensor, parameter and tensor_base must be types");
        return NULL;
    }
    TensorRowsObject *self = (TensorRowsObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->codes = Py_NewRef(codes);
    self->tensor = Py_NewRef(tensor);
    self->parameter = Py_NewRef(parameter);
    self->strided = Py_NewRef(strided);
    if (load_descriptors(base, TR_NAMES, TR_N, self->descr) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int tr_traverse(TensorRowsObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->codes);
    Py_VISIT(self->tensor);
    Py_VISIT(self->parameter);
    Py_VISIT(self->strided);
    for (int i = 0; i < TR_N; i++) Py_VISIT(self->descr[i]);
    return 0;
}

static int tr_clear(TensorRowsObject *self) {
    Py_CLEAR(self->codes);
    Py_CLEAR(self->tensor);
    Py_CLEAR(self->parameter);
    Py_CLEAR(self->strided);
    for (int i = 0; i < TR_N; i++) Py_CLEAR(self->descr[i]);
    return 0;
}

static void tr_dealloc(TensorRowsObject *self) {
    PyObject_GC_UnTrack(self);
    tr_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef tr_methods[] = {
    {"row", (PyCFunction)(void (*)(void))tr_row, METH_FASTCALL,
     "row(raw, t, eps, threads) -> the index of t's row appended to raw, or None where the kernel does not read t"},
    {"rows", (PyCFunction)(void (*)(void))tr_rows, METH_FASTCALL,
     "rows(raw, tensors, eps, threads) -> the index of the first of their rows, or None (nothing appended)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TensorRowsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "msprobe_core.stats._fast_stats.TensorRows",
    .tp_basicsize = sizeof(TensorRowsObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "TensorRows(codes, tensor, parameter, tensor_base, strided): the monitor's kernel rows of plain tensors",
    .tp_new = tr_new,
    .tp_traverse = (traverseproc)tr_traverse,
    .tp_clear = (inquiry)tr_clear,
    .tp_dealloc = (destructor)tr_dealloc,
    .tp_methods = tr_methods,
};

static int add_tensor_rows(PyObject *m) {
    if (PyType_Ready(&TensorRowsType) < 0) return -1;
    Py_INCREF(&TensorRowsType);
    if (PyModule_AddObject(m, "TensorRows", (PyObject *)&TensorRowsType) < 0) {
        Py_DECREF(&TensorRowsType);
        return -1;
    }
    return 0;
}
/* ================================================================== end of the monitor's step values */

#include "_fast_monitor.c"
