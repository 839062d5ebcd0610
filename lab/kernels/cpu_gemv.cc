// Small-batch matmul for the CPU (decode's GEMV), registered with XLA through jax.ffi
// (cpu_gemv.py builds and loads it).
//
//   y[M, N] = x[M, C] · w[C, N] (· scale[N])
//   y[M, N] = x[M, C] · w[N, C]ᵀ (· scale[N])     transposed=1: a tied model's head, the
//                                               embedding table [V, D] read in place
//
// x is float32 or bfloat16 (the model's compute dtype), w float32, bfloat16 or int8 codes with
// one float32 scale per output column (lab/quant.py's per-channel Int8Weight). The weight is
// read once, in its own dtype, and widened to f32 in registers: an int8 weight is never
// dequantised into memory; its scale is constant along the contraction, so it multiplies the
// f32 sum once per output. Every sum is f32; y takes x's dtype.
//
// Decode is memory-bound: every weight byte is read from memory exactly once per call whatever
// M is. Each thread takes its own run of weight rows (or, for a wide output or a short
// contraction, its own range of columns); at batch 1 it streams them as four long runs side
// by side (`kStreams`; AVX-512 builds off AMD CPUs: sixteen or four adjacent rows) into sums held
// in L1, and with several rows of x it reads them in blocks, a tile of columns at a time, into
// sums held in registers (`tile` says why).
// The inner loop is written with GCC/Clang vector extensions sized to the ISA the build targets
// (AVX-512 with -march=native here; SSE2 or NEON on a portable build). The threads are a
// persistent pool (a decode step makes ~100 of these calls; a thread started per call would
// cost tens of microseconds each).

#include <algorithm>
#include <cmath>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int kVW = 16;
#elif defined(__AVX__)
constexpr int kVW = 8;
#else
constexpr int kVW = 4;
#endif
typedef float vf __attribute__((vector_size(4 * kVW)));

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

// One element and one vector of kVW elements of a weight row, widened to f32.
inline float scalar(const float* p) { return *p; }
inline float scalar(const uint16_t* p) { return bf16_to_f32(*p); }
inline float scalar(const int8_t* p) { return static_cast<float>(*p); }

