// Flash attention for the CPU, registered with XLA through jax.ffi (cpu_flash.py builds and
// loads it). Forward with the log-sum-exp saved; backward as FlashAttention-2, recomputing
// the probabilities: in one pass over key blocks that adds dQ beside dK and dV where the
// (batch, kv head) items spread evenly over the threads (`fused_backward`), else a dQ pass
// over query blocks and a dK/dV pass over key blocks.
//
// Layout as the lab's other kernels: q [B, L, H, K], k and v [B, S, G, K] (grouped-query:
// query head h reads kv head h / R, R = H / G; K/V are never repeated), lse [B, H, L] f32.
// Leading dimensions before the last three are folded into B (jax.vmap's broadcast_all).
// Masks as lab/kernels/attention/common.py's Mask (causal aligned bottom-right, a sliding
// window, segment ids, lengths); the tiles to skip or mask come from its block map, passed in;
// a row that sees no key gives 0. Inputs f32 or bf16; every tile is packed into f32 and every sum is f32.
//
// Work is split over XLA's own intra-op threads where the call has them (ffi::ThreadPool: the
// caller takes items too), else over std::threads started for the call. Spawning threads of
// its own beside XLA's oversubscribed the cores: XLA's threads, still spinning after the ops
// before the call, held the cores a timeslice while the new threads waited (on 2 cores, a
// 48 µs call took 4 ms when timed right after an XLA kernel). The items:
// (batch, head, query block) items for the forward and dQ,
// (batch, kv head, key block) items for dK/dV, heaviest first (causal blocks differ in work);
// (batch, kv head) items for the one-pass backward (as heavy as one another unless lengths or
// segments differ between sequences).
// The inner products run in one register-blocked micro-kernel written with GCC/Clang vector
// extensions, sized to the vector ISA the build targets (AVX-512 with -march=native here;
// SSE2 or NEON on a portable build).

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// ------------------------------------------------------------------------- numbers

constexpr float kMask = -0.7f * FLT_MAX;  // common.MASK_VALUE: exp(kMask - m) == 0, never NaN
constexpr float kLog2e = 1.44269504088896341f;

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept quiet
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

template <typename T>
inline float load(const T* p, int64_t i);
template <>
inline float load<float>(const float* p, int64_t i) { return p[i]; }
template <>
inline float load<uint16_t>(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }

template <typename T>
inline void store(T* p, int64_t i, float x);
template <>
inline void store<float>(float* p, int64_t i, float x) { p[i] = x; }
template <>
inline void store<uint16_t>(uint16_t* p, int64_t i, float x) { p[i] = f32_to_bf16(x); }

// ------------------------------------------------------------------------- micro-kernel

// The widest vector register the build targets, in floats, and the micro-tile that fills the
// register file: kMR rows × kNV vectors of accumulators, plus kNV vectors of B and one
// broadcast of A. AVX2's 16 registers take 6 × 2 (12 accumulators): 4 × 2 left the two FMA
// pipes waiting on each other's results (8 chains of 4-cycle FMAs) and, measured on an AMD
// EPYC (Zen 3) at one thread on the forward's 128 × 128 × 64 and 128 × 64 × 128 products,
// ran at 60 GFLOP/s against 88 for 6 × 2 (4 × 3: 59–62, 3 × 4: 69, 5 × 2: 87).
#if defined(__AVX512F__)
constexpr int kVW = 16;  // zmm: 8 × 32 floats in 16 of 32 registers
constexpr int kMR = 8;
#elif defined(__AVX__)
constexpr int kVW = 8;  // ymm: 6 × 16 floats in 12 of 16 registers
constexpr int kMR = 6;
#else
constexpr int kVW = 4;  // SSE2 / NEON: 4 × 8 floats in 8 of 16 (32 on NEON) registers
constexpr int kMR = 4;
#endif
constexpr int kNV = 2;
constexpr int kNR = kVW * kNV;
constexpr int kAlign = 32;  // block sizes and the padded head dim are multiples of this
static_assert(kAlign % kNR == 0, "tiles must hold whole micro-tiles");

typedef float vf __attribute__((vector_size(4 * kVW)));
typedef int32_t vi __attribute__((vector_size(4 * kVW)));

// Unaligned vector loads and stores through a float vector type, not memcpy: a memcpy may
// alias anything, so GCC reloaded every captured loop bound (the tile sizes) from memory after
// each store of the exp loop; a float vector aliases only floats.
typedef float vf_unaligned __attribute__((vector_size(4 * kVW), aligned(4)));
inline vf vload(const float* p) { return *reinterpret_cast<const vf_unaligned*>(p); }
inline void vstore(float* p, vf v) { *reinterpret_cast<vf_unaligned*>(p) = v; }

inline float hsum(vf v) {
  float out = 0.0f;
  for (int i = 0; i < kVW; ++i) out += v[i];
  return out;
}

// max(lo, x) and min(hi, x) lane by lane, a NaN in x kept: one instruction where the build
// has the x86 vector ISA (its max/min return the second operand when either is NaN), a
// compare and a select elsewhere.
inline vf vmax_lo(vf lo, vf x) {
#if defined(__AVX512F__)
  return (vf)_mm512_max_ps((__m512)lo, (__m512)x);
#elif defined(__AVX__)
  return (vf)_mm256_max_ps((__m256)lo, (__m256)x);
#elif defined(__SSE2__)
  return (vf)_mm_max_ps((__m128)lo, (__m128)x);
#else
  return x < lo ? lo : x;
#endif
}
inline vf vmin_hi(vf hi, vf x) {
#if defined(__AVX512F__)
  return (vf)_mm512_min_ps((__m512)hi, (__m512)x);
#elif defined(__AVX__)
  return (vf)_mm256_min_ps((__m256)hi, (__m256)x);
#elif defined(__SSE2__)
  return (vf)_mm_min_ps((__m128)hi, (__m128)x);
#else
  return x > hi ? hi : x;
#endif
}

