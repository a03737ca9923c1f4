/* A TT embedding table's lookup, forward and backward, one pass over the ids (planner.native_lookup).

   A recommender's lookup is a few thousand ids through a chain of small cores: as torch ops it
   is dozens of kernel launches, each costing about what its arithmetic does. Here each id is
   one loop: its slot in the hot-row cache (a hash index of the cached ids), else its row
   built from its cores' slices; backward rebuilds a missed row's partial products (they
   are never stored) and writes each core slice's gradient.

   Cores are slices first: core k is (m[k], r[k], n[k], r[k+1]), contiguous, r[0] = r[order] = 1.
   A row's column index is mixed radix over n[], the first mode most significant; a row is
   cut to `width` columns. gates[k - 1] (r[k] entries, or none at all; entries of
   |g| <= threshold count as 0) scales the bond between cores k - 1 and k. Built for float and double: this file includes itself once per type.
   Loops run on torch's own OpenMP threads where built with -fopenmp (the runtime torch
   loaded is the one they join): a step's next parallel op finds its threads awake. */

#ifndef REAL

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define AHEAD 16 /* ids ahead whose memory a loop asks for before it needs it */

static inline int64_t comera_bucket(int64_t id, int bits) {
    return (int64_t)(((uint64_t)id * 0x9E3779B97F4A7C15ull) >> (64 - bits)); /* Fibonacci */
}

/* An open-addressing index of the cache's ids: 2^bits buckets of (id, slot), id -1 empty.
   Its buckets are read once per id (a binary search reads ~17 cache lines in a row). */
void comera_tt_index(int64_t rows, const int64_t *cache_ids, int bits, int64_t *table) {
    int64_t mask = ((int64_t)1 << bits) - 1;
    for (int64_t b = 0; b <= mask; ++b) table[2 * b] = -1;
    for (int64_t slot = 0; slot < rows; ++slot) {
        int64_t id = cache_ids[slot], b = comera_bucket(id, bits);
        if (id < 0) continue;
        while (table[2 * b] != -1) b = (b + 1) & mask;
        table[2 * b] = id;
        table[2 * b + 1] = slot;
    }
}

#ifdef _OPENMP
#include <omp.h>
static int comera_team(void) { return omp_get_num_threads(); }
#else
static int comera_team(void) { return 1; }
#endif

#define REAL float
#define NAME(x) x##_f32
#include __FILE__
#undef REAL
#undef NAME
#define REAL double
#define NAME(x) x##_f64
#include __FILE__
#undef REAL
#undef NAME

#else /* the kernels of one floating type */

/* The partial products of one row, acc[k] of (prod n[0..k], r[k+1]) each, laid end to end
   in `acc` (offsets: at[k]). */
static void NAME(chain)(int order, const int64_t *n, const int64_t *r, const int64_t *at,
                        const REAL *const *cores, const REAL *const *gates,
                        const int64_t *digit, int64_t stride, REAL *acc) {
    int64_t slice = n[0] * r[1], width = n[0];
    memcpy(acc, cores[0] + digit[0] * slice, slice * sizeof(REAL));
    for (int k = 1; k < order; ++k) {
        const REAL *in = acc + at[k - 1], *gate = gates ? gates[k - 1] : NULL;
        int64_t rank = r[k], cols = n[k] * r[k + 1];
        const REAL *core = cores[k] + digit[k * stride] * rank * cols;
        REAL *out = acc + at[k];
        memset(out, 0, width * cols * sizeof(REAL));
        for (int64_t w = 0; w < width; ++w) {
            REAL *dst = out + w * cols;
            for (int64_t a = 0; a < rank; ++a) {
                REAL v = in[w * rank + a] * (gate ? gate[a] : (REAL)1);
                const REAL *src = core + a * cols;
                for (int64_t c = 0; c < cols; ++c) dst[c] += v * src[c];
            }
        }
        width *= n[k];
    }
}

/* Ask for the cache lines of a row's slices (each read whole). */
static void NAME(prefetch)(int order, const int64_t *n, const int64_t *r,
                           const REAL *const *cores, const int64_t *digit, int64_t stride) {
    for (int k = 0; k < order; ++k) {
        int64_t size = r[k] * n[k] * r[k + 1];
        const char *slice = (const char *)(cores[k] + digit[k * stride] * size);
        for (int64_t b = 0; b < size * (int64_t)sizeof(REAL); b += 64) __builtin_prefetch(slice + b);
    }
}

static int64_t NAME(layout)(int order, const int64_t *n, const int64_t *r, int64_t *at) {
    int64_t total = 0, width = 1;
    for (int k = 0; k < order; ++k) {
        width *= n[k];
        at[k] = total;
        total += width * r[k + 1];
    }
    return total;
}