inline vf vec(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
// The widening loads use intrinsics where the ISA has them: GCC scalarises
// __builtin_convertvector from 8- and 16-bit lanes (a byte extract per element).
inline vf vec(const uint16_t* p) {
#if defined(__AVX512F__)
  const __m512i u = _mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  return (vf)_mm512_castsi512_ps(u);
#elif defined(__AVX2__)
  const __m256i u = _mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  return (vf)_mm256_castsi256_ps(u);
#else
  vf v;
  for (int i = 0; i < kVW; ++i) v[i] = bf16_to_f32(p[i]);
  return v;
#endif
}
inline vf vec(const int8_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (vf)_mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vf v;
  for (int i = 0; i < kVW; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// ------------------------------------------------------------------------- the pool

// A persistent pool whose workers help rather than own: a call is cut into parts, and the
// caller and every awake worker claim parts from one counter until none is left; the caller
// then waits only for parts already being run. A worker that is slow to wake (a busy host,
// more threads than cores) costs nothing: the caller runs its parts. Never a deadlock, even
// when XLA runs two of these calls at once (they share the parts of whichever came first;
// the second caller claims its own parts alone).
class Pool {
 public:
  explicit Pool(int workers) {
    for (int t = 1; t < workers; ++t) threads_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      gen_.fetch_add(1);
    }
    start_.notify_all();
    for (auto& t : threads_) t.join();
  }
  int size() const { return static_cast<int>(threads_.size()) + 1; }

  // fn(i) for every i in [0, parts), on the caller and the pool's threads.
  void run(int parts, const std::function<void(int)>& fn) {
    std::unique_lock<std::mutex> call(call_mu_, std::try_to_lock);
    if (!call.owns_lock() || threads_.empty() || parts <= 1) {
      for (int i = 0; i < parts; ++i) fn(i);
      return;
    }
    const uint64_t g = gen_.load() + 1;
    job_ = &fn;
    parts_.store(parts);
    done_.store(0);
    ticket_.store(g << 32, std::memory_order_release);
    {
      std::lock_guard<std::mutex> lock(mu_);
      gen_.store(g);
    }
    start_.notify_all();
    claim(g);
    for (int spin = 0; done_.load(std::memory_order_acquire) < parts; ++spin)
      if (spin > 1024) std::this_thread::yield();
  }

 private:
  // Run unclaimed parts of generation g until none is left.
  void claim(uint64_t g) {
    for (;;) {
      uint64_t t = ticket_.load(std::memory_order_acquire);
      const int parts = parts_.load();
      if ((t >> 32) != g || static_cast<int>(t & 0xffffffffu) >= parts) return;
      if (!ticket_.compare_exchange_weak(t, t + 1)) continue;
      (*job_)(static_cast<int>(t & 0xffffffffu));
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      // spin a little first: decode calls the kernel back to back
      for (int spin = 0; spin < 2000 && gen_.load(std::memory_order_acquire) == seen; ++spin) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      }
      {
        std::unique_lock<std::mutex> lock(mu_);
        start_.wait(lock, [&] { return gen_.load() != seen; });
        seen = gen_.load();
        if (stop_) return;
      }
      claim(seen);
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mu_, call_mu_;
  std::condition_variable start_;
  std::atomic<uint64_t> gen_{0}, ticket_{0};
  std::atomic<int> parts_{0}, done_{0};
  const std::function<void(int)>* job_ = nullptr;
  bool stop_ = false;
};

// At most this many threads per core, whatever LAB_CPU_GEMV_THREADS says: each is an OS
// thread of the pool, and a mistyped count (100000) would starve the host. The Python side
// refuses a count that is not a number and says when it cuts one (lab/kernels/native.py,
// THREADS_PER_CORE); this is the guard for a variable changed after that check.
constexpr long kThreadsPerCore = 4;

int default_threads() {
  // The core count is read once: hardware_concurrency() reads /sys on every call (glibc's
  // get_nprocs), several microseconds in a VM, paid by every call of the kernel; decode
  // makes ~100 calls a step, each tens of microseconds.
  static const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (const char* env = std::getenv("LAB_CPU_GEMV_THREADS")) {
    const long n = std::strtol(env, nullptr, 10);  // LONG_MAX past the range, never UB
    if (n > 0) return static_cast<int>(std::min(n, kThreadsPerCore * cores));
  }
  return cores;
}

Pool& pool() {
  static Pool p(default_threads());
  return p;
}

// ------------------------------------------------------------------------- the kernel

// At batch 1 the weight rows are read in one of two layouts (`long_streams`, below):
//
// Four long streams: a part's rows cut into four runs, one row of each per pass. Four adjacent
// rows are one short stream: a decoder's row is 0.75–8 KiB, so the hardware prefetcher meets
// a new stream every few KiB; the four runs of a 128-row part are 24–256 KiB each. Measured on
// AMD EPYC hosts, 2 threads, one decode step's weights from memory (12 layers of 768 × 768 ×4,
// 768 × 2048 ×2, 2048 × 768), alternated steps in one process, median ratio of the pairs:
// - Zen 3 (AVX2) against four adjacent rows: f32 1.13× (twice), 24.3–26.9 GB/s against
//   21.7–23.6; int8 1.35–1.37× (22.8–23.9 GB/s against 17.0–17.5), 1.11–1.24× with a prefetch
//   kAhead rows ahead in each stream; bf16 1.21–1.32×. Two or eight long streams and one
//   stream were slower than four; a prefetch along each stream no faster (0.5 KiB ahead:
//   +1.4% and −1%; 1–4 KiB: 5–10% slower).
// - Zen 4 (AVX-512) against the AVX-512 adjacent rows below (sixteen f32 rows; four bf16 or
//   int8 rows, prefetched): f32 1.18–1.25× (five runs; 30–35 GB/s against 24–29), bf16
//   1.38–1.47×, int8 1.37–1.56× (two runs); eight long streams 1.18–1.22×, 1.35×, 1.42–1.49×.
//
// Adjacent rows (sixteen for f32 and four, prefetched kAhead rows ahead, for narrower weights)
// are what AVX-512 builds take on other vendors' CPUs: measured on an Intel Xeon host against
// four adjacent rows (below), where the long streams were not measured. Builds without
// AVX-512 take the long streams on every CPU.
constexpr int kStreams = 4;

// On adjacent rows: how many weight rows ahead of the four being read `strip` asks for, for
// weights narrower than f32: the hardware prefetchers alone left one thread reading int8
// weights at 4–5 GB/s from memory against 15 GB/s from L2 (the loop waited on memory, not
// arithmetic); fetching the same columns of the rows two passes ahead doubled it. Measured
// over 4, 8, 12 and 16 rows and against a batch of prefetches per pass: 8 rows per vector read
// won. f32 rows stream fast enough without (with it, f32 decode was slower).
constexpr int64_t kAhead = 8;

// On adjacent rows, f32 weight rows per pass on AVX-512: sixteen, where narrower weights take
// four (their prefetch is tuned to four). Measured on an Intel Xeon (AVX-512) on the decoder's
// shapes (768 × 768, 768 × 2048, 2048 × 768), 2 threads, f32 weights from memory, four
// alternated rounds of all: four rows moved a median 24.5 GB/s, sixteen 27.2 GB/s (a
// read-only stream in C on this host: 23–28 GB/s); eight rows with a prefetch 1 KiB ahead
// 25.9, sixteen with one 512 B ahead 26.0. Other builds take four (sixteen broadcasts of x
// would not fit AVX2's or SSE2's 16 registers beside the sums and the weight vectors).
#if defined(__AVX512F__)
constexpr int kRowsF32 = 16;
#else
constexpr int kRowsF32 = 4;
#endif

// The batch-1 layout: `layout` 1 long streams, 2 adjacent rows, anything else this build's
// choice for the CPU it runs on (the tests take each; the model takes the choice).
bool long_streams(int64_t layout) {
  if (layout == 1) return true;
  if (layout == 2) return false;
#if defined(__AVX512F__) && (defined(__x86_64__) || defined(__i386__))
  // The vendor from CPUID itself (the compiler runtime's CPU table is left empty by some
  // toolchains, which would pass an AMD CPU over in silence).
  static const bool amd = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
    char vendor[13] = {};
    std::memcpy(vendor, &b, 4);
    std::memcpy(vendor + 4, &d, 4);
    std::memcpy(vendor + 8, &c, 4);
    return std::strcmp(vendor, "AuthenticAMD") == 0;
  }();
  return amd;
#else
  return true;
#endif
}

// Ask for the same kVW columns of four consecutive weight rows (`stride` elements apart).
template <typename W>
inline void prefetch(const W* p, int64_t stride) {
  __builtin_prefetch(p);
  __builtin_prefetch(p + stride);
  __builtin_prefetch(p + 2 * stride);
  __builtin_prefetch(p + 3 * stride);
}

// Several rows of x (M > 1: a batch of sequences decoding together) are a small GEMM, not a
// GEMV. A register tile of MR rows of x × NV vectors of columns holds its sums across a block
// of kBlockRows weight rows; each weight vector is loaded and widened once and used by every
// row of the tile. A block's rows are read a tile's width at a time: kBlockRows streams side
// by side, which the hardware prefetchers follow, and the tile asks for its row's next piece
// while it reads this one. Measured on 8 rows, f32 weights from memory, 2 threads, on the
// decoder's shapes (768 × 768, 768 × 2048, 2048 × 768):
// - the batch-1 loop (four weight rows added into sums held in L1: a vector of sums loaded
//   and stored per four FMAs) moved 7–9 GB/s (and 40–54 GFLOP/s on one or two threads with
//   the weights in cache);
// - the tile walking down all C rows of its columns at once (one short read per row, which no
//   prefetcher follows) moved 6–8 GB/s;
// - blocks of 32 rows moved 13–23 GB/s (int8 weights: 1.45–1.6× the batch-1 loop's speed).
constexpr int64_t kBlockRows = 32;

// acc[m, 0 : NV·kVW] (rows `as` floats apart) (+)= x[m, 0 : C] · w[0 : C, 0 : NV·kVW] for MR
// rows of x (x's rows `xs` floats apart, w's rows N elements apart); `first`: acc is not read.
template <int MR, int NV, typename W>
inline void tile(const float* x, int64_t xs, int64_t C, const W* w, int64_t N, float* acc,
                 int64_t as, bool ahead, bool first) {
  vf a[MR][NV] = {};
  if (!first)
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < NV; ++v) std::memcpy(&a[m][v], acc + m * as + v * kVW, sizeof(vf));
  constexpr int64_t kLine = 64 / sizeof(W);  // elements per cache line
  constexpr int64_t kPiece = NV * kVW;
  for (int64_t d = 0; d < C; ++d) {
    const W* r = w + d * N;
    if (ahead)
      for (int64_t e = 0; e < kPiece; e += kLine) __builtin_prefetch(r + kPiece + e);
    vf wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = vec(r + v * kVW);
    for (int m = 0; m < MR; ++m) {
      const float xv = x[m * xs + d];
      for (int v = 0; v < NV; ++v) a[m][v] += xv * wv[v];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) std::memcpy(acc + m * as + v * kVW, &a[m][v], sizeof(vf));
}

// Rows of x per register tile: 8 × 2 vectors of sums are 16 of AVX-512's 32 registers. Other
// builds take 4 × 2, which leaves room in AVX2's or SSE2's 16 for the weight vectors and x's
// broadcasts without spilling.
#if defined(__AVX512F__)
constexpr int64_t kTileRows = 8;
#else
constexpr int64_t kTileRows = 4;
#endif

// tile() over every row of x, kTileRows at a time.
template <int NV, typename W>
inline void tile_rows(const float* x, int64_t M, int64_t xs, int64_t C, const W* w, int64_t N,
                      float* acc, int64_t as, bool ahead, bool first) {
  for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
    const float* xm = x + m0 * xs;
    float* am = acc + m0 * as;
    switch (std::min<int64_t>(kTileRows, M - m0)) {
      case 1: tile<1, NV>(xm, xs, C, w, N, am, as, ahead, first); break;
      case 2: tile<2, NV>(xm, xs, C, w, N, am, as, ahead, first); break;
      case 3: tile<3, NV>(xm, xs, C, w, N, am, as, ahead, first); break;
      case 4: tile<4, NV>(xm, xs, C, w, N, am, as, ahead, first); break;
      case 5: tile<5, NV>(xm, xs, C, w, N, am, as, ahead, first); break;
      case 6: tile<6, NV>(xm, xs, C, w, N, am, as, ahead, first); break;
      case 7: tile<7, NV>(xm, xs, C, w, N, am, as, ahead, first); break;
      default: tile<8, NV>(xm, xs, C, w, N, am, as, ahead, first); break;
    }
  }
}

// Decode at batch 1: acc[0 : width] += Σ_r x[r · xs] · w[r · rs, 0 : width], R weight rows
// per pass (`rs` elements apart: adjacent rows, or one row of each of R long streams), x's R
// values held in registers across the rows, a vector of sums loaded and stored once per R
// FMAs. `ahead`: ask for the rows kAhead further on (adjacent rows only) too.
template <int R, typename W>
inline void rows(const float* x, int64_t xs, const W* w, int64_t rs, int64_t nv, int64_t width,
                 float* acc, bool ahead) {
  float xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x[r * xs];
  for (int64_t j = 0; j < nv; j += kVW) {
    if (ahead) prefetch(w + kAhead * rs + j, rs);
    vf s;
    std::memcpy(&s, acc + j, sizeof s);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) s += xr[r] * vec(w + r * rs + j);
    std::memcpy(acc + j, &s, sizeof s);
  }
  for (int64_t j = nv; j < width; ++j)
    for (int r = 0; r < R; ++r) acc[j] += xr[r] * scalar(w + r * rs + j);
}