// exp(x) lane by lane as 2^(x · log2 e): 2^n · p(r), n = round(x · log2 e), |r| <= 1/2, p a
// degree-6 polynomial fitted for relative error (1.6 ulp); 0 below -87.7 (-inf included: the
// clamp at -127 makes 2^n's bits 0), 2^127 from 88 up (the callers never pass x > ~0), NaN
// kept. Rounding x · log2 e adds |x| · 2^-24 relative error (1.5 ulp for |x| <= 1, 64 near
// ±87), so callers pass x = s - m with m the row max or the log-sum-exp subtracted first: the
// error then grows only where exp(x) is far below the row's largest term. (Scaling the scores
// to base 2 before the max instead doubled the gradients' error against float64 at scores in
// the hundreds, through the log-sum-exp.) Against Cephes' expf (the two-step ln 2 reduction,
// ~1 ulp everywhere): two vector operations fewer an exponential, the forward 2–3% faster.
// Written with vector types: GCC left the same arithmetic on scalars in loops marked `omp simd`
// on AVX2 (its select and the integer exponent), and the forward then spent as long in exp as
// in both products. The clamps are max/min, not compare-and-select: the 0 below the range
// comes from the exponent itself, so no select is left.
inline vf vexp(vf x) {
  const vf lo = vf{} - 127.0f, hi = vf{} + 127.0f;
  const vf magic = vf{} + 12582912.0f;  // 1.5·2^23: adding it rounds to an integer
  const vf xc = vmin_hi(hi, vmax_lo(lo, x * kLog2e));
  const vf n = (xc + magic) - magic;
  const vf r = xc - n;  // exact
  vf p = vf{} + 1.5353362e-4f;
  p = p * r + 1.3398875e-3f;
  p = p * r + 9.6184369e-3f;
  p = p * r + 5.5503324e-2f;
  p = p * r + 2.4022648e-1f;
  p = p * r + 6.9314718e-1f;
  const vf y = p * r + 1.0f;
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;  // n = -127: +0.0
  vf two_n;
  std::memcpy(&two_n, &e, sizeof two_n);
  return y * two_n;
}

// max(init, row[0..n)), n % kVW == 0, or NaN if the row holds one (a NaN in gives NaN out, as
// in the reference; a plain max skips it, and a row of NaN scores read as a row that sees no
// key: 0). Written with vectors (GCC leaves a max reduction scalar).
inline float row_max(const float* row, int64_t n, float init) {
  vf m = vf{} + init;
  vi nan = {};
  for (int64_t c = 0; c < n; c += kVW) {
    const vf x = vload(row + c);
    m = x > m ? x : m;
    nan |= x != x;
  }
  float out = init;
  for (int i = 0; i < kVW; ++i) {
    if (nan[i]) return NAN;
    out = std::max(out, m[i]);
  }
  return out;
}

// C[MR rows from i0 × kNR columns from j0] (+)= A · B over kd; TA: A is stored transposed,
// [kd × M] (row p, column r at A[p · lda + r]). B is stored in panels of kNR columns,
// `panel_rows` rows high (pack's kPanels layouts), so a micro-tile reads its B contiguously.
template <int MR, bool TA>
inline void micro(int i0, int j0, int kd, const float* A, int64_t lda, const float* B,
                  int64_t panel_rows, float* C, int64_t ldc, bool accumulate) {
  vf c[MR][kNV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v)
      c[r][v] = accumulate ? vload(C + (i0 + r) * ldc + j0 + kVW * v) : vf{};
  const float* a = TA ? A + i0 : A + i0 * lda;
  const float* b = B + j0 * panel_rows;
  for (int p = 0; p < kd; ++p) {
    vf bv[kNV];
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) bv[v] = vload(b + p * kNR + kVW * v);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const float s = TA ? a[p * lda + r] : a[r * lda + p];
#pragma GCC unroll 4
      for (int v = 0; v < kNV; ++v) c[r][v] += s * bv[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) vstore(C + (i0 + r) * ldc + j0 + kVW * v, c[r][v]);
}

// C[M×N] (+)= A[M×kd] · B[kd×N] in f32: A row-major (TA: given as Aᵀ [kd×M]), B in panels
// (`micro`), C row-major; N % kNR == 0 (M any: the rows past the last whole micro-tile take a
// shorter one). B in panels because the tiles packed once and read by many products are laid
// out so: a micro-tile then reads its 2 · kVW columns as one contiguous run. Read from rows
// `bk` floats apart they fell into a few cache sets (a 512-byte stride), and on an AMD EPYC
// (Zen 3) one thread's 128 × 128 × 64 product over 256 distinct K tiles ran at 75.6 GFLOP/s
// against 85.3 from panels (88.6 and 91.8 with one tile that stays in cache).
template <bool TA = false>
void gemm_p(int M, int N, int kd, const float* A, int64_t lda, const float* B,
            int64_t panel_rows, float* C, int64_t ldc, bool accumulate) {
  const int whole = M / kMR * kMR;
  for (int i0 = 0; i0 < whole; i0 += kMR)
    for (int j0 = 0; j0 < N; j0 += kNR)
      micro<kMR, TA>(i0, j0, kd, A, lda, B, panel_rows, C, ldc, accumulate);
  if (whole == M) return;
  for (int j0 = 0; j0 < N; j0 += kNR) switch (M - whole) {
      case 1: micro<1, TA>(whole, j0, kd, A, lda, B, panel_rows, C, ldc, accumulate); break;
      case 2: micro<2, TA>(whole, j0, kd, A, lda, B, panel_rows, C, ldc, accumulate); break;
      case 3: micro<3, TA>(whole, j0, kd, A, lda, B, panel_rows, C, ldc, accumulate); break;
      case 4: micro<4, TA>(whole, j0, kd, A, lda, B, panel_rows, C, ldc, accumulate); break;
      case 5: micro<5, TA>(whole, j0, kd, A, lda, B, panel_rows, C, ldc, accumulate); break;
      case 6: micro<6, TA>(whole, j0, kd, A, lda, B, panel_rows, C, ldc, accumulate); break;
      default: micro<7, TA>(whole, j0, kd, A, lda, B, panel_rows, C, ldc, accumulate); break;
    }
}

// ------------------------------------------------------------------------- geometry

struct Geo {
  int64_t B, L, S, H, G, R, K;  // B folds every leading dimension
  int64_t Kp;                   // K rounded up to kAlign (zero-padded in every packed tile)
  int64_t bq, bk, nq, nk;
  bool causal;
  float scale;
  int threads;
  // The mask (lab/kernels/attention/common.py, Mask): key j is visible to query i iff
  // lo <= j - i - (S - L) <= hi (each side only where has_lo / has_hi: causal and a window),
  // i < q_len[b], j < kv_len[b], q_seg[b, i] == kv_seg[b, j]. kind [B, nq, nk]: the block
  // map (0 empty: skipped, 1 partial: masked, 2 full: no mask), computed by Mask.block_map.
  float softcap = 0.0f;  // > 0: scores become softcap · tanh(scores / softcap)
  bool has_lo = false, has_hi = false;
  int64_t lo = 0, hi = 0;
  const int32_t* q_seg = nullptr;  // [B, L]
  const int32_t* kv_seg = nullptr;  // [B, S]
  const int32_t* q_len = nullptr;  // [B]
  const int32_t* kv_len = nullptr;  // [B]
  const int32_t* kinds = nullptr;  // [B, nq, nk]

