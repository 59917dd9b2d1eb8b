// One decoding pass of a Llama-family model in bf16 over M rows (up to 128): the one-token
// steps of plain decoding and the (k+1)-token verification passes of speculation, for one
// sequence or for blocks of several sequences at once (a batch; see specdec_pass).
//
// Two goals, both from where speculative decoding runs on a CPU (docs/kernels.md):
//   * Speed. Such a pass is memory-bound: every weight is read once per pass. Each weight row
//     is streamed once and dotted with all M inputs while it sits in L1, and the whole pass is
//     one call with one OpenMP team, so no per-op framework overhead.
//   * Row invariance. Row j of an M-token pass is bit-identical to the one-token pass at that
//     position. Every output element is computed by the same instructions in the same order
//     whatever M is, whichever thread computes it, and whatever rows sit beside it:
//       - each dot product has its own accumulator, filled in order of k, reduced by one fixed tree;
//       - RMSNorm, RoPE, SiLU and the residual adds are per row;
//       - attention for a (row, head) goes over absolute 128-position chunks, positions in order
//         within each, and merges the chunks in order;
//       - there is no fast-math (-ffp-contract=off), so the compiler cannot reorder or fuse.
//     Then greedy speculative output equals plain greedy output in bf16 by construction.
//
// Numerics: bf16 weights, activations rounded to bf16 wherever a matmul reads them (as torch's
// bf16 path does), fp32 accumulation, an fp32 residual stream, fp32 logits. A matrix may
// instead hold int8 weights with a bf16 scale per block of 32 along a row (dtype "int8",
// llama.Int8Linear): about half the bytes to read, which is what a memory-bound pass costs.
// The dot products widen each block in registers to bf16(q * scale) (exact product, one
// rounding) and go on as for bf16 weights, so the pass has exactly the bits of a bf16 pass
// over those widened weights.
//
// Built on first use by specdec/models/kernel.py; called through ctypes with raw pointers.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

typedef uint16_t bf16;

static inline float f32(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Round to nearest even, as torch does; NaN stays NaN. Branch-free, so that loops of it
// vectorize, and a vector lane computes exactly what the scalar form does.
static inline bf16 to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (bf16)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

// Sum of 16 partial sums by one fixed tree.
static inline float tree16(const float* a) {
    float b[8], c[4];
    for (int i = 0; i < 8; i++) b[i] = a[i] + a[i + 8];
    for (int i = 0; i < 4; i++) c[i] = b[i] + b[i + 4];
    return (c[0] + c[2]) + (c[1] + c[3]);
}

// The weight bytes one thread reads in a pass, in the order it reads them. A software prefetch
// runs a fixed distance ahead of use, across the ends of matrices and stages: one core's own
// prefetcher keeps too few misses in flight to stream from memory at full bandwidth, and it
// stops and restarts at every matrix and barrier. The dot products prefetch one line for each
// line they consume, spread through their compute (a burst would stall it), from a span
// `take` hands them; only a span across the end of a range is issued at once.
struct Stream {
    std::vector<std::pair<const char*, size_t>> ranges;
    size_t i = 0, off = 0;  // the prefetch point
    void add(const void* p, size_t bytes) {
        if (bytes) ranges.push_back({(const char*)p, bytes});
    }
    void advance(size_t bytes) {
        for (; bytes >= 64 && i < ranges.size(); bytes -= 64) {
            __builtin_prefetch(ranges[i].first + off, 0, 3);
            if ((off += 64) >= ranges[i].second) i++, off = 0;
        }
    }
    // The next `bytes` to prefetch, if they are one contiguous span (else they are issued now).
    const char* take(size_t bytes) {
        if (i < ranges.size() && off + bytes < ranges[i].second) {
            off += bytes;
            return ranges[i].first + off - bytes;
        }
        advance(bytes);
        return nullptr;
    }
};
constexpr size_t PREFETCH_AHEAD = 12 << 10;  // bytes of weights in flight per thread

// ---- dot products: out[m * ldo + r] = x[m] . W[r] for a tile of R weight rows and MT inputs ----
// K is a multiple of 32. Products of two bf16 values are exact in fp32, so a fused or a separate
// multiply-add gives the same sum; only the order of the adds matters, and it is fixed by k.
// W is bf16, or int8 (WT = int8_t) with `scale` its block scales (ldw / 32 a row), widened to
// bf16(q * scale) as they are read. A line of weights is prefetched per 64 bytes consumed: into
// L1 for a tile of one input, into L2 for more (PF_LOCALITY). A tile of several inputs holds them
// and its weights in L1, read again by the block's next tile, and lines prefetched 12 KB ahead
// into L1 pushed them out: on a Zen 4 CPU (32 KB of L1) a 5-token bf16 pass took 12.5 ms with
// L1 prefetches and 8.7 ms with L2 ones, a 9-token pass 17.3 and 12.3, one token 8.2 either way.
template <int MT>
constexpr int PF_LOCALITY = MT == 1 ? 3 : 2;  // __builtin_prefetch's: 3 into L1, 2 into L2

#if defined(__AVX512BF16__)
// Sums of 16 vectors, r[j] = sum of a[j]'s lanes, by a butterfly of shuffles (about 3
// instructions a sum instead of a horizontal reduction each). Every slot's sum takes
// tree16's tree, so it has exactly tree16's bits: the dot products reduce their accumulators
// with it, and attention its scores (slot = position mod 16).
static inline __m512 sum16(__m512* a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44), _mm512_shuffle_f32x4(a[i], a[i + 8], 0xEE));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], 0x88), _mm512_shuffle_f32x4(b[i], b[i + 4], 0xDD));
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_unpacklo_ps(c[i], c[i + 2]), _mm512_unpackhi_ps(c[i], c[i + 2]));
    const __m512d d0 = _mm512_castps_pd(d[0]), d1 = _mm512_castps_pd(d[1]);
    __m512 e = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d0, d1)), _mm512_castpd_ps(_mm512_unpackhi_pd(d0, d1)));
    // Lane 4q + l of e holds slot [0, 2, 1, 3][l] + [0, 8, 4, 12][q] (a permutation that is its own inverse).
    const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
    return _mm512_permutexvar_ps(order, e);
}

static inline __m512bh bf16x32(const bf16* p, const bf16*) { return (__m512bh)_mm512_loadu_si512((const void*)p); }
static inline __m512bh bf16x32(const int8_t* p, const bf16* scale) {  // q * scale is exact in fp32; rounded to nearest even
    const __m512 s = _mm512_set1_ps(f32(*scale));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
    return _mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, s), _mm512_mul_ps(lo, s));
}

template <int R, int MT, typename WT>
static inline void dot_tile(const bf16* x, int ldx, const WT* W, int ldw, int K, float* out, int ldo,
                            const char* pf, const bf16* scale = nullptr) {
    __m512 acc[R][MT];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MT; m++) acc[r][m] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 32) {
        __m512bh w[R];
        for (int r = 0; r < R; r++) {
            w[r] = bf16x32(W + (size_t)r * ldw + k, scale + (size_t)r * (ldw / 32) + k / 32);
            if (pf && k * sizeof(WT) % 64 == 0) __builtin_prefetch(pf, 0, PF_LOCALITY<MT>), pf += 64;
        }
        for (int m = 0; m < MT; m++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void*)(x + (size_t)m * ldx + k));
            for (int r = 0; r < R; r++) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], xv, w[r]);
        }
    }
    // Sixteen accumulators reduced at once by sum16, which adds each one's lanes by tree16's
    // own tree: the same bits as tree16 on each, in a tenth of the instructions (reducing them
    // one by one cost as much as the products themselves at K = 576).
    constexpr int N = R * MT;
    for (int s = 0; s < N; s += 16) {
        __m512 a[16];
        for (int j = 0; j < 16; j++) a[j] = s + j < N ? acc[(s + j) / MT][(s + j) % MT] : _mm512_setzero_ps();
        alignas(64) float sums[16];
        _mm512_store_ps(sums, sum16(a));
        for (int j = 0; j < 16 && s + j < N; j++) out[(size_t)((s + j) % MT) * ldo + (s + j) / MT] = sums[j];
    }
}
#define SPECDEC_ISA "avx512-bf16"
#elif defined(__AVX2__) && defined(__FMA__) && !defined(SPECDEC_GENERIC)
// The portable form below, vectorized by hand for AVX2: its 16 lanes as two 8-lane halves, each
// lane summing the same products in the same order, and the same tree at the end, so the same
// bits (a fused multiply-add equals its separate multiply and add: the product is exact). The
// compiler's form of those loops spends its time converting bf16: on a Zen 3 CPU a 9-row pass
// cost 2.8x a one-row pass (docs/kernels.md). Here the inputs come converted to fp32 once per
// matrix (dots), each weight is converted once per tile, and one weight row at a time keeps
// its 2 * MT accumulators in AVX2's 16 registers.
#define SPECDEC_FP32_INPUTS 1
static inline __m256 f32x8(const bf16* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

static inline __m256 f32x8(const float* p) { return _mm256_loadu_ps(p); }

static inline __m256 f32x8(const bf16* p, const bf16*) { return f32x8(p); }

static inline __m256 f32x8(const int8_t* p, const bf16* scale) {  // bf16(q * scale), as to_bf16 rounds
    const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))),
                                   _mm256_set1_ps(f32(*scale)));
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u)));
}

