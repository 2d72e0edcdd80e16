/* precprof one-pass CPU statistics kernel (v4: the row layout is passed in; pp_add reads and merges in one call). Plain C (OpenMP when available), no torch headers.

   The thread's floating-point mode is the caller's: torch.set_flush_denormal(True) sets x86's MXCSR FTZ and DAZ
   (ARM: FPCR.FZ), under which a float conversion or compare reads a subnormal as 0. The statistics (pp_call,
   pp_add, ...) therefore use no float arithmetic at all: every value is classified from its bits, widened to
   fp64 bits by integer operations. The what-ifs whose definition is float arithmetic (pp_block, pp_upd_classify)
   run in IEEE mode (fp_ieee_enter / fp_ieee_leave), set and restored on every thread that computes. */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NKEYS 4096
#define BLOCK 2048
#define MAXF 16 /* what-if formats and fp8 formats a row may hold (precprof.stats.layout._C_MAX_FORMATS) */
#define F64_BIAS 1023
#define NO_MIN_BITS 0x7FFFFFFFFFFFFFFFLL
#define MANT64 ((1ULL << 52) - 1)
#define INF64 0x7FF0000000000000ULL
#define NOINLINE __attribute__((noinline))

/* IEEE mode for the arithmetic of the what-ifs: subnormals neither read as 0 nor flushed, round to nearest.
   fp_ieee_enter saves the thread's mode and clears what departs from IEEE (x86 MXCSR: FTZ, DAZ and the
   rounding control; AArch64 FPCR: FZ, FZ16, the rounding mode, and FEAT_AFP's FIZ and AH), writing only when
   something was set; fp_ieee_leave puts the saved mode back. Each thread that computes enters it (an OpenMP
   worker keeps the mode it had, whatever the caller's), and the arithmetic runs in a NOINLINE function
   called in between, which the compiler cannot move across the mode switch. */
#if defined(__x86_64__) || (defined(__i386__) && defined(__SSE__))
typedef uint32_t fpmode_t;
#define FP_NOT_IEEE 0xE040u
#define FP_FLAGS 0x3Fu /* the sticky exception flags, which any arithmetic sets: not part of the mode */
static inline fpmode_t fp_ieee_enter(void) {
    uint32_t m;
    __asm__ __volatile__("stmxcsr %0" : "=m"(m) : : "memory");
    if (m & FP_NOT_IEEE) {
        uint32_t c = m & ~FP_NOT_IEEE;
        __asm__ __volatile__("ldmxcsr %0" : : "m"(c) : "memory");
    }
    return m;
}
static inline void fp_ieee_leave(fpmode_t m) {
    if (m & FP_NOT_IEEE) __asm__ __volatile__("ldmxcsr %0" : : "m"(m) : "memory");
}
#elif defined(__aarch64__)
typedef uint64_t fpmode_t;
#define FP_NOT_IEEE ((1ULL << 24) | (1ULL << 19) | (3ULL << 22) | 3ULL)
#define FP_FLAGS 0 /* in FPSR */
static inline fpmode_t fp_ieee_enter(void) {
    uint64_t m;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(m) : : "memory");
    if (m & FP_NOT_IEEE) __asm__ __volatile__("msr fpcr, %0" : : "r"(m & ~FP_NOT_IEEE) : "memory");
    return m;
}
static inline void fp_ieee_leave(fpmode_t m) {
    if (m & FP_NOT_IEEE) __asm__ __volatile__("msr fpcr, %0" : : "r"(m) : "memory");
}
#else /* no flush-to-zero mode this kernel knows of */
typedef int fpmode_t;
#define FP_FLAGS 0
static inline fpmode_t fp_ieee_enter(void) { return 0; }
static inline void fp_ieee_leave(fpmode_t m) { (void)m; }
#endif

/* the calling thread's mode, as fp_ieee_enter saves it, without the exception flags: for tests (the kernel
   leaves it as it found it) */
int64_t pp_fpmode(void) {
    fpmode_t m = fp_ieee_enter();
    fp_ieee_leave(m);
    return (int64_t)(m & ~(fpmode_t)FP_FLAGS);
}

/* The row layout and the formats' constants, passed in by precprof.stats.layout.RowLayout.c_config():
   column offsets, then the overflow shortcut (no value below it overflows any format) as fp64, fp32, bf16
   and fp16 bits, then per what-if format (threshold bits, inclusive, underflow exponent), then per fp8
   format (max bits, underflow exponent). */
typedef struct {
    int64_t numel, zeros, nan, inf, overflow, absmax, absmin, cs, pow2, hist, width;
    int nw, nf, exp_min, exp_max, n_bins, lo_field, hi_field;
    uint64_t big64;
    uint32_t big32;
    uint16_t big_bf16, big_f16;
    uint64_t t[MAXF];  /* overflow thresholds as fp64 bits (positive: ordered as their values), what-if order */
    int inc[MAXF];   /* 1: v >= t counts, 0: v > t */
    int uf_exp[MAXF]; /* underflow_max = 2^uf_exp */
    uint64_t fp8_max[MAXF]; /* fp64 bits */
    int fp8_uf_exp[MAXF];
    int fp8_k_cap[MAXF]; /* the largest scale exponent: torchao's amax floor (formats.FP8_AMAX_FLOOR) */
} cfg_t;

static int read_cfg(const int64_t* c, cfg_t* cfg) {
    cfg->numel = c[0]; cfg->zeros = c[1]; cfg->nan = c[2]; cfg->inf = c[3]; cfg->overflow = c[4];
    cfg->absmax = c[5]; cfg->absmin = c[6]; cfg->cs = c[7]; cfg->pow2 = c[8]; cfg->hist = c[9];
    cfg->width = c[10]; cfg->nw = (int)c[11]; cfg->nf = (int)c[12]; cfg->exp_min = (int)c[13];
    cfg->exp_max = (int)c[14];
    if (cfg->nw < 1 || cfg->nw > MAXF || cfg->nf < 0 || cfg->nf > MAXF) return 0;
    cfg->n_bins = cfg->exp_max - cfg->exp_min + 1;
    cfg->lo_field = F64_BIAS + cfg->exp_min;
    cfg->hi_field = F64_BIAS + cfg->exp_max;
    cfg->big64 = (uint64_t)c[15];
    cfg->big32 = (uint32_t)c[16];
    cfg->big_bf16 = (uint16_t)c[17];
    cfg->big_f16 = (uint16_t)c[18];
    const int64_t* f = c + 19;
    for (int j = 0; j < cfg->nw; j++, f += 3) {
        cfg->t[j] = (uint64_t)f[0]; cfg->inc[j] = (int)f[1]; cfg->uf_exp[j] = (int)f[2];
    }
    for (int j = 0; j < cfg->nf; j++, f += 3) {
        cfg->fp8_max[j] = (uint64_t)f[0]; cfg->fp8_uf_exp[j] = (int)f[1];
        cfg->fp8_k_cap[j] = (int)f[2];
    }
    return 1;
}

typedef struct {
    int64_t keys[NKEYS]; /* key = 2 * fp64 exponent field + (mantissa == 0) */
    int64_t ov[MAXF];
    uint64_t mx; /* largest finite |x| as fp64 bits; 0 when none */
    uint64_t mn; /* smallest nonzero finite |x| as fp64 bits; UINT64_MAX when none */
} acc_t;

static uint16_t TAB_BF16[32768], TAB_F16[32768]; /* |x| bit pattern -> key */
static uint16_t TAB_F32[512];                      /* (exponent << 1 | mantissa == 0) of normal fp32 -> key */

/* The fp64 bits of |x| for a binary float's |x| bit pattern u (exponent field above mb mantissa bits, bias
   `bias`), by integer operations alone (the thread's FTZ/DAZ mode never touches them): a subnormal is
   normalised from its leading one, inf and nan keep their field (a nan its nonzero mantissa). */
static inline uint64_t widen_bits(uint32_t u, int mb, int bias, uint32_t field_max) {
    uint32_t e = u >> mb, m = u & ((1u << mb) - 1);
    if (e == field_max) return INF64 | ((uint64_t)m << (52 - mb));
    if (e) return ((uint64_t)(e - bias + F64_BIAS) << 52) | ((uint64_t)m << (52 - mb));
    if (!m) return 0;
    int p = 31 - __builtin_clz(m); /* |x| = m * 2^(1 - bias - mb) = 2^(p + 1 - bias - mb) * (m / 2^p) */
    return ((uint64_t)(p + 1 - bias - mb + F64_BIAS) << 52) | (((uint64_t)m << (52 - p)) & MANT64);
}
static inline uint64_t f32_bits64(uint32_t u) { return widen_bits(u & 0x7FFFFFFFu, 23, 127, 0xFF); }
static inline uint64_t bf16_bits64(uint16_t h) { return f32_bits64((uint32_t)h << 16); }
static inline uint64_t f16_bits64(uint16_t h) { return widen_bits(h & 0x7FFFu, 10, 15, 0x1F); }
static inline int key_of_bits(uint64_t b) { return (int)(((b >> 52) << 1) | ((b & MANT64) == 0)); }

