// The demo target's F32 mat-muls outside llama.cpp: where a verification forward's time goes.
//
//   g++ -O3 -march=native -pthread -o /tmp/matmul-overlap tools/matmul-overlap.cpp
//   /tmp/matmul-overlap N [VARIANT] [DISTANCE] [ROW_MASK]
//
// Runs every product of one forward of N tokens of SmolLM2-135M (30 layers of q, k, v, o, gate,
// up and down, then the 49,152-row output product: 538 MB of F32 weights) on 2 threads, each a
// contiguous share of every product's rows with a barrier after each product, as the ggml patch
// does (tools/patches/ggml-batch-invariant.patch, edgespec_rows_t). Prints the median of 15
// forwards and the time in the 576-wide, the 1,536-wide and the output products.
//
// VARIANT: 0 = 4-row x 4-column tiles; 1 = the patch's tiles (8 x 2 with the next 8 rows
// prefetched where rows hold up to 768 floats, else 4 x 4); 2 / 3 = 8 x 2 (4 x 4 for longer
// rows) with the rows DISTANCE blocks ahead prefetched into L2 / L1, spread over every column
// tile of the block; 4 = 4 x 4 tiles with that L2 prefetch. ROW_MASK = 63 reads only the first
// 64 rows of every product (the weights come from cache: the FMAs' time alone); N = 1 with
// variant 0 is close to the weights' stream alone. Every variant computes the same bits per
// element (one accumulator per element, k in steps of 16, the patch's horizontal sum): the
// output of each is compared with variant 0's.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <thread>
#include <vector>

static long g_mask = -1;

// lane r = _mm512_reduce_add_ps(v[r]) in its pairing (the patch's edgespec_hsum16)
static inline __m512 hsum16(const __m512 * v) {
    __m512 w[8];
    for (int i = 0; i < 8; ++i)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2*i], v[2*i+1], 0xEE), _mm512_shuffle_f32x4(v[2*i], v[2*i+1], 0x44));
    __m512 x[4];
    for (int i = 0; i < 4; ++i)
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2*i], w[2*i+1], 0xDD), _mm512_shuffle_f32x4(w[2*i], w[2*i+1], 0x88));
    __m512 y[2];
    for (int i = 0; i < 2; ++i)
        y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2*i], x[2*i+1], 0xEE), _mm512_shuffle_ps(x[2*i], x[2*i+1], 0x44));
    const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
}

// C[jj+j][ii+i] for i < RM, j < RN; P (or null): RM rows whose line l is fetched at step l
template <int RM, int RN>
static inline __attribute__((always_inline)) void tile(const float * A, long lda, const float * B, long ldb, float * C,
                                                       long ldc, long k, long ii, long jj, const float * P) {
    __m512 acc[RM][RN];
    for (int i = 0; i < RM; ++i) for (int j = 0; j < RN; ++j) acc[i][j] = _mm512_setzero_ps();
    for (long l = 0; l < k; l += 16) {
        if (P) for (int i = 0; i < RM; ++i) _mm_prefetch((const char *) (P + lda*i + l), _MM_HINT_T0);
        __m512 b[RN];
        for (int j = 0; j < RN; ++j) b[j] = _mm512_loadu_ps(B + ldb*(jj + j) + l);
        for (int i = 0; i < RM; ++i) {
            const __m512 a = _mm512_loadu_ps(A + lda*((ii + i) & g_mask) + l);
            for (int j = 0; j < RN; ++j) acc[i][j] = _mm512_fmadd_ps(a, b[j], acc[i][j]);
        }
    }
    constexpr int T = RM*RN;
    for (int g = 0; g < (T + 15)/16; ++g) {
        __m512 v[16];
        int cnt = 0;
        for (int r = 0; r < 16; ++r) {
            const int e = g*16 + r;
            if (e < T) { v[r] = acc[e % RM][e / RM]; cnt++; } else v[r] = _mm512_setzero_ps();
        }
        float t[16];
        _mm512_storeu_ps(t, hsum16(v));
        for (int r = 0; r < cnt; ++r) { const int e = g*16 + r; C[ldc*(jj + e / RM) + ii + e % RM] = t[r]; }
    }
}