// tree16 of lanes 0-7 (lo) and 8-15 (hi) in registers, by the same adds in the same order
// (attention's scores are one short dot product each, where a trip through memory cost more
// than the products).
static inline float tree16(__m256 lo, __m256 hi) {
    const __m256 b = _mm256_add_ps(lo, hi);                                          // b[i] = a[i] + a[i + 8]
    const __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));  // c[i] = b[i] + b[i + 4]
    const __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));                             // c0 + c2, c1 + c3
    return _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)));
}

template <int R, int MT, typename X, typename WT>
static inline void dot_tile(const X* x, int ldx, const WT* W, int ldw, int K, float* out, int ldo,
                            const char* pf, const bf16* scale = nullptr) {
    for (int r = 0; r < R; r++) {
        __m256 acc[MT][2];  // [m][0]: lanes 0-7, [m][1]: lanes 8-15 of the portable form
        for (int m = 0; m < MT; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
        const WT* w = W + (size_t)r * ldw;
        const bf16* sr = scale ? scale + (size_t)r * (ldw / 32) : nullptr;
        for (int k = 0; k < K; k += 32) {
            if (pf && k * sizeof(WT) % 64 == 0) __builtin_prefetch(pf, 0, PF_LOCALITY<MT>), pf += 64;
            for (int g = 0; g < 4; g++) {  // k + 8g: lanes 0-7 for even g, 8-15 for odd
                const __m256 wv = f32x8(w + k + 8 * g, sr + k / 32);
                for (int m = 0; m < MT; m++)
                    acc[m][g & 1] = _mm256_fmadd_ps(f32x8(x + (size_t)m * ldx + k + 8 * g), wv, acc[m][g & 1]);
            }
        }
        for (int m = 0; m < MT; m++) out[(size_t)m * ldo + r] = tree16(acc[m][0], acc[m][1]);
    }
}
#define SPECDEC_ISA "avx2"
#else
// Portable form: 16 independent lanes the compiler vectorizes without reassociating.
static inline float widen(const bf16* W, const bf16*, size_t i, size_t) { return f32(W[i]); }
static inline float widen(const int8_t* W, const bf16* scale, size_t i, size_t b) { return f32(to_bf16((float)W[i] * f32(scale[b]))); }

template <int R, int MT, typename WT>
static inline void dot_tile(const bf16* x, int ldx, const WT* W, int ldw, int K, float* out, int ldo,
                            const char* pf, const bf16* scale = nullptr) {
    float acc[R][MT][16] = {};
    for (int k = 0; k < K; k += 32) {
        if (pf && k * sizeof(WT) % 64 == 0)
            for (int r = 0; r < R; r++) __builtin_prefetch(pf, 0, 3), pf += 64;
        for (int half = 0; half < 32; half += 16) {
            float w[R][16];
            for (int r = 0; r < R; r++)
                for (int l = 0; l < 16; l++)
                    w[r][l] = widen(W, scale, (size_t)r * ldw + k + half + l, (size_t)r * (ldw / 32) + k / 32);
            for (int m = 0; m < MT; m++) {
                float xv[16];
                for (int l = 0; l < 16; l++) xv[l] = f32(x[(size_t)m * ldx + k + half + l]);
                for (int r = 0; r < R; r++)
                    for (int l = 0; l < 16; l++) acc[r][m][l] += xv[l] * w[r][l];
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MT; m++) out[(size_t)m * ldo + r] = tree16(acc[r][m]);
}
#define SPECDEC_ISA "portable"
#endif

// A stage's left operand (its M input rows of K values), prepared once per stage and thread in
// the layout this form's dot products read: as it is (bf16), converted to fp32 (AVX2), or as
// bf16 pairs in AMX tiles. `scratch` is the caller's, reused from stage to stage.
struct Operand {
    const bf16* x;
    int M, K;
    const void* prepared;
};
#if defined(__AMX_BF16__) && defined(__AVX512BF16__) && !defined(SPECDEC_GENERIC)
#define SPECDEC_AMX 1
static Operand operand(const bf16* x, int M, int K, std::vector<uint32_t>& scratch);
#else
static inline void release_tiles() {}
static Operand operand(const bf16* x, int M, int K, std::vector<uint32_t>& scratch) {
#if defined(SPECDEC_FP32_INPUTS)
    static_assert(sizeof(float) == sizeof(uint32_t), "fp32 inputs live in the 32-bit scratch");
    scratch.resize((size_t)M * K);
    float* f = reinterpret_cast<float*>(scratch.data());
    for (size_t i = 0; i < (size_t)M * K; i++) f[i] = f32(x[i]);
    return {x, M, K, f};
#else
    (void)scratch;
    return {x, M, K, x};
#endif
}
#endif

// Inputs go in balanced tiles of at most TILE_INPUTS rows: R * MT independent accumulators keep
// the dot-product unit busy (a 1-row tile beside a 4-row one would wait on its own latency).
// The AVX-512 form reduces its accumulators 16 at a time (sum16): tiles of 4 inputs by 4 weight
// rows fill one reduction, where tiles of 6 left a third of the second one empty; on a Zen 5
// CPU blocks of 5 to 128 rows took up to 5% less time (docs/kernels.md). Which rows share a tile
// never changes a sum, so the bits are the same either way.
#if defined(__AVX512BF16__) && !defined(SPECDEC_GENERIC)
constexpr int TILE_INPUTS = 4;
#else
constexpr int TILE_INPUTS = 6;
#endif
// R rows of int8 weights widened to bf16(q * scale) into `out` ([R, K]), the bits the dot
// products widen them to in registers; prefetching the stream's lines as it reads.
static void widen_rows(const int8_t* W, const bf16* scale, int R, int K, bf16* out, const char* pf) {
    for (int r = 0; r < R; r++)
        for (int k = 0; k < K; k += 32) {
            if (pf && k % 64 == 0) __builtin_prefetch(pf, 0, 2), pf += 64;  // into L2, as a tile of several inputs prefetches
            const int8_t* q = W + (size_t)r * K + k;
            const bf16* sc = scale + (size_t)r * (K / 32) + k / 32;
#if defined(__AVX512BF16__)
            _mm512_storeu_si512((void*)(out + (size_t)r * K + k), (__m512i)bf16x32(q, sc));
#elif defined(SPECDEC_FP32_INPUTS)  // AVX2: f32x8's bf16 values (low halves zero), packed to 16 bits
            for (int h = 0; h < 32; h += 16) {
                const __m256i lo = _mm256_srli_epi32(_mm256_castps_si256(f32x8(q + h, sc)), 16);
                const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(f32x8(q + h + 8, sc)), 16);
                const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
                _mm256_storeu_si256((__m256i*)(out + (size_t)r * K + k + h), packed);
            }
#else
            for (int l = 0; l < 32; l++) out[(size_t)r * K + k + l] = to_bf16((float)q[l] * f32(*sc));
#endif
        }
}

template <int R, typename X, typename WT>
static void dot_rows(const X* x, int M, int K, const WT* W, const bf16* scale, float* out, int ldo, Stream* s) {
    // Each tile prefetches the same span: for blocks of more than one tile, asking again in the
    // second tile measured faster than asking once (10.3 vs 11.9 ms a 9-token pass).
    const char* pf = s ? s->take((size_t)R * K * sizeof(WT)) : nullptr;
    const int tiles = (M + TILE_INPUTS - 1) / TILE_INPUTS;
    if constexpr (sizeof(WT) == 1) {
        if (tiles > 1) {  // int8 rows for several tiles: widened once, not once a tile
            thread_local std::vector<bf16> wide;
            wide.resize((size_t)R * K);
            widen_rows(W, scale, R, K, wide.data(), pf);
            return dot_rows<R>(x, M, K, (const bf16*)wide.data(), nullptr, out, ldo, nullptr);
        }
    }
    for (int t = 0, m0 = 0; t < tiles; t++) {
        const int mt = (M - m0) / (tiles - t);
        const X* xm = x + (size_t)m0 * K;
        float* o = out + (size_t)m0 * ldo;
        switch (mt) {
            case 6: dot_tile<R, 6>(xm, K, W, K, K, o, ldo, pf, scale); break;
            case 5: dot_tile<R, 5>(xm, K, W, K, K, o, ldo, pf, scale); break;
            case 4: dot_tile<R, 4>(xm, K, W, K, K, o, ldo, pf, scale); break;
            case 3: dot_tile<R, 3>(xm, K, W, K, K, o, ldo, pf, scale); break;
            case 2: dot_tile<R, 2>(xm, K, W, K, K, o, ldo, pf, scale); break;
            default: dot_tile<R, 1>(xm, K, W, K, K, o, ldo, pf, scale); break;
        }
        m0 += mt;
    }
}

// out[m * ldo + (n - n0)] = x[m] . W[n] for n in [n0, n1): x is [M, K], W is [N, K] (int8 W with
// its block scales, [N, K / 32]). The AMX form has its own for bf16 W below; int8 W comes here
// in every form.
template <typename WT>
static void dot_range(const Operand& in, const WT* W, const bf16* scale, int n0, int n1, float* out, int ldo, Stream* s) {
#if defined(SPECDEC_FP32_INPUTS)
    const float* x = static_cast<const float*>(in.prepared);
#else
    const bf16* x = in.x;
#endif
    const int M = in.M, K = in.K;
    auto sc = [&](int n) { return scale ? scale + (size_t)n * (K / 32) : nullptr; };
    int n = n0;
    for (; n + 4 <= n1; n += 4) dot_rows<4>(x, M, K, W + (size_t)n * K, sc(n), out + (n - n0), ldo, s);
    for (; n < n1; n++) dot_rows<1>(x, M, K, W + (size_t)n * K, sc(n), out + (n - n0), ldo, s);
}

#if !defined(SPECDEC_AMX)
static void dots(const Operand& in, const bf16* W, int n0, int n1, float* out, int ldo, Stream* s) {
    dot_range(in, W, nullptr, n0, n1, out, ldo, s);
}
#endif

#if defined(SPECDEC_AMX)
// ---- AMX: the dot products as tile products (Intel Sapphire Rapids and later) ----
// One TDPBF16PS multiplies a tile of 16 weight rows x 32 k (read straight from W, whose rows
// are the tile's rows) by a tile of 32 k x 16 inputs, stored as 16 lines of bf16 pairs, into
// 16 x 16 fp32 accumulators: 8192 products an instruction, against 32 for vdpbf16ps. Each
// accumulator is one output element, summed over k in the unit's own fixed order and never
// reduced across lanes, so an element depends on its weight row and its input row alone:
// a row gets the same bits in a block of any size, padded or not. (They are not the other
// forms' bits, whose tree16 reduction sums in another order; greedy exactness needs only
// that every pass of this build sums alike.)
// Tiles: 0-3 accumulators, 4 and 6 weights, 5 and 7 inputs.
#undef SPECDEC_ISA
#define SPECDEC_ISA "amx-bf16"

// Linux hands a process the tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM).
static bool amx_permitted() {
    static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return ok;
}

// Every tile 16 rows of 64 bytes. Loaded at each call: other code on these threads (torch's
// oneDNN) may have configured the tiles otherwise.
static void configure_tiles() {
    struct {
        uint8_t palette = 1, start_row = 0, reserved[14] = {};
        uint16_t colsb[16] = {};
        uint8_t rows[16] = {};
    } c;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = 16;
    _tile_loadconfig(&c);
}

// At the end of a pass: tiles left in use cost every context switch a save of 8 KB of tile state.
static inline void release_tiles() { _tile_release(); }

// Sixteen rows of 16 dwords transposed in registers (unpacks within 128-bit lanes, then lanes).
static inline void transpose16(__m512i* r) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // u[4i + k], lane L: column 4L + k of rows 4i..4i+3.
    for (int k = 0; k < 4; k++) {
        const __m512i a = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88), b = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xdd);
        const __m512i c = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88), d = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xdd);
        r[k] = _mm512_shuffle_i32x4(a, c, 0x88);
        r[8 + k] = _mm512_shuffle_i32x4(a, c, 0xdd);
        r[4 + k] = _mm512_shuffle_i32x4(b, d, 0x88);
        r[12 + k] = _mm512_shuffle_i32x4(b, d, 0xdd);
    }
}