void pp_init(void) {
    for (uint32_t h = 0; h < 32768; h++) {
        TAB_BF16[h] = (uint16_t)key_of_bits(bf16_bits64((uint16_t)h));
        TAB_F16[h] = (uint16_t)key_of_bits(f16_bits64((uint16_t)h));
    }
    for (uint32_t i = 0; i < 512; i++) {
        uint32_t e = i >> 1, mz = i & 1;
        /* e == 0 with mz == 0 is a subnormal: never counted through this table */
        TAB_F32[i] = (uint16_t)(e == 0 ? (mz ? 1 : 0) : key_of_bits(f32_bits64((e << 23) | (mz ? 0 : 1))));
    }
}

int pp_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}


/* the overflow counts of one value, given as the fp64 bits b of |x| (not a nan: b <= INF64); non-negative
   doubles are ordered as their bits */
static inline void overflow_of(acc_t* a, uint64_t b, const cfg_t* cfg) {
    for (int j = 0; j < cfg->nw; j++) a->ov[j] += cfg->inc[j] ? (b >= cfg->t[j]) : (b > cfg->t[j]);
}
/* the reference per-value update, for the rare paths: fp64 bits b of |x| */
static inline void add_bits(acc_t* a, uint64_t b, const cfg_t* cfg) {
    a->keys[key_of_bits(b)]++;
    if (b >= cfg->big64 && b <= INF64) overflow_of(a, b, cfg);
    if (b < INF64) {
        if (b > a->mx) a->mx = b;
        if (b && b < a->mn) a->mn = b;
    }
}
/* a block's largest finite and smallest nonzero |x|, as fp64 bits */
static inline void extremes(acc_t* a, uint64_t bmax, uint64_t bmin_nz, int have_max, int have_min) {
    if (have_max && bmax > a->mx) a->mx = bmax;
    if (have_min && bmin_nz < a->mn) a->mn = bmin_nz;
}

/* one block of fp32 values whose largest |x| pattern is rawmax: its largest finite value (a second pass only
   when inf or nan is there) and its overflow counts (compares only when a value reaches the shortcut) */
static inline uint32_t rare_f32(const uint32_t* q, int64_t m, uint32_t rawmax, acc_t* a, const cfg_t* cfg) {
    uint32_t fmax = rawmax;
    if (__builtin_expect(rawmax >= 0x7F800000u, 0)) {
        fmax = 0;
        for (int64_t i = 0; i < m; i++) {
            uint32_t u = q[i] & 0x7FFFFFFFu;
            if (u < 0x7F800000u && u > fmax) fmax = u;
        }
    }
    if (__builtin_expect(rawmax >= cfg->big32, 0)) {
        for (int64_t i = 0; i < m; i++) {
            uint32_t u = q[i] & 0x7FFFFFFFu;
            if (u >= cfg->big32 && u <= 0x7F800000u) overflow_of(a, f32_bits64(u), cfg);
        }
    }
    return fmax;
}

/* run_f32 of a small tensor: each value's key straight into the keys (subnormals by their exact key) */
static void run_f32_small(const uint32_t* q, int64_t m, acc_t* a, const cfg_t* cfg) {
    uint32_t rawmax = 0, vmin = 0xFFFFFFFFu;
    for (int64_t i = 0; i < m; i++) {
        uint32_t u = q[i] & 0x7FFFFFFFu, v = u - 1;
        rawmax = u > rawmax ? u : rawmax;
        vmin = v < vmin ? v : vmin;
        if (__builtin_expect(u != 0 && u < 0x00800000u, 0)) a->keys[key_of_bits(f32_bits64(u))]++;
        else a->keys[TAB_F32[((u >> 22) & 0x1FEu) | ((u & 0x7FFFFFu) == 0)]]++;
    }
    uint32_t fmax = rare_f32(q, m, rawmax, a, cfg);
    extremes(a, f32_bits64(fmax), f32_bits64(vmin + 1), fmax != 0, vmin < 0x7F7FFFFFu);
}

/* contiguous fp32. Per block of BLOCK values: vectorisable single-reduction passes (largest |x|, smallest
   |x| - 1, smallest mantissa) decide whether the block holds anything rare (|x| >= 256, inf, nan,
   subnormals, exact powers of two); a block without them needs only its exponent histogram, one with
   powers of two the (exponent, mantissa-is-zero) histogram, both counted into four interleaved
   sub-histograms (no store-to-load stalls between neighbours in the same bin); subnormals take the exact
   per-element path. A tensor of at most SMALL values is counted straight into the keys: clearing and folding
   the sub-histograms (12 KiB) cost more than its values. */