/* gates[k - 1] as the forward sees them: entries with |g| <= threshold are 0 (rank gates
   switched off), written into buf (sum of r[1..order-1]); ptrs[k - 1] points at each. */
static void NAME(threshold_gates)(int order, const int64_t *r, const REAL *const *gates,
                                  double threshold, REAL *buf, const REAL **ptrs) {
    for (int k = 1, at = 0; k < order; at += r[k], ++k) {
        for (int64_t a = 0; a < r[k]; ++a) {
            REAL g = gates[k - 1][a];
            buf[at + a] = (g > threshold || g < -threshold) ? g : (REAL)0;
        }
        ptrs[k - 1] = buf + at;
    }
}

/* A lookup's rows (n_ids, width) into out, on `threads` threads: ids the cache holds (found
   through comera_tt_index's table, or none where table is NULL) read cache_weight, the
   others are built from the chain (gates: raw rank gates, thresholded here). With bag > 1,
   out is (n_ids / bag, width): each run of `bag` ids summed (mean: averaged), the rows
   themselves never returned. work is (3 + order, n_ids): hits' positions, their slots,
   misses' positions, then each miss's digit per core (all in ids order). Returns the hits;
   -1 where an id lies outside [0, limit); -2 where scratch memory could not be had. */
int64_t NAME(comera_tt_forward)(int threads, int64_t n_ids, const int64_t *ids, int64_t limit,
                                int bits, const int64_t *table, const REAL *cache_weight,
                                int64_t width, REAL *out, int64_t *work, int order,
                                const int64_t *m, const int64_t *n, const int64_t *r,
                                const REAL *const *cores, const REAL *const *raw_gates,
                                double threshold, int64_t bag, int mean) {
    int64_t *hit_pos = work, *hit_slot = work + n_ids, *miss_pos = work + 2 * n_ids;
    REAL *pooled = out;
    if (bag > 1 && !(out = malloc((n_ids ? n_ids : 1) * width * sizeof(REAL)))) return -2;
    int64_t *digits = work + 3 * n_ids, at[64], gate_total = 0;
    for (int k = 1; k < order; ++k) gate_total += r[k];
    REAL *gate_buf = raw_gates ? malloc((gate_total ? gate_total : 1) * sizeof(REAL)) : NULL;
    const REAL *gates[64];
    if (raw_gates && !gate_buf) return -2;
    if (raw_gates) NAME(threshold_gates)(order, r, raw_gates, threshold, gate_buf, gates);
    int64_t total = NAME(layout)(order, n, r, at), hits = 0, misses = 0;
    int64_t mask = table ? ((int64_t)1 << bits) - 1 : 0;
    int bad = 0, failed = 0;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static) reduction(| : bad)
        for (int64_t i = 0; i < n_ids; ++i) {
            int64_t id = ids[i];
            hit_slot[i] = -1;
            if (id < 0 || id >= limit) {
                bad = 1;
                continue;
            }
            if (!table) continue;
            if (i + AHEAD < n_ids && ids[i + AHEAD] >= 0)
                __builtin_prefetch(table + 2 * comera_bucket(ids[i + AHEAD], bits));
            int64_t b = comera_bucket(id, bits);
            while (table[2 * b] != id && table[2 * b] != -1) b = (b + 1) & mask;
            if (table[2 * b] == id) hit_slot[i] = table[2 * b + 1];
        }
