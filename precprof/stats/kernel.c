/* precprof one-pass CPU statistics kernel (v2). Plain C (OpenMP when available), no torch headers. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NKEYS 4096
#define BLOCK 2048
/* row layout: must equal precprof.stats (checked by pp_layout at load time) */
#define COL_NUMEL 0
#define COL_ZEROS 1
#define COL_NAN 2
#define COL_INF 3
#define COL_OVERFLOW 4
#define COL_ABSMAX_BITS 8
#define COL_ABSMIN_BITS 9
#define COL_UNDERFLOW_CS 10
#define COL_POW2_AT 12
#define COL_HIST 16
#define EXP_MIN (-149)
#define EXP_MAX 127
#define N_BINS (EXP_MAX - EXP_MIN + 1)
#define ROW_WIDTH (COL_HIST + N_BINS)
#define CALL_LEN (ROW_WIDTH + 2) /* + first and last nonzero histogram bin (-1 when none) */
#define F64_BIAS 1023
#define LO_FIELD (F64_BIAS + EXP_MIN)
#define HI_FIELD (F64_BIAS + EXP_MAX)
#define NO_MIN_BITS 0x7FFFFFFFFFFFFFFFLL
#define MANT64 ((1ULL << 52) - 1)
#define INF64 0x7FF0000000000000ULL
#define BIG64 0x4070000000000000ULL /* 256.0: every overflow threshold is above it */

typedef struct {
    double t[4];      /* overflow thresholds, WHATIF order */
    int inc[4];       /* 1: v >= t counts, 0: v > t */
    int uf_exp[4];    /* underflow_max = 2^uf_exp, WHATIF order */
    double fp8_max[2];
    int fp8_uf_exp[2];
} cfg_t;

typedef struct {
    int64_t keys[NKEYS]; /* key = 2 * fp64 exponent field + (mantissa == 0) */
    int64_t ov[4];
    uint64_t mx; /* largest finite |x| as fp64 bits; 0 when none */
    uint64_t mn; /* smallest nonzero finite |x| as fp64 bits; UINT64_MAX when none */
} acc_t;

static uint16_t TAB_BF16[32768], TAB_F16[32768]; /* |x| bit pattern -> key */
static uint16_t TAB_F32[512];                      /* (exponent << 1 | mantissa == 0) of normal fp32 -> key */

static inline double f16_to_double(uint16_t h) {
    uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    double v;
    if (exp == 0) v = (double)man * (1.0 / 16777216.0);
    else if (exp == 31) v = man ? __builtin_nan("") : __builtin_inf();
    else v = (double)(man | 0x400) * ldexp(1.0, (int)exp - 25);
    return (h >> 15) ? -v : v;
}
static inline double bf16_to_double(uint16_t h) {
    uint32_t b = ((uint32_t)h) << 16; float f; memcpy(&f, &b, 4); return (double)f;
}
static inline double u32_to_double(uint32_t u) { float f; memcpy(&f, &u, 4); return (double)f; }
static inline uint64_t dbits(double d) { uint64_t b; memcpy(&b, &d, 8); return b & ~(1ULL << 63); }
static inline int key_of_bits(uint64_t b) { return (int)(((b >> 52) << 1) | ((b & MANT64) == 0)); }

void pp_init(void) {
    for (uint32_t h = 0; h < 32768; h++) {
        TAB_BF16[h] = (uint16_t)key_of_bits(dbits(bf16_to_double((uint16_t)h)));
        TAB_F16[h] = (uint16_t)key_of_bits(dbits(f16_to_double((uint16_t)h)));
    }
    for (uint32_t i = 0; i < 512; i++) {
        uint32_t e = i >> 1, mz = i & 1;
        /* e == 0 with mz == 0 is a subnormal: never counted through this table */
        TAB_F32[i] = (uint16_t)(e == 0 ? (mz ? 1 : 0) : key_of_bits(dbits(u32_to_double((e << 23) | (mz ? 0 : 1)))));
    }
}

int pp_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

void pp_layout(int64_t* out) {
    int64_t v[] = {COL_NUMEL, COL_ZEROS, COL_NAN, COL_INF, COL_OVERFLOW, COL_ABSMAX_BITS, COL_ABSMIN_BITS,
                   COL_UNDERFLOW_CS, COL_POW2_AT, COL_HIST, EXP_MIN, EXP_MAX, ROW_WIDTH, CALL_LEN};
    memcpy(out, v, sizeof(v));
}