static void rows_4x4(const float * A, long lda, const float * B, long ldb, float * C, long ldc, long k, long n, long r0, long r1) {
    for (long ii = r0; ii < r1; ii += 4) {
        for (long jj = 0; jj < n;) {
            const long nc = std::min(n - jj, 4L);
            switch (nc) {
                case 1: tile<4, 1>(A, lda, B, ldb, C, ldc, k, ii, jj, nullptr); break;
                case 2: tile<4, 2>(A, lda, B, ldb, C, ldc, k, ii, jj, nullptr); break;
                case 3: tile<4, 3>(A, lda, B, ldb, C, ldc, k, ii, jj, nullptr); break;
                default: tile<4, 4>(A, lda, B, ldb, C, ldc, k, ii, jj, nullptr);
            }
            jj += nc;
        }
    }
}

static void rows_patch(const float * A, long lda, const float * B, long ldb, float * C, long ldc, long k, long n, long r0, long r1) {
    long ii = r0;
    for (; k <= 768 && ii + 8 <= r1; ii += 8) {
        const float * P = ii + 16 <= r1 ? A + lda*(ii + 8) : nullptr;
        long jj = 0;
        for (; jj + 2 <= n; jj += 2) tile<8, 2>(A, lda, B, ldb, C, ldc, k, ii, jj, jj == 0 ? P : nullptr);
        for (; jj < n; ++jj) tile<8, 1>(A, lda, B, ldb, C, ldc, k, ii, jj, nullptr);
    }
    if (ii < r1) rows_4x4(A, lda, B, ldb, C, ldc, k, n, ii, r1);
}

// the block D blocks ahead, its lines shared out over the block's column tiles
template <int RM, int RN, int HINT>
static void rows_spread(const float * A, long lda, const float * B, long ldb, float * C, long ldc, long k, long n, long r0,
                        long r1, int D) {
    long ii = r0;
    const long per_row = k/16, lines = RM*per_row, ntiles = (n + RN - 1)/RN;
    for (; ii + RM <= r1; ii += RM) {
        const long pb = ii + D*RM;
        long t = 0;
        for (long jj = 0; jj < n; jj += RN, ++t) {
            if (pb + RM <= r1) {
                for (long q = lines*t/ntiles; q < lines*(t + 1)/ntiles; ++q) {
                    _mm_prefetch((const char *) (A + lda*(pb + q / per_row) + 16*(q % per_row)), HINT ? _MM_HINT_T1 : _MM_HINT_T0);
                }
            }
            if (jj + RN <= n) tile<RM, RN>(A, lda, B, ldb, C, ldc, k, ii, jj, nullptr);
            else for (long j = jj; j < n; ++j) tile<RM, 1>(A, lda, B, ldb, C, ldc, k, ii, j, nullptr);
        }
    }
    if (ii < r1) rows_4x4(A, lda, B, ldb, C, ldc, k, n, ii, r1);
}

struct Mat { long m, k; float * w; };

static double now() { timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9*t.tv_nsec; }

static std::atomic<int> bar_count{0}, bar_gen{0};
static void barrier(int nth) {
    const int g = bar_gen.load();
    if (bar_count.fetch_add(1) == nth - 1) { bar_count = 0; bar_gen.fetch_add(1); }
    else while (bar_gen.load() == g) _mm_pause();
}