  int64_t offset() const { return S - L; }
  float inv_cap() const { return softcap > 0.0f ? 1.0f / softcap : 0.0f; }
  int32_t kind(int64_t b, int64_t i, int64_t j) const { return kinds[(b * nq + i) * nk + j]; }
  bool segments = false;  // the segment ids hold more than one value: compared per element
  bool visible(int64_t b, int64_t qpos, int64_t kpos) const {
    if (qpos >= L || kpos >= S || qpos >= q_len[b] || kpos >= kv_len[b]) return false;
    const int64_t d = kpos - qpos - offset();
    if ((has_lo && d < lo) || (has_hi && d > hi)) return false;
    return q_seg[b * L + qpos] == kv_seg[b * S + kpos];
  }
  // The keys of [k0, k0 + n) that query qpos may see before segments are compared: one run
  // [a, z) of offsets (the lengths and the causal/window band each bound it on one side).
  void keys_of(int64_t b, int64_t qpos, int64_t k0, int64_t n, int64_t* a, int64_t* z) const {
    int64_t first = 0, last = std::min<int64_t>(S, kv_len[b]) - 1;  // key positions
    if (qpos >= L || qpos >= q_len[b]) last = -1;
    if (has_lo) first = std::max(first, qpos + offset() + lo);
    if (has_hi) last = std::min(last, qpos + offset() + hi);
    *a = std::clamp<int64_t>(first - k0, 0, n);
    *z = std::max(*a, std::clamp<int64_t>(last + 1 - k0, 0, n));
  }
  // The queries of [q0, q0 + n) that may see key kpos before segments: one run [a, z).
  void queries_of(int64_t b, int64_t kpos, int64_t q0, int64_t n, int64_t* a, int64_t* z) const {
    int64_t first = 0, last = std::min<int64_t>(L, q_len[b]) - 1;  // query positions
    if (kpos >= S || kpos >= kv_len[b]) last = -1;
    if (has_hi) first = std::max(first, kpos - offset() - hi);
    if (has_lo) last = std::min(last, kpos - offset() - lo);
    *a = std::clamp<int64_t>(first - q0, 0, n);
    *z = std::max(*a, std::clamp<int64_t>(last + 1 - q0, 0, n));
  }
  // Row qpos of a tile of keys from k0 (n wide): every key it may not see set to `fill`.
  void mask_keys(int64_t b, int64_t qpos, int64_t k0, int64_t n, float* row, float fill) const {
    int64_t a, z;
    keys_of(b, qpos, k0, n, &a, &z);
    std::fill(row, row + a, fill);
    std::fill(row + z, row + n, fill);
    if (!segments) return;
    for (int64_t c = a; c < z; ++c)
      if (q_seg[b * L + qpos] != kv_seg[b * S + k0 + c]) row[c] = fill;
  }
  int64_t q_index(int64_t b, int64_t l, int64_t h) const { return ((b * L + l) * H + h) * K; }
  int64_t kv_index(int64_t b, int64_t s, int64_t g) const { return ((b * S + s) * G + g) * K; }
  int64_t row_index(int64_t b, int64_t h, int64_t l) const { return (b * H + h) * L + l; }
};

// How `pack` lays a tile out: kRows, [rows×Kp] row-major (a product's left operand); kPanels,
// the tile as a right operand [rows×Kp] in panels of kNR columns, (r, d) at
// ((d / kNR) · rows + r) · kNR + d % kNR; kPanelsT, its transpose [Kp×rows] so, (d, r) at
// ((r / kNR) · Kp + d) · kNR + r % kNR (`gemm_p` reads both).
enum Layout { kRows, kPanels, kPanelsT };

// Rows [r0, r0 + rows) of x [B, N, heads, K] at (b, head), times `mul`, into dst as `layout`
// says; rows past `n` and columns past K are zeros.
template <typename T>
void pack(const T* x, int64_t base, int64_t row_stride, int64_t r0, int64_t rows, int64_t n,
          int64_t K, int64_t Kp, float mul, float* dst, Layout layout) {
  if (layout != kRows && (r0 + rows > n || K < Kp))  // padding to zero: rows past n, columns past K
    std::fill(dst, dst + rows * Kp, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = x + base + (r0 + r) * row_stride;
    if (layout == kPanelsT) {
      if (r0 + r < n) {
        float* out = dst + (r / kNR) * Kp * kNR + r % kNR;
        for (int64_t d = 0; d < K; ++d) out[d * kNR] = load(src, d) * mul;
      }
      continue;
    }
    if (layout == kPanels) {
      if (r0 + r < n)
        for (int64_t d = 0; d < K; ++d)
          dst[((d / kNR) * rows + r) * kNR + d % kNR] = load(src, d) * mul;
      continue;
    }
    float* out = dst + r * Kp;
    const int64_t real = r0 + r < n ? K : 0;
#pragma omp simd
    for (int64_t d = 0; d < real; ++d) out[d] = load(src, d) * mul;
    std::fill(out + real, out + Kp, 0.0f);
  }
}

// Whole-input buffers (the packed copies below, the one-pass backward's dQ sums), kept on the
// calling thread from one call to the next. Allocated fresh for every call, their pages were
// faulted in and zeroed by the kernel each time: a tenth of the forward at S = 2048, K = 128,
// f32 on 2 threads (13 ms of 118 at one thread in `pack_all` alone, most of it in the kernel).
// `release_scratch` frees them after a call once they hold more than kKeepBytes, so one long
// sequence does not pin its copies for the life of the process; each thread that makes calls
// keeps its own (up to kKeepBytes each: XLA makes them from one or a few threads).
constexpr int kSlots = 5;
constexpr size_t kKeepBytes = size_t{256} << 20;
thread_local std::vector<float> scratch_slots[kSlots];

float* scratch(int slot, int64_t n) {
  std::vector<float>& buf = scratch_slots[slot];
  if (buf.size() < static_cast<size_t>(n)) {  // grown without copying what it held
    std::vector<float>().swap(buf);
    buf.resize(n);
  }
  return buf.data();
}

void release_scratch() {
  size_t held = 0;
  for (const auto& buf : scratch_slots) held += buf.capacity() * sizeof(float);
  if (held <= kKeepBytes) return;
  for (auto& buf : scratch_slots) std::vector<float>().swap(buf);
}