// acc[M, width] = x[M, C] · w[C, n0 : n0 + width].
// x's rows are xs floats apart (a part over a run of weight rows passes x and w offset to
// the run's first row, C its length).
template <typename W>
void strip(const float* x, int64_t M, int64_t xs, int64_t C, const W* w, int64_t N, int64_t n0,
           int64_t width, float* acc, bool streams) {
  const int64_t nv = width / kVW * kVW;
  if (M > 1) {  // register tiles of two vectors, then one, then the columns left
    if (C == 0) std::fill(acc, acc + M * width, 0.0f);
    for (int64_t d0 = 0; d0 < C; d0 += kBlockRows) {
      const int64_t kb = std::min<int64_t>(kBlockRows, C - d0);
      const W* wb = w + d0 * N + n0;
      const bool first = d0 == 0;
      int64_t j = 0;
      for (; j + 2 * kVW <= nv; j += 2 * kVW)
        tile_rows<2>(x + d0, M, xs, kb, wb + j, N, acc + j, width, j + 4 * kVW <= nv, first);
      for (; j < nv; j += kVW)
        tile_rows<1>(x + d0, M, xs, kb, wb + j, N, acc + j, width, false, first);
    }
    for (int64_t j = nv; j < width; ++j)
      for (int64_t m = 0; m < M; ++m) {
        float s = 0.0f;
        for (int64_t d = 0; d < C; ++d) s += x[m * xs + d] * scalar(w + d * N + n0 + j);
        acc[m * width + j] = s;
      }
    return;
  }
  std::fill(acc, acc + width, 0.0f);
  int64_t d = 0;
  if (streams) {  // row i of each of the long streams
    const int64_t q = C / kStreams;
    for (int64_t i = 0; i < q; ++i)
      rows<kStreams>(x + i, q, w + i * N + n0, q * N, nv, width, acc, false);
    d = q * kStreams;
  }
  if constexpr (sizeof(W) == 4 && kRowsF32 > 4)
    for (; d + kRowsF32 <= C; d += kRowsF32)
      rows<kRowsF32>(x + d, 1, w + d * N + n0, N, nv, width, acc, false);
  for (; d + 4 <= C; d += 4)
    rows<4>(x + d, 1, w + d * N + n0, N, nv, width, acc, sizeof(W) < 4 && d + 4 + kAhead <= C);
  for (; d < C; ++d) {
    const W* r0 = w + d * N + n0;
    for (int64_t j = 0; j < width; ++j) acc[j] += x[d] * scalar(r0 + j);
  }
}