#define SMALL 4096
static void run_f32(const uint32_t* p, int64_t n, acc_t* a, const cfg_t* cfg) {
    uint32_t sub[4][256], sub9[4][512];
    if (n <= SMALL) {
        run_f32_small(p, n, a, cfg);
        return;
    }
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
        uint32_t fmax = rare_f32(q, m, rawmax, a, cfg); /* inf/nan, values >= the shortcut: extra passes */
        if (__builtin_expect(vmin < 0x007FFFFFu, 0)) { /* a subnormal: the exact key of every element */
            for (int64_t i = 0; i < m; i++) {
                uint32_t u = q[i] & 0x7FFFFFFFu;
                if (u != 0 && u < 0x00800000u) a->keys[key_of_bits(f32_bits64(u))]++;
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
        extremes(a, f32_bits64(fmax), f32_bits64(vmin + 1), fmax != 0, vmin < 0x7F7FFFFFu);
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

/* one block of 16-bit values whose largest |x| pattern is rawmax: its largest finite value (a second pass only
   when inf or nan is there) and its overflow counts (a pass only when a value reaches the shortcut) */
static inline uint16_t rare_16(const uint16_t* q, int64_t m, uint16_t rawmax, acc_t* a, const cfg_t* cfg,
                               uint16_t inf16, uint16_t big16, uint64_t (*widen)(uint16_t)) {
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
    return fmax;
}

/* one block of m 16-bit values, before its histogram: its largest magnitude pattern (rawmax) and smallest
   nonzero one minus 1 (vmin; 0xFFFF when all are zero), its overflow counts and largest finite value
   (rare_16), and its extremes into a */
static inline void block_16(const uint16_t* q, int64_t m, acc_t* a, const cfg_t* cfg, uint16_t inf16,
                            uint16_t big16, uint64_t (*widen)(uint16_t), uint16_t* rawmax_out, uint16_t* vmin_out) {
    uint16_t rawmax = 0, vmin = 0xFFFF;
    for (int64_t i = 0; i < m; i++) { uint16_t u = q[i] & 0x7FFF; rawmax = u > rawmax ? u : rawmax; }
    for (int64_t i = 0; i < m; i++) { uint16_t v = (uint16_t)((q[i] & 0x7FFF) - 1); vmin = v < vmin ? v : vmin; }
    uint16_t fmax = rare_16(q, m, rawmax, a, cfg, inf16, big16, widen);
    extremes(a, widen(fmax), widen((uint16_t)(vmin + 1)), fmax != 0, vmin < (uint16_t)(inf16 - 1));
    *rawmax_out = rawmax;
    *vmin_out = vmin;
}

/* A tensor of at least DIRECT_MIN 16-bit values is counted by its 15-bit magnitudes themselves (run_16_direct):
   one increment a value and no table read, the keys made from the bins the values touched once at the end. A
   smaller one keeps the table: the end's pass over the touched bins would cost more than its values. */
#define DIRECT_MIN 65536
#define DIRECT_BINS 32768
static pthread_key_t DIRECT_KEY;
static pthread_once_t DIRECT_ONCE = PTHREAD_ONCE_INIT;
static int DIRECT_KEY_OK;
static void direct_key_make(void) { DIRECT_KEY_OK = pthread_key_create(&DIRECT_KEY, free) == 0; }
/* this thread's four interleaved counts of every 15-bit magnitude (512 KiB, allocated at its first use, all
   zero between calls, freed when the thread ends); NULL where it cannot be had (the table path then) */
static uint32_t (*direct_bins(void))[DIRECT_BINS] {
    pthread_once(&DIRECT_ONCE, direct_key_make);
    if (!DIRECT_KEY_OK) return NULL;
    uint32_t(*d)[DIRECT_BINS] = pthread_getspecific(DIRECT_KEY);
    if (!d) {
        d = calloc(4, sizeof(uint32_t[DIRECT_BINS]));
        if (d && pthread_setspecific(DIRECT_KEY, d) != 0) {
            free(d);
            d = NULL;
        }
    }
    return d;
}
/* the counts of the magnitudes 0 and lo..hi into the keys, and those bins zeroed again */
static void direct_fold(uint32_t (*d)[DIRECT_BINS], acc_t* a, const uint16_t* tab, uint32_t lo, uint32_t hi) {
    a->keys[tab[0]] += (int64_t)d[0][0] + d[1][0] + d[2][0] + d[3][0];
    d[0][0] = d[1][0] = d[2][0] = d[3][0] = 0;
    for (uint32_t u = lo; u <= hi; u++) {
        uint32_t c = d[0][u] + d[1][u] + d[2][u] + d[3][u];
        if (c) {
            a->keys[tab[u]] += c;
            d[0][u] = d[1][u] = d[2][u] = d[3][u] = 0;
        }
    }
}

/* contiguous bf16 / fp16 of at least DIRECT_MIN values: per block, the passes of run_16, then each value counted
   in the bin of its magnitude's bits (four interleaved counts, as run_16's); the bins touched since the last fold
   (0 and the smallest nonzero to the largest magnitude) become keys through the table at the end, or every
   2^30 values (a bin's count stays within 32 bits) */
static void run_16_direct(const uint16_t* p, int64_t n, acc_t* a, const cfg_t* cfg, const uint16_t* tab,
                          uint16_t inf16, uint16_t big16, uint64_t (*widen)(uint16_t),
                          uint32_t (*d)[DIRECT_BINS]) {
    uint32_t lo = DIRECT_BINS, hi = 0; /* the nonzero magnitudes counted since the last fold lie in lo..hi */
    int64_t since = 0;
    for (int64_t s = 0; s < n; s += BLOCK) {
        int64_t m = n - s < BLOCK ? n - s : BLOCK;
        const uint16_t* q = p + s;
        uint16_t rawmax, vmin;
        block_16(q, m, a, cfg, inf16, big16, widen, &rawmax, &vmin);
        int64_t i = 0;
        for (; i + 4 <= m; i += 4) {
            d[0][q[i] & 0x7FFF]++;
            d[1][q[i + 1] & 0x7FFF]++;
            d[2][q[i + 2] & 0x7FFF]++;
            d[3][q[i + 3] & 0x7FFF]++;
        }
        for (; i < m; i++) d[0][q[i] & 0x7FFF]++;
        if (rawmax > hi) hi = rawmax;
        if (vmin != 0xFFFF && (uint32_t)vmin + 1 < lo) lo = (uint32_t)vmin + 1; /* 0xFFFF: zeros alone */
        since += m;
        if (since >= (1LL << 30) || s + BLOCK >= n) {
            direct_fold(d, a, tab, lo, hi);
            lo = DIRECT_BINS;
            hi = 0;
            since = 0;
        }
    }
}

/* contiguous bf16 / fp16: the key of every 15-bit magnitude comes from a table */
static void run_16(const uint16_t* p, int64_t n, acc_t* a, const cfg_t* cfg, const uint16_t* tab,
                   uint16_t inf16, uint16_t big16, uint64_t (*widen)(uint16_t)) {
    uint32_t(*direct)[DIRECT_BINS] = n >= DIRECT_MIN ? direct_bins() : NULL;
    if (direct) {
        run_16_direct(p, n, a, cfg, tab, inf16, big16, widen, direct);
        return;
    }
    /* a small tensor straight into the keys: the sub-histograms' 64 KiB cost more than its values */
    uint32_t (*sub)[NKEYS] = n <= SMALL ? NULL : calloc(4, sizeof(uint32_t[NKEYS]));
    if (n <= SMALL) {
        uint16_t rawmax = 0, vmin = 0xFFFF;
        for (int64_t i = 0; i < n; i++) {
            uint16_t u = p[i] & 0x7FFF, v = (uint16_t)(u - 1);
            rawmax = u > rawmax ? u : rawmax;
            vmin = v < vmin ? v : vmin;
            a->keys[tab[u]]++;
        }
        uint16_t fmax = rare_16(p, n, rawmax, a, cfg, inf16, big16, widen);
        extremes(a, widen(fmax), widen((uint16_t)(vmin + 1)), fmax != 0, vmin < (uint16_t)(inf16 - 1));
        return;
    }
    if (!sub) { for (int64_t i = 0; i < n; i++) add_bits(a, widen(p[i] & 0x7FFF), cfg); return; }
    int64_t since = 0;
    for (int64_t s = 0; s < n; s += BLOCK) {
        int64_t m = n - s < BLOCK ? n - s : BLOCK;
        const uint16_t* q = p + s;
        uint16_t rawmax, vmin;
        block_16(q, m, a, cfg, inf16, big16, widen, &rawmax, &vmin);
        int64_t i = 0;
        for (; i + 4 <= m; i += 4) {
            sub[0][tab[q[i] & 0x7FFF]]++;
            sub[1][tab[q[i + 1] & 0x7FFF]]++;
            sub[2][tab[q[i + 2] & 0x7FFF]]++;
            sub[3][tab[q[i + 3] & 0x7FFF]]++;
        }
        for (; i < m; i++) sub[0][tab[q[i] & 0x7FFF]]++;
        since += m;
        if (since >= (1LL << 30) || s + BLOCK >= n) {
            for (int k = 0; k < NKEYS; k++) a->keys[k] += (int64_t)sub[0][k] + sub[1][k] + sub[2][k] + sub[3][k];
            memset(sub, 0, 4 * sizeof(uint32_t[NKEYS]));
            since = 0;
        }
    }
    free(sub);
}

/* the fp64 bits of |x| of element i, from its bits */
static uint64_t ld_f16(const void* d, int64_t i) { return f16_bits64(((const uint16_t*)d)[i]); }
static uint64_t ld_bf16(const void* d, int64_t i) { return bf16_bits64(((const uint16_t*)d)[i]); }
static uint64_t ld_f32(const void* d, int64_t i) { return f32_bits64(((const uint32_t*)d)[i]); }
static uint64_t ld_f64(const void* d, int64_t i) { return ((const uint64_t*)d)[i] & ~(1ULL << 63); }

typedef struct {
    const void* data;
    int64_t n, stride;
    int dtype;
    int clean; /* keys all zero on entry: the per-thread job (zero-initialised, zeroed again after each use) */
    const cfg_t* cfg;
    acc_t acc;
} job_t;

static void* run_job(void* arg) {
    job_t* j = (job_t*)arg;
    acc_t* a = &j->acc;
    if (!j->clean) memset(a->keys, 0, sizeof(a->keys)); /* a clean job's keys are zero already */
    memset(a->ov, 0, sizeof(a->ov));
    a->mx = 0;
    a->mn = UINT64_MAX;
    if (j->stride == 1 && j->dtype == 0) run_f32((const uint32_t*)j->data, j->n, a, j->cfg);
    else if (j->stride == 1 && j->dtype == 1)
        run_16((const uint16_t*)j->data, j->n, a, j->cfg, TAB_BF16, 0x7F80, j->cfg->big_bf16, bf16_bits64);
    else if (j->stride == 1 && j->dtype == 2)
        run_16((const uint16_t*)j->data, j->n, a, j->cfg, TAB_F16, 0x7C00, j->cfg->big_f16, f16_bits64);
    else {
        uint64_t (*ld)(const void*, int64_t) = j->dtype == 0 ? ld_f32 : j->dtype == 1 ? ld_bf16 : j->dtype == 2 ? ld_f16 : ld_f64;
        for (int64_t i = 0; i < j->n; i++) add_bits(a, ld(j->data, i * j->stride), j->cfg);
    }
    return NULL;
}

/* finite nonzero values <= 2^j, from the keys klo..khi (every finite nonzero value's key lies there) */
static int64_t le_pow2(const int64_t* keys, int64_t j, int64_t klo, int64_t khi) {
    int64_t f = j + F64_BIAS, s = 0;
    if (f <= 0) return 0;
    if (f >= 2047) f = 2047;
    int64_t end = 2 * f - 1 < khi ? 2 * f - 1 : khi;
    for (int64_t k = klo; k <= end; k++) s += keys[k];
    if (klo <= 1 && end >= 1) s -= keys[1]; /* zeros */
    if (f < 2047 && 2 * f + 1 >= klo && 2 * f + 1 <= khi) s += keys[2 * f + 1];
    return s;
}

/* floor(log2 v) and the 53-bit significand of a positive finite fp64 v given by its bits (a subnormal
   normalised), by integer operations */
static inline void f64_parts(uint64_t b, int* e, uint64_t* sig) {
    int f = (int)(b >> 52);
    uint64_t m = b & MANT64;
    if (f) { *e = f - F64_BIAS; *sig = m | (1ULL << 52); return; }
    int p = 63 - __builtin_clzll(m);
    *e = p - 1074;
    *sig = m << (52 - p);
}
/* the largest k with amax * 2^k <= fmax (exact; both positive finite, as fp64 bits): their exponents' difference,
   one less where amax's significand is the larger */
static int cs_exponent(uint64_t fmax, uint64_t amax) {
    int ef, ea;
    uint64_t sf, sa;
    f64_parts(fmax, &ef, &sf);
    f64_parts(amax, &ea, &sa);
    return ef - ea - (sa > sf);
}

/* Statistics of one tensor call into call[width + 2] (overwritten): a row, then its first and last nonzero
   histogram bin (-1 when none). dtype: 0 fp32, 1 bf16, 2 fp16, 3 fp64. config: RowLayout.c_config(). */
/* One tensor's statistics into call[width + 2]; 0, or -1 when the scratch could not be allocated. A single
   thread's scratch lives in static memory: most tensors of a training step are small, and a fresh 33 KiB
   allocation per call cost more than reading them. */
static __thread job_t ONE_JOB; /* per thread: ctypes releases the GIL during a call */
static int call_stats(const void* data, int64_t n, int64_t stride, int dtype, int nthreads, const cfg_t* pcfg,
                      int64_t* call) {
    cfg_t cfg = *pcfg;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 64) nthreads = 64;
    if (n < (1 << 16)) nthreads = 1; /* not worth a thread */
    job_t* jobs = nthreads == 1 ? &ONE_JOB : malloc(sizeof(job_t) * nthreads);
    if (!jobs) return -1; /* out of host memory: the caller raises */
    /* the per-thread job's keys are zeroed after each use (below), over the range the call touched: a small
       tensor costs what it reads, not a clear and a scan of all 4096 keys */
    if (jobs == &ONE_JOB) ONE_JOB.clean = 1;
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
        if (jobs != &ONE_JOB) jobs[w].clean = 0;
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
        for (int j = 0; j < cfg.nw; j++) a->ov[j] += b->ov[j];
        if (b->mx > a->mx) a->mx = b->mx;
        if (b->mn < a->mn) a->mn = b->mn;
    }
    int64_t* keys = a->keys;
    /* every finite nonzero value's key lies in klo..khi (between the smallest and the largest one's); zeros
       are key 1, nan 4094, inf 4095 */
    int64_t klo = a->mn == UINT64_MAX ? 2 : 2 * (int64_t)(a->mn >> 52);
    int64_t khi = a->mx == 0 ? 1 : 2 * (int64_t)(a->mx >> 52) + 1;
    memset(call, 0, sizeof(int64_t) * (cfg.width + 2));
    call[cfg.numel] = n;
    call[cfg.zeros] = keys[1];
    call[cfg.nan] = keys[2 * 2047];
    call[cfg.inf] = keys[2 * 2047 + 1];
    for (int j = 0; j < cfg.nw; j++) {
        call[cfg.overflow + j] = a->ov[j];
        call[cfg.pow2 + j] = keys[2 * (cfg.uf_exp[j] + F64_BIAS) + 1];
    }
    call[cfg.absmax] = (int64_t)a->mx;
    call[cfg.absmin] = a->mn == UINT64_MAX ? NO_MIN_BITS : (int64_t)(a->mn - 1);
    if (a->mx > 0) {
        for (int j = 0; j < cfg.nf; j++) {
            int k = cs_exponent(cfg.fp8_max[j], a->mx);
            if (k > cfg.fp8_k_cap[j]) k = cfg.fp8_k_cap[j]; /* amax under the floor: the scale stops growing */
            call[cfg.cs + j] = le_pow2(keys, cfg.fp8_uf_exp[j] - k, klo, khi);
        }
    }
    int64_t* hist = call + cfg.hist;
    int nb = cfg.n_bins, lof = cfg.lo_field, hif = cfg.hi_field;
    int64_t lo = -1, hi = -1;
    for (int64_t f = klo / 2; f <= khi / 2 && f < 2047; f++) {
        int64_t c = f == 0 ? keys[0] : keys[2 * f] + keys[2 * f + 1]; /* field 0: key 1 is the zeros */
        if (!c) continue;
        int64_t b = f < lof ? 0 : f > hif ? nb - 1 : f - lof; /* below fp32's range: the first bin; above: the last */
        hist[b] += c;
        if (lo < 0 || b < lo) lo = b;
        if (b > hi) hi = b;
    }
    call[cfg.width] = lo;
    call[cfg.width + 1] = hi;
    if (jobs == &ONE_JOB) { /* zero what this call touched, for the next one */
        if (klo <= khi) memset(keys + klo, 0, sizeof(int64_t) * (size_t)(khi - klo + 1));
        keys[0] = keys[1] = keys[2 * 2047] = keys[2 * 2047 + 1] = 0;
    }
    if (jobs != &ONE_JOB) free(jobs);
    return 0;
}

void pp_call(const void* data, int64_t n, int64_t stride, int dtype, int nthreads, const int64_t* config,
             int64_t* call) {
    cfg_t cfg;
    if (!read_cfg(config, &cfg)) { call[0] = -2; return; } /* a layout this kernel cannot hold */
    if (call_stats(data, n, stride, dtype, nthreads, &cfg, call) < 0) call[cfg.numel] = -1;
}

/* Add a call's statistics into a row: its first hist columns (counts[hist]) and a histogram window of w
   bins starting at bin wlo. ops: the merge rule of each column (RowLayout.merge_ops: 0 sum, 1 max, 2 min).
   Returns 1 (and changes nothing) when the call's bins do not fit the window. */
int pp_merge(const int64_t* call, int64_t* counts, int64_t* window, int64_t wlo, int64_t w, const int64_t* config,
             const int64_t* ops) {
    int64_t hist = config[9], width = config[10];
    int64_t lo = call[width], hi = call[width + 1];
    if (lo >= 0 && (lo < wlo || hi >= wlo + w)) return 1;
    for (int64_t c = 0; c < hist; c++) {
        if (ops[c] == 1) counts[c] = call[c] > counts[c] ? call[c] : counts[c];
        else if (ops[c] == 2) counts[c] = call[c] < counts[c] ? call[c] : counts[c];
        else counts[c] += call[c];
    }
    if (lo >= 0) for (int64_t b = lo; b <= hi; b++) window[b - wlo] += call[hist + b];
    return 0;
}

/* The rows pp_add fills, as one int64 array (precprof.stats.rows_host.HostRows keeps it up to date): the
   layout's config, the call row, the merge rule, threads per call, the counts (rows x counts_width, the
   columns before the histogram) and the histogram window (rows x w bins, from bin wlo). */
enum { CTX_CONFIG, CTX_CALL, CTX_OPS, CTX_THREADS, CTX_COUNTS, CTX_COUNTS_WIDTH, CTX_WINDOW, CTX_WLO, CTX_W,
       /* pp_add_at's arguments, written into the context by the caller */
       CTX_DATA, CTX_N, CTX_STRIDE, CTX_DTYPE, CTX_ROW, CTX_FLAGS,
       /* the first and last histogram bin any call merged since the caller last set them (its reset of the rows
          zeroes those bins alone, and a sampled step's copy reads them alone) */
       CTX_USED_LO, CTX_USED_HI };

/* pp_call, then pp_merge into row ``row``, in one call. flags: 1 clears the row first (a weight gradient: the
   last accumulation wins), 2 merges the call row as it is (it already holds this tensor: a tensor added again
   right away is not read again). Returns 0; 1 when the call's bins fall outside the window (the call row holds
   the statistics, the row is untouched but for the clearing: grow the window, then pp_merge); -1 when the
   scratch could not be allocated; -2 for a layout this kernel cannot hold. */
int pp_add(int64_t* ctx, const void* data, int64_t n, int64_t stride, int dtype, int64_t row, int flags) {
    const int64_t* config = (const int64_t*)(intptr_t)ctx[CTX_CONFIG];
    int64_t* call = (int64_t*)(intptr_t)ctx[CTX_CALL];
    int64_t w = ctx[CTX_W];
    int64_t* counts = (int64_t*)(intptr_t)ctx[CTX_COUNTS] + row * ctx[CTX_COUNTS_WIDTH];
    int64_t* window = (int64_t*)(intptr_t)ctx[CTX_WINDOW] + row * w;
    cfg_t cfg;
    if (!read_cfg(config, &cfg)) return -2;
    if (flags & 1) {
        memset(counts, 0, sizeof(int64_t) * cfg.hist);
        counts[cfg.absmin] = NO_MIN_BITS;
        if (w > 0) memset(window, 0, sizeof(int64_t) * w);
    }
    if (!(flags & 2) && call_stats(data, n, stride, dtype, (int)ctx[CTX_THREADS], &cfg, call) < 0) return -1;
    int rc = pp_merge(call, counts, window, ctx[CTX_WLO], w, config, (const int64_t*)(intptr_t)ctx[CTX_OPS]);
    const int64_t lo = call[cfg.width], hi = call[cfg.width + 1];
    if (rc == 0 && lo >= 0) {
        if (lo < ctx[CTX_USED_LO]) ctx[CTX_USED_LO] = lo;
        if (hi > ctx[CTX_USED_HI]) ctx[CTX_USED_HI] = hi;
    }
    return rc;
}

/* pp_add with its arguments in the context (CTX_DATA..CTX_FLAGS): a call with one argument costs a sixth of one
   with seven through ctypes, which converts each argument (1.7 us against 0.25 us), on every tensor of a step */
int pp_add_at(int64_t* ctx) {
    return pp_add(ctx, (const void*)(intptr_t)ctx[CTX_DATA], ctx[CTX_N], ctx[CTX_STRIDE], (int)ctx[CTX_DTYPE],
                  ctx[CTX_ROW], (int)ctx[CTX_FLAGS]);
}

/* pp_add of k tensors (data pointers, sizes, strides, dtypes, rows), from index start, each with pp_add's
   flags (1: clear its row first): the parameters of a sampled step, or their gradients, read in one call.
   Returns k when all are merged; i when tensor i's bins fall outside the window (its call row holds its
   statistics: grow the window, pp_merge it, go on from i + 1); -1 - i when tensor i could not be read (no
   scratch, or a layout this kernel cannot hold). */
int64_t pp_add_many(int64_t* ctx, int64_t k, const int64_t* ptrs, const int64_t* ns, const int64_t* strides,
                    const int64_t* dtypes, const int64_t* rows, int64_t start, int64_t flags) {
    for (int64_t i = start; i < k; i++) {
        int rc = pp_add(ctx, (const void*)(intptr_t)ptrs[i], ns[i], strides[i], (int)dtypes[i], rows[i], (int)flags);
        if (rc == 1) return i;
        if (rc < 0) return -1 - i;
    }
    return k;
}

/* ------------------------------------------------------------------------------------------------------
   Block-scaled what-if (precprof.block_formats): per recipe, the flushed / saturated / poisoned counts and the
   float64 sums of x^2 and (x - q)^2, with the rules and the fp32 arithmetic of block_formats.block_stats.

   The tensor is a contiguous 2-D view [rows, last]. Orientation 0 ("row") reads blocks along the last
   dimension, orientation 1 ("col") down the columns (stride = last), without a transposed copy. Either way
   the work is cut into tiles of BG blocks of BT = 32 values, loaded into buf[BT][BG] (the last block of a
   line padded with zeros), so that every recipe runs vectorised across the BG blocks side by side; NVFP4's
   blocks of 16 are the two halves of a tile's blocks. Every recipe is evaluated from the same tile while it
   sits in L1: one read of the tensor per orientation. NVFP4's per-tensor scale needs the tensor's amax
   before its blocks: a first, cheap max pass over the bits (shared by both orientations) gives it.
   The float64 sums are deterministic: the tiles are cut into chunks of a fixed size (not per thread), each
   chunk sums into its own partials, and the partials are added in chunk order, so the result does not
   depend on the thread count. An MX recipe on a tile whose block amaxes all lie in [2^-90, 2^101) (or are 0)
   carries its scales to per-block bounds (tile_mx_bounds: no product by 2^-k or 2^k a value, the counts
   integer comparisons), the same statistics as tile_recipe's; with NVFP4's elements rounded by round_value too,
   the seven recipes of the layers table on 2M values, both orientations, one thread, take 11.2 ms (fp32) and
   12.5 (bf16) against 18.5 and 19.9 before. */

#define BT 32
#define BG 16
#define MAXR 16
#define CHUNK_TILES 64
#define REC_LEN 10 /* int64 per recipe in the config: precprof.stats.kernel.recipe_config */

typedef struct {
    int kind;  /* 0 MX floor, 1 MX rceil, 2 NVFP4 */
    int m, emin, emax; /* element: mantissa bits, floor(log2 smallest normal), floor(log2 max) */
    float fmax, fsat; /* element max; saturated: |scaled| > fsat (block_formats.saturation_bound) */
    int sm, semin; /* NVFP4's E4M3 block scale: mantissa bits, smallest normal exponent */
    float smax, smin;
} brec_t;

typedef struct { int64_t flushed, saturated, poisoned; double x2, err2; } bsum_t;

static inline uint32_t fbits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bitsf(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline int floor_log2_bits(uint32_t a) { /* a: the bits of a positive finite float */
    if (a >= 0x800000u) return (int)(a >> 23) - 127;
    return -149 + 31 - __builtin_clz(a);
}
static inline float pow2f(int k) { /* 2^k, k in [-149, 127] */
    return k >= -126 ? bitsf((uint32_t)(k + 127) << 23) : bitsf(1u << (k + 149));
}
static inline float h2f(uint16_t h) { /* fp16 -> fp32, exact (subnormals, inf and nan included) */
    uint32_t em = h & 0x7FFFu;
    float f = bitsf(em << 13) * 0x1p112f;
    uint32_t u = em >= 0x7C00u ? 0x7F800000u | ((em & 0x3FFu) << 13) : fbits(f);
    return bitsf(u | ((uint32_t)(h & 0x8000u) << 16));
}

/* block_formats.round_to_element: clamp to +-fmax, then round half to even at the spacing of the value's
   binade (subnormals share the smallest normal binade's); every step exact in fp32. The magic-number
   rounding is round-to-nearest-even for |t| < 2^22 (here |t| < 2^(m+2)). */
static inline float round_elem(float v, int m, int emin, float fmax) {
    float a = v > fmax ? fmax : (v < -fmax ? -fmax : v);
    int e = (int)((fbits(a) >> 23) & 0xFFu) - 127;
    e = e < emin ? emin : e;
    float t = a * bitsf((uint32_t)(m - e + 127) << 23);
    float r = (t + 12582912.0f) - 12582912.0f;
    return r * bitsf((uint32_t)(e - m + 127) << 23);
}

/* round_elem of a magnitude a >= 0 in fewer operations (the Triton kernels' _round_value, tested equal to the
   general rounding on every tie and binade edge): a clamped to fmax is rounded to nearest-even by the
   magic-number sum with big = 2^(E + 23 - m), E the larger of its binade and emin (from its exponent bits):
   big's binade holds c + big and its spacing is the element's at c; its significand is 0, so a tie goes to
   the even multiple; and (c + big) - big is exact */
static inline float round_value(float a, int m, int emin, float fmax) {
    const float c = a > fmax ? fmax : a;
    const uint32_t e = fbits(c) & 0x7F800000u, lo = (uint32_t)(emin + 127) << 23;
    const float big = bitsf((e > lo ? e : lo) + ((uint32_t)(23 - m) << 23));
    return (c + big) - big;
}

/* the E8M0 exponent k of an MX block whose finite amax has bits a (block_formats._quantize) */
static int mx_exponent(uint32_t a, const brec_t* r) {
    if (a == 0) return -127;
    int k;
    if (r->kind == 0) {
        k = floor_log2_bits(a) - r->emax;
    } else { /* rceil: the smallest k with 2^k >= fl32(amax / max); a quotient of 0 takes E8M0's smallest */
        uint32_t u = fbits(bitsf(a) / r->fmax);
        if (u == 0) k = -127;
        else {
            int pow2 = u >= 0x800000u ? (u & 0x7FFFFFu) == 0 : (u & (u - 1)) == 0;
            k = floor_log2_bits(u) + (pow2 ? 0 : 1);
        }
    }
    return k < -127 ? -127 : (k > 127 ? 127 : k);
}

typedef struct {
    int32_t fl[MAXR][BG], sat[MAXR][BG];
    double err[MAXR][BG], x2[BG];
    int64_t pois;
} lanes_t;

/* one recipe over one tile, on magnitudes (rounding to nearest-even is symmetric): scaled = |x| * mul[g] (per
   block, or per half-block for NVFP4), q = element(scaled) * deq[g]; counts and sums per lane, in registers
   over the tile. With a power-of-two (MX) scale, |x| - q is exact in fp32 (q is 0, or within a factor of two
   of |x|); NVFP4's q carries an fp32 rounding of its own, so its difference is taken in fp64, as the
   reference takes both. */
static inline void tile_recipe(const float* restrict buf, int n_i, const float* restrict mul0,
                               const float* restrict deq0, const float* restrict mul1,
                               const float* restrict deq1, int half, int pow2_scale, const brec_t* r,
                               int32_t* restrict fl, int32_t* restrict sat, double* restrict err) {
    const int m = r->m, emin = r->emin;
    const float fmax = r->fmax, fsat = r->fsat;
    int32_t f[BG], st[BG];
    double e[BG];
    for (int g = 0; g < BG; g++) { f[g] = 0; st[g] = 0; e[g] = 0.0; }
    for (int i = 0; i < n_i; i++) {
        const float* restrict x = buf + i * BG;
        const float* restrict mul = i < half ? mul0 : mul1;
        const float* restrict dq = i < half ? deq0 : deq1;
        if (pow2_scale) {
            for (int g = 0; g < BG; g++) {
                const float a = fabsf(x[g]), sc = a * mul[g];
                st[g] += sc > fsat;
                float q = round_value(sc, m, emin, fmax) * dq[g];
                f[g] += (a != 0.0f) & (q == 0.0f);
                double d = (double)(a - q);
                e[g] += d * d;
            }
        } else {
            for (int g = 0; g < BG; g++) {
                const float a = fabsf(x[g]), sc = a * mul[g];
                st[g] += sc > fsat;
                float q = round_value(sc, m, emin, fmax) * dq[g];
                f[g] += (a != 0.0f) & (q == 0.0f);
                double d = (double)a - (double)q;
                e[g] += d * d;
            }
        }
    }
    for (int g = 0; g < BG; g++) { fl[g] += f[g]; sat[g] += st[g]; err[g] += e[g]; }
}

/* The blocks whose MX scales carry to the bounds (tile_mx_bounds; the Triton kernel's triton_block_math._safe):
   amax bits a in [2^-90, 2^101), or 0, where every bound below is a normal fp32 and no sum overflows */
static inline int mx_bounds_hold(uint32_t a) {
    uint32_t e = a & 0x7F800000u;
    return a == 0 || (e >= (uint32_t)(127 - 90) << 23 && e <= (uint32_t)(127 + 100) << 23);
}

/* One MX recipe over one tile with its block scales 2^k (k[g]; ka[g] the block's amax bits) carried to the
   values: a power-of-two scale only moves the element grid, its largest value (fmax * 2^k), the largest value
   that rounds to 0 (half the smallest subnormal, 2^(emin - m - 1 + k): a tie goes to the even 0) and the
   saturation bound (fsat * 2^k), so a value needs no product by 2^-k or 2^k and its counts are integer
   comparisons of its bits. q = |x| rounded to nearest-even by the magic-number sum with 2^(e + 23 - m), e the
   larger of |x|'s binade and the format's lowest at this scale (emin + k), then clamped to the largest value:
   rounding is monotonic and the largest value is on the grid, so that is tile_recipe's clamp before the
   rounding. The same counts and sums as tile_recipe, for a tile whose blocks all pass mx_bounds_hold. */
static inline void tile_mx_bounds(const float* restrict buf, int n_i, const int* restrict k,
                                  const uint32_t* restrict ka, const brec_t* r, int32_t* restrict fl,
                                  int32_t* restrict sat, double* restrict err) {
    const int m = r->m, emin = r->emin;
    const uint32_t c = (uint32_t)(23 - m) << 23;
    uint32_t low[BG], zero[BG], satb[BG];
    float top[BG];
    int32_t f[BG], st[BG];
    double e[BG];
    for (int g = 0; g < BG; g++) {
        const int32_t kb = (ka[g] == 0 ? 0 : k[g]) * (1 << 23); /* (a block of zeros: any scale, 2^0) */
        low[g] = (uint32_t)(((emin + 150 - m) << 23) + kb);
        zero[g] = (uint32_t)(((emin - m + 126) << 23) + kb);
        satb[g] = (uint32_t)((int32_t)fbits(r->fsat) + kb);
        top[g] = bitsf((uint32_t)((int32_t)fbits(r->fmax) + kb));
        f[g] = 0; st[g] = 0; e[g] = 0.0;
    }
    for (int i = 0; i < n_i; i++) {
        const float* restrict x = buf + i * BG;
        for (int g = 0; g < BG; g++) {
            const uint32_t ab = fbits(x[g]) & 0x7FFFFFFFu;
            const float a = bitsf(ab);
            const uint32_t own = (ab & 0x7F800000u) + c;
            const float big = bitsf(own > low[g] ? own : low[g]);
            float q = (a + big) - big;
            q = q < top[g] ? q : top[g];
            f[g] += (ab != 0) & (ab <= zero[g]);
            st[g] += ab > satb[g];
            const double d = (double)(a - q);
            e[g] += d * d;
        }
    }
    for (int g = 0; g < BG; g++) { fl[g] += f[g]; sat[g] += st[g]; err[g] += e[g]; }
}

typedef struct {
    const void* data;
    int64_t rows, last;
    int dtype, orient, nr;
    const brec_t* rec;
    int nvfp4_ok;     /* the tensor's amax is finite */
    float p, inv_p;   /* NVFP4's per-tensor scale and fl(1 / p) */
} bjob_t;

static inline float load_x(const void* d, int dtype, int64_t i) {
    if (dtype == 0) return ((const float*)d)[i];
    if (dtype == 1) return bitsf((uint32_t)((const uint16_t*)d)[i] << 16);
    return h2f(((const uint16_t*)d)[i]);
}

/* load tile t into buf[BT][BG]; valid[g]: how many of block g's values are real (not padding). Returns the
   longest block's length: the tile's rows from there on are padding alone, zeros, which add nothing to any
   count or sum (a zero is never flushed nor saturated, its error is 0), so they are not evaluated (a tensor
   narrower or shorter than a block, a small layer's, costs its values rather than whole tiles). */
static int load_tile(const bjob_t* j, int64_t t, float* buf, int* valid) {
    int longest = 0;
    int64_t R = j->rows, L = j->last;
    if (j->orient == 0) {
        int64_t nbl = (L + BT - 1) / BT, nb = R * nbl;
        for (int g = 0; g < BG; g++) {
            int64_t b = t * BG + g;
            int len = 0;
            int64_t base = 0;
            if (b < nb) {
                int64_t r = b / nbl, c0 = (b % nbl) * BT;
                len = (int)(L - c0 < BT ? L - c0 : BT);
                base = r * L + c0;
            }
            valid[g] = len;
            longest = len > longest ? len : longest;
            if (len == BT && j->dtype == 0) {
                const float* s = (const float*)j->data + base;
                for (int i = 0; i < BT; i++) buf[i * BG + g] = s[i];
            } else {
                for (int i = 0; i < BT; i++) buf[i * BG + g] = i < len ? load_x(j->data, j->dtype, base + i) : 0.0f;
            }
        }
    } else {
        int64_t nct = (L + BG - 1) / BG;
        int64_t r0 = (t / nct) * BT, c0 = (t % nct) * BG;
        int len = (int)(R - r0 < BT ? R - r0 : BT);
        int w = (int)(L - c0 < BG ? L - c0 : BG);
        for (int g = 0; g < BG; g++) valid[g] = g < w ? len : 0;
        for (int i = 0; i < BT; i++) {
            float* o = buf + i * BG;
            int64_t base = (r0 + i) * L + c0;
            if (i < len && w == BG) {
                if (j->dtype == 0) { const float* s = (const float*)j->data + base; for (int g = 0; g < BG; g++) o[g] = s[g]; }
                else if (j->dtype == 1) { const uint16_t* s = (const uint16_t*)j->data + base; for (int g = 0; g < BG; g++) o[g] = bitsf((uint32_t)s[g] << 16); }
                else { const uint16_t* s = (const uint16_t*)j->data + base; for (int g = 0; g < BG; g++) o[g] = h2f(s[g]); }
            } else {
                for (int g = 0; g < BG; g++) o[g] = (i < len && g < w) ? load_x(j->data, j->dtype, base + g) : 0.0f;
            }
        }
        longest = w > 0 ? len : 0;
    }
    return longest;
}

static NOINLINE void run_tiles(const bjob_t* j, int64_t t0, int64_t t1, bsum_t* out) {
    float buf[BT * BG];
    int valid[BG];
    uint32_t am0[BG], am1[BG], am[BG];
    int ke[BG];
    float mul0[BG], deq0[BG], mul1[BG], deq1[BG];
    lanes_t lanes; /* 6 KiB on this thread's stack: no allocation per call */
    lanes_t* ln = &lanes;
    const int nr = j->nr;
    for (int k = 0; k < nr; k++)
        for (int g = 0; g < BG; g++) { ln->fl[k][g] = 0; ln->sat[k][g] = 0; ln->err[k][g] = 0.0; }
    for (int g = 0; g < BG; g++) ln->x2[g] = 0.0;
    ln->pois = 0;
    for (int64_t t = t0; t < t1; t++) {
        const int n_i = load_tile(j, t, buf, valid);
        const int h_i = n_i < BT / 2 ? n_i : BT / 2;
        for (int g = 0; g < BG; g++) { am0[g] = 0; am1[g] = 0; }
        for (int i = 0; i < h_i; i++)
            for (int g = 0; g < BG; g++) { uint32_t u = fbits(buf[i * BG + g]) & 0x7FFFFFFFu; am0[g] = u > am0[g] ? u : am0[g]; }
        for (int i = BT / 2; i < n_i; i++)
            for (int g = 0; g < BG; g++) { uint32_t u = fbits(buf[i * BG + g]) & 0x7FFFFFFFu; am1[g] = u > am1[g] ? u : am1[g]; }
        for (int g = 0; g < BG; g++) {
            if ((am0[g] > am1[g] ? am0[g] : am1[g]) >= 0x7F800000u) { /* nan or inf: a poisoned MX block */
                ln->pois += valid[g];
                for (int i = 0; i < n_i; i++) buf[i * BG + g] = 0.0f;
                am0[g] = am1[g] = 0;
            }
        }
        for (int i = 0; i < n_i; i++)
            for (int g = 0; g < BG; g++) { double x = (double)buf[i * BG + g]; ln->x2[g] += x * x; }
        int bounds_hold = 1; /* every block of the tile: its MX scales carry to the bounds (tile_mx_bounds) */
        for (int g = 0; g < BG; g++) {
            am[g] = am0[g] > am1[g] ? am0[g] : am1[g];
            bounds_hold &= mx_bounds_hold(am[g]);
        }
        for (int k = 0; k < nr; k++) {
            const brec_t* r = &j->rec[k];
            if (r->kind == 2) {
                if (!j->nvfp4_ok) continue;
                for (int g = 0; g < BG; g++) {
                    for (int h = 0; h < 2; h++) {
                        float a = bitsf(h ? am1[g] : am0[g]);
                        float v = a / r->fmax / j->p;
                        v = v < r->smin ? r->smin : (v > r->smax ? r->smax : v);
                        float s = round_elem(v, r->sm, r->semin, r->smax);
                        float f = j->inv_p / s; /* an overflowing factor is the fp32 max (nan stays) */
                        (h ? mul1 : mul0)[g] = f > FLT_MAX ? FLT_MAX : f;
                        (h ? deq1 : deq0)[g] = j->p * s;
                    }
                }
                tile_recipe(buf, n_i, mul0, deq0, mul1, deq1, BT / 2, 0, r, ln->fl[k], ln->sat[k], ln->err[k]);
            } else if (bounds_hold) {
                for (int g = 0; g < BG; g++) ke[g] = mx_exponent(am[g], r);
                tile_mx_bounds(buf, n_i, ke, am, r, ln->fl[k], ln->sat[k], ln->err[k]);
            } else {
                for (int g = 0; g < BG; g++) {
                    int e = mx_exponent(am[g], r);
                    /* rceil at E8M0's smallest scale: a factor of 1, as TE's exp2f_rcp (block_formats) */
                    mul0[g] = r->kind == 1 && e == -127 ? 1.0f : pow2f(-e);
                    deq0[g] = pow2f(e);
                }
                tile_recipe(buf, n_i, mul0, deq0, mul0, deq0, BT, 1, r, ln->fl[k], ln->sat[k], ln->err[k]);
            }
        }
    }
    double x2 = 0.0;
    for (int g = 0; g < BG; g++) x2 += ln->x2[g];
    for (int k = 0; k < nr; k++) {
        bsum_t* o = &out[k];
        memset(o, 0, sizeof(*o));
        for (int g = 0; g < BG; g++) {
            o->flushed += ln->fl[k][g];
            o->saturated += ln->sat[k][g];
            o->err2 += ln->err[k][g];
        }
        if (j->rec[k].kind == 2) o->x2 = j->nvfp4_ok ? x2 : 0.0; /* no poisoned block when the amax is finite */
        else { o->x2 = x2; o->poisoned = ln->pois; }
    }
}

/* |x| of element i as a bit pattern ordered as the values (nan > inf > finite); an fp16's is its own (the
   amax pass compares bits, with no float arithmetic) */
static inline uint32_t absbits_at(const void* d, int dtype, int64_t i) {
    if (dtype == 0) return ((const uint32_t*)d)[i] & 0x7FFFFFFFu;
    uint16_t h = ((const uint16_t*)d)[i] & 0x7FFFu;
    return dtype == 1 ? (uint32_t)h << 16 : h;
}

/* Block statistics of a contiguous [rows, last] tensor (dtype 0 fp32, 1 bf16, 2 fp16) for nr recipes (config:
   REC_LEN int64 each) in the orientations of the bit mask orients (1: row, 2: col), into out[2][nr][5]
   (flushed, saturated, poisoned, sum_x2, sum_err2 as doubles; an orientation not asked for is left as it
   is; with bit 4 of orients the statistics are added into out, an accumulator, instead of written).
   Returns 0, or -1 when out of host memory. Runs in IEEE mode (pp_block). */
static NOINLINE int block_stats(const void* data, int64_t rows, int64_t last, int dtype, int orients, int nr,
                                const int64_t* config, int nthreads, double* out) {
    if (nr < 1 || nr > MAXR) return -2;
    brec_t rec[MAXR];
    int any_nv = 0;
    for (int k = 0; k < nr; k++) {
        const int64_t* c = config + k * REC_LEN;
        rec[k].kind = (int)c[0]; rec[k].m = (int)c[1]; rec[k].emin = (int)c[2]; rec[k].emax = (int)c[3];
        rec[k].fmax = bitsf((uint32_t)c[4]); rec[k].sm = (int)c[5]; rec[k].semin = (int)c[6];
        rec[k].smax = bitsf((uint32_t)c[7]); rec[k].smin = bitsf((uint32_t)c[8]); rec[k].fsat = bitsf((uint32_t)c[9]);
        any_nv |= rec[k].kind == 2;
    }
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 64) nthreads = 64;
    int64_t n = rows * last;
    if (n < (1 << 15)) nthreads = 1;
    bjob_t job = {data, rows, last, dtype, 0, nr, rec, 1, 1.0f, 1.0f};
    if (any_nv) { /* the tensor's amax: the largest |x| bit pattern (nan > inf > finite) */
        uint32_t amax = 0;
        if (nthreads > 1) {
#ifdef _OPENMP
            #pragma omp parallel for num_threads(nthreads) schedule(static) reduction(max : amax)
#endif
            for (int64_t i = 0; i < n; i++) { uint32_t u = absbits_at(data, dtype, i); amax = u > amax ? u : amax; }
        } else { /* no parallel region: entering one, even to run it on this thread alone, costs microseconds */
            for (int64_t i = 0; i < n; i++) { uint32_t u = absbits_at(data, dtype, i); amax = u > amax ? u : amax; }
        }
        if (dtype == 2) amax = fbits(h2f((uint16_t)amax)); /* fp16: as fp32 (inf and nan stay so) */
        job.nvfp4_ok = amax < 0x7F800000u;
        if (amax > 0 && job.nvfp4_ok) {
            job.p = bitsf(amax) / 2688.0f; /* fl(amax / (448 * 6)), at least the smallest fp32 whose */
            if (job.p < bitsf(0x00200001u)) job.p = bitsf(0x00200001u); /* reciprocal is finite */
            job.inv_p = 1.0f / job.p;
        }
    }
    for (int o = 0; o < 2; o++) {
        if (!(orients & (1 << o))) continue;
        job.orient = o;
        int64_t tiles = o == 0 ? (rows * ((last + BT - 1) / BT) + BG - 1) / BG
                               : ((rows + BT - 1) / BT) * ((last + BG - 1) / BG);
        int64_t nch = (tiles + CHUNK_TILES - 1) / CHUNK_TILES;
        bsum_t one[MAXR]; /* a tensor of one chunk (a small one) needs no allocation */
        bsum_t* part = nch <= 1 ? one : calloc((size_t)nch * nr, sizeof(bsum_t));
        if (!part) return -1;
        if (nch < 1) memset(one, 0, sizeof(one));
        if (nthreads > 1 && nch > 1) {
#ifdef _OPENMP
            #pragma omp parallel num_threads(nthreads)
#endif
            {
                fpmode_t fm = fp_ieee_enter(); /* this worker's own mode: IEEE while it computes */
#ifdef _OPENMP
                #pragma omp for schedule(static)
#endif
                for (int64_t c = 0; c < nch; c++) {
                    int64_t t0 = c * CHUNK_TILES, t1 = t0 + CHUNK_TILES < tiles ? t0 + CHUNK_TILES : tiles;
                    run_tiles(&job, t0, t1, part + c * nr);
                }
                fp_ieee_leave(fm);
            }
        } else {
            for (int64_t c = 0; c < nch; c++) {
                int64_t t0 = c * CHUNK_TILES, t1 = t0 + CHUNK_TILES < tiles ? t0 + CHUNK_TILES : tiles;
                run_tiles(&job, t0, t1, part + c * nr);
            }
        }
        double* dst = out + o * nr * 5;
        for (int k = 0; k < nr; k++) {
            int64_t fl = 0, sat = 0, po = 0;
            double x2 = 0.0, e2 = 0.0;
            for (int64_t c = 0; c < nch; c++) { /* in chunk order: the same sums for any thread count */
                const bsum_t* s = &part[c * nr + k];
                fl += s->flushed; sat += s->saturated; po += s->poisoned; x2 += s->x2; e2 += s->err2;
            }
            if (rec[k].kind == 2 && !job.nvfp4_ok) po = n;
            if (orients & 4) {
                dst[k * 5 + 0] += (double)fl; dst[k * 5 + 1] += (double)sat; dst[k * 5 + 2] += (double)po;
                dst[k * 5 + 3] += x2; dst[k * 5 + 4] += e2;
            } else {
                dst[k * 5 + 0] = (double)fl; dst[k * 5 + 1] = (double)sat; dst[k * 5 + 2] = (double)po;
                dst[k * 5 + 3] = x2; dst[k * 5 + 4] = e2;
            }
        }
        if (part != one) free(part);
    }
    return 0;
}

/* block_stats in IEEE mode, whatever the caller's (on the calling thread here, on each worker in block_stats) */
int pp_block(const void* data, int64_t rows, int64_t last, int dtype, int orients, int nr, const int64_t* config,
             int nthreads, double* out) {
    fpmode_t fm = fp_ieee_enter();
    int rc = block_stats(data, rows, last, dtype, orients, nr, config, nthreads, out);
    fp_ieee_leave(fm);
    return rc;
}

/* pp_block with its arguments in an int64 array (data, rows, last, dtype, orients, nr, config, nthreads, out):
   one argument for ctypes to convert instead of nine (see pp_add_at), on every block-format evaluation */
int pp_block_at(const int64_t* a) {
    return pp_block((const void*)(intptr_t)a[0], a[1], a[2], (int)a[3], (int)a[4], (int)a[5],
                    (const int64_t*)(intptr_t)a[6], (int)a[7], (double*)(intptr_t)a[8]);
}

/* pp_block_at over k tensors: a[] as pp_block_at's (its data, rows, last, dtype and out unused), each tensor's
   from the arrays (data pointers, rows, last dimensions, dtypes, out pointers). The block-format what-if of a
   sampled step's weights, in one call. Returns 0, or -1 - i when tensor i's scratch could not be allocated. */
int64_t pp_block_many(const int64_t* a, int64_t k, const int64_t* ptrs, const int64_t* rows, const int64_t* lasts,
                      const int64_t* dtypes, const int64_t* outs) {
    for (int64_t i = 0; i < k; i++) {
        int rc = pp_block((const void*)(intptr_t)ptrs[i], rows[i], lasts[i], (int)dtypes[i], (int)a[4], (int)a[5],
                          (const int64_t*)(intptr_t)a[6], (int)a[7], (double*)(intptr_t)outs[i]);
        if (rc) return -1 - i;
    }
    return 0;
}

/* ---- weight-update samples (precprof.capture.updates): a strided sample of each of k parameters (member m:
   data pointer, stride, length and dtype 0 fp32, 1 bf16, 2 fp16), gathered and classified on the host in one
   call per optimizer hook, where the torch path takes a view per parameter and some twenty small ops. Every
   step is the torch path's, in the same fp32 arithmetic (tests compare both, rounding boundaries included). */
static inline float upd_load(const void* base, int dtype, int64_t i) {
    if (dtype == 0) return ((const float*)base)[i];
    uint16_t h = ((const uint16_t*)base)[i];
    return dtype == 1 ? bitsf((uint32_t)h << 16) : h2f(h);
}

/* fp32 -> bf16 -> fp32, round to nearest even (torch's conversion; a nan stays a nan) */
static inline float upd_bf16(float f) {
    if (f != f) return f;
    uint32_t u = fbits(f);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return bitsf(u & 0xFFFF0000u);
}

/* fp32 -> fp16 -> fp32, round to nearest even: a multiple of the spacing of the value's binade (2^-24 below
   fp16's smallest normal), and infinity from 65520 (halfway between 65504 and 2^16) up */
static inline float upd_f16(float f) {
    if (f != f) return f;
    float a = fabsf(f);
    if (a >= 65520.0f) return copysignf(INFINITY, f);
    int e = a < 0x1p-14f ? -14 : floor_log2_bits(fbits(a));
    float t = a * pow2f(10 - e); /* exact: a power-of-two scaling, t < 2^11 */
    float q = ((t + 0x1p23f) - 0x1p23f) * pow2f(e - 10); /* round half to even at 1 (t < 2^22) */
    return copysignf(q, f);
}

/* The members' samples, now, in fp32, one after the other into out; returns how many. In IEEE mode (pp_upd_gather):
   an fp16 subnormal is widened by a multiplication. */
static NOINLINE int64_t upd_gather(int64_t k, const int64_t* ptrs, const int64_t* strides, const int64_t* lens,
                      const int64_t* dtypes, float* out) {
    int64_t j = 0;
    for (int64_t m = 0; m < k; m++) {
        const void* base = (const void*)(intptr_t)ptrs[m];
        int dt = (int)dtypes[m];
        int64_t s = strides[m];
        for (int64_t i = 0; i < lens[m]; i++) out[j++] = upd_load(base, dt, i * s);
    }
    return j;
}

/* Per sampled element, whether the gradient is nonzero (a nan is; a member with a null pointer has no
   gradient: zeros), into out as 0/1 bytes; returns how many. */
int64_t pp_upd_nonzero(int64_t k, const int64_t* ptrs, const int64_t* strides, const int64_t* lens,
                       const int64_t* dtypes, uint8_t* out) {
    int64_t j = 0;
    for (int64_t m = 0; m < k; m++) {
        const char* base = (const char*)(intptr_t)ptrs[m];
        int64_t s = strides[m], n = lens[m];
        if (!base) {
            memset(out + j, 0, (size_t)n);
        } else if (dtypes[m] == 0) {
            for (int64_t i = 0; i < n; i++) out[j + i] = (((const uint32_t*)base)[i * s] & 0x7FFFFFFFu) != 0;
        } else {
            for (int64_t i = 0; i < n; i++) out[j + i] = (((const uint16_t*)base)[i * s] & 0x7FFFu) != 0;
        }
        j += n;
    }
    return j;
}

/* The updates of the step just taken: the samples now against before (pp_upd_gather's, before the step) and
   intended (pp_upd_nonzero's), added into counts[k][5] (sampled, no update, lost in bf16, lost in fp16, lost
   in the weight as held: intended and not moved) as
   precprof.capture.updates._DeviceGroup.classify counts them. held_bf16: the weights are held in bf16 (an
   update that did not land then says nothing of fp16). Returns how many elements were read. In IEEE mode
   (pp_upd_classify). */
static NOINLINE int64_t upd_classify(int64_t k, const int64_t* ptrs, const int64_t* strides, const int64_t* lens,
                        const int64_t* dtypes, const float* before, const uint8_t* intended, int held_bf16,
                        int64_t* counts) {
    int64_t j = 0;
    for (int64_t m = 0; m < k; m++) {
        const void* base = (const void*)(intptr_t)ptrs[m];
        int dt = (int)dtypes[m];
        int64_t s = strides[m], n = lens[m], none = 0, bf = 0, hf = 0, held = 0;
        for (int64_t i = 0; i < n; i++, j++) {
            float b = before[j];
            float delta = upd_load(base, dt, i * s) - b;
            int moved = delta != 0.0f; /* a nan delta moved */
            int meant = intended[j] != 0;
            int stuck = meant && !moved;
            held += stuck;
            none += !(moved || meant);
            float hb = upd_bf16(b);
            int lost = moved && upd_bf16(hb + delta) == hb;
            bf += lost || stuck;
            float hh = upd_f16(b);
            lost = moved && upd_f16(hh + delta) == hh;
            hf += held_bf16 ? lost : (lost || stuck);
        }
        counts[5 * m] += n;
        counts[5 * m + 1] += none;
        counts[5 * m + 2] += bf;
        counts[5 * m + 3] += hf;
        counts[5 * m + 4] += held;
    }
    return j;
}

/* upd_gather and upd_classify in IEEE mode, whatever the caller's: their fp32 arithmetic is the torch path's
   in IEEE arithmetic (a subnormal delta moved the weight) */
int64_t pp_upd_gather(int64_t k, const int64_t* ptrs, const int64_t* strides, const int64_t* lens,
                      const int64_t* dtypes, float* out) {
    fpmode_t fm = fp_ieee_enter();
    int64_t r = upd_gather(k, ptrs, strides, lens, dtypes, out);
    fp_ieee_leave(fm);
    return r;
}

int64_t pp_upd_classify(int64_t k, const int64_t* ptrs, const int64_t* strides, const int64_t* lens,
                        const int64_t* dtypes, const float* before, const uint8_t* intended, int held_bf16,
                        int64_t* counts) {
    fpmode_t fm = fp_ieee_enter();
    int64_t r = upd_classify(k, ptrs, strides, lens, dtypes, before, intended, held_bf16, counts);
    fp_ieee_leave(fm);
    return r;
}
