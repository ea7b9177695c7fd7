// The draft model's whole forward in one call: embedding, every decoder layer, the logits head.
//
// Plain C++17 + OpenMP, no torch headers: `cpu_draft/native.py` compiles it at first use
// (g++ -O3 -march=native -fopenmp) and calls `draft_forward` through ctypes with raw pointers
// to the weights `cpu_draft/native_model.py` prepared and to the slot K/V cache of
// `cpu_draft/slot_kv.py`. The maths is `cpu_draft/lean_model.py`'s (norm weights folded
// into the projections, Q pre-scaled, rotary pairs adjacent); the reason for this file is
// cost: torch runs ~28 ops per layer, each paying fork/join and dispatch, while here one
// OpenMP parallel region covers the whole forward, with five barriers per layer (our own spinning
// ones, `SpinBarrier`, not OpenMP's):
//
//   QKV matmul (rms scale, bias, rotary, K/V store fused in its epilogue) | attention |
//   O matmul (+= residual, partial sums of squares for the next rms) | gate_up matmul
//   (silu(gate) * up in its epilogue) | down matmul (+= residual, sums of squares)
//
// then the final rms of the requested rows and the logits head. Activations, the residual
// stream and attention are float32; K/V are stored in float32 or bfloat16 (the caller's cache:
// rounded to nearest even by the QKV epilogue, as torch's `.to(torch.bfloat16)` rounds, and widened
// in registers as attention reads them: half the bytes a decode batch's attention streams); weights
// are float32, bfloat16 (widened in registers: bits << 16; with AVX512_BF16, packed in k pairs
// for vpdpbf16ps over inputs rounded to bf16 once per matmul) or int8 per output channel with
// float32 scales (the logits head too, under int8 weights; widened to float32 in registers, or with AVX512_VNNI stored + 128 in k quads
// for vpdpbusd over inputs quantised to int8 once per matmul, in blocks of 64 with a scale each).
//
// Matmuls are "skinny": M (tokens) is 1..64 in decode, the weights are what costs. Weights
// come packed in panels of VW output channels, [panels][K][VW], so a thread streams each of
// its panels once, front to back, and keeps an MT rows x NPT panels block of accumulators in
// vector registers: per k, NPT weight vectors and MT broadcasts of x[m][k] feed NPT*MT FMAs,
// with no horizontal sums (NPT = 2 from 5 rows up, more panels at once below that so enough
// independent FMAs are in flight), from 2 rows up prefetching the panels it streams next as it streams
// these. Threads own contiguous ranges of panels (static partition), so each output element is summed
// in the same order whatever the batch: a token's result does not depend on the other tokens of its
// forward.
//
// Built for AMX (-march=native on a Xeon with it) and allowed at run time (the CPU has it, Linux
// granted the process its tile data; HETERO_NATIVE_AMX=0 or draft_set_amx(0) turn it off), int8 and
// bf16 matmuls of 4 rows or more multiply 16-row tiles instead (`amx_tile`): the packed weights
// already are AMX B tiles. INT8 gives the VNNI kernel's results bit for bit (exact int32 sums per input
// block, the same epilogue); BF16 sums in another order than vpdpbf16ps.
//
// Attention runs in chunks of ATTN_CHUNK (64) positions. A decode batch has few (token, KV head)
// pairs for many threads (24 at batch 8 for 14), so each chunk of a pair is an item handed out
// dynamically (with the same chunk of the pairs of the slot's next tokens in the batch, which read the
// same K/V); it leaves a partial (its maximum score, sum of exponentials and exp-weighted values)
// and the pair's last chunk to finish merges the partials in chunk order. A thread claims its next item
// before attending the current one and prefetches that chunk's K/V meanwhile. Past a memory budget (long
// prefills) a pair's chunks run in turn on one thread, merged the same way. Chunk bounds are fixed
// positions, and the rms sums of squares are summed per panel in panel order, so a token's results
// depend neither on its batch nor on the thread count.
//
// HETERO_NATIVE_PROFILE=1 (read once at load; draft_profile_enable switches it) sums each thread's time
// per phase, computing and waiting at the closing barrier: draft_profile / draft_profile_reset,
// read by `cpu_draft.native.read_profile` and `python -m bench.cpu_draft --profile-native`.
//
// Only GOMP_parallel / omp_get_* are used (no worksharing constructs, no OpenMP barriers), so
// the library binds to whichever libgomp the process already has (torch's, soname
// libgomp.so.1): one thread pool, not two fighting for the draft's cores.
#include <omp.h>
#include <sched.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && (defined(__AMX_INT8__) || defined(__AMX_BF16__))
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>

namespace {

#if defined(__AVX512F__)
#define DRAFT_VW 16
constexpr int MT_MAX = 8;  // 2 x 8 accumulators + 2 weight vectors of 32 zmm registers
#else
#define DRAFT_VW 8
constexpr int MT_MAX = 6;  // 2 x 6 accumulators + 2 weight vectors + 1 broadcast of 16 ymm registers
#endif
constexpr int VW = DRAFT_VW;  // floats per vector register

// With AVX512_BF16, bf16 weights are packed in pairs of k, [panels][k / 2][VW][2], and each matmul
// rounds its input rows to bf16 once (after the rms scale, where there is one) so one vpdpbf16ps
// does 2 x VW multiply-adds into float32 accumulators.
#if defined(__AVX512BF16__) && DRAFT_VW == 16
#define DRAFT_BF16_PAIRS 1
#else
#define DRAFT_BF16_PAIRS 0
#endif
struct bf16x2 {  // a pair of bf16 weights of consecutive k (only the type matters: it selects the pair kernel)
    uint32_t bits;
};

// With AVX512_VNNI, int8 weights are stored as u8 = w + 128 in quads of k, [panels][k / 4][VW][4], and
// each matmul quantises its input rows to int8 once, in blocks of QB consecutive k with a scale each
// (amax / 127). Blocks, not rows: the residual stream's few large channels would cost the other
// channels of their row most of their precision. SmolLM2-135M's greedy tokens agreed with bf16's at
// 95% of positions with blocks of 64 (as with 16 or 32), 83% with blocks of 512, 96% with int8 weights
// and float inputs; blocks of 64 matmul 5-15% faster than blocks of 32 (fewer conversions per vpdpbusd).
// One vpdpbusd does 4 x VW multiply-adds into int32: sum_k (w + 128) x = sum_k w x + 128 sum_k x, so
// each block's accumulators start at -128 * (sum of the block's x) and end as the exact sum_k w x,
// which adds into float32 times the block's scale.
#if defined(__AVX512VNNI__) && DRAFT_VW == 16
#define DRAFT_INT8_QUADS 1
#else
#define DRAFT_INT8_QUADS 0
#endif
constexpr int QB = 64;       // k per activation block
constexpr int QB4 = QB / 4;  // quads per block
struct u8x4 {  // a quad of int8 weights + 128 of consecutive k (the type selects the VNNI kernel)
    uint32_t bits;
};
constexpr int NP_MAX = 8;  // most panels a thread streams side by side (at M = 1)

// With AMX (built for it, and at run time the CPU has it and Linux granted this process the tile
// data: `amx_permitted`), matmuls of AMX_MIN_ROWS rows or more multiply tiles instead. The int8 quads
// and bf16 pairs above are already AMX B tiles: AMX_DEPTH quads (pairs) of k by VW channels, 64 bytes
// a row, for 64 (32) k; a quantised (rounded) input row's bytes over the same k are a row of an A
// tile. One tile multiply covers up to AMX_ROWS rows x VW channels x 64 (32) k, what the VNNI kernel
// spends 16 x rows vpdpbusd on. The tile registers (palette 1, eight of 1 KB): C tiles 0-3 for
// AMX_PANELS panels side by side (the A tile loaded once for four), A tile 4 and B tile 5 over
// AMX_DEPTH quads (pairs), A tile 6 and B tile 7 shaped for K's last, partial, block (none where K is
// a multiple of it). INT8 stores each block's C tiles and runs the VNNI kernel's block epilogue on
// them (start, then float32 times the block's scale, in block order): int32 sums are exact, so its
// results are the VNNI kernel's bit for bit. BF16 accumulates in the C tiles over all of K, then
// stores them: float32 sums in another order than vpdpbf16ps's. Below AMX_MIN_ROWS rows (decode at
// batch 1-3) the vector kernels stay: a tile multiply costs about the same at 1 row as at 16, while
// the vector kernels' work shrinks with the rows (a threshold by that argument, not measured).
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && DRAFT_INT8_QUADS
#define DRAFT_AMX_INT8 1
#else
#define DRAFT_AMX_INT8 0
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && DRAFT_BF16_PAIRS
#define DRAFT_AMX_BF16 1
#else
#define DRAFT_AMX_BF16 0
#endif
#define DRAFT_AMX (DRAFT_AMX_INT8 || DRAFT_AMX_BF16)
constexpr int AMX_ROWS = 16;     // rows of an A or C tile
constexpr int AMX_DEPTH = 16;    // rows of a B tile: quads (int8) or pairs (bf16) of k
constexpr int AMX_PANELS = 4;    // C tiles, one per panel computed side by side
constexpr int AMX_MIN_ROWS = 4;  // fewer rows take the vector kernels
#if DRAFT_AMX
static_assert(QB4 == AMX_DEPTH, "an int8 input block is one tile of k: its epilogue runs per tile multiply");
static_assert(AMX_PANELS * AMX_ROWS <= NP_MAX * MT_MAX, "an AMX block of results fits the vector kernels' out buffer");
#endif

template <typename WT>
constexpr bool amx_kernel() {
    return (DRAFT_AMX_INT8 && std::is_same_v<WT, u8x4>) || (DRAFT_AMX_BF16 && std::is_same_v<WT, bf16x2>);
}

typedef float vf __attribute__((vector_size(VW * sizeof(float))));
typedef uint16_t vu16 __attribute__((vector_size(VW * sizeof(uint16_t))));
typedef uint32_t vu32 __attribute__((vector_size(VW * sizeof(uint32_t))));
typedef int8_t vi8 __attribute__((vector_size(VW * sizeof(int8_t))));
typedef int32_t vi32 __attribute__((vector_size(VW * sizeof(int32_t))));

enum Format : int64_t { F32 = 0, BF16 = 1, I8 = 2 };

// Mirrors of the ctypes structures in cpu_draft/native_model.py: int64 and pointers only.
struct Matrix {
    const void* weight;   // [panels][k][VW] in `format` (k pairs / quads: see below); rows past n are zero
    const float* scale;   // [panels * VW]: int8 per-channel scales, else null
    const float* bias;    // [panels * VW] or null
    int64_t n, k, panels, format;
};

struct Layer {
    Matrix qkv, o, gate_up, down;  // gate_up's panels interleave gate and up: g0, u0, g1, u1, ...
};

struct Model {
    int64_t hidden, num_layers, num_heads, num_kv_heads, head_dim, intermediate, vocab, max_positions;
    int64_t embed_format;  // F32 or BF16, [vocab][hidden] row-major
    const void* embed;
    const float* cos;  // [max_positions][head_dim / 2]
    const float* sin;
    const float* eps;  // [2 * num_layers + 1]: each layer's two norms, then the final one
    const Layer* layers;
    Matrix head;
    int64_t vector_width;  // VW the weights were packed for
};

// Phase timing (HETERO_NATIVE_PROFILE=1 at load, or draft_profile_enable): per thread, the time each
// phase computed and then waited at the barrier that ends it, summed over calls. Off, it costs one
// predictable branch per phase.
enum Phase : int { P_EMBED, P_QKV, P_ATTN, P_O, P_GATE_UP, P_DOWN, P_HEAD, P_TOP, NUM_PHASES };
constexpr const char* PHASE_NAMES = "embed,qkv,attention,o,gate_up,down,lm_head,top_k";
constexpr int PROFILE_THREADS = 512;

struct alignas(64) ThreadProfile {
    double compute[NUM_PHASES];
    double wait[NUM_PHASES];
};

bool env_flag(const char* name) {
    const char* v = std::getenv(name);
    return v && *v && std::strcmp(v, "0") != 0;
}

bool g_profile = env_flag("HETERO_NATIVE_PROFILE");
ThreadProfile g_thread_profile[PROFILE_THREADS];
int64_t g_profile_calls = 0, g_profile_threads = 0;
double g_profile_total = 0.0;

#if DRAFT_AMX
// Whether this CPU has the tile instructions this build uses (CPUID leaf 7: EDX bit 24 AMX-TILE, 25
// AMX-INT8, 22 AMX-BF16) and Linux let this process use the tile data: a process must ask once
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA) before its first tile instruction, and a
// kernel without AMX support refuses. Asking again, as torch's oneDNN may have, is harmless.
bool amx_permitted() {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const unsigned needed = (1u << 24) | (DRAFT_AMX_INT8 ? 1u << 25 : 0u) | (DRAFT_AMX_BF16 ? 1u << 22 : 0u);
    if ((edx & needed) != needed) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}