template <typename T>
void store(const float* acc, int64_t M, int64_t width, const float* scale, int64_t N,
           int64_t n0, T* y) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < width; ++j) {
      float v = acc[m * width + j];
      if (scale) v *= scale[n0 + j];
      if constexpr (sizeof(T) == 4)
        y[m * N + n0 + j] = v;
      else
        y[m * N + n0 + j] = f32_to_bf16(v);
    }
}

constexpr int64_t kAccFloats = 4096;  // one strip's accumulators: 16 KiB, well inside L1

constexpr int64_t kRunRows = 128;  // weight rows per part when the parts split the rows

// Few rows of x and a narrow enough output (all of decode's f32 batch-1 products): the parts
// are runs of kRunRows weight rows, so each part streams one contiguous stretch of memory (a
// column strip reads a short piece of every row: a new page, and a new prefetch stream, every
// few KiB), into its own M × N partial sums, added in a fixed order after (the parts do not
// depend on the thread count: one thread gives the same sums as many).
template <typename W, typename T>
bool gemv_rows(const float* x, int64_t M, int64_t C, const W* w, int64_t N, const float* scale,
               T* y, int threads, bool streams) {
  const int parts = static_cast<int>((C + kRunRows - 1) / kRunRows);
  if (M * N > 32768 || parts < 2) return false;  // partials past L2: the column strips
  std::vector<float> partial(static_cast<size_t>(parts * M * N));
  auto part = [&](int i) {
    const int64_t d0 = i * kRunRows, d1 = std::min(C, d0 + kRunRows);
    strip(x + d0, M, C, d1 - d0, w + d0 * N, N, 0, N, partial.data() + i * M * N, streams);
  };
  if (threads <= 1) {
    for (int i = 0; i < parts; ++i) part(i);
  } else {
    pool().run(parts, part);
  }
  float* sum = partial.data();  // part 0, then every other part added in order: vectorised
  for (int i = 1; i < parts; ++i) {
    const float* p = partial.data() + i * M * N;
    for (int64_t e = 0; e < M * N; ++e) sum[e] += p[e];
  }
  for (int64_t e = 0; e < M * N; ++e) {
    float v = sum[e];
    if (scale) v *= scale[e % N];
    if constexpr (sizeof(T) == 4)
      y[e] = v;
    else
      y[e] = f32_to_bf16(v);
  }
  return true;
}