/* the reference per-value update, for the rare paths: fp64 bits b of |x|, weight c */
static inline void add_bits(acc_t* a, uint64_t b, const cfg_t* cfg) {
    a->keys[key_of_bits(b)]++;
    if (b >= BIG64) {
        double v; memcpy(&v, &b, 8);
        for (int j = 0; j < 4; j++) a->ov[j] += cfg->inc[j] ? (v >= cfg->t[j]) : (v > cfg->t[j]);
    }
    if (b < INF64) {
        if (b > a->mx) a->mx = b;
        if (b && b < a->mn) a->mn = b;
    }
}
static inline void overflow_of(acc_t* a, double v, const cfg_t* cfg) {
    for (int j = 0; j < 4; j++) a->ov[j] += cfg->inc[j] ? (v >= cfg->t[j]) : (v > cfg->t[j]);
}
static inline void extremes(acc_t* a, double vmax, double vmin_nz, int have_max, int have_min) {
    if (have_max) { uint64_t b = dbits(vmax); if (b > a->mx) a->mx = b; }
    if (have_min) { uint64_t b = dbits(vmin_nz); if (b < a->mn) a->mn = b; }
}

/* contiguous fp32. Per block of BLOCK values: vectorisable single-reduction passes (largest |x|, smallest
   |x| - 1, smallest mantissa) decide whether the block holds anything rare (|x| >= 256, inf, nan,
   subnormals, exact powers of two); a block without them needs only its exponent histogram, one with
   powers of two the (exponent, mantissa-is-zero) histogram, both counted into four interleaved
   sub-histograms (no store-to-load stalls between neighbours in the same bin); subnormals take the exact
   per-element path. */
static void run_f32(const uint32_t* p, int64_t n, acc_t* a, const cfg_t* cfg) {
    uint32_t sub[4][256], sub9[4][512];
    memset(sub, 0, sizeof(sub));
    memset(sub9, 0, sizeof(sub9));
    int64_t since = 0;
    for (int64_t s = 0; s < n; s += BLOCK) {
        int64_t m = n - s < BLOCK ? n - s : BLOCK;
        const uint32_t* q = p + s;
        uint32_t rawmax = 0, vmin = 0xFFFFFFFFu, pmin = 0xFFFFFFFFu;
        for (int64_t i = 0; i < m; i++) { uint32_t u = q[i] & 0x7FFFFFFFu; rawmax = u > rawmax ? u : rawmax; }
        for (int64_t i = 0; i < m; i++) { uint32_t v = (q[i] & 0x7FFFFFFFu) - 1; vmin = v < vmin ? v : vmin; }
        /* 0 exactly when a nonzero value has a zero mantissa (a power of two, or inf) */
        for (int64_t i = 0; i < m; i++) {
            uint32_t w = (q[i] & 0x7FFFFFu) + ((q[i] & 0x7FFFFFFFu) == 0);
            pmin = w < pmin ? w : pmin;
        }
        uint32_t fmax = rawmax;
        if (__builtin_expect(rawmax >= 0x7F800000u, 0)) { /* inf or nan here: the largest finite value */
            fmax = 0;
            for (int64_t i = 0; i < m; i++) {
                uint32_t u = q[i] & 0x7FFFFFFFu;
                if (u < 0x7F800000u && u > fmax) fmax = u;
            }
        }
        if (__builtin_expect(rawmax >= 0x43800000u, 0)) { /* values >= 256 (or inf/nan): exact compares */
            for (int64_t i = 0; i < m; i++) {
                uint32_t u = q[i] & 0x7FFFFFFFu;
                if (u >= 0x43800000u && u <= 0x7F800000u) overflow_of(a, u32_to_double(u), cfg);
            }
        }
        if (__builtin_expect(vmin < 0x007FFFFFu, 0)) { /* a subnormal: the exact key of every element */
            for (int64_t i = 0; i < m; i++) {
                uint32_t u = q[i] & 0x7FFFFFFFu;
                if (u != 0 && u < 0x00800000u) a->keys[key_of_bits(dbits(u32_to_double(u)))]++;
                else sub9[0][((u >> 22) & 0x1FEu) | ((u & 0x7FFFFFu) == 0)]++;
            }
        } else if (pmin == 0) {
            /* exact powers of two (common when fp32 holds values of bf16 precision, as gradients
               accumulated from bf16 do): exponent and mantissa-is-zero */
            int64_t i = 0;
            for (; i + 4 <= m; i += 4) {
                uint32_t u0 = q[i], u1 = q[i + 1], u2 = q[i + 2], u3 = q[i + 3];
                sub9[0][((u0 >> 22) & 0x1FEu) | ((u0 & 0x7FFFFFu) == 0)]++;
                sub9[1][((u1 >> 22) & 0x1FEu) | ((u1 & 0x7FFFFFu) == 0)]++;
                sub9[2][((u2 >> 22) & 0x1FEu) | ((u2 & 0x7FFFFFu) == 0)]++;
                sub9[3][((u3 >> 22) & 0x1FEu) | ((u3 & 0x7FFFFFu) == 0)]++;
            }
            for (; i < m; i++) { uint32_t u = q[i]; sub9[0][((u >> 22) & 0x1FEu) | ((u & 0x7FFFFFu) == 0)]++; }
        } else {
            int64_t i = 0;
            for (; i + 4 <= m; i += 4) {
                sub[0][(q[i] >> 23) & 0xFF]++;
                sub[1][(q[i + 1] >> 23) & 0xFF]++;
                sub[2][(q[i + 2] >> 23) & 0xFF]++;
                sub[3][(q[i + 3] >> 23) & 0xFF]++;
            }
            for (; i < m; i++) sub[0][(q[i] >> 23) & 0xFF]++;
        }
        extremes(a, u32_to_double(fmax), u32_to_double(vmin + 1), fmax != 0, vmin < 0x7F7FFFFFu);
        since += m;
        if (since >= (1LL << 30) || s + BLOCK >= n) {
            /* in these blocks: exponent 0 is only zero (no subnormals), 255 only nan (no inf), and no
               nonzero value has a zero mantissa */
            for (int e = 0; e < 256; e++) {
                uint64_t c = (uint64_t)sub[0][e] + sub[1][e] + sub[2][e] + sub[3][e];
                if (c) a->keys[TAB_F32[(e << 1) | (e == 0)]] += (int64_t)c;
            }
            for (int k = 0; k < 512; k++) {
                uint64_t c = (uint64_t)sub9[0][k] + sub9[1][k] + sub9[2][k] + sub9[3][k];
                if (c) a->keys[TAB_F32[k]] += (int64_t)c;
            }
            memset(sub, 0, sizeof(sub));
            memset(sub9, 0, sizeof(sub9));
            since = 0;
        }
    }
}