#else
bool amx_permitted() { return false; }
#endif

const bool g_amx_permitted = amx_permitted();

bool amx_at_load() {
    const char* v = std::getenv("HETERO_NATIVE_AMX");
    return g_amx_permitted && !(v && std::strcmp(v, "0") == 0);
}

// AMX kernels in use: permitted, and not turned off (HETERO_NATIVE_AMX=0 at load, or draft_set_amx).
// Read by every matmul: switch it between forwards, not during one.
bool g_amx = amx_at_load();

inline double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// One thread's clock within a forward: `computed(p)` closes phase p's work, `waited(p)` its barrier.
struct PhaseClock {
    ThreadProfile* tp;
    double mark;
    PhaseClock(bool on, int tid) : tp(on && tid < PROFILE_THREADS ? &g_thread_profile[tid] : nullptr), mark(tp ? now_s() : 0.0) {}
    void computed(int phase) {
        if (tp) {
            const double t = now_s();
            tp->compute[phase] += t - mark;
            mark = t;
        }
    }
    void waited(int phase) {
        if (tp) {
            const double t = now_s();
            tp->wait[phase] += t - mark;
            mark = t;
        }
    }
};

// The forward's threads meet here between phases: a spinning sense-reversing barrier. Each thread
// counts itself in; the last one resets the count and bumps the generation the others spin on
// (with `pause`). libgomp's barrier costs ~12 µs at 14 threads (it may sleep on a futex); this one
// is a few cache-line transfers. After `spin` pauses a waiter yields its core each round, and with
// more threads than usable cores (CI, tests) it yields at once: the thread it waits for may be
// waiting for that core.
constexpr int SPIN_PAUSES = 4096;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
}

int usable_cpus() {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
    return int(std::max(1u, std::thread::hardware_concurrency()));
}

class SpinBarrier {
    alignas(64) std::atomic<int> arrived_{0};
    alignas(64) std::atomic<int> generation_{0};  // a line of its own: arrivals do not disturb the spinners
    const int spin_;

  public:
    explicit SpinBarrier(int spin) : spin_(spin) {}

    void wait(int nt) {  // nt: the team's size, the same in every thread
        if (nt == 1) return;
        const int generation = generation_.load(std::memory_order_relaxed);
        if (arrived_.fetch_add(1, std::memory_order_acq_rel) == nt - 1) {
            arrived_.store(0, std::memory_order_relaxed);
            generation_.store(generation + 1, std::memory_order_release);
            return;
        }
        for (int spins = 0; generation_.load(std::memory_order_acquire) == generation;) {
            if (spins < spin_) {
                cpu_relax();
                ++spins;
            } else {
                std::this_thread::yield();
            }
        }
    }
};