// Pairs for block b of 16 input rows and chunk c of 32 k: 16 lines (k pairs) of 16 inputs,
// at scratch[((b * K/32 + c) * 16 + line) * 16 + input]. A block of 4 or more rows is
// transposed in registers, 16 pairs of 16 rows at a time (its columns past M become zeros); a
// block of fewer writes its own columns only and leaves the others as they are. Either way a
// column past M feeds only its own column of the products, which no one reads (clearing them
// cost a one-row pass 4.5 MB of stores).
static Operand operand(const bf16* x, int M, int K, std::vector<uint32_t>& scratch) {
    const int blocks = (M + 15) / 16, chunks = K / 32;
    scratch.resize((size_t)blocks * chunks * 256);
    for (int b = 0; b < blocks; b++) {
        const int rows = M - 16 * b < 16 ? M - 16 * b : 16;
        uint32_t* dst = scratch.data() + (size_t)b * chunks * 256;
        const uint32_t* src = reinterpret_cast<const uint32_t*>(x + (size_t)16 * b * K);
        if (rows < 4) {  // a few rows: their own columns only
            for (int m = 0; m < rows; m++)
                for (int i = 0; i < K / 2; i++) dst[(size_t)i * 16 + m] = src[(size_t)m * K / 2 + i];
            continue;
        }
        for (int c = 0; c < chunks; c++) {  // 16 pairs of 16 rows, transposed: the chunk's 16 lines
            __m512i r[16];
            for (int m = 0; m < 16; m++)
                r[m] = m < rows ? _mm512_loadu_si512((const void*)(src + (size_t)m * K / 2 + 16 * c)) : _mm512_setzero_si512();
            transpose16(r);
            for (int l = 0; l < 16; l++) _mm512_storeu_si512((void*)(dst + (size_t)c * 256 + l * 16), r[l]);
        }
    }
    return {x, M, K, scratch.data()};
}

// The prefetch stream's lines for one weight tile (16 lines), spread through the products.
static inline const char* prefetch16(const char* pf) {
    if (pf)
        for (int i = 0; i < 16; i++) _mm_prefetch(pf, _MM_HINT_T0), pf += 64;
    return pf;
}

// NB (1 or 2) blocks of 16 weight rows (ldw apart) against one block of inputs; tile t -> c[t].
template <int NB>
static void tiles_1(const bf16* W, int ldw, const uint32_t* xb, int chunks, float (*c)[256], const char* pf) {
    const size_t stride = (size_t)ldw * sizeof(bf16);
    _tile_zero(0);
    if constexpr (NB > 1) _tile_zero(1);
    for (int k = 0; k < chunks; k++) {
        const bf16* w = W + (size_t)k * 32;
        _tile_loadd(5, xb + (size_t)k * 256, 64);
        _tile_loadd(4, w, stride);
        _tile_dpbf16ps(0, 4, 5);
        pf = prefetch16(pf);
        if constexpr (NB > 1) {
            _tile_loadd(6, w + (size_t)16 * ldw, stride);
            _tile_dpbf16ps(1, 6, 5);
            pf = prefetch16(pf);
        }
    }
    _tile_stored(0, c[0], 64);
    if constexpr (NB > 1) _tile_stored(1, c[1], 64);
}

// NB (1 or 2) blocks of weight rows against two blocks of inputs (xb, xb + chunks * 256):
// each tile loaded serves two products. Tile (weights w, inputs i) -> c[2 * w + i].
template <int NB>
static void tiles_2(const bf16* W, int ldw, const uint32_t* xb, int chunks, float (*c)[256], const char* pf) {
    const size_t stride = (size_t)ldw * sizeof(bf16), next = (size_t)chunks * 256;
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (NB > 1) { _tile_zero(2); _tile_zero(3); }
    for (int k = 0; k < chunks; k++) {
        const bf16* w = W + (size_t)k * 32;
        _tile_loadd(5, xb + (size_t)k * 256, 64);
        _tile_loadd(7, xb + next + (size_t)k * 256, 64);
        _tile_loadd(4, w, stride);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 7);
        pf = prefetch16(pf);
        if constexpr (NB > 1) {
            _tile_loadd(6, w + (size_t)16 * ldw, stride);
            _tile_dpbf16ps(2, 6, 5);
            _tile_dpbf16ps(3, 6, 7);
            pf = prefetch16(pf);
        }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    if constexpr (NB > 1) { _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64); }
}