/* contiguous bf16 / fp16: the key of every 15-bit magnitude comes from a table */
static void run_16(const uint16_t* p, int64_t n, acc_t* a, const cfg_t* cfg, const uint16_t* tab,
                   uint16_t inf16, uint16_t big16, double (*widen)(uint16_t)) {
    uint32_t (*sub)[NKEYS] = calloc(4, sizeof(uint32_t[NKEYS]));
    if (!sub) { for (int64_t i = 0; i < n; i++) add_bits(a, dbits(widen(p[i])), cfg); return; }
    int64_t since = 0;
    for (int64_t s = 0; s < n; s += BLOCK) {
        int64_t m = n - s < BLOCK ? n - s : BLOCK;
        const uint16_t* q = p + s;
        uint16_t rawmax = 0, vmin = 0xFFFF;
        for (int64_t i = 0; i < m; i++) { uint16_t u = q[i] & 0x7FFF; rawmax = u > rawmax ? u : rawmax; }
        for (int64_t i = 0; i < m; i++) { uint16_t v = (uint16_t)((q[i] & 0x7FFF) - 1); vmin = v < vmin ? v : vmin; }
        uint16_t fmax = rawmax;
        if (__builtin_expect(rawmax >= inf16, 0)) {
            fmax = 0;
            for (int64_t i = 0; i < m; i++) {
                uint16_t u = q[i] & 0x7FFF;
                if (u < inf16 && u > fmax) fmax = u;
            }
        }
        if (__builtin_expect(rawmax >= big16, 0)) {
            for (int64_t i = 0; i < m; i++) {
                uint16_t u = q[i] & 0x7FFF;
                if (u >= big16 && u <= inf16) overflow_of(a, widen(u), cfg);
            }
        }
        int64_t i = 0;
        for (; i + 4 <= m; i += 4) {
            sub[0][tab[q[i] & 0x7FFF]]++;
            sub[1][tab[q[i + 1] & 0x7FFF]]++;
            sub[2][tab[q[i + 2] & 0x7FFF]]++;
            sub[3][tab[q[i + 3] & 0x7FFF]]++;
        }
        for (; i < m; i++) sub[0][tab[q[i] & 0x7FFF]]++;
        extremes(a, widen(fmax), widen((uint16_t)(vmin + 1)), fmax != 0, vmin < (uint16_t)(inf16 - 1));
        since += m;
        if (since >= (1LL << 30) || s + BLOCK >= n) {
            for (int k = 0; k < NKEYS; k++) a->keys[k] += (int64_t)sub[0][k] + sub[1][k] + sub[2][k] + sub[3][k];
            memset(sub, 0, 4 * sizeof(uint32_t[NKEYS]));
            since = 0;
        }
    }
    free(sub);
}