// Every block of x [B, N, heads, K] packed once, as `pack` lays one out, into scratch `slot`:
// block `blk` of head `hd` of batch b at ((b · heads + hd) · nblocks + blk) · block · Kp. Tiles
// that many work items read (K and V in the forward and dQ, q and dO in dK/dV) are packed here,
// not per item.
template <typename T>
const float* pack_all(const Geo& g, const T* x, int64_t N, int64_t heads, int64_t block,
                      float mul, Layout layout, int slot) {
  const int64_t nblocks = (N + block - 1) / block, size = block * g.Kp;
  float* out = scratch(slot, g.B * heads * nblocks * size);
  parallel_for(g.B * heads * nblocks, g.threads, [&](int64_t item) {
    const int64_t b = item / (heads * nblocks), hd = item / nblocks % heads, blk = item % nblocks;
    const int64_t base = (b * N * heads + hd) * g.K;
    pack(x, base, heads * g.K, blk * block, block, N, g.K, g.Kp, mul, out + item * size, layout);
  });
  return out;
}

// XLA's intra-op thread pool for the call being run on this thread (PoolScope), or none.
thread_local ffi::ThreadPool* tl_pool = nullptr;

struct PoolScope {
  explicit PoolScope(ffi::ThreadPool* pool) : prev(tl_pool) { tl_pool = pool; }
  ~PoolScope() { tl_pool = prev; }
  ffi::ThreadPool* prev;
};

// Items of one parallel_for on XLA's pool. A task that starts after the caller has closed it
// (every item claimed) touches nothing but this object, which it co-owns: the caller waits
// only for the tasks that got in before it closed, never for a pool thread busy elsewhere.
// The handshake needs the default seq_cst order: the caller stores `closed` then loads
// `active`; a task adds to `active` then loads `closed` (one of the two sees the other).
template <typename Fn>
struct PoolWork {
  std::atomic<int64_t> next{0};
  std::atomic<int> active{0};
  std::atomic<bool> closed{false};
  int64_t n = 0;
  const Fn* fn = nullptr;
  void run() {
    for (int64_t item = next++; item < n; item = next++) (*fn)(item);
  }
};

// Run fn(item) for item in [0, n) over the threads, each taking the next item in order.
template <typename Fn>
void parallel_for(int64_t n, int threads, Fn fn) {
  const int workers = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, n)));
  if (workers > 1 && tl_pool != nullptr && tl_pool->num_threads() > 0) {
    auto work = std::make_shared<PoolWork<Fn>>();
    work->n = n;
    work->fn = &fn;
    for (int t = 1; t < workers; ++t) {
      tl_pool->Schedule([work]() {
        work->active.fetch_add(1);
        if (!work->closed.load()) work->run();
        work->active.fetch_sub(1);
      });
    }
    struct Close {  // closed and drained however the caller leaves, an exception included
      PoolWork<Fn>& w;
      ~Close() {
        w.closed.store(true);
        for (int spin = 0; w.active.load() != 0; ++spin)
          if (spin > 64) std::this_thread::yield();
      }
    } close{*work};
    work->run();  // the caller works too: every item is done even if no pool thread is free
    return;
  }
  std::atomic<int64_t> next{0};
  auto worker = [&]() {
    for (int64_t item = next++; item < n; item = next++) fn(item);
  };
  if (workers == 1) return worker();
  std::vector<std::thread> pool;
  pool.reserve(workers - 1);
  for (int t = 1; t < workers; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
}

// Soft-capping in place: x -> softcap · tanh(x / softcap) (nothing without softcap). The
// backward's chain rule reads tanh back as capped / softcap: d capped / d x = 1 - tanh².
inline void cap(const Geo& g, float* x, int64_t n) {
  if (g.softcap <= 0.0f) return;
  const float c = g.softcap, inv = 1.0f / g.softcap;
  for (int64_t i = 0; i < n; ++i) x[i] = c * std::tanh(x[i] * inv);
}

// ------------------------------------------------------------------------- forward

template <typename T>
void forward(const Geo& g, const T* q, const T* k, const T* v, T* o, float* lse) {
  const int64_t bq = g.bq, bk = g.bk, Kp = g.Kp;
  const float* kt_all = pack_all(g, k, g.S, g.G, bk, 1.0f, kPanelsT, 0);
  const float* v_all = pack_all(g, v, g.S, g.G, bk, 1.0f, kPanels, 1);
  // Heaviest first: for causal, late query blocks see the most keys.
  parallel_for(g.nq * g.B * g.H, g.threads, [&](int64_t item) {
    thread_local std::vector<float> buf;
    buf.resize(bq * Kp * 2 + bq * bk + 2 * bq);
    float* qs = buf.data();     // [bq×Kp] q · scale
    float* acc = qs + bq * Kp;  // [bq×Kp] unnormalised output
    float* s = acc + bq * Kp;   // [bq×bk] scores, then probabilities
    float* mx = s + bq * bk;    // [bq] running max
    float* sum = mx + bq;       // [bq] running sum
    const int64_t i = g.nq - 1 - item / (g.B * g.H);
    const int64_t bh = item % (g.B * g.H), b = bh / g.H, h = bh % g.H, kvh = h / g.R;
    const int64_t q0 = i * bq;
    pack(q, g.q_index(b, 0, h), g.H * g.K, q0, bq, g.L, g.K, Kp, g.scale, qs, kRows);
    std::fill(acc, acc + bq * Kp, 0.0f);
    std::fill(mx, mx + bq, kMask);
    std::fill(sum, sum + bq, 0.0f);
    for (int64_t j = 0; j < g.nk; ++j) {
      const int32_t kind = g.kind(b, i, j);
      if (kind == 0) continue;  // no visible pair in this tile
      const int64_t k0 = j * bk, at = ((b * g.G + kvh) * g.nk + j) * bk * Kp;
      const float *kt = kt_all + at, *vr = v_all + at;  // [Kp×bk], [bk×Kp], in panels
      gemm_p(bq, bk, g.K, qs, Kp, kt, Kp, s, bk, false);
      cap(g, s, bq * bk);
      const bool masked = kind == 1;
      for (int64_t r = 0; r < bq; ++r) {
        float* row = s + r * bk;
        if (masked) g.mask_keys(b, q0 + r, k0, bk, row, kMask);
        const float m = row_max(row, bk, mx[r]);
        if (m == kMask) {  // the row has seen no visible key yet: nothing to add
          std::fill(row, row + bk, 0.0f);
          continue;
        }
        const float alpha = vexp(vf{} + (mx[r] - m))[0];
        vf total = {};
        for (int64_t c = 0; c < bk; c += kVW) {
          const vf e = vexp(vload(row + c) - m);
          vstore(row + c, e);
          total += e;
        }
        mx[r] = m;
        sum[r] = sum[r] * alpha + hsum(total);
        float* out = acc + r * Kp;
        for (int64_t d = 0; d < Kp; d += kVW) vstore(out + d, vload(out + d) * alpha);
      }
      gemm_p(bq, Kp, bk, s, bk, vr, bk, acc, Kp, true);
    }
    for (int64_t r = 0; r < bq && q0 + r < g.L; ++r) {
      // A row that saw no key: output 0, and lse +inf so the backward's exp(s - lse) is 0.
      const bool seen = !(sum[r] <= 0.0f);  // NaN counts as seen: it reaches o and lse
      const float inv = seen ? 1.0f / sum[r] : 0.0f;
      T* dst = o + g.q_index(b, q0 + r, h);
      for (int64_t d = 0; d < g.K; ++d) store(dst, d, acc[r * Kp + d] * inv);
      lse[g.row_index(b, h, q0 + r)] = seen ? mx[r] + std::log(sum[r]) : INFINITY;
    }
  });
}