#pragma omp single
        {  /* in ids order; a write never passes the read it follows */
            for (int64_t i = 0; !bad && i < n_ids; ++i) {
                int64_t slot = hit_slot[i];
                if (slot >= 0) {
                    hit_pos[hits] = i;
                    hit_slot[hits++] = slot;
                } else {
                    miss_pos[misses++] = i;
                }
            }
        }
        if (!bad) {
#pragma omp for schedule(static) nowait
            for (int64_t j = 0; j < hits; ++j) {
                if (j + AHEAD < hits) __builtin_prefetch(cache_weight + hit_slot[j + AHEAD] * width);
                memcpy(out + hit_pos[j] * width, cache_weight + hit_slot[j] * width,
                       width * sizeof(REAL));
            }
#pragma omp for schedule(static)
            for (int64_t j = 0; j < misses; ++j) {
                int64_t rest = ids[miss_pos[j]];
                for (int k = order - 1; k > 0; --k) {
                    digits[k * n_ids + j] = rest % m[k];
                    rest /= m[k];
                }
                digits[j] = rest;
            }
            REAL *acc = misses ? malloc(total * sizeof(REAL)) : NULL;
#pragma omp for schedule(static)
            for (int64_t j = 0; j < misses; ++j) {
                if (!acc) {
#pragma omp atomic write
                    failed = 1;
                    continue;
                }
                if (j + AHEAD < misses)
                    NAME(prefetch)(order, n, r, cores, digits + j + AHEAD, n_ids);
                NAME(chain)(order, n, r, at, cores, raw_gates ? gates : NULL, digits + j, n_ids,
                            acc);
                memcpy(out + miss_pos[j] * width, acc + at[order - 1], width * sizeof(REAL));
            }
            free(acc);
            if (bag > 1) {  /* the misses' loop ended on a barrier: every row is written */
                REAL scale = mean ? (REAL)1 / (REAL)bag : (REAL)1;
#pragma omp for schedule(static)
                for (int64_t b = 0; b < n_ids / bag; ++b) {
                    REAL *dst = pooled + b * width;
                    const REAL *src = out + b * bag * width;
                    for (int64_t c = 0; c < width; ++c) dst[c] = src[c];
                    for (int64_t i = 1; i < bag; ++i)
                        for (int64_t c = 0; c < width; ++c) dst[c] += src[i * width + c];
                    if (mean)
                        for (int64_t c = 0; c < width; ++c) dst[c] *= scale;
                }
            }
        }
    }
    if (bag > 1) free(out);
    free(gate_buf);
    return bad ? -1 : failed ? -2 : hits;
}

/* One missed row's gradients: its slices' into dst[k] (added), its gates' into gate_grad
   (added). acc: the row's partial products; d_out, d_in, gated: scratch of the widest. */
static void NAME(row_grads)(int order, const int64_t *n, const int64_t *r, const int64_t *at,
                            const int64_t *gate_at, int64_t full, const REAL *const *cores,
                            const REAL *const *gates, const int64_t *digit, int64_t stride,
                            const REAL *acc, REAL *d_out, REAL *d_in, REAL *gated,
                            REAL **dst, double *gate_grad) {
    int64_t rows = full;
    for (int k = order - 1; k >= 0; --k) {
        int64_t rank = r[k], cols = n[k] * r[k + 1], slice = rank * cols;
        rows /= n[k];  /* the input's width: prod n[0..k-1] */
        const REAL *in = k ? acc + at[k - 1] : NULL, *gate = (k && gates) ? gates[k - 1] : NULL;
        for (int64_t w = 0; w < rows * rank; ++w)  /* gated input; core 0's is a one */
            gated[w] = in ? in[w] * (gate ? gate[w % rank] : (REAL)1) : (REAL)1;
        if (dst[k])
            for (int64_t w = 0; w < rows; ++w)
                for (int64_t a = 0; a < rank; ++a) {
                    REAL v = gated[w * rank + a];
                    const REAL *src = d_out + w * cols;
                    REAL *row = dst[k] + a * cols;
                    for (int64_t c = 0; c < cols; ++c) row[c] += v * src[c];
                }
        if (!k) break;
        const REAL *core = cores[k] + digit[k * stride] * slice;
        for (int64_t w = 0; w < rows; ++w)
            for (int64_t a = 0; a < rank; ++a) {
                const REAL *src = d_out + w * cols, *c_row = core + a * cols;
                REAL s = 0;
                for (int64_t c = 0; c < cols; ++c) s += src[c] * c_row[c];
                if (gate_grad && gates) gate_grad[gate_at[k - 1] + a] += (double)s * in[w * rank + a];
                d_in[w * rank + a] = s * (gate ? gate[a] : (REAL)1);
            }
        REAL *swap = d_out; d_out = d_in; d_in = swap;
    }
}

/* Gradients for grad (n_ids, width) of comera_tt_rows' rows, on `threads` threads.
   hit_grad (n_hits, width), if given: the hits' rows of grad. For each core k:
   core_grad[k], if given, a core written with the slices' gradients (summed); else
   core_rows[k], if given, (n_misses, slice) the j-th miss's slice gradient; gate_grad, if
   given, (sum of r[1..order-1]) written with the gates' (summed in double). With bag > 1,
   grad is (n_ids / bag, width), of the rows pooled by `bag` (mean: averaged). Threads add
   into private copies of core_grad and of the gates' sums, added up at the end. Returns 0,
   or -1 where scratch memory could not be had. */