static double ld_f16(const void* d, int64_t i) { return f16_to_double(((const uint16_t*)d)[i]); }
static double ld_bf16(const void* d, int64_t i) { return bf16_to_double(((const uint16_t*)d)[i]); }
static double ld_f32(const void* d, int64_t i) { return (double)((const float*)d)[i]; }
static double ld_f64(const void* d, int64_t i) { return ((const double*)d)[i]; }

typedef struct {
    const void* data;
    int64_t n, stride;
    int dtype;
    const cfg_t* cfg;
    acc_t acc;
} job_t;

static void* run_job(void* arg) {
    job_t* j = (job_t*)arg;
    acc_t* a = &j->acc;
    memset(a, 0, sizeof(*a));
    a->mn = UINT64_MAX;
    if (j->stride == 1 && j->dtype == 0) run_f32((const uint32_t*)j->data, j->n, a, j->cfg);
    else if (j->stride == 1 && j->dtype == 1)
        run_16((const uint16_t*)j->data, j->n, a, j->cfg, TAB_BF16, 0x7F80, 0x4380, bf16_to_double);
    else if (j->stride == 1 && j->dtype == 2)
        run_16((const uint16_t*)j->data, j->n, a, j->cfg, TAB_F16, 0x7C00, 0x5C00, f16_to_double);
    else {
        double (*ld)(const void*, int64_t) = j->dtype == 0 ? ld_f32 : j->dtype == 1 ? ld_bf16 : j->dtype == 2 ? ld_f16 : ld_f64;
        for (int64_t i = 0; i < j->n; i++) add_bits(a, dbits(ld(j->data, i * j->stride)), j->cfg);
    }
    return NULL;
}

static int64_t le_pow2(const int64_t* keys, int64_t j) { /* finite nonzero values <= 2^j */
    int64_t f = j + F64_BIAS, s = 0;
    if (f <= 0) return 0;
    if (f >= 2047) f = 2047;
    for (int64_t k = 0; k < 2 * f; k++) s += keys[k];
    s -= keys[1];
    if (f < 2047) s += keys[2 * f + 1];
    return s;
}

static int cs_exponent(double fmax, double amax) { /* the largest k with amax * 2^k <= fmax (exact) */
    int ef, ea;
    frexp(fmax, &ef);
    frexp(amax, &ea);
    int k = ef - ea;
    while (ldexp(amax, k) > fmax) k--;
    while (ldexp(amax, k + 1) <= fmax) k++;
    return k;
}

/* Statistics of one tensor call into call[CALL_LEN] (overwritten). dtype: 0 fp32, 1 bf16, 2 fp16, 3 fp64. */
void pp_call(const void* data, int64_t n, int64_t stride, int dtype, int nthreads, const double* t,
             const int* inc, const int* uf_exp, const double* fp8_max, const int* fp8_uf_exp, int64_t* call) {
    cfg_t cfg;
    for (int j = 0; j < 4; j++) { cfg.t[j] = t[j]; cfg.inc[j] = inc[j]; cfg.uf_exp[j] = uf_exp[j]; }
    for (int j = 0; j < 2; j++) { cfg.fp8_max[j] = fp8_max[j]; cfg.fp8_uf_exp[j] = fp8_uf_exp[j]; }
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 64) nthreads = 64;
    if (n < (1 << 16)) nthreads = 1; /* not worth a thread */
    job_t* jobs = malloc(sizeof(job_t) * nthreads);
    if (!jobs) { call[COL_NUMEL] = -1; return; } /* out of host memory: the caller raises */
    int64_t per = (n + nthreads - 1) / nthreads;
    per = (per + 63) & ~63LL;
    int used = 0;
    for (int w = 0; w < nthreads; w++) {
        int64_t lo = per * w, hi = lo + per < n ? lo + per : n;
        if (lo >= hi && w > 0) break;
        size_t es = dtype == 0 ? 4 : dtype == 3 ? 8 : 2;
        jobs[w].data = (const char*)data + (size_t)(lo * stride) * es;
        jobs[w].n = hi - lo;
        jobs[w].stride = stride;
        jobs[w].dtype = dtype;
        jobs[w].cfg = &cfg;
        used = w + 1;
    }