// ------------------------------------------------------------------------- backward

// delta_i = Σ_d dO_id · O_id (= Σ_j P_ij · dP_ij), one per query row: [B, H, L].
template <typename T>
void row_deltas(const Geo& g, const T* o, const T* d_o, float* delta) {
  parallel_for(g.B * g.H, g.threads, [&](int64_t bh) {
    const int64_t b = bh / g.H, h = bh % g.H;
    for (int64_t l = 0; l < g.L; ++l) {
      const int64_t at = g.q_index(b, l, h);
      float total = 0.0f;
      for (int64_t d = 0; d < g.K; ++d) total += load(o, at + d) * load(d_o, at + d);
      delta[g.row_index(b, h, l)] = total;
    }
  });
}

// dQ = scale · Σ_j dS_j · K_j with dS = P ⊙ (dP − δ), P = exp(S − lse), dP = dO · Vᵀ.
template <typename T>
void backward_dq(const Geo& g, const T* q, const T* k, const T* v, const float* lse,
                 const float* delta, const T* d_o, T* dq) {
  const int64_t bq = g.bq, bk = g.bk, Kp = g.Kp;
  const float* kt_all = pack_all(g, k, g.S, g.G, bk, 1.0f, kPanelsT, 0);
  const float* kr_all = pack_all(g, k, g.S, g.G, bk, 1.0f, kPanels, 1);
  const float* vt_all = pack_all(g, v, g.S, g.G, bk, 1.0f, kPanelsT, 2);
  parallel_for(g.nq * g.B * g.H, g.threads, [&](int64_t item) {
    thread_local std::vector<float> buf;
    buf.resize(3 * bq * Kp + 2 * bq * bk + 2 * bq);
    float* qs = buf.data();       // [bq×Kp]
    float* dor = qs + bq * Kp;    // [bq×Kp] dO
    float* acc = dor + bq * Kp;   // [bq×Kp] dQ / scale
    float* p = acc + bq * Kp;     // [bq×bk] P, then dS
    float* dp = p + bq * bk;      // [bq×bk]
    float* lse_r = dp + bq * bk;  // [bq]
    float* del_r = lse_r + bq;    // [bq]
    const int64_t i = g.nq - 1 - item / (g.B * g.H);
    const int64_t bh = item % (g.B * g.H), b = bh / g.H, h = bh % g.H, kvh = h / g.R;
    const int64_t q0 = i * bq;
    pack(q, g.q_index(b, 0, h), g.H * g.K, q0, bq, g.L, g.K, Kp, g.scale, qs, kRows);
    pack(d_o, g.q_index(b, 0, h), g.H * g.K, q0, bq, g.L, g.K, Kp, 1.0f, dor, kRows);
    for (int64_t r = 0; r < bq; ++r) {
      const bool real = q0 + r < g.L;
      lse_r[r] = real ? lse[g.row_index(b, h, q0 + r)] : 0.0f;
      del_r[r] = real ? delta[g.row_index(b, h, q0 + r)] : 0.0f;
    }
    std::fill(acc, acc + bq * Kp, 0.0f);
    for (int64_t j = 0; j < g.nk; ++j) {
      const int32_t kind = g.kind(b, i, j);
      if (kind == 0) continue;
      const int64_t k0 = j * bk, at = ((b * g.G + kvh) * g.nk + j) * bk * Kp;
      const float* kt = kt_all + at;  // [Kp×bk] in panels
      const float* kr = kr_all + at;  // [bk×Kp] in panels
      const float* vt = vt_all + at;  // [Kp×bk] in panels
      gemm_p(bq, bk, g.K, qs, Kp, kt, Kp, p, bk, false);
      cap(g, p, bq * bk);
      gemm_p(bq, bk, g.K, dor, Kp, vt, Kp, dp, bk, false);
      const bool masked = kind == 1;
      for (int64_t r = 0; r < bq; ++r) {
        float* pr = p + r * bk;
        const float* dpr = dp + r * bk;
        const float m = lse_r[r], dl = del_r[r], inv_cap = g.inv_cap();
        for (int64_t c = 0; c < bk; c += kVW) {
          const vf x = vload(pr + c), prob = vexp(x - m), t = x * inv_cap;  // t: tanh, or 0
          vstore(pr + c, prob * (vload(dpr + c) - dl) * (1.0f - t * t));
        }
        if (masked) g.mask_keys(b, q0 + r, k0, bk, pr, 0.0f);
      }
      gemm_p(bq, Kp, bk, p, bk, kr, bk, acc, Kp, true);
    }
    for (int64_t r = 0; r < bq && q0 + r < g.L; ++r) {
      T* dst = dq + g.q_index(b, q0 + r, h);
      for (int64_t d = 0; d < g.K; ++d) store(dst, d, acc[r * Kp + d] * g.scale);
    }
  });
}

// The q-side tiles every dK/dV product reads, each packed once, in panels: q · scale and dO,
// and their transposes, per (batch, head, query block).
struct QTiles {
  const float *qs, *qst, *dor, *dot;
};

template <typename T>
QTiles pack_q_tiles(const Geo& g, const T* q, const T* d_o) {
  return {pack_all(g, q, g.L, g.H, g.bq, g.scale, kPanels, 0),
          pack_all(g, q, g.L, g.H, g.bq, g.scale, kPanelsT, 1),
          pack_all(g, d_o, g.L, g.H, g.bq, 1.0f, kPanels, 2),
          pack_all(g, d_o, g.L, g.H, g.bq, 1.0f, kPanelsT, 3)};
}