int main(int argc, char ** argv) {
    if (argc < 2) { fprintf(stderr, "usage: %s N [VARIANT] [DISTANCE] [ROW_MASK]\n", argv[0]); return 2; }
    const long n = atol(argv[1]);
    const int variant = argc > 2 ? atoi(argv[2]) : 1, D = argc > 3 ? atoi(argv[3]) : 1, nth = 2, reps = 15;
    if (argc > 4) g_mask = atol(argv[4]);
    std::vector<Mat> mats;
    const long shapes[7][2] = {{576, 576}, {192, 576}, {192, 576}, {576, 576}, {1536, 576}, {1536, 576}, {576, 1536}};
    for (int L = 0; L < 30; ++L) for (auto & s : shapes) mats.push_back({s[0], s[1], nullptr});
    mats.push_back({49152, 576, nullptr});
    for (auto & m : mats) {
        m.w = (float *) aligned_alloc(64, m.m*m.k*sizeof(float));
        for (long i = 0; i < m.m*m.k; ++i) m.w[i] = (float) ((i*7919) % 2001 - 1000)*1e-3f;
    }
    std::vector<float> B(n*1536), C(n*49152), C0(n*49152);
    for (size_t i = 0; i < B.size(); ++i) B[i] = (float) ((long) (i*104729) % 2001 - 1000)*1e-3f;
    double kind_t[3] = {0, 0, 0}, t_last = 0;
    auto run = [&](int ith, int v, float * out) {
        if (ith == 0) t_last = now();
        for (auto & m : mats) {
            const long per = (m.m/4 + nth - 1)/nth*4, r0 = std::min(m.m, per*ith), r1 = std::min(m.m, r0 + per);
            switch (v) {
                case 0: rows_4x4(m.w, m.k, B.data(), m.k, out, m.m, m.k, n, r0, r1); break;
                case 1: rows_patch(m.w, m.k, B.data(), m.k, out, m.m, m.k, n, r0, r1); break;
                case 2:
                    if (m.k <= 768) rows_spread<8, 2, 1>(m.w, m.k, B.data(), m.k, out, m.m, m.k, n, r0, r1, D);
                    else rows_spread<4, 4, 1>(m.w, m.k, B.data(), m.k, out, m.m, m.k, n, r0, r1, D);
                    break;
                case 3:
                    if (m.k <= 768) rows_spread<8, 2, 0>(m.w, m.k, B.data(), m.k, out, m.m, m.k, n, r0, r1, D);
                    else rows_spread<4, 4, 0>(m.w, m.k, B.data(), m.k, out, m.m, m.k, n, r0, r1, D);
                    break;
                default: rows_spread<4, 4, 1>(m.w, m.k, B.data(), m.k, out, m.m, m.k, n, r0, r1, D);
            }
            barrier(nth);
            if (ith == 0) { const double t2 = now(); kind_t[m.m == 49152 ? 2 : (m.k > 768 ? 1 : 0)] += t2 - t_last; t_last = t2; }
        }
    };
    {  // the reference bits: the last product's output of variant 0
        std::thread t1(run, 1, 0, C0.data());
        run(0, 0, C0.data());
        t1.join();
    }
    kind_t[0] = kind_t[1] = kind_t[2] = 0;
    std::vector<double> ts;
    for (int rep = 0; rep < reps; ++rep) {
        const double t = now();
        std::thread t1(run, 1, variant, C.data());
        run(0, variant, C.data());
        t1.join();
        ts.push_back(now() - t);
    }
    std::sort(ts.begin(), ts.end());
    double flop = 0;
    for (auto & m : mats) flop += 2.0*m.m*m.k*n;
    const bool same = memcmp(C.data(), C0.data(), sizeof(float)*n*49152) == 0;
    printf("N=%ld variant=%d distance=%d row_mask=%ld: median %.2f ms (%.0f GFLOP/s); 576-wide %.1f ms, 1,536-wide %.1f ms, "
           "output %.1f ms; bits %s\n", n, variant, D, g_mask, ts[reps/2]*1e3, flop/ts[reps/2]/1e9, kind_t[0]*1e3/reps,
           kind_t[1]*1e3/reps, kind_t[2]*1e3/reps, same ? "as variant 0" : "DIFFER");
    return same ? 0 : 1;
}