// out[m * ldo + (n - n0)] = x[m] . W[n] for n in [n0, n1): x is [M, K], W is [N, K].
static void dots(const Operand& in, const bf16* W, int n0, int n1, float* out, int ldo, Stream* s) {
    const int M = in.M, K = in.K, chunks = K / 32, blocks = (M + 15) / 16;
    const uint32_t* pairs = static_cast<const uint32_t*>(in.prepared);
    configure_tiles();
    alignas(64) float c[4][256];
    // c[t] holds weight rows n.. against input block b: element (i, j) is out row 16b + j, column n + i.
    auto put = [&](int t, int n, int b) {
        const int rows = n1 - n < 16 ? n1 - n : 16, cols = M - 16 * b < 16 ? M - 16 * b : 16;
        if (cols == 1) {
            for (int i = 0; i < rows; i++) out[(size_t)(16 * b) * ldo + (n - n0) + i] = c[t][i * 16];
            return;
        }
        __m512i r[16];  // transposed: r[j] = input j's outputs for the tile's 16 weight rows
        for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512((const void*)&c[t][i * 16]);
        transpose16(r);
        const __mmask16 keep = (__mmask16)((1u << rows) - 1);
        for (int j = 0; j < cols; j++)
            _mm512_mask_storeu_epi32((void*)&out[(size_t)(16 * b + j) * ldo + (n - n0)], keep, r[j]);
    };
    // Rows in groups of 16 * nb; a last group of fewer than 16 rows is copied into a zeroed tile.
    // The tiles read a group chunk by chunk of k across its rows, so groups stay small: 16 rows
    // for one block of inputs (up to 16), else 32, whose tiles then serve two products each.
    // On the AMX VM (kernel_rows.py, one process, 300 cached) 16-row groups took a 2-row pass
    // 12.25 ms against 12.88 with 32, 4 rows 13.25 against 13.97, 16 rows 16.78 against 17.13;
    // 17 rows 20.81 against 20.43, 128 rows 76.6 against 72.2.
    const int most = M <= 16 ? 1 : 2;
    thread_local std::vector<bf16> tail;
    for (int n = n0; n < n1;) {
        const int full = (n1 - n) / 16, nb = full == 0 ? 1 : full < most ? full : most;
        const size_t bytes = (size_t)(full ? 16 * nb : n1 - n) * K * sizeof(bf16);
        const char* pf = s ? s->take(bytes) : nullptr;
        const bf16* w = W + (size_t)n * K;
        if (!full) {
            tail.assign((size_t)16 * K, 0);
            std::memcpy(tail.data(), w, bytes);
            w = tail.data();
            for (const char* p = pf; p && p < pf + bytes; p += 64) _mm_prefetch(p, _MM_HINT_T0);
            pf = nullptr;
        }
        for (int b = 0; b < blocks; b += 2, pf = nullptr) {  // the stream is followed on the first pass only
            const uint32_t* xb = pairs + (size_t)b * chunks * 256;
            if (b + 1 < blocks) {
                if (nb == 2) tiles_2<2>(w, K, xb, chunks, c, pf);
                else tiles_2<1>(w, K, xb, chunks, c, pf);
                for (int t = 0; t < 2 * nb; t++) put(t, n + 16 * (t / 2), b + t % 2);
            } else {
                if (nb == 2) tiles_1<2>(w, K, xb, chunks, c, pf);
                else tiles_1<1>(w, K, xb, chunks, c, pf);
                for (int t = 0; t < nb; t++) put(t, n + 16 * t, b);
            }
        }
        n += full ? 16 * nb : n1 - n;
    }
}
#endif

// This thread's share [lo, hi) of n items split in units of `unit` (the last takes the rest).
static inline void share(int n, int unit, int tid, int nt, int* lo, int* hi) {
    int units = n / unit;
    *lo = (int)((int64_t)units * tid / nt) * unit;
    *hi = tid == nt - 1 ? n : (int)((int64_t)units * (tid + 1) / nt) * unit;
}

// exp(x) for x <= 0 (and a little above): 2^n * p(r), r = x - n ln2, a degree-6 Taylor form.
// Only IEEE +, * and floor: the same bits in a vector lane and in a scalar tail.
static inline float exp_le0(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    float n = std::floor(x * 1.44269504f + 0.5f);
    float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f + r * (0.00833333377f + r * 0.00138888892f)))));
    int32_t e = ((int32_t)n + 127) << 23;
    float s;
    std::memcpy(&s, &e, 4);
    return p * s;
}

#if defined(SPECDEC_FP32_INPUTS)
// exp_le0 on 8 lanes, the same operations in the same order.
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _mm256_set1_ps(0.5f)));
    const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693145752f))),
                                   _mm256_mul_ps(n, _mm256_set1_ps(1.42860677e-6f)));
    __m256 p = _mm256_set1_ps(0.00138888892f);
    const float c[6] = {0.00833333377f, 0.0416666679f, 0.166666672f, 0.5f, 1.0f, 1.0f};
    for (int i = 0; i < 6; i++) p = _mm256_add_ps(_mm256_set1_ps(c[i]), _mm256_mul_ps(r, p));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// x [D] fp32 -> out [D] bf16: weight * bf16(x / rms(x)), as the reference RMSNorm rounds.
static void rms_norm(const float* x, const bf16* w, int D, float eps, bf16* out) {
    float part[16] = {};
    for (int d = 0; d < D; d += 16)
        for (int l = 0; l < 16; l++) part[l] += x[d + l] * x[d + l];
    float r = 1.0f / std::sqrt(tree16(part) / (float)D + eps);
    for (int d = 0; d < D; d++) out[d] = to_bf16(f32(w[d]) * f32(to_bf16(x[d] * r)));
}

// Projection outputs are rounded to bf16, as the reference's are, then added to the residual.
static void add_residual(float* x, int ldx, const float* y, int ldy, const bf16* bias, int M, int n) {
    for (int m = 0; m < M; m++) {
        float* xm = x + (size_t)m * ldx;
        const float* ym = y + (size_t)m * ldy;
        if (bias)
            for (int i = 0; i < n; i++) xm[i] += f32(to_bf16(ym[i] + f32(bias[i])));
        else
            for (int i = 0; i < n; i++) xm[i] += f32(to_bf16(ym[i]));
    }
}

// out = bf16(silu(gate) * up), each rounded where the reference rounds.
#if defined(__AVX512BF16__)
static inline __m512 f32x16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

static inline __m256i bf16x16(__m512 f) {  // to_bf16 on 16 lanes, the same integer steps
    const __m512i u = _mm512_castps_si512(f);
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

static inline __m512 round_bf16(__m512 f) { return f32x16(bf16x16(f)); }

static inline __m512 exp16(__m512 x);

// Vectorized by hand (the compiler leaves this loop scalar), 16 at a time with masked tails, so
// every element takes the same instructions.
static void swiglu(float* gate, float* up, const bf16* bg, const bf16* bu, int n, bf16* out) {
    for (int i = 0; i < n; i += 16) {
        const __mmask16 mask = (__mmask16)(n - i >= 16 ? 0xffff : (1u << (n - i)) - 1);
        __m512 g = _mm512_maskz_loadu_ps(mask, gate + i), u = _mm512_maskz_loadu_ps(mask, up + i);
        if (bg) g = _mm512_add_ps(g, f32x16(_mm256_maskz_loadu_epi16(mask, bg + i)));
        if (bu) u = _mm512_add_ps(u, f32x16(_mm256_maskz_loadu_epi16(mask, bu + i)));
        g = round_bf16(g);
        u = round_bf16(u);
        const __m512 silu = round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
        _mm256_mask_storeu_epi16(out + i, mask, bf16x16(_mm512_mul_ps(silu, u)));
    }
}
#else
static void swiglu(float* gate, float* up, const bf16* bg, const bf16* bu, int n, bf16* out) {
    if (bg)
        for (int i = 0; i < n; i++) gate[i] += f32(bg[i]);
    if (bu)
        for (int i = 0; i < n; i++) up[i] += f32(bu[i]);
    for (int i = 0; i < n; i++) {
        const float g = f32(to_bf16(gate[i])), u = f32(to_bf16(up[i]));
        out[i] = to_bf16(f32(to_bf16(g / (1.0f + exp_le0(-g)))) * u);
    }
}
#endif

// ---- attention: softmax(q.K / sqrt(hd)) V over the static cache, split into chunks ----
// Positions are cut into absolute chunks of CHUNK. A task takes one KV head and one chunk for
// every query row and every query head sharing that KV head, so each K/V row comes from memory
// once per pass, however many rows the pass has. It leaves, per (row, head, chunk), the
// chunk's maximum score, its sum of exponentials and its unnormalized output; a second step
// merges a row's chunks in order. Both steps depend only on the row's position, never on M.
constexpr int CHUNK = 128;
constexpr int MAX_ROWS = 128;  // rows a pass takes (kernel.py decides which passes come here)

// The queries of one task: each is one (row, head) over positions [c0, end) of a chunk, and
// gets {max score, sum of exp, sum of exp * V} in its `partial`.
struct Queries {
#if defined(SPECDEC_AMX)
    static constexpr int MAX = 16;  // one tile of queries
#else
    static constexpr int MAX = 6;
#endif
    const bf16* q[MAX];
    int end[MAX];
    float* partial[MAX];
    int n = 0;
};

#if defined(__AVX512BF16__)
// out[j] = scale * q.K[j] for the first n (<= 16) rows of a block of K.
static inline void block_scores(const bf16* q, const bf16* K, int n, int hd, float scale, float* out) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) {
        acc[j] = _mm512_setzero_ps();
        if (j >= n) continue;  // past the last position: a zero sum, ignored
        for (int c = 0; c < hd; c += 32)
            acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512((const void*)(q + c)),
                                      (__m512bh)_mm512_loadu_si512((const void*)(K + (size_t)j * hd + c)));
    }
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << n) - 1), _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
}

// exp_le0 on 16 lanes, the same operations in the same order.
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693145752f))),
                                   _mm512_mul_ps(n, _mm512_set1_ps(1.42860677e-6f)));
    __m512 p = _mm512_set1_ps(0.00138888892f);
    const float c[6] = {0.00833333377f, 0.0416666679f, 0.166666672f, 0.5f, 1.0f, 1.0f};
    for (int i = 0; i < 6; i++) p = _mm512_add_ps(_mm512_set1_ps(c[i]), _mm512_mul_ps(r, p));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// Scores, their maximum and exponentials for one query: scores[0..end-c0) become exp(s - max).