#ifdef _OPENMP
    if (used > 1) {
        #pragma omp parallel for num_threads(used) schedule(static, 1)
        for (int w = 0; w < used; w++) run_job(&jobs[w]);
    } else {
        run_job(&jobs[0]);
    }
#else
    for (int w = 0; w < used; w++) run_job(&jobs[w]);
#endif
    acc_t* a = &jobs[0].acc;
    for (int w = 1; w < used; w++) {
        acc_t* b = &jobs[w].acc;
        for (int k = 0; k < NKEYS; k++) a->keys[k] += b->keys[k];
        for (int j = 0; j < 4; j++) a->ov[j] += b->ov[j];
        if (b->mx > a->mx) a->mx = b->mx;
        if (b->mn < a->mn) a->mn = b->mn;
    }
    const int64_t* keys = a->keys;
    memset(call, 0, sizeof(int64_t) * CALL_LEN);
    call[COL_NUMEL] = n;
    call[COL_ZEROS] = keys[1];
    call[COL_NAN] = keys[2 * 2047];
    call[COL_INF] = keys[2 * 2047 + 1];
    for (int j = 0; j < 4; j++) {
        call[COL_OVERFLOW + j] = a->ov[j];
        call[COL_POW2_AT + j] = keys[2 * (cfg.uf_exp[j] + F64_BIAS) + 1];
    }
    call[COL_ABSMAX_BITS] = (int64_t)a->mx;
    call[COL_ABSMIN_BITS] = a->mn == UINT64_MAX ? NO_MIN_BITS : (int64_t)(a->mn - 1);
    if (a->mx > 0) {
        double amax; memcpy(&amax, &a->mx, 8);
        for (int j = 0; j < 2; j++)
            call[COL_UNDERFLOW_CS + j] = le_pow2(keys, cfg.fp8_uf_exp[j] - cs_exponent(cfg.fp8_max[j], amax));
    }
    int64_t* hist = call + COL_HIST;
    for (int b = 0; b < N_BINS; b++) hist[b] = keys[2 * (LO_FIELD + b)] + keys[2 * (LO_FIELD + b) + 1];
    hist[0] += keys[0];
    for (int f = 1; f < LO_FIELD; f++) hist[0] += keys[2 * f] + keys[2 * f + 1];
    for (int f = HI_FIELD + 1; f < 2047; f++) hist[N_BINS - 1] += keys[2 * f] + keys[2 * f + 1];
    int64_t lo = -1, hi = -1;
    for (int b = 0; b < N_BINS; b++) if (hist[b]) { if (lo < 0) lo = b; hi = b; }
    call[ROW_WIDTH] = lo;
    call[ROW_WIDTH + 1] = hi;
    free(jobs);
}

/* Add a call's statistics into a row: counts[COL_HIST] and a histogram window of w bins starting at bin
   wlo. Returns 1 (and changes nothing) when the call's bins do not fit the window. */
int pp_merge(const int64_t* call, int64_t* counts, int64_t* window, int64_t wlo, int64_t w) {
    int64_t lo = call[ROW_WIDTH], hi = call[ROW_WIDTH + 1];
    if (lo >= 0 && (lo < wlo || hi >= wlo + w)) return 1;
    for (int c = 0; c < COL_HIST; c++) {
        if (c == COL_ABSMAX_BITS) counts[c] = call[c] > counts[c] ? call[c] : counts[c];
        else if (c == COL_ABSMIN_BITS) counts[c] = call[c] < counts[c] ? call[c] : counts[c];
        else counts[c] += call[c];
    }
    if (lo >= 0) for (int64_t b = lo; b <= hi; b++) window[b - wlo] += call[COL_HIST + b];
    return 0;
}