template <typename W, typename T>
void gemv(const float* x, int64_t M, int64_t C, const W* w, int64_t N, const float* scale,
          T* y, int threads, bool streams) {
  if (gemv_rows(x, M, C, w, N, scale, y, threads, streams)) return;
  // Parts: column strips whose accumulators fit kAccFloats, at least one per thread, each a
  // multiple of the vector width (the last takes the rest).
  const int64_t acc_w = std::max<int64_t>(kVW, kAccFloats / std::max<int64_t>(M, 1) / kVW * kVW);
  const int64_t by_threads = (N + threads - 1) / threads;
  const int64_t width = std::max<int64_t>(
      kVW, (std::min(std::min<int64_t>(acc_w, 1024), by_threads) + kVW - 1) / kVW * kVW);
  const int parts = static_cast<int>((N + width - 1) / width);
  auto part = [&](int i) {
    const int64_t n0 = i * width, n1 = std::min(N, n0 + width);
    std::vector<float> acc(static_cast<size_t>(M * (n1 - n0)));
    strip(x, M, C, C, w, N, n0, n1 - n0, acc.data(), streams);
    store(acc.data(), M, n1 - n0, scale, N, n0, y);
  };
  if (threads <= 1) {
    for (int i = 0; i < parts; ++i) part(i);
  } else {
    pool().run(parts, part);
  }
}