inline vf load_w(const float* p) {
    vf v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

// bf16 weights widen to float32 (bits << 16), int8 ones convert exactly; GCC scalarises the generic
// int8 -> float conversion and splits the 512-bit widening, so x86 takes intrinsics.
#if defined(__AVX512F__)
inline vf load_w(const uint16_t* p) {
    const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
    return vf(_mm512_castsi512_ps(bits));
}

inline vf load_w(const int8_t* p) {
    return vf(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
}
#elif defined(__AVX2__)
inline vf load_w(const uint16_t* p) {
    const __m256i bits = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
    return vf(_mm256_castsi256_ps(bits));
}

inline vf load_w(const int8_t* p) {
    return vf(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
}
#else
inline vf load_w(const uint16_t* p) {
    vu16 raw;
    std::memcpy(&raw, p, sizeof raw);
    vu32 bits = __builtin_convertvector(raw, vu32) << 16;
    vf v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
}

inline vf load_w(const int8_t* p) {
    vi8 raw;
    std::memcpy(&raw, p, sizeof raw);
    return __builtin_convertvector(__builtin_convertvector(raw, vi32), vf);
}
#endif

inline float bf16_to_float(uint16_t b) {
    uint32_t bits = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// float32 to bf16 rounded to nearest, ties to even, as torch's `.to(torch.bfloat16)` rounds, so the
// native and torch forwards store the same K/V bits; NaN stays a NaN (0x7fc0: rounding its bits could
// carry into the exponent).
inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    if (std::isnan(f)) return 0x7fc0;
    return uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// K/V elements: float32, or bf16 widened on load.
inline float kv_value(float x) { return x; }
inline float kv_value(uint16_t x) { return bf16_to_float(x); }
inline void kv_store(float* p, float x) { *p = x; }
inline void kv_store(uint16_t* p, float x) { *p = float_to_bf16(x); }

// exp(x) for x in about [-87, 88] (clamped), within a few ulp, for a float or a vector of VW (the
// same operations lane by lane, so both give the same bits). Written for vectors, and inlined by force:
// left to `omp simd`, GCC called the scalar function once per element.
inline float clamp(float x, float lo, float hi) { return std::min(std::max(x, lo), hi); }
inline vf clamp(vf x, float lo, float hi) {
    x = x < lo ? vf{} + lo : x;
    return x > hi ? vf{} + hi : x;
}
inline int32_t to_int(float x) { return int32_t(x); }
inline vi32 to_int(vf x) { return __builtin_convertvector(x, vi32); }
inline float from_bits(int32_t b) {
    float f;
    std::memcpy(&f, &b, sizeof f);
    return f;
}
inline vf from_bits(vi32 b) { return vf(b); }

template <typename F>
__attribute__((always_inline)) inline F exp_approx(F x) {
    x = clamp(x, -87.0f, 88.0f);
    const F n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln 2)
    F r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    F p = F{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * from_bits((to_int(n) + 127) << 23);
}

// Sums in an order fixed by n alone (never by the data's alignment, as vectorised reductions can be),
// so a token's results do not depend on where its rows sit in this forward's buffers.
inline float lane_sum(vf v) {
    float lanes[VW];
    std::memcpy(lanes, &v, sizeof v);
    float s = 0.0f;
    for (int i = 0; i < VW; ++i) s += lanes[i];
    return s;
}

template <typename KT>
inline float dot(const float* a, const KT* b, int64_t n) {
    vf acc = {};
    int64_t i = 0;
    for (; i + VW <= n; i += VW) acc += load_w(a + i) * load_w(b + i);
    float s = lane_sum(acc);
    for (; i < n; ++i) s += a[i] * kv_value(b[i]);
    return s;
}

inline float max_of(const float* a, int64_t n) {
    vf most = vf{} + a[0];
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        const vf v = load_w(a + i);
        most = v > most ? v : most;
    }
    float m = most[0];
    for (int j = 1; j < VW; ++j) m = std::max(m, most[j]);
    for (; i < n; ++i) m = std::max(m, a[i]);
    return m;
}

inline float sum(const float* a, int64_t n) {
    vf acc = {};
    int64_t i = 0;
    for (; i + VW <= n; i += VW) acc += load_w(a + i);
    float s = lane_sum(acc);
    for (; i < n; ++i) s += a[i];
    return s;
}

// Weights stream from memory once per forward, and the hardware prefetchers alone, or prefetching a
// few KB ahead within each panel, left the kernels waiting on them. A thread's panels lie one after
// another in memory, so while a kernel streams its NPT panels it prefetches the NPT panels it streams
// next, `next`: at step k, the k-th NPT * VW weights of them, one line per panel read, so they are all
// on their way a whole group of panels before their use (int8 gate_up at M = 8: 2.9 ms per forward with
// 4 KB ahead within each panel, 1.7 ms so; at M = 4, 3.1 -> 2.3 ms; one Zen 5 core). To L1, but for the
// int8 quad kernel, whose vpdpbusd (one a cycle on Zen 5, half the rate of vdpbf16ps or FMAs) take
// longer than its loads: to L2 there (to L1 measured 5-10% slower for it, 15-20% faster for bf16 and
// float32). Where no panels follow, `next` is the kernel's own first panel (cached already): a branch
// per step measured slower. Kernels of NP_MAX panels (M = 1) stream enough side by side for the hardware
// alone (prefetching measured 0-10% slower there).
template <int NPT, typename WT>
inline void prefetch_next(const WT* next, int64_t k, int p) {
    if constexpr (NPT < NP_MAX) __builtin_prefetch(next + (k * NPT + p) * VW, 0, std::is_same_v<WT, u8x4> ? 2 : 3);
}

// The float kernel: weights widened to float32 in registers (load_w), one FMA per weight and row.
template <typename WT, int NPT, int MT>
inline void tile_float(const WT* const* wp, const WT* next, const float* const* xr, int64_t K, float* out) {
    vf acc[NPT][MT];
    const float* x[MT];
    for (int m = 0; m < MT; ++m) {
        x[m] = xr[m];
        for (int p = 0; p < NPT; ++p) acc[p][m] = vf{};
    }
    const WT* w[NPT];
    for (int p = 0; p < NPT; ++p) w[p] = wp[p];
    for (int64_t k = 0; k < K; ++k) {
        vf wv[NPT];
        for (int p = 0; p < NPT; ++p) {
            wv[p] = load_w(w[p] + k * VW);
            prefetch_next<NPT>(next, k, p);
        }
        for (int m = 0; m < MT; ++m) {
            const float xv = x[m][k];
            for (int p = 0; p < NPT; ++p) acc[p][m] += wv[p] * xv;
        }
    }
    for (int p = 0; p < NPT; ++p)
        for (int m = 0; m < MT; ++m) std::memcpy(out + (p * MT + m) * VW, &acc[p][m], sizeof(vf));
}

// acc[p][m] = sum_k w_p[k] * x_m[k] for NPT panels and MT rows, prefetching `next`; out is [NPT][MT][VW].
// bf16x2 weights take rows of bf16 pairs (uint32) and K counts pairs; u8x4 weights take rows quantised
// by `quantize_rows` and K counts quads.
template <typename WT, int NPT, int MT>
inline void tile(const WT* const* wp, const WT* next, const void* const* xr, int64_t K, float* out) {
#if DRAFT_INT8_QUADS
    if constexpr (std::is_same_v<WT, u8x4>) {
        const uint32_t* xq[MT];
        const float* xs[MT];
        const int32_t* xc[MT];
        for (int m = 0; m < MT; ++m) {
            xq[m] = static_cast<const uint32_t*>(xr[m]);
            xs[m] = reinterpret_cast<const float*>(xq[m] + K);
            xc[m] = reinterpret_cast<const int32_t*>(xs[m] + (K + QB4 - 1) / QB4);
            for (int p = 0; p < NPT; ++p) _mm512_storeu_ps(out + (p * MT + m) * VW, _mm512_setzero_ps());
        }
        const u8x4* w[NPT];
        for (int p = 0; p < NPT; ++p) w[p] = wp[p];
        for (int64_t b = 0, k0 = 0; k0 < K; ++b, k0 += QB4) {
            __m512i acc[NPT][MT];
            for (int m = 0; m < MT; ++m) {
                const __m512i start = _mm512_set1_epi32(xc[m][b]);
                for (int p = 0; p < NPT; ++p) acc[p][m] = start;
            }
            const auto quad = [&](int64_t k) __attribute__((always_inline)) {
                __m512i wv[NPT];
                for (int p = 0; p < NPT; ++p) {
                    wv[p] = _mm512_loadu_si512(w[p] + k * VW);
                    prefetch_next<NPT>(next, k, p);
                }
                for (int m = 0; m < MT; ++m) {
                    const __m512i xv = _mm512_set1_epi32(int(xq[m][k]));
                    for (int p = 0; p < NPT; ++p) acc[p][m] = _mm512_dpbusd_epi32(acc[p][m], wv[p], xv);
                }
            };
            // A whole block unrolled: as a loop, GCC copied every accumulator to another register (or the
            // stack) and back each quad, doubling the instructions around the vpdpbusd.
            if (K - k0 >= QB4) {
#pragma GCC unroll 16
                for (int i = 0; i < QB4; ++i) quad(k0 + i);
            } else {
                for (int64_t k = k0; k < K; ++k) quad(k);
            }
            for (int m = 0; m < MT; ++m) {
                const __m512 scale = _mm512_set1_ps(xs[m][b]);
                for (int p = 0; p < NPT; ++p) {
                    float* o = out + (p * MT + m) * VW;
                    _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[p][m]), scale, _mm512_loadu_ps(o)));
                }
            }
        }
        return;
    }
#endif
#if DRAFT_BF16_PAIRS
    if constexpr (std::is_same_v<WT, bf16x2>) {
        __m512 acc[NPT][MT];
        const uint32_t* x[MT];
        for (int m = 0; m < MT; ++m) {
            x[m] = static_cast<const uint32_t*>(xr[m]);
            for (int p = 0; p < NPT; ++p) acc[p][m] = _mm512_setzero_ps();
        }
        const bf16x2* w[NPT];
        for (int p = 0; p < NPT; ++p) w[p] = wp[p];
        for (int64_t k = 0; k < K; ++k) {
            __m512bh wv[NPT];
            for (int p = 0; p < NPT; ++p) {
                wv[p] = (__m512bh)_mm512_loadu_si512(w[p] + k * VW);
                prefetch_next<NPT>(next, k, p);
            }
            for (int m = 0; m < MT; ++m) {
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(int(x[m][k]));
                for (int p = 0; p < NPT; ++p) acc[p][m] = _mm512_dpbf16_ps(acc[p][m], wv[p], xv);
            }
        }
        for (int p = 0; p < NPT; ++p)
            for (int m = 0; m < MT; ++m) _mm512_storeu_ps(out + (p * MT + m) * VW, acc[p][m]);
        return;
    }
#endif
    if constexpr (!std::is_same_v<WT, bf16x2> && !std::is_same_v<WT, u8x4>)
        tile_float<WT, NPT, MT>(wp, next, reinterpret_cast<const float* const*>(xr), K, out);
}

// Register blocks that fit: NPT panels x MT rows of accumulators plus NPT weight vectors.
template <int NPT, int MT>
constexpr bool fits() {
    return NPT <= 2 || NPT * MT <= (VW == 16 ? 16 : 8);
}

template <typename WT, int NPT, int MT = 1>
inline void tile_rows(int mt, const WT* const* wp, const WT* next, const void* const* xr, int64_t K, float* out) {
    if constexpr (MT < MT_MAX) {
        if (mt != MT) return tile_rows<WT, NPT, MT + 1>(mt, wp, next, xr, K, out);
    }
    if constexpr (fits<NPT, MT>()) tile<WT, NPT, MT>(wp, next, xr, K, out);
}

template <typename WT>
inline void tile_any(int np, int mt, const WT* const* wp, const WT* next, const void* const* xr, int64_t K, float* out) {
    switch (np) {
        case 8: return tile_rows<WT, 8>(mt, wp, next, xr, K, out);
        case 4: return tile_rows<WT, 4>(mt, wp, next, xr, K, out);
        case 2: return tile_rows<WT, 2>(mt, wp, next, xr, K, out);
        default: return tile_rows<WT, 1>(mt, wp, next, xr, K, out);
    }
}

// Panels streamed side by side for M rows: enough independent accumulators (>= 8) to hide the FMA
// latency when M is small, and few enough to stay in registers. A power of two, so gate_up's
// (gate, up) pairs stay whole.
inline int panels_at_once(int64_t M) {
    if (VW == 16) return M >= 5 ? 2 : M >= 2 ? 4 : 8;
    return M >= 3 ? 2 : 4;
}

#if DRAFT_BF16_PAIRS
// Rows x[m] * (row_scale ? row_scale[m] : 1) rounded to bf16 (nearest even), K padded with a zero to
// whole pairs: rows[m] points at row m's K / 2 pairs. Each thread rounds its own copy.
inline void round_rows_bf16(const float* const* xr, const float* row_scale, int64_t M, int64_t K, const void** rows) {
    thread_local std::unique_ptr<uint16_t[]> buffer;
    thread_local int64_t size = 0;
    const int64_t K2 = (K + 1) / 2, need = M * K2 * 2;
    if (need > size) {
        buffer.reset(new uint16_t[need]);
        size = need;
    }
    for (int64_t m = 0; m < M; ++m) {
        uint16_t* b = buffer.get() + m * K2 * 2;
        const __m512 scale = _mm512_set1_ps(row_scale ? row_scale[m] : 1.0f);
        for (int64_t k = 0; k < K2 * 2; k += VW) {
            const int64_t left = K - k;
            const __mmask16 in = left >= VW ? __mmask16(0xffff) : __mmask16(left > 0 ? (1u << left) - 1 : 0);
            const int64_t stored = std::min<int64_t>(VW, K2 * 2 - k);
            const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(in, xr[m] + k), scale);
            _mm256_mask_storeu_epi16(b + k, __mmask16((1u << stored) - 1), (__m256i)_mm512_cvtneps_pbh(x));
        }
        rows[m] = b;
    }
}
#endif

#if DRAFT_INT8_QUADS
// Bytes of a row quantised by `quantize_rows`: K4 quads of int8, then a float scale and an int32
// start per block of QB4 quads, rounded up to a cache line.
inline int64_t quantized_row_bytes(int64_t K) {
    const int64_t K4 = (K + 3) / 4, blocks = (K4 + QB4 - 1) / QB4;
    return (K4 * 4 + blocks * 8 + 63) / 64 * 64;
}