// One key block's scratch, laid out in `buf`: its K and V rows [bk×Kp], the dK and dV sums
// [bk×Kp] (adjacent), the Pᵀ and dPᵀ (then dSᵀ) tiles [bk×bq], a query block's lse and delta.
struct KeyBlock {
  float *kr, *vr, *dk_acc, *dv_acc, *pt, *dpt, *lse_r, *del_r;
  KeyBlock(const Geo& g, std::vector<float>& buf) {
    buf.resize(4 * g.bk * g.Kp + 2 * g.bk * g.bq + 2 * g.bq);
    kr = buf.data();
    vr = kr + g.bk * g.Kp;
    dk_acc = vr + g.bk * g.Kp;
    dv_acc = dk_acc + g.bk * g.Kp;
    pt = dv_acc + g.bk * g.Kp;
    dpt = pt + g.bk * g.bq;
    lse_r = dpt + g.bk * g.bq;
    del_r = lse_r + g.bq;
  }
};

// dV = Σ Pᵀ · dO and dK = Σ dSᵀ · (q · scale) for key block j of kv head kvh in batch b, over
// its R query heads and the query blocks that see it; tiles computed transposed ([keys ×
// queries]), then dK and dV written. `then(rr, i, w)` runs after each tile, its dSᵀ in w.dpt
// (the one-pass backward adds dQ there).
template <typename T, typename Then>
void key_block(const Geo& g, const T* k, const T* v, const float* lse, const float* delta,
               const QTiles& qt, int64_t b, int64_t kvh, int64_t j, KeyBlock& w, T* dk, T* dv,
               Then then) {
  const int64_t bq = g.bq, bk = g.bk, Kp = g.Kp;
  const int64_t k0 = j * bk, base = g.kv_index(b, 0, kvh);
  pack(k, base, g.G * g.K, k0, bk, g.S, g.K, Kp, 1.0f, w.kr, kRows);
  pack(v, base, g.G * g.K, k0, bk, g.S, g.K, Kp, 1.0f, w.vr, kRows);
  std::fill(w.dk_acc, w.dk_acc + 2 * bk * Kp, 0.0f);
  for (int64_t rr = 0; rr < g.R; ++rr) {
    const int64_t h = kvh * g.R + rr;
    for (int64_t i = 0; i < g.nq; ++i) {
      const int32_t kind = g.kind(b, i, j);
      if (kind == 0) continue;
      const int64_t q0 = i * bq, at = ((b * g.H + h) * g.nq + i) * bq * Kp;
      const float* qs = qt.qs + at;    // [bq×Kp] in panels: q · scale
      const float* qst = qt.qst + at;  // [Kp×bq] in panels
      const float* dor = qt.dor + at;  // [bq×Kp] in panels: dO
      const float* dot = qt.dot + at;  // [Kp×bq] in panels
      for (int64_t r = 0; r < bq; ++r) {
        const bool real = q0 + r < g.L;
        w.lse_r[r] = real ? lse[g.row_index(b, h, q0 + r)] : 0.0f;
        w.del_r[r] = real ? delta[g.row_index(b, h, q0 + r)] : 0.0f;
      }
      gemm_p(bk, bq, g.K, w.kr, Kp, qst, Kp, w.pt, bq, false);
      cap(g, w.pt, bk * bq);
      gemm_p(bk, bq, g.K, w.vr, Kp, dot, Kp, w.dpt, bq, false);
      const bool masked = kind == 1;
      const float inv_cap = g.inv_cap();
      for (int64_t c = 0; c < bk; ++c) {
        float* prow = w.pt + c * bq;
        float* drow = w.dpt + c * bq;
        for (int64_t r = 0; r < bq; r += kVW) {
          const vf x = vload(prow + r), prob = vexp(x - vload(w.lse_r + r)), t = x * inv_cap;
          vstore(prow + r, prob);
          vstore(drow + r, prob * (vload(drow + r) - vload(w.del_r + r)) * (1.0f - t * t));
        }
        if (masked) {
          int64_t a, z;
          g.queries_of(b, k0 + c, q0, bq, &a, &z);
          std::fill(prow, prow + a, 0.0f), std::fill(prow + z, prow + bq, 0.0f);
          std::fill(drow, drow + a, 0.0f), std::fill(drow + z, drow + bq, 0.0f);
          if (g.segments)
            for (int64_t r = a; r < z; ++r)
              if (!g.visible(b, q0 + r, k0 + c)) prow[r] = drow[r] = 0.0f;
        }
      }
      gemm_p(bk, Kp, bq, w.pt, bq, dor, bq, w.dv_acc, Kp, true);
      gemm_p(bk, Kp, bq, w.dpt, bq, qs, bq, w.dk_acc, Kp, true);
      then(rr, i, w);
    }
  }
  for (int64_t c = 0; c < bk && k0 + c < g.S; ++c) {
    T* dst_k = dk + g.kv_index(b, k0 + c, kvh);
    T* dst_v = dv + g.kv_index(b, k0 + c, kvh);
    for (int64_t d = 0; d < g.K; ++d) {
      store(dst_k, d, w.dk_acc[c * Kp + d]);
      store(dst_v, d, w.dv_acc[c * Kp + d]);
    }
  }
}

// The dK/dV pass: (batch, kv head, key block) items, key block 0 first (causal: it sees the
// most query blocks).
template <typename T>
void backward_dkdv(const Geo& g, const T* q, const T* k, const T* v, const float* lse,
                   const float* delta, const T* d_o, T* dk, T* dv) {
  const QTiles qt = pack_q_tiles(g, q, d_o);
  parallel_for(g.nk * g.B * g.G, g.threads, [&](int64_t item) {
    thread_local std::vector<float> buf;
    KeyBlock w(g, buf);
    const int64_t j = item / (g.B * g.G), bg = item % (g.B * g.G);
    key_block(g, k, v, lse, delta, qt, bg / g.G, bg % g.G, j, w, dk, dv,
              [](int64_t, int64_t, const KeyBlock&) {});
  });
}