inline float hsum(vf v) {
  float s = 0.0f;
  for (int i = 0; i < kVW; ++i) s += v[i];
  return s;
}

// y[m, n] = Σ_c x[m, c] · w[n, c] for a weight stored [N, C] (rows are output channels):
// each part takes a contiguous run of rows, so every thread streams its own stretch of
// memory; four rows at a time, each dotted with every row of x while it is in L1.
template <typename W, typename T>
void gemv_t(const float* x, int64_t M, int64_t C, const W* w, int64_t N, const float* scale,
            T* y, int threads) {
  const int64_t by_threads = (N + threads - 1) / threads;
  const int64_t run_rows = std::max<int64_t>(4, std::min<int64_t>(256, by_threads) / 4 * 4);
  const int parts = static_cast<int>((N + run_rows - 1) / run_rows);
  const int64_t cv = C / kVW * kVW;
  auto part = [&](int i) {
    const int64_t n0 = i * run_rows, n1 = std::min(N, n0 + run_rows);
    for (int64_t n = n0; n < n1; n += 4) {
      const int64_t k = std::min<int64_t>(4, n1 - n);
      const W* r[4];
      for (int64_t q = 0; q < 4; ++q) r[q] = w + (n + std::min(q, k - 1)) * C;
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = x + m * C;
        vf a0 = {}, a1 = {}, a2 = {}, a3 = {};
        for (int64_t j = 0; j < cv; j += kVW) {
          const vf xv = vec(xm + j);
          a0 += xv * vec(r[0] + j);
          a1 += xv * vec(r[1] + j);
          a2 += xv * vec(r[2] + j);
          a3 += xv * vec(r[3] + j);
        }
        float s[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
        for (int64_t j = cv; j < C; ++j)
          for (int q = 0; q < 4; ++q) s[q] += xm[j] * scalar(r[q] + j);
        for (int64_t q = 0; q < k; ++q) {
          float v = s[q];
          if (scale) v *= scale[n + q];
          if constexpr (sizeof(T) == 4)
            y[m * N + n + q] = v;
          else
            y[m * N + n + q] = f32_to_bf16(v);
        }
      }
    }
  };
  if (threads <= 1) {
    for (int i = 0; i < parts; ++i) part(i);
  } else {
    pool().run(parts, part);
  }
}

template <typename W, typename T>
void dispatch(bool transposed, const float* x, int64_t M, int64_t C, const W* w, int64_t N,
              const float* scale, T* y, int threads, bool streams) {
  if (transposed)
    gemv_t(x, M, C, w, N, scale, y, threads);
  else
    gemv(x, M, C, w, N, scale, y, threads, streams);
}

template <typename T>
void run_typed(ffi::AnyBuffer w, bool transposed, const float* x, int64_t M, int64_t C,
               int64_t N, const float* scale, T* y, int threads, bool streams) {
  const void* p = w.untyped_data();
  switch (w.element_type()) {
    case ffi::DataType::F32:
      return dispatch(transposed, x, M, C, static_cast<const float*>(p), N, scale, y, threads,
                      streams);
    case ffi::DataType::BF16:
      return dispatch(transposed, x, M, C, static_cast<const uint16_t*>(p), N, scale, y,
                      threads, streams);
    default:
      return dispatch(transposed, x, M, C, static_cast<const int8_t*>(p), N, scale, y, threads,
                      streams);
  }
}

// ------------------------------------------------------------------------- decode attention