static inline void softmax_scores(const bf16* q, const bf16* K, int c0, int end, int hd, float* scores, float* partial) {
    const float scale = 1.0f / std::sqrt((float)hd);
    const int n = end - c0;
    __m512 mxv = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < n; t += 16) {
        const int k = n - t < 16 ? n - t : 16;
        block_scores(q, K + (size_t)(c0 + t) * hd, k, hd, scale, scores + t);
        mxv = _mm512_mask_max_ps(mxv, (__mmask16)((1u << k) - 1), mxv, _mm512_loadu_ps(scores + t));
    }
    const float mx = _mm512_reduce_max_ps(mxv);  // a maximum is exact in any order
    __m512 sum = _mm512_setzero_ps();  // lane = position mod 16
    for (int t = 0; t < n; t += 16) {
        const __mmask16 mask = (__mmask16)((1u << (n - t < 16 ? n - t : 16)) - 1);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, scores + t), _mm512_set1_ps(mx)));
        _mm512_mask_storeu_ps(scores + t, mask, e);
        sum = _mm512_mask_add_ps(sum, mask, sum, e);
    }
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, sum);
    partial[0] = mx;
    partial[1] = tree16(lanes);
}

// NQ queries sharing a KV head: each V row is loaded and widened once for all of them. A
// query's output accumulates in its own registers, position after position, so it is the same
// whichever queries share the task. HV = hd / 16 output vectors.
template <int HV, int NQ>
static void attend_t(const Queries& qs, const bf16* K, const bf16* V, int c0, float* scores) {
    constexpr int hd = HV * 16;
    int lo = qs.end[0], hi = qs.end[0];
    for (int j = 0; j < NQ; j++) {
        softmax_scores(qs.q[j], K, c0, qs.end[j], hd, scores + (size_t)j * CHUNK, qs.partial[j]);
        lo = qs.end[j] < lo ? qs.end[j] : lo;
        hi = qs.end[j] > hi ? qs.end[j] : hi;
    }
    __m512 o[NQ][HV];
    for (int j = 0; j < NQ; j++)
        for (int i = 0; i < HV; i++) o[j][i] = _mm512_setzero_ps();
    for (int t = c0; t < hi; t++) {
        __m512 v[HV];
        for (int i = 0; i < HV; i++)
            v[i] = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)(V + (size_t)t * hd + 16 * i)));
        for (int j = 0; j < NQ; j++) {
            if (t >= lo && t >= qs.end[j]) continue;  // past this query's last position
            const __m512 p = _mm512_set1_ps(scores[(size_t)j * CHUNK + t - c0]);
            for (int i = 0; i < HV; i++) o[j][i] = _mm512_fmadd_ps(p, v[i], o[j][i]);
        }
    }
    for (int j = 0; j < NQ; j++)
        for (int i = 0; i < HV; i++) _mm512_storeu_ps(qs.partial[j] + 2 + 16 * i, o[j][i]);
}

template <int HV>
static void attend_hv(const Queries& qs, const bf16* K, const bf16* V, int c0, float* scores) {
    switch (qs.n) {
        case 1: return attend_t<HV, 1>(qs, K, V, c0, scores);
        case 2: return attend_t<HV, 2>(qs, K, V, c0, scores);
        case 3: return attend_t<HV, 3>(qs, K, V, c0, scores);
        case 4: return attend_t<HV, 4>(qs, K, V, c0, scores);
        case 5: return attend_t<HV, 5>(qs, K, V, c0, scores);
        default: return attend_t<HV, 6>(qs, K, V, c0, scores);
    }
}

#else
static inline void block_scores(const bf16* q, const bf16* K, int n, int hd, float scale, float* out) {
    for (int j = 0; j < n; j++) {
        float s;
        dot_tile<1, 1>(q, hd, K + (size_t)j * hd, hd, hd, &s, 1, nullptr);
        out[j] = s * scale;
    }
}

#endif

// The generic form, one query at a time: {max, sum of exp, sum of exp * V} for one (row, head)
// over positions [c0, end).
static void attend_one(const bf16* q, const bf16* K, const bf16* V, int c0, int end, int hd, float* scores,
                       float* partial) {
    const float scale = 1.0f / std::sqrt((float)hd);
    const int n = end - c0;
    for (int t = 0; t < n; t += 16)
        block_scores(q, K + (size_t)(c0 + t) * hd, n - t < 16 ? n - t : 16, hd, scale, scores + t);
    float mx = -INFINITY;
    for (int t = 0; t < n; t++) mx = scores[t] > mx ? scores[t] : mx;
    float part[16] = {};  // lane = position mod 16 (c0 is a multiple of 16)
    float* o = partial + 2;
#if defined(SPECDEC_FP32_INPUTS)  // AVX2: the loops below, 8 lanes at a time, the same operations
    const __m256 mxv = _mm256_set1_ps(mx);
    int t = 0;
    for (; t + 8 <= n; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), mxv));
        _mm256_storeu_ps(scores + t, e);
        _mm256_storeu_ps(part + t % 16, _mm256_add_ps(_mm256_loadu_ps(part + t % 16), e));
    }
    for (; t < n; t++) {
        scores[t] = exp_le0(scores[t] - mx);
        part[t % 16] += scores[t];
    }
    for (int d0 = 0; d0 < hd; d0 += 32) {  // 4 output vectors in registers, position after position
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int u = 0; u < n; u++) {
            const __m256 p = _mm256_set1_ps(scores[u]);
            const bf16* v = V + (size_t)(c0 + u) * hd + d0;
            for (int i = 0; i < 4; i++) acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(p, f32x8(v + 8 * i)));
        }
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(o + d0 + 8 * i, acc[i]);
    }
#else
    for (int t = 0; t < n; t++) {
        scores[t] = exp_le0(scores[t] - mx);
        part[t % 16] += scores[t];
    }
    for (int d = 0; d < hd; d++) o[d] = 0.0f;
    for (int t = 0; t < n; t++) {
        const bf16* v = V + (size_t)(c0 + t) * hd;
        for (int d = 0; d < hd; d++) o[d] += scores[t] * f32(v[d]);
    }
#endif
    partial[0] = mx;
    partial[1] = tree16(part);
}

// Up to Queries::MAX queries sharing a KV head over one chunk; scores: Queries::MAX * CHUNK floats.
static void attend(const Queries& qs, const bf16* K, const bf16* V, int c0, int hd, float* scores) {
#if defined(__AVX512BF16__)
    switch (hd) {  // the head sizes of common models (registers for 6 queries up to 64); others one by one
        case 32: return attend_hv<2>(qs, K, V, c0, scores);
        case 64: return attend_hv<4>(qs, K, V, c0, scores);
        default: break;
    }
#endif
    for (int j = 0; j < qs.n; j++) attend_one(qs.q[j], K, V, c0, qs.end[j], hd, scores, qs.partial[j]);
}

#if defined(SPECDEC_AMX)
// ---- attention as tile products (the AMX form) ----
// A task packs its chunk of K and V once for all its queries, then takes them 16 at a time:
// scores = queries x K (tiles of 16 queries x 16 positions), softmax per query in fp32, its
// weights rounded to bf16, and the weighted sum = weights x V (16 queries x 16 dimensions).
// Each score and each output element is one accumulator over its own query's row, so a
// query gets the same bits in any task. Positions past the sequence's end are packed as
// zeros and past a query's own end its weights are zeros: exact zeros added, whatever other
// queries share the task.
// A task of one tile of queries (a one-token pass, a short verification) skips packing K: its
// scores are K's rows (as they lie in the cache) x the queries as pairs, positions x queries,
// transposed after. The products and their order over k are the same either way round, so
// the scores are the same bits (the tests compare passes whose tasks take either route).
struct Chunk {
    const uint32_t* k;  // tile (32 dims kd, 16 positions pb) at (kd * blocks16 + pb) * 256: line r, column j = dims 32kd + 2r, +1 of position 16pb + j
    const bf16* rows;   // or, where K is not packed: K's rows from the chunk's first position
    const uint32_t* v;  // tile (32 positions pc, 16 dims db) at (pc * hd / 16 + db) * 256: line r, column j = dim 16db + j of positions 32pc + 2r, +1
    int blocks16, blocks32;
};

// K as the right operand of the scores (Chunk::k), its n rows from position c0; V's rows are
// prefetched meanwhile, a block behind (a long cache is not in cache).
static void pack_keys(const bf16* K, const bf16* V, int c0, int n, int hd, uint32_t* kp) {
    const int b16 = (n + 15) / 16;
    for (int pb = 0; pb < b16; pb++) {
        for (int j = 16 * pb; j < 16 * pb + 16 && j < n; j++)  // the next K rows and these V rows
            for (int d = 0; d < hd; d += 32) {
                _mm_prefetch((const char*)(V + (size_t)(c0 + j) * hd + d), _MM_HINT_T0);
                if (j + 16 < n) _mm_prefetch((const char*)(K + (size_t)(c0 + j + 16) * hd + d), _MM_HINT_T0);
            }
        for (int kd = 0; kd < hd / 32; kd++) {
            __m512i rows[16];
            for (int j = 0; j < 16; j++)
                rows[j] = 16 * pb + j < n ? _mm512_loadu_si512((const void*)(K + (size_t)(c0 + 16 * pb + j) * hd + 32 * kd))
                                          : _mm512_setzero_si512();
            transpose16(rows);
            for (int r = 0; r < 16; r++) _mm512_storeu_si512((void*)(kp + (size_t)(kd * b16 + pb) * 256 + r * 16), rows[r]);
        }
    }
}