// The backward in one pass when there are enough (batch, kv head) items to keep every thread
// busy: an item owns every query row of its R heads, so it can add dQ into its own sums as it
// goes (dQ += dS · K beside dK and dV) and the scores and dP are computed once, not once per
// pass: 5 products a tile where the two passes take 7. Same sums, added in the same order of
// key blocks as the dQ pass.
template <typename T>
void backward_fused(const Geo& g, const T* q, const T* k, const T* v, const float* lse,
                    const float* delta, const T* d_o, T* dq, T* dk, T* dv) {
  const int64_t bq = g.bq, bk = g.bk, Kp = g.Kp;
  const QTiles qt = pack_q_tiles(g, q, d_o);
  // Every item's dQ sums [R, nq·bq, Kp] (dQ / scale) at once, in scratch: the size of one
  // packed q, beside the four q-side tiles already packed.
  const int64_t dq_size = g.R * g.nq * bq * Kp;
  float* dq_all = scratch(4, g.B * g.G * dq_size);
  parallel_for(g.B * g.G, g.threads, [&](int64_t item) {
    std::vector<float> buf;
    KeyBlock w(g, buf);
    std::vector<float> krp(bk * Kp);  // the key block's K again, in panels: dQ's right operand
    float* dq_buf = dq_all + item * dq_size;
    std::fill(dq_buf, dq_buf + dq_size, 0.0f);
    const int64_t b = item / g.G, kvh = item % g.G, base = g.kv_index(b, 0, kvh);
    for (int64_t j = 0; j < g.nk; ++j) {
      pack(k, base, g.G * g.K, j * bk, bk, g.S, g.K, Kp, 1.0f, krp.data(), kPanels);
      key_block(g, k, v, lse, delta, qt, b, kvh, j, w, dk, dv,
                [&](int64_t rr, int64_t i, const KeyBlock& t) {
                  // dQ[q0 : q0 + bq] += dS · K: dS given as dSᵀ [bk×bq]
                  gemm_p<true>(bq, Kp, bk, t.dpt, bq, krp.data(), bk,
                               dq_buf + (rr * g.nq + i) * bq * Kp, Kp, true);
                });
    }
    for (int64_t rr = 0; rr < g.R; ++rr) {
      const int64_t h = kvh * g.R + rr;
      for (int64_t l = 0; l < g.L; ++l) {
        T* dst = dq + g.q_index(b, l, h);
        const float* src = dq_buf + (rr * g.nq * bq + l) * Kp;
        for (int64_t d = 0; d < g.K; ++d) store(dst, d, src[d] * g.scale);
      }
    }
  });
}

// ------------------------------------------------------------------------- FFI

// At most this many threads per core, whatever LAB_CPU_FLASH_THREADS or the threads
// attribute says: without XLA's pool each is an OS thread started for the call, and a
// mistyped count (100000) would starve the host. The Python side refuses a count that is not
// a number and says when it cuts one (lab/kernels/native.py, THREADS_PER_CORE); this is the
// guard for a variable changed after that check.
constexpr int64_t kThreadsPerCore = 4;

// read once: hardware_concurrency() reads /sys on every call (glibc's get_nprocs)
int cores() {
  static const int n = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return n;
}

int capped_threads(int64_t n) {
  return static_cast<int>(std::min<int64_t>(n, kThreadsPerCore * cores()));
}

int default_threads() {
  if (const char* env = std::getenv("LAB_CPU_FLASH_THREADS")) {
    const long n = std::strtol(env, nullptr, 10);  // LONG_MAX past the range, never UB
    if (n > 0) return capped_threads(n);
  }
  return cores();
}

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

struct MaskArgs {
  ffi::Buffer<ffi::S32> q_seg, kv_seg, q_len, kv_len, kinds;
  int64_t has_lo, lo, has_hi, hi;
  float softcap;
};

ffi::Error geometry(ffi::AnyBuffer q, ffi::AnyBuffer k, int64_t causal, float scale,
                    int64_t block_q, int64_t block_k, int64_t threads, const MaskArgs& m,
                    Geo* g) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() < 4 || kd.size() != qd.size())
    return ffi::Error::InvalidArgument("cpu_flash: q, k, v must be [..., seq, heads, dim]");
  const size_t n = qd.size();
  g->B = 1;
  for (size_t a = 0; a + 3 < n; ++a) g->B *= qd[a];
  g->L = qd[n - 3], g->H = qd[n - 2], g->K = qd[n - 1];
  g->S = kd[n - 3], g->G = kd[n - 2];
  if (g->G <= 0 || g->H % g->G || kd[n - 1] != g->K)
    return ffi::Error::InvalidArgument("cpu_flash: bad kv heads or head dim");
  if (block_q <= 0 || block_k <= 0 || block_q % kAlign || block_k % kAlign)
    return ffi::Error::InvalidArgument("cpu_flash: block sizes must be multiples of 32");
  g->R = g->H / g->G;
  g->Kp = round_up(g->K, kAlign);
  g->bq = block_q, g->bk = block_k;
  g->nq = round_up(g->L, g->bq) / g->bq, g->nk = round_up(g->S, g->bk) / g->bk;
  g->causal = causal != 0;
  g->scale = scale;
  g->threads = threads > 0 ? capped_threads(threads) : default_threads();
  if (m.q_seg.element_count() != static_cast<size_t>(g->B * g->L) ||
      m.kv_seg.element_count() != static_cast<size_t>(g->B * g->S) ||
      m.q_len.element_count() != static_cast<size_t>(g->B) ||
      m.kv_len.element_count() != static_cast<size_t>(g->B) ||
      m.kinds.element_count() != static_cast<size_t>(g->B * g->nq * g->nk))
    return ffi::Error::InvalidArgument("cpu_flash: mask arrays do not match q and k");
  g->softcap = m.softcap;
  g->has_lo = m.has_lo != 0, g->lo = m.lo, g->has_hi = m.has_hi != 0, g->hi = m.hi;
  g->q_seg = m.q_seg.typed_data(), g->kv_seg = m.kv_seg.typed_data();
  {  // one segment everywhere (no packed sequences): the rows' runs are the whole mask
    const int32_t* qs = g->q_seg;
    const int32_t* ks = g->kv_seg;
    const int64_t nq = g->B * g->L, nk = g->B * g->S;
    const int32_t first = nq ? qs[0] : (nk ? ks[0] : 0);
    g->segments = std::any_of(qs, qs + nq, [&](int32_t x) { return x != first; }) ||
                  std::any_of(ks, ks + nk, [&](int32_t x) { return x != first; });
  }
  g->q_len = m.q_len.typed_data(), g->kv_len = m.kv_len.typed_data();
  g->kinds = m.kinds.typed_data();
  return ffi::Error::Success();
}