// One query token per sequence against its cache [B, G, S, K] (lab/kernels/attention/
// decode.py's layout): o[b, g·R + r] = softmax_t(q · k_t · scale) · v_t over the valid slots
// t in [first, length) only (slots past the length are never read, so their garbage never
// reaches the output). An int8 cache's per-slot scales fold into the small operands, the
// cache is read once in its own dtype and widened in registers:
//   s_t = (q · k_code_t) · σ_k[t] · scale,   o = Σ_t (p_t · σ_v[t]) · v_code_t / Σ_t p_t
// A part is one (b, g): its R query heads share the rows of K and V (read from memory once,
// then from L1/L2 for the next head).
template <typename KV>
void attend_group(const float* q, const KV* k, const KV* v, const float* ks, const float* vs,
                  int64_t R, int64_t K, int64_t lo, int64_t hi, float scale, float* o,
                  float* s, float* acc) {
  const int64_t kv = K / kVW * kVW;
  for (int64_t r = 0; r < R; ++r) {
    const float* qr = q + r * K;
    float* orow = o + r * K;
    if (hi <= lo) {
      std::fill(orow, orow + K, 0.0f);
      continue;
    }
    float m = -3.0e38f;
    for (int64_t t = lo; t < hi; ++t) {
      const KV* kt = k + t * K;
      vf a = {};
      for (int64_t j = 0; j < kv; j += kVW) a += vec(qr + j) * vec(kt + j);
      float d = hsum(a);
      for (int64_t j = kv; j < K; ++j) d += qr[j] * scalar(kt + j);
      d *= scale;
      if (ks) d *= ks[t];
      s[t - lo] = d;
      m = std::max(m, d);
    }
    float l = 0.0f;
    for (int64_t t = lo; t < hi; ++t) {
      const float p = std::exp(s[t - lo] - m);
      l += p;
      s[t - lo] = vs ? p * vs[t] : p;
    }
    std::fill(acc, acc + K, 0.0f);
    for (int64_t t = lo; t < hi; ++t) {
      const KV* vt = v + t * K;
      const float p = s[t - lo];
      for (int64_t j = 0; j < kv; j += kVW) {
        vf a;
        std::memcpy(&a, acc + j, sizeof a);
        a += p * vec(vt + j);
        std::memcpy(acc + j, &a, sizeof a);
      }
      for (int64_t j = kv; j < K; ++j) acc[j] += p * scalar(vt + j);
    }
    const float inv = 1.0f / l;
    for (int64_t j = 0; j < K; ++j) orow[j] = acc[j] * inv;
  }
}

template <typename KV>
void decode_attention(const float* q, const KV* k, const KV* v, const int32_t* lengths,
                      const float* ks, const float* vs, int64_t B, int64_t H, int64_t G,
                      int64_t S, int64_t K, float scale, int64_t window, float* o, int threads) {
  const int64_t R = H / G;
  auto part = [&](int i) {
    const int64_t b = i / G, g = i % G;
    const int64_t hi = std::min<int64_t>(std::max<int32_t>(lengths[b], 0), S);
    const int64_t lo = window > 0 ? std::max<int64_t>(hi - window, 0) : 0;
    std::vector<float> scratch(static_cast<size_t>(std::max<int64_t>(hi - lo, 1) + K));
    const int64_t row = (b * G + g) * S;
    attend_group(q + (b * H + g * R) * K, k + row * K, v + row * K, ks ? ks + row : nullptr,
                 vs ? vs + row : nullptr, R, K, lo, hi, scale, o + (b * H + g * R) * K,
                 scratch.data(), scratch.data() + std::max<int64_t>(hi - lo, 1));
  };
  const int parts = static_cast<int>(B * G);
  if (threads <= 1) {
    for (int i = 0; i < parts; ++i) part(i);
  } else {
    pool().run(parts, part);
  }
}