// Rows x[m] quantised to int8 in blocks of QB k (the last block and quad padded with zeros): per
// block, amax = max |x|, q = round(x * (127 / amax)) (nearest even), scale amax / 127 (q = 0, scale
// 0 where amax is 0), start -128 * sum q. rows[m] points at row m's record. Each thread quantises its
// own copy.
inline void quantize_rows(const float* const* xr, int64_t M, int64_t K, const void** rows) {
    thread_local std::unique_ptr<uint8_t[]> buffer;
    thread_local int64_t size = 0;
    const int64_t K4 = (K + 3) / 4, blocks = (K4 + QB4 - 1) / QB4, bytes = quantized_row_bytes(K);
    if (M * bytes > size) {
        buffer.reset(new uint8_t[M * bytes]);
        size = M * bytes;
    }
    for (int64_t m = 0; m < M; ++m) {
        int8_t* q = reinterpret_cast<int8_t*>(buffer.get() + m * bytes);
        float* scales = reinterpret_cast<float*>(q + K4 * 4);
        int32_t* starts = reinterpret_cast<int32_t*>(scales + blocks);
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t k0 = b * QB, left = K - k0;
            __m512 x[QB / VW];
            __m512 amax = _mm512_setzero_ps();
            for (int i = 0; i < QB / VW; ++i) {
                const int64_t n = left - i * VW;
                const __mmask16 in = n >= VW ? __mmask16(0xffff) : __mmask16(n > 0 ? (1u << n) - 1 : 0);
                x[i] = _mm512_maskz_loadu_ps(in, xr[m] + k0 + i * VW);
                amax = _mm512_max_ps(amax, _mm512_abs_ps(x[i]));
            }
            const float most = _mm512_reduce_max_ps(amax);
            const __m512 inv = _mm512_set1_ps(most > 0.0f ? 127.0f / most : 0.0f);
            scales[b] = most / 127.0f;
            __m512i total = _mm512_setzero_si512();
            for (int i = 0; i < QB / VW; ++i) {
                const int64_t stored = std::min<int64_t>(VW, K4 * 4 - k0 - i * VW);
                if (stored <= 0) break;
                const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(x[i], inv));
                total = _mm512_add_epi32(total, qi);
                _mm_mask_storeu_epi8(q + k0 + i * VW, __mmask16((1u << stored) - 1), _mm512_cvtsepi32_epi8(qi));
            }
            starts[b] = -128 * _mm512_reduce_add_epi32(total);
        }
        rows[m] = q;
    }
}
#endif

#if DRAFT_AMX
// This thread's tile configuration while a matmul uses AMX (the configuration is per thread, and
// torch's oneDNN kernels on the same OpenMP threads load their own between our calls): loaded when
// the rows or K's partial block change, released when the matmul returns.
class AmxTiles {
    struct alignas(64) Config {
        uint8_t palette = 1, start_row = 0, reserved[14] = {};
        uint16_t colsb[16] = {};  // bytes per row of each tile
        uint8_t rows[16] = {};
    };
    int rows_ = 0, tail_ = -1;

  public:
    // Tiles for `rows` rows over K quads (pairs): tail = K % AMX_DEPTH quads (pairs) in the last block.
    void configure(int rows, int tail) {
        if (rows == rows_ && tail == tail_) return;
        Config c;
        for (int t = 0; t < AMX_PANELS; ++t) {
            c.rows[t] = uint8_t(rows);
            c.colsb[t] = VW * 4;
        }
        c.rows[4] = uint8_t(rows);
        c.colsb[4] = AMX_DEPTH * 4;
        c.rows[5] = AMX_DEPTH;
        c.colsb[5] = VW * 4;
        if (tail) {
            c.rows[6] = uint8_t(rows);
            c.colsb[6] = uint16_t(tail * 4);
            c.rows[7] = uint8_t(tail);
            c.colsb[7] = VW * 4;
        }
        // GCC 12's _tile_loadconfig names only the first 8 of the 64 bytes as read, so the compiler
        // could drop the stores to the rest: this asm reads the whole configuration.
        asm volatile("ldtilecfg %0" ::"m"(c));
        rows_ = rows;
        tail_ = tail;
    }
    ~AmxTiles() {
        if (rows_) _tile_release();
    }
};

// GCC's tile intrinsics paste the tile number into the instruction's text, so it must be a literal:
// C tile i (panel i of a block) is a case of its own.
#define DRAFT_AMX_C_TILE(i, STEP) \
    switch (i) {                  \
        case 0: STEP(0); break;   \
        case 1: STEP(1); break;   \
        case 2: STEP(2); break;   \
        default: STEP(3); break;  \
    }

inline void amx_zero(int i) {
#define DRAFT_STEP(C) _tile_zero(C)
    DRAFT_AMX_C_TILE(i, DRAFT_STEP)
#undef DRAFT_STEP
}

inline void amx_store(int i, void* out) {
#define DRAFT_STEP(C) _tile_stored(C, out, VW * 4)
    DRAFT_AMX_C_TILE(i, DRAFT_STEP)
#undef DRAFT_STEP
}

// The A tile (4, or 6 for K's partial block) from rows of row_bytes each.
inline void amx_load_a(const void* rows, int64_t row_bytes, bool tail) {
    if (tail)
        _tile_loadd(6, rows, row_bytes);
    else
        _tile_loadd(4, rows, row_bytes);
}

// The tile asm statements name the addresses they read, not the memory: make the input rows this
// thread has just quantised or rounded visible to them.
inline void amx_rows_written() { asm volatile("" ::: "memory"); }

#if DRAFT_AMX_INT8
// C tile i = the A tile's rows . panel weights w (B tile 5, or 7 for K's partial block), int32.
inline void amx_dot_int8(int i, const u8x4* w, bool tail) {
#define DRAFT_STEP(C)                 \
    if (tail) {                       \
        _tile_loadd(7, w, VW * 4);    \
        _tile_zero(C);                \
        _tile_dpbsud(C, 6, 7);        \
    } else {                          \
        _tile_loadd(5, w, VW * 4);    \
        _tile_zero(C);                \
        _tile_dpbsud(C, 4, 5);        \
    }
    DRAFT_AMX_C_TILE(i, DRAFT_STEP)
#undef DRAFT_STEP
}

// The u8x4 `tile` of np panels and mt rows (rows quantised by `quantize_rows`, K quads) with tile
// multiplies: per block of QB4 quads, a C tile per panel (tdpbsud: signed inputs x unsigned weights)
// stored to `dots`, then the VNNI kernel's epilogue on the stored sums (start + sum, converted, times
// the block's scale, added into out). A block's epilogue runs after the next block's multiplies are
// issued, so the vector units work while the tile unit does; `dots` alternates between two buffers.
inline void amx_tile_int8(int np, int mt, const u8x4* const* wp, const void* const* xr, int64_t K, float* out) {
    const int64_t blocks = (K + QB4 - 1) / QB4, full = K / QB4, row_bytes = quantized_row_bytes(K * 4);
    const float* xs[AMX_ROWS];
    const int32_t* xc[AMX_ROWS];
    for (int m = 0; m < mt; ++m) {
        xs[m] = reinterpret_cast<const float*>(static_cast<const int8_t*>(xr[m]) + K * 4);
        xc[m] = reinterpret_cast<const int32_t*>(xs[m] + blocks);
    }
    for (int i = 0; i < np * mt; ++i) _mm512_storeu_ps(out + i * VW, _mm512_setzero_ps());
    alignas(64) int32_t dots[2][AMX_PANELS][AMX_ROWS][VW];
    auto epilogue = [&](int64_t b) {
        for (int m = 0; m < mt; ++m) {
            const __m512i start = _mm512_set1_epi32(xc[m][b]);
            const __m512 scale = _mm512_set1_ps(xs[m][b]);
            for (int i = 0; i < np; ++i) {
                float* o = out + (i * mt + m) * VW;
                const __m512i acc = _mm512_add_epi32(_mm512_load_si512(dots[b & 1][i][m]), start);
                _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), scale, _mm512_loadu_ps(o)));
            }
        }
    };
    const int8_t* a = static_cast<const int8_t*>(xr[0]);
    amx_rows_written();
    for (int64_t b = 0; b < blocks; ++b) {
        const bool tail = b == full;
        amx_load_a(a + b * QB, row_bytes, tail);
        for (int i = 0; i < np; ++i) amx_dot_int8(i, wp[i] + b * QB4 * VW, tail);
        if (b > 0) epilogue(b - 1);
        for (int i = 0; i < np; ++i) amx_store(i, dots[b & 1][i]);
    }
    epilogue(blocks - 1);
}
#endif

#if DRAFT_AMX_BF16
// C tile i += the A tile's rows . panel weights w (B tile 5, or 7 for K's partial block), float32.
inline void amx_dot_bf16(int i, const bf16x2* w, bool tail) {
#define DRAFT_STEP(C)                 \
    if (tail) {                       \
        _tile_loadd(7, w, VW * 4);    \
        _tile_dpbf16ps(C, 6, 7);      \
    } else {                          \
        _tile_loadd(5, w, VW * 4);    \
        _tile_dpbf16ps(C, 4, 5);      \
    }
    DRAFT_AMX_C_TILE(i, DRAFT_STEP)
#undef DRAFT_STEP
}

// The bf16x2 `tile` of np panels and mt rows (rows rounded by `round_rows_bf16`, K pairs) with tile
// multiplies (tdpbf16ps) accumulating in the C tiles over all of K, stored to out at the end.
inline void amx_tile_bf16(int np, int mt, const bf16x2* const* wp, const void* const* xr, int64_t K, float* out) {
    const int64_t blocks = (K + AMX_DEPTH - 1) / AMX_DEPTH, full = K / AMX_DEPTH, row_bytes = K * 4;
    const uint32_t* a = static_cast<const uint32_t*>(xr[0]);
    amx_rows_written();
    for (int i = 0; i < np; ++i) amx_zero(i);
    for (int64_t b = 0; b < blocks; ++b) {
        const bool tail = b == full;
        amx_load_a(a + b * AMX_DEPTH, row_bytes, tail);
        for (int i = 0; i < np; ++i) amx_dot_bf16(i, wp[i] + b * AMX_DEPTH * VW, tail);
    }
    for (int i = 0; i < np; ++i) amx_store(i, out + i * mt * VW);
}
#endif

#undef DRAFT_AMX_C_TILE

// `tile` by tile multiplies for mt <= AMX_ROWS rows, consecutive in one buffer (as quantize_rows and
// round_rows_bf16 lay them out), and np <= AMX_PANELS panels.
template <typename WT>
inline void amx_tile(AmxTiles& tiles, int np, int mt, const WT* const* wp, const void* const* xr, int64_t K, float* out) {
    tiles.configure(mt, int(K % AMX_DEPTH));
#if DRAFT_AMX_INT8
    if constexpr (std::is_same_v<WT, u8x4>) amx_tile_int8(np, mt, wp, xr, K, out);
#endif
#if DRAFT_AMX_BF16
    if constexpr (std::is_same_v<WT, bf16x2>) amx_tile_bf16(np, mt, wp, xr, K, out);
#endif
}
#endif