// V as the right operand of the weighted sum (Chunk::v): pairs of positions interleaved.
static void pack_values(const bf16* V, int c0, int n, int hd, uint32_t* vp) {
    __m512i even, odd;  // (a[i], b[i]) for i in 0..15, and in 16..31
    {
        alignas(64) uint16_t e[32], o[32];
        for (int i = 0; i < 16; i++) e[2 * i] = i, e[2 * i + 1] = 32 + i, o[2 * i] = 16 + i, o[2 * i + 1] = 48 + i;
        even = _mm512_load_si512((const void*)e);
        odd = _mm512_load_si512((const void*)o);
    }
    const int dblocks = hd / 16;
    for (int pc = 0; pc < (n + 31) / 32; pc++)
        for (int r = 0; r < 16; r++) {
            const int p = 32 * pc + 2 * r;
            for (int d = 0; d < hd; d += 32) {
                const __m512i a = p < n ? _mm512_loadu_si512((const void*)(V + (size_t)(c0 + p) * hd + d)) : _mm512_setzero_si512();
                const __m512i b = p + 1 < n ? _mm512_loadu_si512((const void*)(V + (size_t)(c0 + p + 1) * hd + d)) : _mm512_setzero_si512();
                uint32_t* tile = vp + (size_t)(pc * dblocks + d / 16) * 256 + r * 16;
                _mm512_storeu_si512((void*)tile, _mm512_permutex2var_epi16(a, even, b));
                _mm512_storeu_si512((void*)(tile + 256), _mm512_permutex2var_epi16(a, odd, b));
            }
        }
}

// A task's chunk, positions [c0, hi). pack_k false: K stays in the cache (Chunk::rows), whose
// rows must reach c0 + 16 * blocks16.
static Chunk pack_chunk(const bf16* K, const bf16* V, int c0, int hi, int hd, bool pack_k,
                        std::vector<uint32_t>& scratch) {
    const int n = hi - c0, b16 = (n + 15) / 16, b32 = (n + 31) / 32, dw = hd / 2;
    scratch.resize((size_t)b16 * 16 * dw + (size_t)b32 * 32 * dw);
    uint32_t* kp = scratch.data();
    uint32_t* vp = kp + (size_t)b16 * 16 * dw;
    if (pack_k)
        pack_keys(K, V, c0, n, hd, kp);
    else  // V's rows come from memory while the first are interleaved
        for (int j = 0; j < n; j++)
            for (int d = 0; d < hd; d += 32) _mm_prefetch((const char*)(V + (size_t)(c0 + j) * hd + d), _MM_HINT_T0);
    pack_values(V, c0, n, hd, vp);
    return {pack_k ? kp : nullptr, pack_k ? nullptr : K + (size_t)c0 * hd, vp, b16, b32};
}

// Scores S[j][p] (16 x CHUNK) of n queries (qg: 16 x hd) over a chunk whose K is in the cache:
// positions x queries (A = 16 of K's rows, B = the queries as pairs), each tile transposed.
static void scores_from_rows(int n, const bf16* qg, const Chunk& ck, int hd, float* S) {
    const size_t qstride = (size_t)hd * sizeof(bf16);
    alignas(64) uint32_t qp[8][256];  // the queries as pairs: tile kd, line r, column j = dims 32kd + 2r, +1 of query j
    for (int kd = 0; kd < hd / 32; kd++) {
        __m512i r[16];
        for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_si512((const void*)(qg + (size_t)j * hd + 32 * kd));
        transpose16(r);
        for (int i = 0; i < 16; i++) _mm512_store_si512((void*)&qp[kd][16 * i], r[i]);
    }
    for (int pb = 0; pb < ck.blocks16; pb++) {
        _tile_zero(0);
        for (int kd = 0; kd < hd / 32; kd++) {
            _tile_loadd(4, ck.rows + (size_t)16 * pb * hd + 32 * kd, qstride);
            _tile_loadd(5, qp[kd], 64);
            _tile_dpbf16ps(0, 4, 5);
        }
        alignas(64) float t[256];
        _tile_stored(0, t, 64);
        __m512i r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512((const void*)(t + 16 * i));
        transpose16(r);
        for (int j = 0; j < n; j++) _mm512_storeu_si512((void*)(S + (size_t)j * CHUNK + 16 * pb), r[j]);
    }
}

// The same scores over a chunk whose K is packed: queries x positions, four tiles of positions at a time.
static void scores_from_packed(const bf16* qg, const Chunk& ck, int hd, float* S) {
    const size_t qstride = (size_t)hd * sizeof(bf16), sstride = CHUNK * sizeof(float);
    for (int pb = 0; pb < ck.blocks16; pb += 4) {
        const int nb = ck.blocks16 - pb < 4 ? ck.blocks16 - pb : 4;
        _tile_zero(0);
        if (nb > 1) _tile_zero(1);
        if (nb > 2) _tile_zero(2);
        if (nb > 3) _tile_zero(3);
        for (int kd = 0; kd < hd / 32; kd++) {
            const uint32_t* kt = ck.k + (size_t)(kd * ck.blocks16 + pb) * 256;
            _tile_loadd(4, qg + (size_t)kd * 32, qstride);
            _tile_loadd(5, kt, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (nb > 1) { _tile_loadd(6, kt + 256, 64); _tile_dpbf16ps(1, 4, 6); }
            if (nb > 2) { _tile_loadd(7, kt + 512, 64); _tile_dpbf16ps(2, 4, 7); }
            if (nb > 3) { _tile_loadd(5, kt + 768, 64); _tile_dpbf16ps(3, 4, 5); }
        }
        _tile_stored(0, S + 16 * pb, sstride);
        if (nb > 1) _tile_stored(1, S + 16 * (pb + 1), sstride);
        if (nb > 2) _tile_stored(2, S + 16 * (pb + 2), sstride);
        if (nb > 3) _tile_stored(3, S + 16 * (pb + 3), sstride);
    }
}

// Up to 16 queries over one chunk: {max, sum of weights, sum of weights * V} each.
// S: 16 x CHUNK floats of this thread's.
static void attend_tiles(const Queries& qs, const Chunk& ck, int c0, int hd, float* S) {
    // The queries and their weights, 16 x hd and 16 x CHUNK. Rows past qs.n are whatever was
    // there: their results are rows of their own, never read.
    thread_local std::vector<bf16> qg, pw;
    qg.resize((size_t)16 * hd);
    pw.resize((size_t)16 * CHUNK);
    for (int j = 0; j < qs.n; j++) std::memcpy(&qg[(size_t)j * hd], qs.q[j], (size_t)hd * sizeof(bf16));
    configure_tiles();
    if (ck.rows)
        scores_from_rows(qs.n, qg.data(), ck, hd, S);
    else
        scores_from_packed(qg.data(), ck, hd, S);
    const float scale = 1.0f / std::sqrt((float)hd);
    for (int j = 0; j < qs.n; j++) {  // softmax per query over its own positions, weights in bf16
        float* s = S + (size_t)j * CHUNK;
        const int n = qs.end[j] - c0;
        __m512 mxv = _mm512_set1_ps(-INFINITY);
        for (int t = 0; t < n; t += 16) {
            const __mmask16 mask = (__mmask16)((1u << (n - t < 16 ? n - t : 16)) - 1);
            const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, s + t), _mm512_set1_ps(scale));
            _mm512_mask_storeu_ps(s + t, mask, v);
            mxv = _mm512_mask_max_ps(mxv, mask, mxv, v);
        }
        const float mx = _mm512_reduce_max_ps(mxv);  // a maximum is exact in any order
        __m512 sum = _mm512_setzero_ps();  // lane = position mod 16
        for (int t = 0; t < n; t += 16) {
            const __mmask16 mask = (__mmask16)((1u << (n - t < 16 ? n - t : 16)) - 1);
            const __m512 e = round_bf16(exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + t), _mm512_set1_ps(mx))));
            _mm256_mask_storeu_epi16(&pw[(size_t)j * CHUNK + t], mask, bf16x16(e));
            sum = _mm512_mask_add_ps(sum, mask, sum, e);
        }
        for (int t = n; t < 32 * ck.blocks32; t++) pw[(size_t)j * CHUNK + t] = 0;  // past its end: no weight
        alignas(64) float lanes[16];
        _mm512_store_ps(lanes, sum);
        qs.partial[j][0] = mx;
        qs.partial[j][1] = tree16(lanes);
    }
    alignas(64) float o[4][256];
    const int dblocks = hd / 16;
    for (int db = 0; db < dblocks; db += 4) {  // weights x V, four blocks of 16 dimensions at a time
        const int nb = dblocks - db < 4 ? dblocks - db : 4;
        _tile_zero(0);
        if (nb > 1) _tile_zero(1);
        if (nb > 2) _tile_zero(2);
        if (nb > 3) _tile_zero(3);
        for (int pc = 0; pc < ck.blocks32; pc++) {
            const uint32_t* vt = ck.v + (size_t)(pc * dblocks + db) * 256;
            _tile_loadd(4, &pw[(size_t)pc * 32], CHUNK * sizeof(bf16));
            _tile_loadd(5, vt, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (nb > 1) { _tile_loadd(6, vt + 256, 64); _tile_dpbf16ps(1, 4, 6); }
            if (nb > 2) { _tile_loadd(7, vt + 512, 64); _tile_dpbf16ps(2, 4, 7); }
            if (nb > 3) { _tile_loadd(5, vt + 768, 64); _tile_dpbf16ps(3, 4, 5); }
        }
        _tile_stored(0, o[0], 64);
        if (nb > 1) _tile_stored(1, o[1], 64);
        if (nb > 2) _tile_stored(2, o[2], 64);
        if (nb > 3) _tile_stored(3, o[3], 64);
        for (int t = 0; t < nb; t++)
            for (int j = 0; j < qs.n; j++) std::memcpy(qs.partial[j] + 2 + 16 * (db + t), &o[t][j * 16], 16 * sizeof(float));
    }
}
#endif