int NAME(comera_tt_grads)(int threads, int64_t width, const REAL *grad, int64_t n_hits,
                          const int64_t *hit_pos, REAL *hit_grad, int64_t n_misses,
                          const int64_t *miss_pos, const int64_t *digits, int64_t stride,
                          int order, const int64_t *m, const int64_t *n, const int64_t *r,
                          const REAL *const *cores, const REAL *const *raw_gates,
                          double threshold, REAL *const *core_grad, REAL *const *core_rows,
                          REAL *gate_out, int64_t bag, int mean) {
    const REAL scale = mean ? (REAL)1 / (REAL)bag : (REAL)1;  /* grad is per bag of `bag` ids */
    int64_t at[64], gate_at[64], size[64], widest = 0, full = 1, gate_total = 0;
    int64_t total = NAME(layout)(order, n, r, at);
    for (int k = 0; k < order; ++k) {
        full *= n[k];
        if (full * r[k + 1] > widest) widest = full * r[k + 1];
        size[k] = m[k] * r[k] * n[k] * r[k + 1];
        if (k) { gate_at[k - 1] = gate_total; gate_total += r[k]; }
    }
    REAL *gate_buf = raw_gates ? malloc((gate_total ? gate_total : 1) * sizeof(REAL)) : NULL;
    const REAL *thresholded[64], *const *gates = raw_gates ? thresholded : NULL;
    if (raw_gates && !gate_buf) return -1;
    if (raw_gates) NAME(threshold_gates)(order, r, raw_gates, threshold, gate_buf, thresholded);
    for (int k = 0; k < order; ++k)
        if (core_grad && core_grad[k]) memset(core_grad[k], 0, size[k] * sizeof(REAL));
    double *gate_grad = gate_out ? calloc(gate_total ? gate_total : 1, sizeof(double)) : NULL;
    if (gate_out && !gate_grad) {
        free(gate_buf);
        return -1;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        if (hit_grad) {
#pragma omp for schedule(static) nowait
            for (int64_t j = 0; j < n_hits; ++j) {
                const REAL *src = grad + hit_pos[j] / bag * width;
                for (int64_t c = 0; c < width; ++c) hit_grad[j * width + c] = src[c] * scale;
            }
        }
        int team = comera_team();
        REAL *scratch = malloc((total + 3 * widest) * sizeof(REAL));
        REAL *mine[64];
        double *my_gates = gate_grad && team > 1 ? calloc(gate_total, sizeof(double)) : gate_grad;
        int ok = scratch && (!gate_grad || my_gates);
        for (int k = 0; k < order; ++k) {
            mine[k] = core_grad && core_grad[k] && team > 1 ? calloc(size[k], sizeof(REAL))
                      : (core_grad ? core_grad[k] : NULL);
            if (core_grad && core_grad[k] && !mine[k]) ok = 0;
        }
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n_misses; ++j) {
            if (!ok) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            const int64_t *digit = digits + j;
            if (j + AHEAD < n_misses) NAME(prefetch)(order, n, r, cores, digit + AHEAD, stride);
            REAL *acc = scratch, *d_out = acc + total;
            NAME(chain)(order, n, r, at, cores, gates, digit, stride, acc);
            memset(d_out, 0, full * sizeof(REAL));  /* columns past width get no gradient */
            const REAL *src = grad + (miss_pos ? miss_pos[j] : j) / bag * width;
            for (int64_t c = 0; c < width; ++c) d_out[c] = src[c] * scale;
            REAL *dst[64];
            for (int k = 0; k < order; ++k) {
                int64_t slice = r[k] * n[k] * r[k + 1];
                dst[k] = NULL;
                if (mine[k]) dst[k] = mine[k] + digit[k * stride] * slice;
                else if (core_rows && core_rows[k]) {
                    dst[k] = core_rows[k] + j * slice;
                    memset(dst[k], 0, slice * sizeof(REAL));
                }
            }
            NAME(row_grads)(order, n, r, at, gate_at, full, cores, gates, digit, stride, acc,
                            d_out, d_out + widest, d_out + 2 * widest, dst, my_gates);
        }
        if (team > 1) {
#pragma omp critical
            {
                for (int k = 0; k < order; ++k)
                    if (mine[k] && core_grad && mine[k] != core_grad[k])
                        for (int64_t i = 0; i < size[k]; ++i) core_grad[k][i] += mine[k][i];
                if (my_gates && my_gates != gate_grad)
                    for (int64_t i = 0; i < gate_total; ++i) gate_grad[i] += my_gates[i];
            }
            for (int k = 0; k < order; ++k)
                if (core_grad && mine[k] != core_grad[k]) free(mine[k]);
            if (my_gates != gate_grad) free(my_gates);
        }
        free(scratch);
    }
    for (int64_t i = 0; gate_out && i < gate_total; ++i)  /* a gate switched off gets none */
        gate_out[i] = gate_buf[i] != (REAL)0 ? (REAL)gate_grad[i] : (REAL)0;
    free(gate_grad);
    free(gate_buf);
    return failed ? -1 : 0;
}

#endif