// This thread's share of y = x @ W^T, each row m scaled by row_scale[m] (if given: the rms of a norm
// folded into W): panels in units of `group` (2 keeps gate_up's gate and up panels together);
// epi(m0, mt, panel, np, out) gets each block of results, out [np][mt][VW], scales applied.
// Each output is summed over k in order, whatever the block shape, so no result depends on M.
// Float and int8 quad kernels apply the row scale to the sums; the bf16 pair kernel to the rows before
// rounding them (int8 blocks scale with their rows: quantising x or r * x gives the same q).
template <typename WT, typename Epi>
void matmul_t(const Matrix& W, const float* const* xr, const float* row_scale, int64_t M, int tid, int nt, int group,
              float* out, Epi& epi) {
    constexpr bool pairs = std::is_same_v<WT, bf16x2>, quads = std::is_same_v<WT, u8x4>, converted = pairs || quads;
    const int64_t units = W.panels / group;
    const int64_t p0 = units * tid / nt * group, p1 = units * (tid + 1) / nt * group;
    if (p0 == p1) return;
    const WT* base = static_cast<const WT*>(W.weight);
    const int64_t K = pairs ? (W.k + 1) / 2 : quads ? (W.k + 3) / 4 : W.k, stride = K * VW;
    const void* const* rows = reinterpret_cast<const void* const*>(xr);
    const float* post_scale = row_scale;
    [[maybe_unused]] const void* converted_rows[MT_MAX * 8];  // M <= 64 rows a call: more go round the loop below
    if constexpr (pairs) post_scale = nullptr;
    const int most = panels_at_once(M);
#if DRAFT_AMX
    AmxTiles tiles;
#endif
    for (int64_t r0 = 0; r0 < M; r0 += converted ? MT_MAX * 8 : M) {  // float kernels take every row at once
        const int64_t R = converted ? std::min<int64_t>(MT_MAX * 8, M - r0) : M;
        const bool amx = amx_kernel<WT>() && g_amx && R >= AMX_MIN_ROWS;
        const int rows_at_once = amx ? AMX_ROWS : MT_MAX;
#if DRAFT_BF16_PAIRS
        if constexpr (pairs) {
            round_rows_bf16(xr + r0, row_scale ? row_scale + r0 : nullptr, R, W.k, converted_rows);
            rows = converted_rows;
        }
#endif
#if DRAFT_INT8_QUADS
        if constexpr (quads) {
            quantize_rows(xr + r0, R, W.k, converted_rows);
            rows = converted_rows;
        }
#endif
        for (int64_t p = p0; p < p1;) {
            int np = amx ? AMX_PANELS : most;
            while (np > p1 - p) np /= 2;
            const WT* wp[NP_MAX];
            for (int i = 0; i < np; ++i) wp[i] = base + (p + i) * stride;
            for (int64_t m0 = 0; m0 < R; m0 += rows_at_once) {
                const int mt = int(std::min<int64_t>(rows_at_once, R - m0));
#if DRAFT_AMX
                if (amx)
                    amx_tile<WT>(tiles, np, mt, wp, rows + m0, K, out);
                else
#endif
                    tile_any<WT>(np, mt, wp, m0 + mt == R && p + np < p1 ? wp[np - 1] + stride : wp[0], rows + m0, K, out);
                if (W.scale || post_scale) {
                    for (int pi = 0; pi < np; ++pi) {
                        const float* s = W.scale ? W.scale + (p + pi) * VW : nullptr;
                        for (int mi = 0; mi < mt; ++mi) {
                            float* o = out + (pi * mt + mi) * VW;
                            const float r = post_scale ? post_scale[r0 + m0 + mi] : 1.0f;
                            if (s) {
#pragma omp simd
                                for (int j = 0; j < VW; ++j) o[j] = o[j] * s[j] * r;
                            } else {
#pragma omp simd
                                for (int j = 0; j < VW; ++j) o[j] *= r;
                            }
                        }
                    }
                }
                epi(r0 + m0, mt, p, np, out);
            }
            p += np;
        }
    }
}

template <typename Epi>
void matmul(const Matrix& W, const float* const* xr, const float* row_scale, int64_t M, int tid, int nt, int group, float* out,
            Epi epi) {
    switch (W.format) {
#if DRAFT_BF16_PAIRS
        case BF16: return matmul_t<bf16x2>(W, xr, row_scale, M, tid, nt, group, out, epi);
#else
        case BF16: return matmul_t<uint16_t>(W, xr, row_scale, M, tid, nt, group, out, epi);
#endif
#if DRAFT_INT8_QUADS
        case I8: return matmul_t<u8x4>(W, xr, row_scale, M, tid, nt, group, out, epi);
#else
        case I8: return matmul_t<int8_t>(W, xr, row_scale, M, tid, nt, group, out, epi);
#endif
        default: return matmul_t<float>(W, xr, row_scale, M, tid, nt, group, out, epi);
    }
}

// Sum of squares of one panel's columns of a residual row, in column order.
inline float panel_ssq(const float* r, int64_t width) {
    float s = 0.0f;
    for (int64_t j = 0; j < width; ++j) s += r[j] * r[j];
    return s;
}

// 1 / rms of each row from its per-panel sums of squares [T][panels], summed in panel order: the
// result depends neither on the thread count nor on the batch.
inline void inverse_rms(const float* partial, int64_t panels, int64_t hidden, float eps, const int64_t* rows, int64_t count, float* inv) {
    for (int64_t i = 0; i < count; ++i) {
        const int64_t t = rows ? rows[i] : i;
        float sum = 0.0f;
        for (int64_t j = 0; j < panels; ++j) sum += partial[t * panels + j];
        inv[i] = 1.0f / std::sqrt(sum / float(hidden) + eps);
    }
}