// A row's chunks merged in order: softmax-weighted output, rounded to bf16.
static void merge_chunks(const float* partial, int chunks, int hd, bf16* out) {
    const int stride = hd + 2;
    float mx = -INFINITY;
    for (int c = 0; c < chunks; c++) mx = partial[c * stride] > mx ? partial[c * stride] : mx;
    float sum = 0.0f, o[256] = {};
    for (int c = 0; c < chunks; c++) {
        const float* p = partial + (size_t)c * stride;
        const float w = exp_le0(p[0] - mx);
        sum += w * p[1];
        for (int d = 0; d < hd; d++) o[d] += w * p[2 + d];
    }
    const float inv = 1.0f / sum;
    for (int d = 0; d < hd; d++) out[d] = to_bf16(o[d] * inv);
}

// One head's projection output y [hd] -> dst (bf16): plus its bias, rounded as the reference
// rounds (its projection outputs are bf16), rotated by RoPE if it is a query or key head.
static void project_out(float* y, const bf16* bias, bool rotate, const float* c, const float* s, int hd, bf16* dst) {
    const int half = hd / 2;
#if defined(__AVX512BF16__)  // the scalar form's operations, 16 lanes at a time (half is a multiple of 16)
    for (int d = 0; d < hd; d += 16) {
        __m512 v = _mm512_loadu_ps(y + d);
        if (bias) v = _mm512_add_ps(v, f32x16(_mm256_loadu_si256((const __m256i*)(bias + d))));
        _mm512_storeu_ps(y + d, round_bf16(v));
    }
    if (rotate)
        for (int j = 0; j < half; j += 16) {
            const __m512 a = _mm512_loadu_ps(y + j), z = _mm512_loadu_ps(y + j + half);
            const __m512 cj = _mm512_loadu_ps(c + j), sj = _mm512_loadu_ps(s + j);
            _mm512_storeu_ps(y + j, _mm512_sub_ps(_mm512_mul_ps(a, cj), _mm512_mul_ps(z, sj)));
            _mm512_storeu_ps(y + j + half, _mm512_add_ps(_mm512_mul_ps(z, cj), _mm512_mul_ps(a, sj)));
        }
    for (int d = 0; d < hd; d += 16) _mm256_storeu_si256((__m256i*)(dst + d), bf16x16(_mm512_loadu_ps(y + d)));
#else
    if (bias)
        for (int d = 0; d < hd; d++) y[d] += f32(bias[d]);
    for (int d = 0; d < hd; d++) y[d] = f32(to_bf16(y[d]));
    if (rotate)
        for (int j = 0; j < half; j++) {
            const float a = y[j], z = y[j + half];
            y[j] = a * c[j] - z * s[j];
            y[j + half] = z * c[j] + a * s[j];
        }
    for (int d = 0; d < hd; d++) dst[d] = to_bf16(y[d]);
#endif
}

// Per layer: 9 weight pointers, then 7 optional biases (null when absent), then the 7 matrices'
// block scales (null for a bf16 matrix, else its weights are int8).
enum { IN_NORM, WQ, WK, WV, WO, POST_NORM, WG, WU, WD, BQ, BK, BV, BO, BG, BU, BD, SQ, SK, SV, SO, SG, SU, SD, PER_LAYER };

// A weight matrix [N, K]: bf16 rows, or int8 rows with bf16 scales [N, K / 32] (scale not null).
struct Mat {
    const void* w;
    const bf16* scale;
    size_t row_bytes(int K) const { return (size_t)K * (scale ? sizeof(int8_t) : sizeof(bf16)); }
    Mat rows(size_t r0, int K) const { return {(const char*)w + r0 * row_bytes(K), scale ? scale + r0 * (K / 32) : nullptr}; }
};

static Mat layer_mat(const uint64_t* p, int which) {
    const int s = which < POST_NORM ? SQ + (which - WQ) : SG + (which - WG);
    return {(const void*)p[which], (const bf16*)p[s]};
}

static void dots(const Operand& in, const Mat& W, int n0, int n1, float* out, int ldo, Stream* s) {
    if (W.scale) dot_range(in, (const int8_t*)W.w, W.scale, n0, n1, out, ldo, s);
    else dots(in, (const bf16*)W.w, n0, n1, out, ldo, s);
}

extern "C" const char* specdec_isa() { return SPECDEC_ISA; }

// Whether this build can run here (the AMX form needs the kernel's leave to use the tiles).
extern "C" int specdec_ready() {
#if defined(SPECDEC_AMX)
    return amx_permitted();
#else
    return 1;
#endif
}