ffi::Error DecodeAttention(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::F32> k_scale,
                           ffi::Buffer<ffi::F32> v_scale, ffi::Result<ffi::Buffer<ffi::F32>> o,
                           float scale, int64_t window, int64_t threads) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || qd[0] != kd[0] || qd[2] != kd[3] || kd[1] == 0 ||
      qd[1] % kd[1] != 0)
    return ffi::Error::InvalidArgument(
        "cpu decode attention: q [B, H, K] and caches [B, G, S, K] with H a multiple of G");
  if (k.element_type() != v.element_type() || k.dimensions().size() != v.dimensions().size())
    return ffi::Error::InvalidArgument("cpu decode attention: keys and values alike");
  const int64_t B = kd[0], G = kd[1], S = kd[2], K = kd[3], H = qd[1];
  if (lengths.element_count() != B)
    return ffi::Error::InvalidArgument("cpu decode attention: one length per sequence");
  const bool quantized = k.element_type() == ffi::DataType::S8;
  if (quantized != (k_scale.element_count() == B * G * S) ||
      v_scale.element_count() != k_scale.element_count())
    return ffi::Error::InvalidArgument(
        "cpu decode attention: an int8 cache needs [B, G, 1, S] scales, a float one none");
  const float* ks = quantized ? k_scale.typed_data() : nullptr;
  const float* vs = quantized ? v_scale.typed_data() : nullptr;
  const int n_threads = threads > 0 ? static_cast<int>(threads) : default_threads();
  const int32_t* len = lengths.typed_data();
  float* out = o->typed_data();
  switch (k.element_type()) {
    case ffi::DataType::F32:
      decode_attention(q.typed_data(), static_cast<const float*>(k.untyped_data()),
                       static_cast<const float*>(v.untyped_data()), len, ks, vs, B, H, G, S, K,
                       scale, window, out, n_threads);
      break;
    case ffi::DataType::BF16:
      decode_attention(q.typed_data(), static_cast<const uint16_t*>(k.untyped_data()),
                       static_cast<const uint16_t*>(v.untyped_data()), len, ks, vs, B, H, G, S,
                       K, scale, window, out, n_threads);
      break;
    case ffi::DataType::S8:
      decode_attention(q.typed_data(), static_cast<const int8_t*>(k.untyped_data()),
                       static_cast<const int8_t*>(v.untyped_data()), len, ks, vs, B, H, G, S, K,
                       scale, window, out, n_threads);
      break;
    default:
      return ffi::Error::InvalidArgument("cpu decode attention: a float32, bfloat16 or int8 cache");
  }
  return ffi::Error::Success();
}

ffi::Error Gemv(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scale,
                ffi::Result<ffi::AnyBuffer> y, int64_t threads, int64_t transposed,
                int64_t layout) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[transposed ? 1 : 0])
    return ffi::Error::InvalidArgument("cpu_gemv: x must be [M, C] and w [C, N] (or [N, C])");
  const int64_t M = xd[0], C = xd[1], N = wd[transposed ? 0 : 1];
  const int64_t n_scale = scale.element_count();
  if (n_scale != 0 && n_scale != N)
    return ffi::Error::InvalidArgument("cpu_gemv: scale must hold one value per column or none");
  const auto wt = w.element_type(), xt = x.element_type();
  if (wt != ffi::DataType::F32 && wt != ffi::DataType::BF16 && wt != ffi::DataType::S8)
    return ffi::Error::InvalidArgument("cpu_gemv: weights float32, bfloat16 or int8 only");
  if (xt != ffi::DataType::F32 && xt != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("cpu_gemv: x float32 or bfloat16 only");
  if (M * N == 0) return ffi::Error::Success();
  // x widened to f32 once (it is small: M rows of C)
  std::vector<float> xf(static_cast<size_t>(M * C));
  if (xt == ffi::DataType::F32) {
    std::memcpy(xf.data(), x.untyped_data(), xf.size() * 4);
  } else {
    const uint16_t* xs = static_cast<const uint16_t*>(x.untyped_data());
    for (size_t i = 0; i < xf.size(); ++i) xf[i] = bf16_to_f32(xs[i]);
  }
  const float* sc = n_scale ? scale.typed_data() : nullptr;
  const int n_threads = threads > 0 ? static_cast<int>(threads) : default_threads();
  const bool streams = long_streams(layout);
  if (xt == ffi::DataType::F32)
    run_typed(w, transposed != 0, xf.data(), M, C, N, sc, static_cast<float*>(y->untyped_data()),
              n_threads, streams);
  else
    run_typed(w, transposed != 0, xf.data(), M, C, N, sc,
              static_cast<uint16_t*>(y->untyped_data()), n_threads, streams);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LabCpuGemv, Gemv,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x [M, C]
                                  .Arg<ffi::AnyBuffer>()  // w [C, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [N] or [0]
                                  .Ret<ffi::AnyBuffer>()  // y [M, N]
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("transposed")
                                  .Attr<int64_t>("layout"));  // batch 1: long_streams()

XLA_FFI_DEFINE_HANDLER_SYMBOL(LabCpuDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [B, H, K]
                                  .Arg<ffi::AnyBuffer>()  // k [B, G, S, K]
                                  .Arg<ffi::AnyBuffer>()  // v [B, G, S, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k scales [B, G, 1, S] or [0]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v scales [B, G, 1, S] or [0]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o [B, H, K]
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("threads"));