ffi::Error Forward(ffi::ThreadPool xla_pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                   ffi::AnyBuffer v, ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> kv_seg,
                   ffi::Buffer<ffi::S32> q_len, ffi::Buffer<ffi::S32> kv_len,
                   ffi::Buffer<ffi::S32> kinds, ffi::Result<ffi::AnyBuffer> o,
                   ffi::Result<ffi::Buffer<ffi::F32>> lse, int64_t causal, float scale,
                   int64_t block_q, int64_t block_k, int64_t threads, int64_t has_lo,
                   int64_t lo, int64_t has_hi, int64_t hi, float softcap) {
  PoolScope on_xla_threads(&xla_pool);
  Geo g;
  const MaskArgs m{q_seg, kv_seg, q_len, kv_len, kinds, has_lo, lo, has_hi, hi, softcap};
  if (auto e = geometry(q, k, causal, scale, block_q, block_k, threads, m, &g); e.failure())
    return e;
  if (g.B * g.L == 0 || g.H == 0 || g.K == 0) return ffi::Error::Success();
  float* lse_p = lse->typed_data();
  if (q.element_type() == ffi::DataType::F32) {
    forward(g, static_cast<const float*>(q.untyped_data()),
            static_cast<const float*>(k.untyped_data()),
            static_cast<const float*>(v.untyped_data()), static_cast<float*>(o->untyped_data()),
            lse_p);
  } else if (q.element_type() == ffi::DataType::BF16) {
    forward(g, static_cast<const uint16_t*>(q.untyped_data()),
            static_cast<const uint16_t*>(k.untyped_data()),
            static_cast<const uint16_t*>(v.untyped_data()),
            static_cast<uint16_t*>(o->untyped_data()), lse_p);
  } else {
    return ffi::Error::InvalidArgument("cpu_flash: dtypes float32 and bfloat16 only");
  }
  release_scratch();
  return ffi::Error::Success();
}

// One pass needs its (batch, kv head) items to spread evenly over the threads: a whole number
// of items per thread, or enough that the last round's idle threads cost little.
bool fused_backward(const Geo& g) {
  if (const char* env = std::getenv("LAB_CPU_FLASH_BACKWARD")) {
    if (std::string(env) == "two-pass") return false;
    if (std::string(env) == "fused") return true;
  }
  const int64_t items = g.B * g.G;
  return items % g.threads == 0 || items >= 4 * g.threads;
}

template <typename T>
void backward(const Geo& g, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
              ffi::AnyBuffer o, const float* lse, ffi::AnyBuffer d_o, void* dq, void* dk,
              void* dv) {
  auto in = [](ffi::AnyBuffer x) { return static_cast<const T*>(x.untyped_data()); };
  std::vector<float> delta(g.B * g.H * g.L);
  row_deltas(g, in(o), in(d_o), delta.data());
  if (fused_backward(g)) {
    backward_fused(g, in(q), in(k), in(v), lse, delta.data(), in(d_o), static_cast<T*>(dq),
                   static_cast<T*>(dk), static_cast<T*>(dv));
    return;
  }
  backward_dq(g, in(q), in(k), in(v), lse, delta.data(), in(d_o), static_cast<T*>(dq));
  backward_dkdv(g, in(q), in(k), in(v), lse, delta.data(), in(d_o), static_cast<T*>(dk),
                static_cast<T*>(dv));
}

ffi::Error Backward(ffi::ThreadPool xla_pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                    ffi::AnyBuffer v, ffi::AnyBuffer o,
                    ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer d_o, ffi::Buffer<ffi::S32> q_seg,
                    ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::S32> q_len,
                    ffi::Buffer<ffi::S32> kv_len, ffi::Buffer<ffi::S32> kinds,
                    ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                    ffi::Result<ffi::AnyBuffer> dv, int64_t causal, float scale,
                    int64_t block_q, int64_t block_k, int64_t threads, int64_t has_lo,
                    int64_t lo, int64_t has_hi, int64_t hi, float softcap) {
  PoolScope on_xla_threads(&xla_pool);
  Geo g;
  const MaskArgs m{q_seg, kv_seg, q_len, kv_len, kinds, has_lo, lo, has_hi, hi, softcap};
  if (auto e = geometry(q, k, causal, scale, block_q, block_k, threads, m, &g); e.failure())
    return e;
  if (g.B * g.S * g.G * g.K == 0) {  // no key: no gradient reaches q either
    std::memset(dq->untyped_data(), 0, dq->size_bytes());
    return ffi::Error::Success();
  }
  if (g.L == 0) {  // no query: no gradient reaches k or v
    std::memset(dk->untyped_data(), 0, dk->size_bytes());
    std::memset(dv->untyped_data(), 0, dv->size_bytes());
    return ffi::Error::Success();
  }
  void *dq_p = dq->untyped_data(), *dk_p = dk->untyped_data(), *dv_p = dv->untyped_data();
  if (q.element_type() == ffi::DataType::F32)
    backward<float>(g, q, k, v, o, lse.typed_data(), d_o, dq_p, dk_p, dv_p);
  else if (q.element_type() == ffi::DataType::BF16)
    backward<uint16_t>(g, q, k, v, o, lse.typed_data(), d_o, dq_p, dk_p, dv_p);
  else
    return ffi::Error::InvalidArgument("cpu_flash: dtypes float32 and bfloat16 only");
  release_scratch();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LabCpuFlashForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()  // XLA's intra-op threads
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_seg [B, L]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_seg [B, S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_len [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_len [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kinds [B, nq, nk]
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse
                                  .Attr<int64_t>("causal")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("block_q")
                                  .Attr<int64_t>("block_k")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("has_lo")
                                  .Attr<int64_t>("lo")
                                  .Attr<int64_t>("has_hi")
                                  .Attr<int64_t>("hi")
                                  .Attr<float>("softcap"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LabCpuFlashBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()  // XLA's intra-op threads
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Arg<ffi::AnyBuffer>()  // out
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lse
                                  .Arg<ffi::AnyBuffer>()  // dout
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_seg [B, L]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_seg [B, S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_len [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_len [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kinds [B, nq, nk]
                                  .Ret<ffi::AnyBuffer>()  // dq
                                  .Ret<ffi::AnyBuffer>()  // dk
                                  .Ret<ffi::AnyBuffer>()  // dv
                                  .Attr<int64_t>("causal")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("block_q")
                                  .Attr<int64_t>("block_k")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("has_lo")
                                  .Attr<int64_t>("lo")
                                  .Attr<int64_t>("has_hi")
                                  .Attr<int64_t>("hi")
                                  .Attr<float>("softcap"));