// A pass over M rows, each a token of one sequence at one position: one sequence's block
// (plain decoding, verification), or blocks of several sequences at once (a batch). Row m
// appends token[m] to sequence seq[m] at position pos[m]; it attends to that sequence's
// positions 0..pos[m], which this pass or an earlier one wrote. Nothing a row computes
// depends on the other rows, so a row gets the same bits in any batch and any block.
// cfg: D, I, H, Hkv, hd, layers, capacity, vocab rows of `head`, batch.
// cache_k / cache_v: [layers, batch, Hkv, capacity, hd] bf16.
// Logits [n_out, head rows] for the rows listed in out (ascending); head_scale as a layer's scales.
static int pass(const int64_t* cfg, float eps, const float* inv_freq, const uint64_t* layer_ptrs, const bf16* embed,
                const bf16* final_norm, const Mat head, bf16* cache_k, bf16* cache_v, const int64_t* tokens,
                const int64_t* seq, const int64_t* pos, int M, const int64_t* out, int n_out, float* logits, int nthreads) {
    const int D = (int)cfg[0], I = (int)cfg[1], H = (int)cfg[2], Hkv = (int)cfg[3], hd = (int)cfg[4];
    const int layers = (int)cfg[5], C = (int)cfg[6], Vh = (int)cfg[7], B = (int)cfg[8];
    if (!specdec_ready() || M < 1 || M > MAX_ROWS || D % 32 || I % 32 || hd % 32 || hd > 256 || H % Hkv || n_out < 1 || n_out > M)
        return 1;
    int longest = 0;
    for (int m = 0; m < M; m++) {
        if (seq[m] < 0 || seq[m] >= B || pos[m] < 0 || pos[m] >= C) return 1;
        longest = pos[m] + 1 > longest ? (int)pos[m] + 1 : longest;
    }
    for (int i = 0; i < n_out; i++)
        if (out[i] < 0 || out[i] >= M) return 1;
    const int Q = H * hd, KV = Hkv * hd, group = H / Hkv, half = hd / 2;
    const size_t seq_stride = (size_t)Hkv * C * hd, layer_stride = (size_t)B * seq_stride;
    std::vector<float> x((size_t)M * D), buf((size_t)M * 2 * (I > Q + 2 * KV ? I : Q + 2 * KV));
    std::vector<float> rope_cos((size_t)M * half), rope_sin((size_t)M * half);
    std::vector<bf16> xn((size_t)M * D), qb((size_t)M * Q), att((size_t)M * Q), h((size_t)M * I);
    const int chunks = (longest + CHUNK - 1) / CHUNK;  // partial results per (row, head): at most this many
    std::vector<float> scores((size_t)nthreads * Queries::MAX * CHUNK), partial((size_t)H * M * chunks * (hd + 2));
    // Attention tasks: (sequence, KV head, chunk) for every chunk some row of the sequence reaches.
    std::vector<int> seq_end(B, 0);
    for (int m = 0; m < M; m++) seq_end[seq[m]] = pos[m] + 1 > seq_end[seq[m]] ? (int)pos[m] + 1 : seq_end[seq[m]];
    std::vector<int> tasks;
    for (int b = 0; b < B; b++)
        for (int g = 0; g < Hkv; g++)
            for (int c = 0; c * CHUNK < seq_end[b]; c++) tasks.insert(tasks.end(), {b, g, c});
    const int n_tasks = (int)tasks.size() / 3;
    for (int m = 0; m < M; m++) {
        for (int d = 0; d < D; d++) x[(size_t)m * D + d] = f32(embed[(size_t)tokens[m] * D + d]);
        for (int j = 0; j < half; j++) {  // positions are absolute token indices, as in the reference
            float a = (float)pos[m] * inv_freq[j];
            rope_cos[(size_t)m * half + j] = std::cos(a);
            rope_sin[(size_t)m * half + j] = std::sin(a);
        }
    }
    const int ldq = Q + 2 * KV;
#pragma omp parallel num_threads(nthreads)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        int lo, hi;
        Stream stream;  // this thread's weights, in the order of the stages below
        std::vector<uint32_t> scratch;  // this thread's prepared operand, stage after stage
        std::vector<uint32_t> chunk_scratch;  // this thread's packed K/V chunk (the AMX form's attention)
        // rows [lo, hi) of a matrix with K columns, in the order the stages read them
        auto add = [&](const Mat& w, int K) { stream.add(w.rows(lo, K).w, (size_t)(hi - lo) * w.row_bytes(K)); };
        for (int layer = 0; layer < layers; layer++) {
            const uint64_t* p = layer_ptrs + (size_t)layer * PER_LAYER;
            share(H + 2 * Hkv, 1, tid, nt, &lo, &hi);
            for (int u = lo; u < hi; u++) {
                const Mat w = u < H ? layer_mat(p, WQ).rows((size_t)u * hd, D)
                            : u < H + Hkv ? layer_mat(p, WK).rows((size_t)(u - H) * hd, D)
                                          : layer_mat(p, WV).rows((size_t)(u - H - Hkv) * hd, D);
                stream.add(w.w, (size_t)hd * w.row_bytes(D));
            }
            share(D, 16, tid, nt, &lo, &hi);
            add(layer_mat(p, WO), Q);
            share(I, 16, tid, nt, &lo, &hi);
            add(layer_mat(p, WG), D);
            add(layer_mat(p, WU), D);
            share(D, 16, tid, nt, &lo, &hi);
            add(layer_mat(p, WD), I);
        }
        share(Vh, 16, tid, nt, &lo, &hi);
        add(head, D);
        stream.advance(PREFETCH_AHEAD);
        for (int layer = 0; layer < layers; layer++) {
            const bf16* const* p = (const bf16* const*)(layer_ptrs + (size_t)layer * PER_LAYER);
            const uint64_t* mats = layer_ptrs + (size_t)layer * PER_LAYER;
            bf16* kc = cache_k + layer * layer_stride;
            bf16* vc = cache_v + layer * layer_stride;
#pragma omp for schedule(static)
            for (int m = 0; m < M; m++) rms_norm(&x[(size_t)m * D], p[IN_NORM], D, eps, &xn[(size_t)m * D]);
            // q, k, v heads, whole heads per thread so RoPE stays local.
            share(H + 2 * Hkv, 1, tid, nt, &lo, &hi);
            const Operand xq = operand(xn.data(), M, D, scratch);
            for (int u = lo; u < hi; u++) {
                const Mat w = u < H ? layer_mat(mats, WQ).rows((size_t)u * hd, D)
                            : u < H + Hkv ? layer_mat(mats, WK).rows((size_t)(u - H) * hd, D)
                                          : layer_mat(mats, WV).rows((size_t)(u - H - Hkv) * hd, D);
                const bf16* b = u < H ? p[BQ] : u < H + Hkv ? p[BK] : p[BV];
                const int boff = (u < H ? u : u < H + Hkv ? u - H : u - H - Hkv) * hd;
                float* o = &buf[(size_t)u * hd];
                dots(xq, w, 0, hd, o, ldq, &stream);
                for (int m = 0; m < M; m++) {
                    bf16* dst = u < H ? &qb[(size_t)m * Q + u * hd]
                                      : (u < H + Hkv ? kc + (size_t)(u - H) * C * hd : vc + (size_t)(u - H - Hkv) * C * hd)
                                            + seq[m] * seq_stride + (size_t)pos[m] * hd;
                    project_out(o + (size_t)m * ldq, b ? b + boff : nullptr, u < H + Hkv, &rope_cos[(size_t)m * half],
                                &rope_sin[(size_t)m * half], hd, dst);
                }
            }
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
            for (int task = 0; task < n_tasks; task++) {
                const int b = tasks[3 * task], g = tasks[3 * task + 1], c = tasks[3 * task + 2], c0 = c * CHUNK;
                const bf16 *kg = kc + b * seq_stride + (size_t)g * C * hd, *vg = vc + b * seq_stride + (size_t)g * C * hd;
                const int hi = seq_end[b] < c0 + CHUNK ? seq_end[b] : c0 + CHUNK;
                float* sc = &scores[(size_t)tid * Queries::MAX * CHUNK];
                auto reads = [&](int m) { return seq[m] == b && pos[m] + 1 > c0; };  // row m's queries read this chunk
#if defined(SPECDEC_AMX)
                int nq = 0;  // the task's queries: one tile of them reads K's rows as they are
                for (int m = 0; m < M; m++) nq += reads(m) ? group : 0;
                const bool pack_k = nq > Queries::MAX || c0 + 16 * ((hi - c0 + 15) / 16) > C;
                const Chunk ck = pack_chunk(kg, vg, c0, hi, hd, pack_k, chunk_scratch);
                auto run = [&](const Queries& qs) { attend_tiles(qs, ck, c0, hd, sc); };
#else
                auto run = [&](const Queries& qs) { attend(qs, kg, vg, c0, hd, sc); };
#endif
                Queries qs;
                for (int m = 0; m < M; m++) {
                    const int n = (int)pos[m] + 1;  // row m sees positions 0..pos[m] of its sequence
                    if (!reads(m)) continue;
                    for (int hh = g * group; hh < (g + 1) * group; hh++) {
                        qs.q[qs.n] = &qb[(size_t)m * Q + hh * hd];
                        qs.end[qs.n] = n < c0 + CHUNK ? n : c0 + CHUNK;
                        qs.partial[qs.n] = &partial[(((size_t)hh * M + m) * chunks + c) * (hd + 2)];
                        if (++qs.n == Queries::MAX) run(qs), qs.n = 0;
                    }
                }
                if (qs.n) run(qs);
            }
#pragma omp for schedule(static)
            for (int task = 0; task < M * H; task++) {
                const int m = task / H, hh = task % H;
                merge_chunks(&partial[((size_t)hh * M + m) * chunks * (hd + 2)], (int)(pos[m] + CHUNK) / CHUNK, hd,
                             &att[(size_t)m * Q + hh * hd]);
            }
            share(D, 16, tid, nt, &lo, &hi);
            dots(operand(att.data(), M, Q, scratch), layer_mat(mats, WO), lo, hi, &buf[lo], D, &stream);
            add_residual(&x[lo], D, &buf[lo], D, p[BO] ? p[BO] + lo : nullptr, M, hi - lo);
#pragma omp barrier
#pragma omp for schedule(static)
            for (int m = 0; m < M; m++) rms_norm(&x[(size_t)m * D], p[POST_NORM], D, eps, &xn[(size_t)m * D]);
            share(I, 16, tid, nt, &lo, &hi);
            const Operand xg = operand(xn.data(), M, D, scratch);
            dots(xg, layer_mat(mats, WG), lo, hi, &buf[lo], 2 * I, &stream);
            dots(xg, layer_mat(mats, WU), lo, hi, &buf[I + lo], 2 * I, &stream);
            for (int m = 0; m < M; m++)
                swiglu(&buf[(size_t)m * 2 * I + lo], &buf[(size_t)m * 2 * I + I + lo], p[BG] ? p[BG] + lo : nullptr,
                       p[BU] ? p[BU] + lo : nullptr, hi - lo, &h[(size_t)m * I + lo]);
#pragma omp barrier
            share(D, 16, tid, nt, &lo, &hi);
            dots(operand(h.data(), M, I, scratch), layer_mat(mats, WD), lo, hi, &buf[lo], D, &stream);
            add_residual(&x[lo], D, &buf[lo], D, p[BD] ? p[BD] + lo : nullptr, M, hi - lo);
#pragma omp barrier
        }
#pragma omp for schedule(static)
        for (int i = 0; i < n_out; i++) rms_norm(&x[(size_t)out[i] * D], final_norm, D, eps, &xn[(size_t)i * D]);
        share(Vh, 16, tid, nt, &lo, &hi);
        dots(operand(xn.data(), n_out, D, scratch), head, lo, hi, logits + lo, Vh, &stream);
        release_tiles();
    }
    return 0;
}

extern "C" int specdec_pass(const int64_t* cfg, float eps, const float* inv_freq, const uint64_t* layer_ptrs,
                            const bf16* embed, const bf16* final_norm, const void* head, const bf16* head_scale,
                            bf16* cache_k, bf16* cache_v, const int64_t* tokens, const int64_t* seq, const int64_t* pos,
                            int M, const int64_t* out, int n_out, float* logits, int nthreads) {
    return pass(cfg, eps, inv_freq, layer_ptrs, embed, final_norm, Mat{head, head_scale}, cache_k, cache_v, tokens, seq, pos, M, out,
                n_out, logits, nthreads);
}

// out [M, N] = x [M, K] . W [N, K]^T in fp32, with the pass's dot products (for tests and probes).
extern "C" void specdec_linear(const bf16* x, int M, int K, const bf16* W, int N, float* out, int nthreads) {
    if (!specdec_ready()) return;
#pragma omp parallel num_threads(nthreads)
    {
        int lo, hi;
        share(N, 16, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        Stream stream;
        stream.add(W + (size_t)lo * K, (size_t)(hi - lo) * K * sizeof(bf16));
        stream.advance(PREFETCH_AHEAD);
        std::vector<uint32_t> scratch;
        dots(operand(x, M, K, scratch), W, lo, hi, out + lo, N, &stream);
        release_tiles();
    }
}