// a[0] becomes the vector whose lane i sums the lanes of the input a[BITREV[i]]: a transpose-and-add
// tree (VW - 1 shuffle pairs for VW sums) instead of one horizontal reduction per vector.
#if DRAFT_VW == 16
constexpr int BITREV[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
const vi32 LO[4] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                    {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
                    {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
                    {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}};
const vi32 HI[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
                    {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
                    {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
                    {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}};
constexpr int LEVELS = 4;
#else
constexpr int BITREV[8] = {0, 4, 2, 6, 1, 5, 3, 7};
const vi32 LO[3] = {{0, 1, 2, 3, 8, 9, 10, 11}, {0, 1, 8, 9, 4, 5, 12, 13}, {0, 8, 2, 10, 4, 12, 6, 14}};
const vi32 HI[3] = {{4, 5, 6, 7, 12, 13, 14, 15}, {2, 3, 10, 11, 6, 7, 14, 15}, {1, 9, 3, 11, 5, 13, 7, 15}};
constexpr int LEVELS = 3;
#endif

template <int LEVEL = 0>
inline void reduce_step(vf* a) {
    if constexpr (LEVEL < LEVELS) {
        constexpr int n = VW >> LEVEL;
        for (int i = 0; i < n / 2; ++i)
            a[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], LO[LEVEL]) + __builtin_shuffle(a[2 * i], a[2 * i + 1], HI[LEVEL]);
        reduce_step<LEVEL + 1>(a);
    }
}

// Attention is computed in chunks of ATTN_CHUNK positions: each chunk of a (token, KV head) yields a
// partial, [group][D] sums of exp(score - chunk max) * value, then [group] chunk maxima, then [group]
// sums of exp(score - chunk max); `merge_chunks` combines a (token, KV head)'s partials in chunk order.
// The chunk size is fixed, so whether chunks run on one thread or many, a token's attention is the same.
constexpr int64_t ATTN_CHUNK = 64;
// Floats of chunk partials a forward may keep to hand chunks out one by one (decode batches, short
// prefills); past it each (token, KV head) is one item whose chunks one thread computes in turn.
// (-DDRAFT_SPLIT_BUDGET=0 builds the library that never splits, for tests.)
#ifndef DRAFT_SPLIT_BUDGET
#define DRAFT_SPLIT_BUDGET (int64_t(1) << 20)
#endif
constexpr int64_t SPLIT_BUDGET = DRAFT_SPLIT_BUDGET;

// The keys and values of the chunk a thread attends next, prefetched to L2 a few lines at a time
// between the computations of the chunk it attends now. A chunk's storage follows no other in memory,
// so the hardware prefetchers would meet each cold; and its 512 prefetches (16 KB of keys and as many
// of values at D = 64 in float32) issued at once stalled the thread until most had arrived, so its
// memory and compute times added up (batch 8 attention 6.1 ms per forward at once, 4.9 ms spread, one Zen 5 core).
template <typename KT>
class ChunkPrefetch {
    const char* keys_ = nullptr;
    const char* values_ = nullptr;
    int64_t bytes_ = 0, at_ = 0;

  public:
    ChunkPrefetch() = default;
    ChunkPrefetch(const KT* keys, const KT* values, int64_t elements)
        : keys_(reinterpret_cast<const char*>(keys)), values_(reinterpret_cast<const char*>(values)), bytes_(elements * int64_t(sizeof(KT))) {}
    void lines(int64_t count) {  // the next `count` cache lines of the keys and of the values
        for (; count > 0 && at_ < bytes_; --count, at_ += 64) {
            __builtin_prefetch(keys_ + at_, 0, 2);
            __builtin_prefetch(values_ + at_, 0, 2);
        }
    }
};

// The partial of `group` query heads q (sharing one KV head) over n <= ATTN_CHUNK keys and values
// (KT: float32, or bf16 widened in registers), prefetching `ahead` as it goes. scores: [group][ATTN_CHUNK] scratch.
template <int DC, typename KT>
void attend_chunk(const float* q, const KT* keys, const KT* values, int64_t n, int group, int64_t d_runtime, float* scores,
                  float* partial, ChunkPrefetch<KT>& ahead) {
    const int64_t D = DC ? DC : d_runtime;
    float* acc = partial;
    float* maxima = partial + group * D;
    float* sums = maxima + group;
    int64_t start = 0;
    if constexpr (DC > 0 && DC % VW == 0) {  // blocks of VW keys: VW dot products summed by one tree
        constexpr int C = DC / VW;
        for (int h = 0; h < group; ++h) {
            vf qv[C];
            std::memcpy(qv, q + h * DC, sizeof qv);
            for (int64_t j0 = 0; j0 + VW <= n; j0 += VW) {
                vf parts[VW];
                for (int i = 0; i < VW; ++i) {
                    const KT* k = keys + (j0 + BITREV[i]) * DC;
                    vf a = qv[0] * load_w(k);
                    for (int c = 1; c < C; ++c) a += qv[c] * load_w(k + c * VW);
                    parts[i] = a;
                }
                ahead.lines(8);
                reduce_step(parts);
                std::memcpy(scores + h * ATTN_CHUNK + j0, &parts[0], sizeof(vf));
            }
        }
        start = n / VW * VW;
    }
    for (int64_t j = start; j < n; ++j) {
        const KT* k = keys + j * D;
        for (int h = 0; h < group; ++h) scores[h * ATTN_CHUNK + j] = dot(q + h * D, k, D);
    }
    for (int h = 0; h < group; ++h) {
        float* sc = scores + h * ATTN_CHUNK;
        float mx = max_of(sc, n);
        int64_t j = 0;
        for (; j + VW <= n; j += VW) {
            const vf e = exp_approx(load_w(sc + j) - mx);
            std::memcpy(sc + j, &e, sizeof e);
        }
        for (; j < n; ++j) sc[j] = exp_approx(sc[j] - mx);
        maxima[h] = mx;
        sums[h] = sum(sc, n);
    }
    if constexpr (DC > 0 && DC % VW == 0) {  // each head's sums in registers over the chunk's values
        constexpr int C = DC / VW;
        for (int h = 0; h < group; ++h) {
            const float* sc = scores + h * ATTN_CHUNK;
            vf a[C] = {};
            for (int64_t j = 0; j < n; ++j) {
                for (int c = 0; c < C; ++c) a[c] += sc[j] * load_w(values + j * DC + c * VW);
                ahead.lines(1);
            }
            std::memcpy(acc + h * DC, a, sizeof a);
        }
    } else {
        std::memset(acc, 0, sizeof(float) * group * D);
        for (int64_t j = 0; j < n; ++j) {
            const KT* v = values + j * D;
            for (int h = 0; h < group; ++h) {
                const float p = scores[h * ATTN_CHUNK + j];
                float* a = acc + h * D;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) a[d] += p * kv_value(v[d]);
            }
        }
    }
    ahead.lines(INT32_MAX);  // what the loops above left
}

// out [group][D]: the softmax-weighted values from a (token, KV head)'s chunk partials, in chunk order.
inline void merge_chunks(const float* partials, int64_t chunks, int group, int64_t D, float* out) {
    const int64_t size = group * (D + 2);
    for (int h = 0; h < group; ++h) {
        float mx = partials[group * D + h];
        for (int64_t c = 1; c < chunks; ++c) mx = std::max(mx, partials[c * size + group * D + h]);
        float* o = out + h * D;
        std::memset(o, 0, sizeof(float) * D);
        float total = 0.0f;
        for (int64_t c = 0; c < chunks; ++c) {
            const float* part = partials + c * size;
            const float w = exp_approx(part[group * D + h] - mx);
            total += w * part[group * D + group + h];
            const float* a = part + h * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
        }
        const float inv = 1.0f / total;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
}

template <typename KT>
inline void attend_chunk_any(const float* q, const KT* keys, const KT* values, int64_t n, int group, int64_t D, float* scores,
                             float* partial, ChunkPrefetch<KT>& ahead) {
    if (D == 64)
        attend_chunk<64>(q, keys, values, n, group, D, scores, partial, ahead);
    else if (D == 128)
        attend_chunk<128>(q, keys, values, n, group, D, scores, partial, ahead);
    else
        attend_chunk<0>(q, keys, values, n, group, D, scores, partial, ahead);
}

struct AttnItem {  // attention work: chunk c (all chunks, where not split) of KV head g for tokens t0 .. t1 - 1
    int64_t t0, t1, g, c;
};

template <typename T>
std::unique_ptr<T[]> buffer(int64_t n) {
    return std::unique_ptr<T[]>(new T[std::max<int64_t>(n, 1)]);
}

// Each logits row's k largest columns and their softmax probabilities, read in the forward's own
// parallel region (a second region of another team size would make libgomp end and re-create
// pool threads at every switch: pytorch/pytorch#32008). A row is cut into chunks of TOP_CHUNK
// columns, spread over the threads; each chunk leaves its maximum, its sum of exp(x - maximum)
// and its k largest, merged per row in chunk order.
constexpr int64_t TOP_CHUNK = 2048;
constexpr int64_t TOP_K_MAX = 16;

struct TopPartial {
    float max, sum;
    float vals[TOP_K_MAX];
    int64_t cols[TOP_K_MAX];
    int64_t count;
};

// Insert (v, c) into a descending list of at most k (equal values: the lower column first).
inline void top_insert(float* vals, int64_t* cols, int64_t& count, int64_t k, float v, int64_t c) {
    if (count == k && !(v > vals[k - 1] || (v == vals[k - 1] && c < cols[k - 1]))) return;
    int64_t at = count < k ? count : k - 1;
    while (at > 0 && (v > vals[at - 1] || (v == vals[at - 1] && c < cols[at - 1]))) {
        vals[at] = vals[at - 1];
        cols[at] = cols[at - 1];
        --at;
    }
    vals[at] = v;
    cols[at] = c;
    if (count < k) ++count;
}

// Whether any lane of a comparison's result (all ones or zeros per lane) is set.
inline bool any_lane(vi32 c) {
    uint64_t words[sizeof(vi32) / 8];
    std::memcpy(words, &c, sizeof words);
    uint64_t any = 0;
    for (uint64_t w : words) any |= w;
    return any != 0;
}

// Columns [begin, end) of row x: their maximum, sum of exp(x - maximum) and k largest. The k-th
// largest of the lanes' maxima bounds the chunk's k-th largest from below, so the second pass
// looks at a vector's lanes only where one reaches that bound (raised as the list fills).
void top_chunk(const float* x, int64_t begin, int64_t end, int64_t k, TopPartial& out) {
    vf vmax = vf{} - INFINITY;
    int64_t i = begin;
    for (; i + VW <= end; i += VW) {
        const vf v = load_w(x + i);
        vmax = v > vmax ? v : vmax;
    }
    float lanes[VW];
    std::memcpy(lanes, &vmax, sizeof lanes);
    std::sort(lanes, lanes + VW, [](float a, float b) { return a > b; });
    float m = lanes[0];
    for (int64_t j = i; j < end; ++j) m = std::max(m, x[j]);
    float threshold = i > begin && k <= VW ? lanes[k - 1] : -INFINITY;
    vf vsum{};
    out.count = 0;
    for (i = begin; i + VW <= end; i += VW) {
        const vf v = load_w(x + i);
        vsum += exp_approx(v - m);
        if (!any_lane(v >= threshold)) continue;
        float vals[VW];
        std::memcpy(vals, &v, sizeof vals);
        for (int l = 0; l < VW; ++l)
            if (vals[l] >= threshold) {
                top_insert(out.vals, out.cols, out.count, k, vals[l], i + l);
                if (out.count == k) threshold = std::max(threshold, out.vals[k - 1]);
            }
    }
    float sum = lane_sum(vsum);
    for (int64_t j = i; j < end; ++j) {
        sum += exp_approx(vf{} + (x[j] - m))[0];
        if (x[j] >= threshold) {
            top_insert(out.vals, out.cols, out.count, k, x[j], j);
            if (out.count == k) threshold = std::max(threshold, out.vals[k - 1]);
        }
    }
    out.max = m;
    out.sum = sum;
}

// One row's k best columns and their probabilities, from its chunks' partials.
void top_merge(const TopPartial* part, int64_t chunks, int64_t k, float* probs, int64_t* columns) {
    float m = -INFINITY;
    for (int64_t c = 0; c < chunks; ++c) m = std::max(m, part[c].max);
    float sum = 0.0f, vals[TOP_K_MAX];
    int64_t top[TOP_K_MAX], count = 0;
    for (int64_t c = 0; c < chunks; ++c) {
        sum += part[c].sum * exp_approx(vf{} + (part[c].max - m))[0];
        for (int64_t j = 0; j < part[c].count; ++j) top_insert(vals, top, count, k, part[c].vals[j], part[c].cols[j]);
    }
    for (int64_t j = 0; j < k; ++j) {
        probs[j] = exp_approx(vf{} + (vals[j] - m))[0] / sum;
        columns[j] = top[j];
    }
}

}  // namespace

extern "C" {

int64_t draft_vector_width() { return VW; }

// 1 where bf16 weights are packed in pairs of k ([panels][k / 2][VW][2]) for the AVX512_BF16 kernel.
int64_t draft_bf16_pairs() { return DRAFT_BF16_PAIRS; }

// 1 where int8 weights are stored + 128 in quads of k ([panels][k / 4][VW][4]) for the AVX512_VNNI kernel.
int64_t draft_int8_quads() { return DRAFT_INT8_QUADS; }

// 1 while matmuls of AMX_MIN_ROWS rows or more use AMX tiles (the int8 ones where built with AMX-INT8,
// the bf16 ones where built with AMX-BF16): built for it, the CPU has it, Linux granted it, and not
// turned off. draft_set_amx turns it on (where that is possible) or off; returns draft_amx().
// draft_amx_kernels: which AMX kernels the build has, 1 int8 + 2 bf16.
int64_t draft_amx() { return g_amx; }
int64_t draft_amx_kernels() { return DRAFT_AMX_INT8 | DRAFT_AMX_BF16 << 1; }

int64_t draft_set_amx(int64_t on) {
    g_amx = on != 0 && g_amx_permitted;
    return g_amx;
}

// Runs the whole forward. Token t (0..T-1) embeds ids[t], rotates at rot_pos[t], writes its K/V at
// storage index kv_pos[t] of slot slots[t] and attends to indices 0..kv_pos[t] of that slot.
// K/V of layer l: k_cache[l], v_cache[l], each [num_slots][kv_heads][capacity][head_dim] in kv_format
// (F32, or BF16: stored rounded to nearest even, widened to float32 when read).
// logits [n_out][head.n] (float32: the head's rows, the whole vocabulary or a subset of it) are those of rows out_rows. Returns 0, or a code naming a bad input:
// With top_k > 0 it also reads each logits row's top_k largest columns and their softmax
// probabilities into top_probs and top_cols [n_out][top_k], largest first (equal logits: the lower
// column first), as the drafter's level reads them.
// 1 token id, 2 position, 3 slot, 4 output row, 5 vector width, 6 K/V format, 7 top_k.
int draft_forward(const Model* model, int64_t T, const int64_t* ids, const int64_t* rot_pos, const int64_t* slots,
                  const int64_t* kv_pos, int64_t n_out, const int64_t* out_rows, void* const* k_cache,
                  void* const* v_cache, int64_t kv_format, int64_t num_slots, int64_t capacity, int64_t num_threads, float* logits,
                  int64_t top_k, float* top_probs, int64_t* top_cols) {
    const Model& md = *model;
    if (md.vector_width != VW) return 5;
    if (kv_format != F32 && kv_format != BF16) return 6;
    const bool kv_bf16 = kv_format == BF16;
    const int64_t kv_bytes = kv_bf16 ? 2 : 4;
    const bool profile = g_profile;
    const double started = profile ? now_s() : 0.0;
    int64_t max_len = 1;
    for (int64_t t = 0; t < T; ++t) {
        if (ids[t] < 0 || ids[t] >= md.vocab) return 1;
        if (rot_pos[t] < 0 || rot_pos[t] >= md.max_positions || kv_pos[t] < 0 || kv_pos[t] >= capacity) return 2;
        if (slots[t] < 0 || slots[t] >= num_slots) return 3;
        max_len = std::max(max_len, kv_pos[t] + 1);
    }
    for (int64_t i = 0; i < n_out; ++i)
        if (out_rows[i] < 0 || out_rows[i] >= T) return 4;
    if (top_k < 0 || top_k > TOP_K_MAX || top_k > md.head.n) return 7;
    if (T == 0) return 0;

    const int64_t H = md.hidden, D = md.head_dim, half = D / 2, KVH = md.num_kv_heads, I = md.intermediate;
    const int group = int(md.num_heads / KVH);
    const int64_t q_size = md.num_heads * D, kv_size = KVH * D;
    const int max_threads = int(num_threads > 0 ? num_threads : omp_get_max_threads());

    auto residual = buffer<float>(T * H);
    auto q = buffer<float>(T * q_size);
    auto attn = buffer<float>(T * q_size);
    auto act = buffer<float>(T * I);
    const int64_t HP = (H + VW - 1) / VW;  // panels of a residual row
    auto partial = buffer<float>(T * HP);  // sums of squares of the residual, [T][HP]
    auto residual_rows = buffer<const float*>(T), attn_rows = buffer<const float*>(T), act_rows = buffer<const float*>(T);
    auto head_rows = buffer<const float*>(n_out);
    for (int64_t t = 0; t < T; ++t) {
        residual_rows[t] = residual.get() + t * H;
        attn_rows[t] = attn.get() + t * q_size;
        act_rows[t] = act.get() + t * I;
    }
    for (int64_t i = 0; i < n_out; ++i) head_rows[i] = residual.get() + out_rows[i] * H;
    auto counters = std::unique_ptr<std::atomic<int64_t>[]>(new std::atomic<int64_t>[md.num_layers]);
    for (int64_t l = 0; l < md.num_layers; ++l) counters[l].store(0, std::memory_order_relaxed);

    // Attention work: (token, KV head) tg = t * KVH + g has chunks first_chunk[tg] .. first_chunk[tg + 1] - 1.
    const int64_t pairs = T * KVH, partial_size = group * (D + 2);
    auto first_chunk = buffer<int64_t>(pairs + 1);
    first_chunk[0] = 0;
    for (int64_t tg = 0; tg < pairs; ++tg) first_chunk[tg + 1] = first_chunk[tg] + (kv_pos[tg / KVH] + ATTN_CHUNK) / ATTN_CHUNK;
    const int64_t total_chunks = first_chunk[pairs];
    const bool split = total_chunks * partial_size <= SPLIT_BUDGET;
    // Split, an item is chunk c of KV head g for a run of consecutive tokens of one slot (a sequence's
    // tokens in a catch-up forward), which read the same keys and values: one thread attends them in
    // turn, the chunk's K/V in its caches. Not split, an item is a (token, KV head) with all its chunks.
    auto work = buffer<AttnItem>(split ? total_chunks : pairs);  // a split item holds at least one chunk
    int64_t items = 0;
    for (int64_t t0 = 0, t1; t0 < T; t0 = t1) {
        int64_t most = kv_pos[t0];
        for (t1 = t0 + 1; split && t1 < T && slots[t1] == slots[t0]; ++t1) most = std::max(most, kv_pos[t1]);
        for (int64_t g = 0; g < KVH; ++g)
            for (int64_t c = 0; c < (split ? (most + ATTN_CHUNK) / ATTN_CHUNK : 1); ++c) work[items++] = {t0, t1, g, c};
    }
    auto chunk_partials = buffer<float>(split ? total_chunks * partial_size : 0);
    auto chunks_done = std::unique_ptr<std::atomic<int32_t>[]>(new std::atomic<int32_t>[pairs]);
    for (int64_t tg = 0; tg < pairs; ++tg) chunks_done[tg].store(0, std::memory_order_relaxed);
    SpinBarrier barrier(max_threads <= usable_cpus() ? SPIN_PAUSES : 0);
    const int64_t top_chunks = (md.head.n + TOP_CHUNK - 1) / TOP_CHUNK, top_items = top_k ? n_out * top_chunks : 0;
    auto top_partials = buffer<TopPartial>(top_items);

#pragma omp parallel num_threads(max_threads)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        PhaseClock clock(profile, tid);
        if (profile && tid == 0) g_profile_threads = std::max<int64_t>(g_profile_threads, nt);
        auto inv = buffer<float>(std::max(T, n_out));
        auto out = buffer<float>(NP_MAX * MT_MAX * VW);
        auto scores = buffer<float>(group * ATTN_CHUNK);
        auto own_partials = buffer<float>(split ? 0 : (max_len + ATTN_CHUNK - 1) / ATTN_CHUNK * partial_size);
        auto end_phase = [&](int phase) {  // this thread's work of `phase` is done: wait for the others'
            clock.computed(phase);
            barrier.wait(nt);
            clock.waited(phase);
        };

        // Embedding, and the first norm's sums of squares.
        for (int64_t t = T * tid / nt; t < T * (tid + 1) / nt; ++t) {
            float* r = residual.get() + t * H;
            if (md.embed_format == BF16) {
                const uint16_t* e = static_cast<const uint16_t*>(md.embed) + ids[t] * H;
                for (int64_t c = 0; c < H; ++c) r[c] = bf16_to_float(e[c]);
            } else {
                std::memcpy(r, static_cast<const float*>(md.embed) + ids[t] * H, sizeof(float) * H);
            }
            for (int64_t c0 = 0; c0 < H; c0 += VW) partial[t * HP + c0 / VW] = panel_ssq(r + c0, std::min<int64_t>(VW, H - c0));
        }
        end_phase(P_EMBED);

        auto add_to_residual = [&](const Matrix& W) {
            return [&, n = W.n](int64_t m0, int mt, int64_t p, int np, const float* o) {
                for (int pi = 0; pi < np; ++pi) {
                    const int64_t c0 = (p + pi) * VW, width = std::min<int64_t>(VW, n - c0);
                    for (int mi = 0; mi < mt; ++mi) {
                        const int64_t t = m0 + mi;
                        float* r = residual.get() + t * H + c0;
                        const float* a = o + (pi * mt + mi) * VW;
                        for (int64_t j = 0; j < width; ++j) r[j] += a[j];
                        partial[t * HP + p + pi] = panel_ssq(r, width);
                    }
                }
            };
        };
        // A projection added into the residual stream (with the next norm's sums of squares), then the phase's barrier.
        auto project_into_residual = [&](const Matrix& W, const float* const* rows, int phase) {
            matmul(W, rows, nullptr, T, tid, nt, 1, out.get(), add_to_residual(W));
            end_phase(phase);
        };

        for (int64_t l = 0; l < md.num_layers; ++l) {
            const Layer& L = md.layers[l];
            void* kc = k_cache[l];
            void* vc = v_cache[l];

            // QKV: rms scale, bias, rotary of Q and K (adjacent pairs), Q to `q`, K/V into the cache. The
            // cache lines the tokens' K/V go to (in no cache yet: a forward writes each once) are fetched
            // for writing first, while the matmul runs, rather than when its epilogue stores to them.
            for (int64_t t = tid; t < T; t += nt)
                for (int64_t h = 0; h < KVH; ++h) {
                    const int64_t at = (((slots[t] * KVH + h) * capacity + kv_pos[t]) * D) * kv_bytes;
                    for (int64_t b = 0; b < D * kv_bytes; b += 64) {
                        __builtin_prefetch(static_cast<char*>(kc) + at + b, 1, 3);
                        __builtin_prefetch(static_cast<char*>(vc) + at + b, 1, 3);
                    }
                }
            inverse_rms(partial.get(), HP, H, md.eps[2 * l], nullptr, T, inv.get());
            matmul(L.qkv, residual_rows.get(), inv.get(), T, tid, nt, 1, out.get(), [&](int64_t m0, int mt, int64_t p, int np, const float* o) {
                for (int pi = 0; pi < np; ++pi) {
                    const int64_t c0 = (p + pi) * VW, width = std::min<int64_t>(VW, L.qkv.n - c0);
                    // Column c0's part (0 Q, 1 K, 2 V), head and dimension, then stepped along the panel's
                    // column pairs (D is even: a pair never straddles two heads): no division per column.
                    const int part0 = c0 < q_size ? 0 : c0 < q_size + kv_size ? 1 : 2;
                    const int64_t e0 = c0 - (part0 ? q_size + (part0 - 1) * kv_size : 0), h0 = e0 / D, d0 = e0 % D;
                    for (int mi = 0; mi < mt; ++mi) {
                        const int64_t t = m0 + mi;
                        const float* a = o + (pi * mt + mi) * VW;
                        const float* cs = md.cos + rot_pos[t] * half;
                        const float* sn = md.sin + rot_pos[t] * half;
                        int part = part0;
                        int64_t h = h0, d = d0;
                        for (int64_t j = 0; j < width; j += 2) {
                            float re = a[j] + (L.qkv.bias ? L.qkv.bias[c0 + j] : 0.0f);
                            float im = a[j + 1] + (L.qkv.bias ? L.qkv.bias[c0 + j + 1] : 0.0f);
                            if (part < 2) {
                                const int64_t i = d / 2;
                                const float rotated = re * cs[i] - im * sn[i];
                                im = re * sn[i] + im * cs[i];
                                re = rotated;
                            }
                            if (part == 0) {
                                q[t * q_size + c0 + j] = re;
                                q[t * q_size + c0 + j + 1] = im;
                            } else {
                                const int64_t at = ((slots[t] * KVH + h) * capacity + kv_pos[t]) * D + d;
                                void* cache = part == 1 ? kc : vc;
                                if (kv_bf16) {
                                    kv_store(static_cast<uint16_t*>(cache) + at, re);
                                    kv_store(static_cast<uint16_t*>(cache) + at + 1, im);
                                } else {
                                    kv_store(static_cast<float*>(cache) + at, re);
                                    kv_store(static_cast<float*>(cache) + at + 1, im);
                                }
                            }
                            if ((d += 2) == D) {
                                d = 0;
                                if (++h == (part == 0 ? md.num_heads : KVH)) {
                                    h = 0;
                                    ++part;
                                }
                            }
                        }
                    }
                }
            });
            end_phase(P_QKV);

            // Attention: items (`work`) handed out dynamically; the last chunk of a (token, KV head) to
            // finish merges them. A thread claims its next item before attending the current one, so it
            // can prefetch the chunk it attends next while it attends this one (`ChunkPrefetch`).
            const auto attend = [&](const auto* keys, const auto* values) {
                using KT = std::remove_cv_t<std::remove_pointer_t<decltype(keys)>>;
                const auto chunk = [&](int64_t t, int64_t g, int64_t c) {  // chunk c of (token t, KV head g): its K/V data
                    const int64_t at = ((slots[t] * KVH + g) * capacity + c * ATTN_CHUNK) * D;
                    return ChunkPrefetch<KT>(keys + at, values + at, std::min(ATTN_CHUNK, kv_pos[t] + 1 - c * ATTN_CHUNK) * D);
                };
                const auto first_unit = [&](int64_t item) { return chunk(work[item].t0, work[item].g, work[item].c); };
                int64_t item = counters[l].fetch_add(1, std::memory_order_relaxed);
                if (item < items) first_unit(item).lines(INT32_MAX);  // nothing ahead of it did
                while (item < items) {
                    const int64_t next = counters[l].fetch_add(1, std::memory_order_relaxed);
                    const AttnItem& it = work[item];
                    const int64_t g = it.g;
                    ChunkPrefetch<KT> following = next < items ? first_unit(next) : ChunkPrefetch<KT>(), within;
                    for (int64_t t = it.t0; t < it.t1; ++t) {
                        const int64_t tg = t * KVH + g, chunks = first_chunk[tg + 1] - first_chunk[tg];
                        const int64_t c0 = split ? it.c : 0, c1 = split ? std::min(c0 + 1, chunks) : chunks;
                        if (c0 >= c1) continue;  // this token's keys end before chunk c
                        const float* qh = q.get() + t * q_size + g * group * D;
                        float* parts = split ? chunk_partials.get() + first_chunk[tg] * partial_size : own_partials.get();
                        for (int64_t c = c0; c < c1; ++c) {
                            const int64_t j0 = c * ATTN_CHUNK, at = ((slots[t] * KVH + g) * capacity + j0) * D;
                            attend_chunk_any(qh, keys + at, values + at, std::min(ATTN_CHUNK, kv_pos[t] + 1 - j0), group, D, scores.get(),
                                             parts + c * partial_size, c + 1 < c1 ? within = chunk(t, g, c + 1) : following);
                        }
                        bool last = true;
                        if (split && chunks > 1) {
                            last = chunks_done[tg].fetch_add(1, std::memory_order_acq_rel) == chunks - 1;
                            if (last) chunks_done[tg].store(0, std::memory_order_relaxed);  // for the next layer, which reads it after barriers
                        }
                        if (last) merge_chunks(parts, chunks, group, D, attn.get() + t * q_size + g * group * D);
                    }
                    item = next;
                }
            };
            if (kv_bf16)
                attend(static_cast<const uint16_t*>(kc), static_cast<const uint16_t*>(vc));
            else
                attend(static_cast<const float*>(kc), static_cast<const float*>(vc));
            end_phase(P_ATTN);

            project_into_residual(L.o, attn_rows.get(), P_O);

            // gate_up with silu(gate) * up: each unit is a (gate, up) pair of panels over the same channels.
            inverse_rms(partial.get(), HP, H, md.eps[2 * l + 1], nullptr, T, inv.get());
            matmul(L.gate_up, residual_rows.get(), inv.get(), T, tid, nt, 2, out.get(), [&](int64_t m0, int mt, int64_t p, int np, const float* o) {
                for (int pi = 0; pi < np; pi += 2) {
                    const int64_t c0 = (p + pi) / 2 * VW, width = std::min<int64_t>(VW, I - c0);
                    for (int mi = 0; mi < mt; ++mi) {
                        const int64_t t = m0 + mi;
                        const float* g = o + (pi * mt + mi) * VW;
                        const float* u = o + ((pi + 1) * mt + mi) * VW;
                        const vf gv = load_w(g), y = gv / (1.0f + exp_approx(-gv)) * load_w(u);
                        std::memcpy(act.get() + t * I + c0, &y, sizeof(float) * width);
                    }
                }
            });
            end_phase(P_GATE_UP);

            project_into_residual(L.down, act_rows.get(), P_DOWN);
        }

        // Final norm of the requested rows, then the logits head.
        inverse_rms(partial.get(), HP, H, md.eps[2 * md.num_layers], out_rows, n_out, inv.get());
        matmul(md.head, head_rows.get(), inv.get(), n_out, tid, nt, 1, out.get(), [&](int64_t m0, int mt, int64_t p, int np, const float* o) {
            for (int pi = 0; pi < np; ++pi) {
                const int64_t c0 = (p + pi) * VW, width = std::min<int64_t>(VW, md.head.n - c0);
                for (int mi = 0; mi < mt; ++mi) {
                    const float* a = o + (pi * mt + mi) * VW;
                    float* y = logits + (m0 + mi) * md.head.n + c0;
                    std::memcpy(y, a, sizeof(float) * width);
                }
            }
        });
        if (top_k) {
            end_phase(P_HEAD);
            for (int64_t item = tid; item < top_items; item += nt) {
                const int64_t row = item / top_chunks, begin = (item % top_chunks) * TOP_CHUNK;
                top_chunk(logits + row * md.head.n, begin, std::min(md.head.n, begin + TOP_CHUNK), top_k, top_partials[item]);
            }
            end_phase(P_TOP);
            for (int64_t row = tid; row < n_out; row += nt)
                top_merge(&top_partials[row * top_chunks], top_chunks, top_k, top_probs + row * top_k, top_cols + row * top_k);
        } else {
            clock.computed(P_HEAD);
        }
    }
    if (profile) {
        g_profile_total += now_s() - started;
        ++g_profile_calls;
    }
    return 0;
}

// float32 to bf16 as the forward stores K/V (tests compare it with torch's rounding).
void draft_to_bf16(const float* x, int64_t n, uint16_t* y) {
    for (int64_t i = 0; i < n; ++i) y[i] = float_to_bf16(x[i]);
}

// One matmul as the forward runs it, over num_threads threads (tests compare it with the maths it
// stands for): y [M][n] = (x [M][k] @ W^T) * row_scale[m] (if given), without W's bias.
void draft_matmul(const Matrix* W, int64_t M, const float* x, const float* row_scale, int64_t num_threads, float* y) {
    auto rows = buffer<const float*>(M);
    for (int64_t m = 0; m < M; ++m) rows[m] = x + m * W->k;
#pragma omp parallel num_threads(int(num_threads > 0 ? num_threads : omp_get_max_threads()))
    {
        auto out = buffer<float>(NP_MAX * MT_MAX * VW);
        matmul(*W, rows.get(), row_scale, M, omp_get_thread_num(), omp_get_num_threads(), 1, out.get(),
               [&](int64_t m0, int mt, int64_t p, int np, const float* o) {
                   for (int pi = 0; pi < np; ++pi) {
                       const int64_t c0 = (p + pi) * VW, width = std::min<int64_t>(VW, W->n - c0);
                       for (int mi = 0; mi < mt; ++mi) std::memcpy(y + (m0 + mi) * W->n + c0, o + (pi * mt + mi) * VW, sizeof(float) * width);
                   }
               });
    }
}

// Phase timing. draft_profile writes calls, total seconds, most threads, then per phase (draft_profile_names
// order) the mean over threads of seconds computing, the most any thread computed, and the mean seconds
// waiting at the phase's closing barrier; returns how many values it wrote (at most `capacity`).
void draft_profile_enable(int64_t on) { g_profile = on != 0; }
int64_t draft_profile_enabled() { return g_profile; }
const char* draft_profile_names() { return PHASE_NAMES; }

void draft_profile_reset() {
    std::memset(static_cast<void*>(g_thread_profile), 0, sizeof g_thread_profile);
    g_profile_calls = g_profile_threads = 0;
    g_profile_total = 0.0;
}

int64_t draft_profile(double* out, int64_t capacity) {
    const int64_t nt = std::min<int64_t>(g_profile_threads, PROFILE_THREADS);
    double values[3 + 3 * NUM_PHASES] = {double(g_profile_calls), g_profile_total, double(g_profile_threads)};
    for (int p = 0; p < NUM_PHASES; ++p) {
        double compute = 0.0, most = 0.0, wait = 0.0;
        for (int64_t t = 0; t < nt; ++t) {
            compute += g_thread_profile[t].compute[p];
            most = std::max(most, g_thread_profile[t].compute[p]);
            wait += g_thread_profile[t].wait[p];
        }
        values[3 + 3 * p] = nt ? compute / nt : 0.0;
        values[4 + 3 * p] = most;
        values[5 + 3 * p] = nt ? wait / nt : 0.0;
    }
    const int64_t n = std::min<int64_t>(capacity, 3 + 3 * NUM_PHASES);
    std::memcpy(out, values, sizeof(double) * n);
    return n;
}

}  // extern "C"
