// CPU kernels of the engine's execution path, built at first use by engine/kernels.py (torch.utils.cpp_extension,
// -O3 -march=native).
//
// Each has a torch reference (engine/kernels.py TorchOps) that tests/engine/test_kernels.py compares it with.
// Elementwise kernels round to the tensor dtype exactly where the reference stores an intermediate tensor, so bf16
// results match it except where a reduction sums in another order. Math is fp32; tensors are float32, bfloat16 or
// float16. Hot loops use AVX-512 where the compiler targets it (explicitly: GCC leaves these loops scalar), 8-lane
// AVX2 where it has AVX2 + FMA but no AVX-512, and a scalar path elsewhere; all compute the same formulas.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RAYPD_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// A CPU with AVX2 but no AVX-512 (Zen 1-3, Haswell to Comet Lake): the loops GCC leaves scalar (exps, argmaxes, the
// decode attention's dot products) get 8-lane paths of their own.
#define RAYPD_AVX2 1
#include <immintrin.h>
#endif

// The dtypes a model runs in (no double).
#define DISPATCH_FLOATS(TYPE, NAME, ...)                                                            \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                          \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace {

// ---- scalars ----
inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_f(c10::Half x) { return static_cast<float>(x); }

template <typename T> inline T from_f(float x);
template <> inline float from_f<float>(float x) { return x; }
template <> inline c10::BFloat16 from_f<c10::BFloat16>(float x) {
  // Round to nearest even, as torch's own float -> bfloat16 conversion does.
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  uint16_t out = std::isnan(x) ? uint16_t(0x7FC0) : uint16_t((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16);
  return c10::BFloat16(out, c10::BFloat16::from_bits());
}
template <> inline c10::Half from_f<c10::Half>(float x) { return c10::Half(x); }

// Rounds a float to T's precision and back: where the torch reference stores an intermediate tensor in T.
template <typename T> inline float round_to(float x) { return to_f(from_f<T>(x)); }

// exp, Cephes' single-precision polynomial (~1 ulp), clamped to where float neither overflows nor goes subnormal.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

inline float exp_f(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * kLog2e + 0.5f);
  const float r = x - n * kLn2Hi - n * kLn2Lo;
  float p = kP0;
  p = p * r + kP1;
  p = p * r + kP2;
  p = p * r + kP3;
  p = p * r + kP4;
  p = p * r + kP5;
  p = p * r * r + r + 1.0f;
  // p * 2^n, the power built from its bits (n is within [-125, 127] after the clamp): ldexp's exact result, without
  // a library call that would keep a loop of exps from being vectorized
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline float silu_f(float x) { return x / (1.f + exp_f(-x)); }

#ifdef RAYPD_AVX512
// ---- 16 floats at a time ----
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// float -> bfloat16 bits (round to nearest even, NaN -> 0x7FC0) in the low half of each 32-bit lane
inline __m512i bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  __m512i out = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(out, nan, _mm512_set1_epi32(0x7FC0));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
}
inline void store16(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

template <typename T> inline __m512 round16(__m512 v);
template <> inline __m512 round16<float>(__m512 v) { return v; }
template <> inline __m512 round16<c10::BFloat16>(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}
template <> inline __m512 round16<c10::Half>(__m512 v) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kP0);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP5));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __m512 silu16(__m512 x) {
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

// [sum(v[0]), ..., sum(v[15])]: 16 horizontal sums in 15 shuffle-and-add steps instead of 16 separate reductions.
inline __m512 hsum16(const __m512* v) {
  __m512 w[4];
  for (int q = 0; q < 4; ++q) {
    const __m512* a = v + 4 * q;
    // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] for pairs (v0, v1) and (v2, v3)
    const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
    const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
    // per lane: that lane's sum of each of the four vectors
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1));
    w[q] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  // sum the four lanes: pairs of lanes, then pairs of pairs
  const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
  const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x88), _mm512_shuffle_f32x4(w[2], w[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}
#endif

#ifdef RAYPD_AVX2
// ---- 8 floats at a time (AVX2 + FMA + F16C), the same formulas as the 16-lane helpers above ----
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// float -> bfloat16 bits (round to nearest even, NaN -> 0x7FC0) in the low half of each 32-bit lane
inline __m256i bf16_bits8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  const __m256i out = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(out, _mm256_set1_epi32(0x7FC0), nan);
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i b = bf16_bits8(v);  // each lane < 0x10000: the unsigned-saturating pack keeps it
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}
inline void store8(c10::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

template <typename T> inline __m256 round8(__m256 v);
template <> inline __m256 round8<float>(__m256 v) { return v; }
template <> inline __m256 round8<c10::BFloat16>(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
}
template <> inline __m256 round8<c10::Half>(__m256 v) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kP0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  // 2^n from its bits: n is within [-126, 127] after the clamp
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

inline __m256 silu8(__m256 x) {
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#endif

void check_cpu(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

// ---- paged KV: write ----
template <typename T>
void write_kv_impl(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache, torch::Tensor& v_cache,
                   const torch::Tensor& slot_blocks, const torch::Tensor& slot_offsets) {
  const int64_t tokens = k.size(0), row = k.size(1) * k.size(2);
  const int64_t* blocks = slot_blocks.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  const int64_t c0 = k_cache.stride(0), c1 = k_cache.stride(1);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t dst = blocks[t] * c0 + offsets[t] * c1;
    std::memcpy(kc + dst, kp + t * ks, row * sizeof(T));
    std::memcpy(vc + dst, vp + t * vs, row * sizeof(T));
  }
}

// k, v: (T, kv_heads, head_dim), each token's (kv_heads, head_dim) contiguous (views into the qkv output are).
// k_cache, v_cache: (num_blocks, block_size, kv_heads, head_dim) views of the arena, each slot contiguous.
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_blocks, torch::Tensor slot_offsets) {
  for (auto* t : {&k, &v, &k_cache, &v_cache}) check_cpu(*t, "write_kv tensor");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "write_kv: k and v must be (T, kv_heads, head_dim)");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2) &&
              v_cache.sizes() == k_cache.sizes(), "write_kv: cache must be (blocks, block_size, kv_heads, head_dim)");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "write_kv: each token's k and v must be contiguous");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3) &&
              v_cache.strides() == k_cache.strides(), "write_kv: each cache slot must be contiguous");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type() &&
              k.scalar_type() == v.scalar_type(), "write_kv: k/v and cache dtypes differ");
  TORCH_CHECK(slot_blocks.scalar_type() == torch::kLong && slot_offsets.scalar_type() == torch::kLong &&
              slot_blocks.is_contiguous() && slot_offsets.is_contiguous() && slot_blocks.numel() == k.size(0) &&
              slot_offsets.numel() == k.size(0), "write_kv: slots must be contiguous int64 (T,)");
  DISPATCH_FLOATS(k.scalar_type(), "write_kv", [&] {
    write_kv_impl<scalar_t>(k, v, k_cache, v_cache, slot_blocks, slot_offsets);
  });
}

// ---- paged KV: decode attention, read in place ----
// One (sequence, KV head) item: its `group` query heads attend the same keys, so each key and value row is read
// (and converted to fp32) once for all of them. Scores are kept for the whole context (two passes: scores and
// softmax, then the weighted sum of values). Where each key row lives is worked out once per item, block by block
// (`offs`, shared by keys and values: both caches have the same strides), so the hot loops do no division.
struct DecodeItem {
  const float* q;  // (group, dim) queries, already multiplied by the scale
  int64_t group, dim, n;  // n keys, at element offsets offs[0..n) of the cache base
  const int64_t* offs;
};

// The element offset of each of the keys [first, first + n) of a sequence: table[p / bs] * c0 + (p % bs) * c1 + kv.
inline void row_offsets(int64_t* offs, const int32_t* table, int64_t first, int64_t n, int64_t block_size,
                        int64_t c0, int64_t c1, int64_t kv_offset) {
  int64_t block = first / block_size, slot = first % block_size;
  int64_t base = table[block] * c0 + kv_offset;
  for (int64_t j = 0; j < n; ++j) {
    offs[j] = base + slot * c1;
    if (++slot == block_size) {
      slot = 0;
      if (j + 1 < n) base = table[++block] * c0 + kv_offset;
    }
  }
}

// The scalar path (neither AVX-512 nor AVX2 + FMA) is written for the compiler's vectorizer: a float sum it may not
// reorder stays scalar, so reductions keep eight partial sums and exps are computed in a loop of their own.
template <typename T>
inline float dot_row(const float* q, const T* k, int64_t dim) {
  float lanes[8] = {};
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += q[d + l] * to_f(k[d + l]);
  float dot = 0.f;
  for (; d < dim; ++d) dot += q[d] * to_f(k[d]);
  for (int l = 0; l < 8; ++l) dot += lanes[l];
  return dot;
}

inline float sum_lanes(const float* s, int64_t n) {
  float lanes[8] = {};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += s[j + l];
  float sum = 0.f;
  for (; j < n; ++j) sum += s[j];
  for (int l = 0; l < 8; ++l) sum += lanes[l];
  return sum;
}

// scores (group, n_pad) <- q . k, then softmax in place over the first n of each row
template <typename T>
void scores_softmax_scalar(const T* kc, const DecodeItem& it, float* scores, int64_t n_pad) {
  for (int64_t j = 0; j < it.n; ++j) {
    const T* k = kc + it.offs[j];
    for (int64_t g = 0; g < it.group; ++g) scores[g * n_pad + j] = dot_row(it.q + g * it.dim, k, it.dim);
  }
  for (int64_t g = 0; g < it.group; ++g) {
    float* s = scores + g * n_pad;
    const float mx = *std::max_element(s, s + it.n);
    for (int64_t j = 0; j < it.n; ++j) s[j] = exp_f(s[j] - mx);
    const float inv = 1.f / sum_lanes(s, it.n);
    for (int64_t j = 0; j < it.n; ++j) s[j] *= inv;
  }
}

template <typename T>
void weighted_values_scalar(const T* vc, const DecodeItem& it, const float* probs, int64_t n_pad, float* acc) {
  std::fill(acc, acc + it.group * it.dim, 0.f);
  for (int64_t j = 0; j < it.n; ++j) {
    const T* v = vc + it.offs[j];
    for (int64_t g = 0; g < it.group; ++g)
      for (int64_t d = 0; d < it.dim; ++d) acc[g * it.dim + d] += probs[g * n_pad + j] * to_f(v[d]);
  }
}

#ifdef RAYPD_AVX512
// softmax in place over the first n of each of the group's score rows (group, n_pad); padding gets probability 0
inline void softmax_rows(float* scores, int64_t group, int64_t n, int64_t n_pad) {
  const int64_t full = n / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - full)) - 1);
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * n_pad;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < full; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
    if (tail) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_loadu_ps(s + full));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n_pad; j += 16) {
      __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), m));
      if (j == full) e = _mm512_maskz_mov_ps(tail, e);
      _mm512_storeu_ps(s + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
    for (int64_t j = 0; j < n_pad; j += 16) _mm512_storeu_ps(s + j, _mm512_mul_ps(_mm512_loadu_ps(s + j), inv));
  }
}

// The fp32 rows of one chunk of up to 16 keys starting at key c: the cache rows themselves for fp32, else
// converted into buf; rows past the context point at zeros.
template <typename T>
void chunk_rows(const T* cache, const DecodeItem& it, int64_t c, float* buf, const float* zeros, const float** rows) {
  const int64_t cnt = std::min<int64_t>(16, it.n - c), dv = it.dim / 16;
  for (int64_t j = 0; j < 16; ++j) {
    if (j >= cnt) {
      rows[j] = zeros;
    } else if constexpr (std::is_same_v<T, float>) {
      rows[j] = cache + it.offs[c + j];
    } else {
      const T* src = cache + it.offs[c + j];
      for (int64_t i = 0; i < dv; ++i) _mm512_storeu_ps(buf + j * it.dim + 16 * i, load16(src + 16 * i));
      rows[j] = buf + j * it.dim;
    }
  }
}

template <typename T>
void scores_softmax_avx512(const T* kc, const DecodeItem& it, float* scores, int64_t n_pad, float* kbuf,
                           const float* zeros) {
  const int64_t dim = it.dim, dv = dim / 16;
  const float* rows[16];
  for (int64_t c = 0; c < it.n; c += 16) {
    chunk_rows(kc, it, c, kbuf, zeros, rows);  // converted once, read by every query head of the group
    for (int64_t g = 0; g < it.group; ++g) {
      const float* q = it.q + g * dim;
      __m512 part[16];
      for (int64_t j = 0; j < 16; ++j) part[j] = _mm512_setzero_ps();
      for (int64_t i = 0; i < dv; ++i) {
        const __m512 qv = _mm512_loadu_ps(q + 16 * i);
        for (int64_t j = 0; j < 16; ++j) part[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(rows[j] + 16 * i), part[j]);
      }
      _mm512_storeu_ps(scores + g * n_pad + c, hsum16(part));
    }
  }
  softmax_rows(scores, it.group, it.n, n_pad);
}

#ifdef __AVX512BF16__
// bf16 keys: q . k straight from the bf16 rows with VDPBF16PS (bf16 products are exact in fp32, sums in fp32), no
// conversion pass; the scale multiplies the sums. q: the group's unscaled bf16 query rows, q_stride apart.
void scores_softmax_bf16(const c10::BFloat16* kc, const DecodeItem& it, const c10::BFloat16* q, int64_t q_stride,
                         float scale, float* scores, int64_t n_pad, const c10::BFloat16* zeros) {
  const int64_t dw = it.dim / 32;  // 32 bf16 per vector
  const __m512 sv = _mm512_set1_ps(scale);
  const c10::BFloat16* rows[16];
  for (int64_t c = 0; c < it.n; c += 16) {
    const int64_t cnt = std::min<int64_t>(16, it.n - c);
    for (int64_t j = 0; j < 16; ++j) rows[j] = j < cnt ? kc + it.offs[c + j] : zeros;
    for (int64_t g = 0; g < it.group; ++g) {
      __m512 part[16];
      for (int64_t j = 0; j < 16; ++j) part[j] = _mm512_setzero_ps();
      for (int64_t i = 0; i < dw; ++i) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + g * q_stride + 32 * i);
        for (int64_t j = 0; j < 16; ++j)
          part[j] = _mm512_dpbf16_ps(part[j], qv, (__m512bh)_mm512_loadu_si512(rows[j] + 32 * i));
      }
      _mm512_storeu_ps(scores + g * n_pad + c, _mm512_mul_ps(hsum16(part), sv));
    }
  }
  softmax_rows(scores, it.group, it.n, n_pad);
}
#endif

// acc (group, dim) <- probs . values. Each value row is loaded (and converted to fp32) once for GB query heads at a
// time; the GB x DV accumulators stay in registers across the whole context. With few accumulators, even and odd
// keys go to two sets, so the FMA chains overlap instead of waiting on each other.
template <typename T, int DV, int GB>
void weighted_values_regs(const T* vc, const DecodeItem& it, const float* probs, int64_t n_pad, float* acc) {
  constexpr int kSets = GB * DV <= 8 ? 2 : 1;
  for (int64_t g0 = 0; g0 < it.group; g0 += GB) {
    __m512 a[kSets][GB][DV];
    for (int s = 0; s < kSets; ++s)
      for (int b = 0; b < GB; ++b)
        for (int i = 0; i < DV; ++i) a[s][b][i] = _mm512_setzero_ps();
    const float* p = probs + g0 * n_pad;
    int64_t j = 0;
    auto key = [&](int s, int64_t jj) {
      const T* r = vc + it.offs[jj];
      __m512 v[DV];
      for (int i = 0; i < DV; ++i) v[i] = load16(r + 16 * i);
      for (int b = 0; b < GB; ++b) {
        const __m512 pb = _mm512_set1_ps(p[b * n_pad + jj]);
        for (int i = 0; i < DV; ++i) a[s][b][i] = _mm512_fmadd_ps(pb, v[i], a[s][b][i]);
      }
    };
    for (; j + kSets <= it.n; j += kSets)
      for (int s = 0; s < kSets; ++s) key(s, j + s);
    for (; j < it.n; ++j) key(0, j);
    for (int b = 0; b < GB; ++b)
      for (int i = 0; i < DV; ++i) {
        __m512 sum = a[0][b][i];
        for (int s = 1; s < kSets; ++s) sum = _mm512_add_ps(sum, a[s][b][i]);
        _mm512_storeu_ps(acc + (g0 + b) * it.dim + 16 * i, sum);
      }
  }
}

// Head dims past 128 (more vectors than registers to spare): chunks of 16 keys, accumulators in memory.
template <typename T>
void weighted_values_chunked(const T* vc, const DecodeItem& it, const float* probs, int64_t n_pad, float* acc,
                             float* vbuf, const float* zeros) {
  const int64_t dim = it.dim, dv = dim / 16;
  const float* rows[16];
  std::fill(acc, acc + it.group * dim, 0.f);
  for (int64_t c = 0; c < it.n; c += 16) {
    const int64_t cnt = std::min<int64_t>(16, it.n - c);
    chunk_rows(vc, it, c, vbuf, zeros, rows);
    for (int64_t g = 0; g < it.group; ++g) {
      const float* p = probs + g * n_pad + c;
      float* a = acc + g * dim;
      for (int64_t i = 0; i < dv; ++i) {
        __m512 sum = _mm512_loadu_ps(a + 16 * i);
        for (int64_t j = 0; j < cnt; ++j) sum = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_loadu_ps(rows[j] + 16 * i), sum);
        _mm512_storeu_ps(a + 16 * i, sum);
      }
    }
  }
}

template <typename T, int DV>
void weighted_values_dv(const T* vc, const DecodeItem& it, const float* probs, int64_t n_pad, float* acc) {
  // as many query heads per pass as divide the group and leave registers for the row and the broadcasts
  if constexpr (DV <= 4) {
    if (it.group % 4 == 0) return weighted_values_regs<T, DV, 4>(vc, it, probs, n_pad, acc);
  }
  if (it.group % 2 == 0) return weighted_values_regs<T, DV, 2>(vc, it, probs, n_pad, acc);
  weighted_values_regs<T, DV, 1>(vc, it, probs, n_pad, acc);
}

template <typename T>
void weighted_values_avx512(const T* vc, const DecodeItem& it, const float* probs, int64_t n_pad, float* acc,
                            float* vbuf, const float* zeros) {
  switch (it.dim / 16) {
    case 1: return weighted_values_dv<T, 1>(vc, it, probs, n_pad, acc);
    case 2: return weighted_values_dv<T, 2>(vc, it, probs, n_pad, acc);
    case 3: return weighted_values_dv<T, 3>(vc, it, probs, n_pad, acc);
    case 4: return weighted_values_dv<T, 4>(vc, it, probs, n_pad, acc);
    case 5: return weighted_values_dv<T, 5>(vc, it, probs, n_pad, acc);
    case 6: return weighted_values_dv<T, 6>(vc, it, probs, n_pad, acc);
    case 7: return weighted_values_dv<T, 7>(vc, it, probs, n_pad, acc);
    case 8: return weighted_values_dv<T, 8>(vc, it, probs, n_pad, acc);
    default: return weighted_values_chunked(vc, it, probs, n_pad, acc, vbuf, zeros);
  }
}
#endif

#ifdef RAYPD_AVX2
// The same two passes on 8 lanes (AVX2 + FMA): chunks of 8 keys with one accumulator per key for the scores, and
// per query head the value rows' weighted sum in registers, 64 dims at a time. The rows are gathered block by block,
// which the hardware prefetchers follow poorly: each pass asks for the rows kPrefetchKeys keys ahead of the one it
// computes on (4 layers of 16 sequences of 250-550 keys, the cache cold as in a decode step: ~10% faster on Zen 3).
constexpr int64_t kPrefetchKeys = 16;
inline void prefetch_bytes(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(static_cast<const char*>(p) + o, _MM_HINT_T0);
}

// [sum(v[0]), ..., sum(v[7])]
inline __m256 hsum8x8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  // per 128-bit half: the partial sums of v0..v3 (u0) and of v4..v7 (u1)
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// softmax in place over the first n of each of the group's score rows (group, n_pad); padding gets probability 0
inline void softmax_rows8(float* scores, int64_t group, int64_t n, int64_t n_pad) {
  const int64_t full = n / 8 * 8;
  const __m256 tail = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps(float(n - full)),
                                    _CMP_LT_OQ);
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * n_pad;
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < full; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
    if (n > full) mx = _mm256_max_ps(mx, _mm256_blendv_ps(mx, _mm256_loadu_ps(s + full), tail));
    float lanes[8];
    _mm256_storeu_ps(lanes, mx);
    const __m256 m = _mm256_set1_ps(*std::max_element(lanes, lanes + 8));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < n_pad; j += 8) {
      __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
      if (j >= full) e = _mm256_and_ps(e, j == full ? tail : _mm256_setzero_ps());
      _mm256_storeu_ps(s + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    const __m256 inv = _mm256_set1_ps(1.f / hsum8(sum));
    for (int64_t j = 0; j < n_pad; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), inv));
  }
}

// The fp32 rows of one chunk of up to 8 keys starting at key c (as chunk_rows, 8 at a time)
template <typename T>
void chunk_rows8(const T* cache, const DecodeItem& it, int64_t c, float* buf, const float* zeros, const float** rows) {
  const int64_t cnt = std::min<int64_t>(8, it.n - c), dv = it.dim / 8;
  for (int64_t j = 0; j < 8; ++j) {
    if (j >= cnt) {
      rows[j] = zeros;
    } else if constexpr (std::is_same_v<T, float>) {
      rows[j] = cache + it.offs[c + j];
    } else {
      const T* src = cache + it.offs[c + j];
      for (int64_t i = 0; i < dv; ++i) _mm256_storeu_ps(buf + j * it.dim + 8 * i, load8(src + 8 * i));
      rows[j] = buf + j * it.dim;
    }
  }
}

template <typename T>
void scores_softmax_avx2(const T* kc, const DecodeItem& it, float* scores, int64_t n_pad, float* kbuf,
                         const float* zeros) {
  const int64_t dim = it.dim, dv = dim / 8;
  const float* rows[8];
  for (int64_t c = 0; c < it.n; c += 8) {
    for (int64_t j = c + kPrefetchKeys; j < std::min(c + kPrefetchKeys + 8, it.n); ++j)
      prefetch_bytes(kc + it.offs[j], dim * sizeof(T));
    chunk_rows8(kc, it, c, kbuf, zeros, rows);  // converted once, read by every query head of the group
    for (int64_t g = 0; g < it.group; ++g) {
      const float* q = it.q + g * dim;
      __m256 part[8];
      for (int j = 0; j < 8; ++j) part[j] = _mm256_setzero_ps();
      for (int64_t i = 0; i < dv; ++i) {
        const __m256 qv = _mm256_loadu_ps(q + 8 * i);
        for (int j = 0; j < 8; ++j) part[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows[j] + 8 * i), part[j]);
      }
      _mm256_storeu_ps(scores + g * n_pad + c, hsum8x8(part));
    }
  }
  softmax_rows8(scores, it.group, it.n, n_pad);
}

// acc[g, d0 : d0 + 8 DV] <- probs[g] . values[:, d0 : d0 + 8 DV] for each query head g, the DV accumulators in
// registers across the whole context (two sets, even and odd keys, where few: their FMA chains overlap)
template <typename T, int DV>
void weighted_values_slice8(const T* vc, const DecodeItem& it, const float* probs, int64_t n_pad, float* acc,
                            int64_t d0) {
  constexpr int kSets = DV <= 4 ? 2 : 1;
  for (int64_t g = 0; g < it.group; ++g) {
    __m256 a[kSets][DV];
    for (int s = 0; s < kSets; ++s)
      for (int i = 0; i < DV; ++i) a[s][i] = _mm256_setzero_ps();
    const float* p = probs + g * n_pad;
    auto key = [&](int s, int64_t j) {
      const T* r = vc + it.offs[j] + d0;
      if (j + kPrefetchKeys < it.n) prefetch_bytes(vc + it.offs[j + kPrefetchKeys] + d0, 8 * DV * sizeof(T));
      const __m256 pb = _mm256_set1_ps(p[j]);
      for (int i = 0; i < DV; ++i) a[s][i] = _mm256_fmadd_ps(pb, load8(r + 8 * i), a[s][i]);
    };
    int64_t j = 0;
    for (; j + kSets <= it.n; j += kSets)
      for (int s = 0; s < kSets; ++s) key(s, j + s);
    for (; j < it.n; ++j) key(0, j);
    for (int i = 0; i < DV; ++i) {
      __m256 sum = a[0][i];
      for (int s = 1; s < kSets; ++s) sum = _mm256_add_ps(sum, a[s][i]);
      _mm256_storeu_ps(acc + g * it.dim + d0 + 8 * i, sum);
    }
  }
}

template <typename T>
void weighted_values_avx2(const T* vc, const DecodeItem& it, const float* probs, int64_t n_pad, float* acc) {
  int64_t d = 0;
  for (; d + 64 <= it.dim; d += 64) weighted_values_slice8<T, 8>(vc, it, probs, n_pad, acc, d);
  switch ((it.dim - d) / 8) {
    case 1: return weighted_values_slice8<T, 1>(vc, it, probs, n_pad, acc, d);
    case 2: return weighted_values_slice8<T, 2>(vc, it, probs, n_pad, acc, d);
    case 3: return weighted_values_slice8<T, 3>(vc, it, probs, n_pad, acc, d);
    case 4: return weighted_values_slice8<T, 4>(vc, it, probs, n_pad, acc, d);
    case 5: return weighted_values_slice8<T, 5>(vc, it, probs, n_pad, acc, d);
    case 6: return weighted_values_slice8<T, 6>(vc, it, probs, n_pad, acc, d);
    case 7: return weighted_values_slice8<T, 7>(vc, it, probs, n_pad, acc, d);
    default: return;
  }
}
#endif

#ifdef RAYPD_AVX512
// The bf16 scores pass where the CPU has VDPBF16PS; false: the caller runs the fp32 one.
template <typename T>
bool bf16_scores(const T* kc, const DecodeItem& it, const T* q, int64_t q_stride, float scale, float* scores,
                 int64_t n_pad) {
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    static const std::vector<c10::BFloat16> zeros(256, c10::BFloat16(0.f));  // a padding row (dims up to 256)
    if (it.dim > 256) return false;
    scores_softmax_bf16(kc, it, q, q_stride, scale, scores, n_pad, zeros.data());
    return true;
  }
#endif
  return false;
}
#endif

template <typename T>
void decode_attention_impl(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                           const torch::Tensor& v_cache, const torch::Tensor& tables, const torch::Tensor& rows,
                           const torch::Tensor& context_lens, int64_t window, double scale) {
  const int64_t seqs = tables.size(0), width = tables.size(1);
  const int64_t heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), group = heads / kv_heads;
  const int32_t* tab = tables.data_ptr<int32_t>();
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const T* qp = q.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const float fscale = static_cast<float>(scale);
#ifdef RAYPD_AVX512
  const bool simd = dim % 16 == 0;
  const bool dot_bf16 = std::is_same_v<T, c10::BFloat16> && dim % 32 == 0;
#elif defined(RAYPD_AVX2)
  const bool simd = dim % 8 == 0;
#endif

  at::parallel_for(0, seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), scores, kbuf(16 * dim), zeros(dim, 0.f);
    std::vector<int64_t> offs;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / kv_heads, kh = item % kv_heads;
      const int64_t len = ctx[s], first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      TORCH_CHECK(len >= 1 && len <= width * block_size, "decode_attention: sequence ", s, " has ", len,
                  " keys for a table of ", width, " blocks");
      const T* qrow = qp + row_of[s] * qs0 + kh * group * qs1;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = to_f(qrow[g * qs1 + d]) * fscale;
      offs.resize(len - first);
      row_offsets(offs.data(), tab + s * width, first, len - first, block_size, k_cache.stride(0), k_cache.stride(1),
                  kh * k_cache.stride(2));
      const DecodeItem it{qf.data(), group, dim, len - first, offs.data()};
      const int64_t n_pad = (it.n + 15) / 16 * 16;
      scores.resize(group * n_pad);
#ifdef RAYPD_AVX512
      if (simd) {
        if (!dot_bf16 || !bf16_scores(kc, it, qrow, qs1, fscale, scores.data(), n_pad))
          scores_softmax_avx512(kc, it, scores.data(), n_pad, kbuf.data(), zeros.data());
        weighted_values_avx512(vc, it, scores.data(), n_pad, acc.data(), kbuf.data(), zeros.data());
      } else
#elif defined(RAYPD_AVX2)
      if (simd) {
        scores_softmax_avx2(kc, it, scores.data(), n_pad, kbuf.data(), zeros.data());
        weighted_values_avx2(vc, it, scores.data(), n_pad, acc.data());
      } else
#endif
      {
        scores_softmax_scalar(kc, it, scores.data(), n_pad);
        weighted_values_scalar(vc, it, scores.data(), n_pad, acc.data());
      }
      T* orow = op + row_of[s] * os0 + kh * group * os1;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < dim; ++d) orow[g * os1 + d] = from_f<T>(acc[g * dim + d]);
    }
  });
}

// Attention of one query per sequence over its paged context, reading the cache in place (no gathered copy).
// out, q: (T, heads, head_dim), rows [s] of sequence s written; k_cache, v_cache as for write_kv; tables: (S, W)
// int32 block ids; rows: (S,) int64 flat rows; context_lens: (S,) int64 keys per sequence (query position + 1);
// window: 0 = full, else only keys with position > query position - window.
void decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                      torch::Tensor tables, torch::Tensor rows, torch::Tensor context_lens, int64_t window,
                      double scale) {
  for (auto* t : {&out, &q, &k_cache, &v_cache, &tables}) check_cpu(*t, "decode_attention tensor");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "decode_attention: q and out must be (T, heads, head_dim)");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "decode_attention: head_dim must be contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0 &&
              k_cache.stride(3) == 1 && v_cache.strides() == k_cache.strides() &&
              v_cache.sizes() == k_cache.sizes(), "decode_attention: cache shape or strides do not fit q");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type() &&
              v_cache.scalar_type() == q.scalar_type(), "decode_attention: dtypes differ");
  TORCH_CHECK(tables.scalar_type() == torch::kInt && tables.dim() == 2 && tables.is_contiguous(),
              "decode_attention: tables must be contiguous int32 (S, W)");
  TORCH_CHECK(rows.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong &&
              rows.is_contiguous() && context_lens.is_contiguous() && rows.numel() == tables.size(0) &&
              context_lens.numel() == tables.size(0), "decode_attention: rows/context_lens must be int64 (S,)");
  DISPATCH_FLOATS(q.scalar_type(), "decode_attention", [&] {
    decode_attention_impl<scalar_t>(out, q, k_cache, v_cache, tables, rows, context_lens, window, scale);
  });
}

// ---- paged KV: prefill attention (bf16: AMX tiles, else AVX-512 BF16) ----
// One chunk of a sequence's prompt (queries at positions start .. start + n - 1) against its whole causal context,
// read from the paged cache (the chunk's own keys were written there first). Per KV head, the context's keys and
// values are packed once (pairs of bf16 per 32-bit lane: AMX's B operand layout, which VDPBF16PS reads as well).
// Then, per tile of 16 query tokens and per query head of the group: scores = Q K^T in fp32 (exact bf16 products
// summed in fp32), a softmax in fp32 over each row's causal context, rounded to bf16 unnormalized, and out = P V in
// fp32, scaled by 1 / the fp32 sum. torch's bf16 SDPA also rounds the probabilities to bf16 for the second product.
// The two products run as 16 x 16 TDPBF16PS tiles where the CPU has AMX-BF16 and Linux grants the tile state, else
// as VDPBF16PS on 16 accumulators (AVX512-BF16 without AMX, e.g. AMD Zen 4: ~3x faster than torch's SDPA there).
// The argument checks of both prefill kernels: name the kernel, its dtype, and the multiple head_dim must be of.
[[maybe_unused]] void check_prefill_args(const torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                                         const torch::Tensor& v_cache, const torch::Tensor& table, int64_t row,
                                         int64_t start, int64_t n, at::ScalarType dtype, int64_t dim_multiple,
                                         const char* name) {
  for (auto* t : {&out, &q, &k_cache, &v_cache, &table}) check_cpu(*t, name);
  TORCH_CHECK(q.scalar_type() == dtype && out.scalar_type() == dtype && k_cache.scalar_type() == dtype &&
              v_cache.scalar_type() == dtype, name, ": ", c10::toString(dtype), " tensors only");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.is_contiguous() && out.stride(2) == 1,
              name, ": q (contiguous) and out must be (T, heads, head_dim)");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0 &&
              k_cache.stride(3) == 1 && v_cache.strides() == k_cache.strides() &&
              v_cache.sizes() == k_cache.sizes(), name, ": cache shape or strides do not fit q");
  TORCH_CHECK(q.size(2) % dim_multiple == 0 && q.size(2) <= 256, name, ": head_dim must be a multiple of ",
              dim_multiple, " up to 256");
  TORCH_CHECK(table.scalar_type() == torch::kInt && table.dim() == 1 && table.is_contiguous() &&
              table.numel() * k_cache.size(1) >= start + n, name, ": table must be int32 blocks covering the context");
  TORCH_CHECK(row >= 0 && n >= 1 && start >= 0 && row + n <= q.size(0), name, ": rows out of range");
}

// For each KV head of the cache, in parallel: the element offsets of its keys [0, ctx) (values sit at the same ones
// in v_cache), handed to pack(kv_head, offsets).
template <typename Pack>
[[maybe_unused]] void for_each_kv_head(const torch::Tensor& k_cache, const torch::Tensor& table, int64_t ctx,
                                       Pack pack) {
  at::parallel_for(0, k_cache.size(2), 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> offs(ctx);
    for (int64_t kh = begin; kh < end; ++kh) {
      row_offsets(offs.data(), table.data_ptr<int32_t>(), 0, ctx, k_cache.size(1), k_cache.stride(0),
                  k_cache.stride(1), kh * k_cache.stride(2));
      pack(kh, offs.data());
    }
  });
}

#if defined(RAYPD_AVX512) && defined(__AVX512BF16__)
#define RAYPD_PREFILL 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define RAYPD_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

constexpr int64_t kTile = 16;  // query tokens per tile; keys per score tile
constexpr int64_t kKeyBlock = 32;  // keys per P V step (one A tile row: 32 bf16)

#ifdef RAYPD_AMX
// Linux hands out the AMX tile state only on request (once per process; oneDNN asks too).
bool amx_ready() {
  static const bool ok = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Every tile 16 rows x 64 bytes: tmm0 the accumulator, tmm1 the A operand, tmm2 the B operand.
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 3; ++t) colsb[t] = 64, rows[t] = 16;
  }
};
#else
bool amx_ready() { return false; }
#endif

// keys [0, ctx) of one KV head -> packed[((c * dim / 2) + d2) * 16 + j] = dims (2 d2, 2 d2 + 1) of key 16 c + j: for
// each 16 keys and 32 dims, a B tile of 16 rows (dim pairs) x 16 keys; keys past ctx are zero
void pack_keys(const c10::BFloat16* kc, const int64_t* offs, int64_t ctx, int64_t keys_pad, int64_t dim,
               uint32_t* packed) {
  const int64_t d2n = dim / 2;
  std::memset(packed, 0, keys_pad * d2n * sizeof(uint32_t));
  for (int64_t j = 0; j < ctx; ++j) {
    const uint32_t* row = reinterpret_cast<const uint32_t*>(kc + offs[j]);
    uint32_t* dst = packed + (j / 16) * d2n * 16 + (j % 16);
    for (int64_t d2 = 0; d2 < d2n; ++d2) dst[d2 * 16] = row[d2];
  }
}

// values [0, ctx) of one KV head in key pairs: pairs[(m * dim / 16 + i) * 16 + l] = dim 16 i + l of keys 2m, 2m + 1:
// for each 32 keys and 16 dims, a B tile of 16 rows (key pairs) x 16 dims, rows dim / 16 * 64 bytes apart
void pack_values(const c10::BFloat16* vc, const int64_t* offs, int64_t ctx, int64_t keys_pad, int64_t dim,
                 uint32_t* pairs) {
  std::memset(pairs, 0, keys_pad / 2 * dim * sizeof(uint32_t));
  uint16_t* dst = reinterpret_cast<uint16_t*>(pairs);
  for (int64_t j = 0; j < ctx; ++j) {
    const uint16_t* row = reinterpret_cast<const uint16_t*>(vc + offs[j]);
    uint16_t* d = dst + (j / 2) * dim * 2 + (j % 2);
    for (int64_t e = 0; e < dim; ++e) d[2 * e] = row[e];
  }
}

// softmax of each row's first n[r] scores (later keys are masked), rounded to bf16 unnormalized (exp(s - max) in
// (0, 1]); probs (16, n_pad) bf16 with zeros past n[r]; inv[r] = 1 / the fp32 sum, applied to the output
void tile_softmax(const float* scores, int64_t n_pad, const int64_t* n, c10::BFloat16* probs, float* inv) {
  for (int64_t r = 0; r < kTile; ++r) {
    const float* s = scores + r * n_pad;
    auto mask = [&](int64_t j) {
      const int64_t left = n[r] - j;
      return left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
    };
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n[r]; j += 16) mx = _mm512_mask_max_ps(mx, mask(j), mx, _mm512_loadu_ps(s + j));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n_pad; j += 16) {
      const __m512 e = _mm512_maskz_mov_ps(mask(j), exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), m)));
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + r * n_pad + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    inv[r] = 1.f / _mm512_reduce_add_ps(sum);
  }
}

#ifdef RAYPD_AMX
// scores (16, n_pad) fp32 <- q (16, dim) K^T, a 16 x 16 tile per 16 keys
void tile_scores_amx(const c10::BFloat16* q, int64_t n_pad, int64_t dim, const uint32_t* keys, float* scores) {
  const int64_t d2n = dim / 2;
  for (int64_t c = 0; c < n_pad / 16; ++c) {
    _tile_zero(0);
    for (int64_t h = 0; h < dim / 32; ++h) {
      _tile_loadd(1, q + 32 * h, dim * 2);
      _tile_loadd(2, keys + (c * d2n + 16 * h) * 16, 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, scores + c * 16, n_pad * 4);
  }
}

// acc (16, dim) fp32 <- probs (16, n_pad) V over the first `blocks` blocks of 32 keys, a 16 x 16 tile per 16 dims
void tile_pv_amx(const c10::BFloat16* probs, int64_t n_pad, int64_t blocks, int64_t dim, const uint32_t* vpairs,
                 float* acc) {
  const int64_t dv = dim / 16;
  for (int64_t i = 0; i < dv; ++i) {
    _tile_zero(0);
    for (int64_t b = 0; b < blocks; ++b) {
      _tile_loadd(1, probs + b * kKeyBlock, n_pad * 2);
      _tile_loadd(2, vpairs + (b * 16 * dv + i) * 16, dv * 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, acc + 16 * i, dim * 4);
  }
}
#endif

// tile_scores_amx with VDPBF16PS: per 16 keys, one accumulator per query row (lanes: keys), each packed key vector
// (16 keys x one dim pair) multiplied by every row's broadcast dim pair
void tile_scores_vec(const c10::BFloat16* q, int64_t n_pad, int64_t dim, const uint32_t* keys, float* scores) {
  const int64_t d2n = dim / 2;
  const uint32_t* qw = reinterpret_cast<const uint32_t*>(q);  // row r's dim pair d2 at r * d2n + d2
  for (int64_t c = 0; c < n_pad / 16; ++c) {
    __m512 acc[kTile];
    for (int64_t r = 0; r < kTile; ++r) acc[r] = _mm512_setzero_ps();
    const uint32_t* kb = keys + c * d2n * 16;
    for (int64_t d2 = 0; d2 < d2n; ++d2) {
      const __m512bh kv = (__m512bh)_mm512_loadu_si512(kb + d2 * 16);
      for (int64_t r = 0; r < kTile; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[r * d2n + d2])), kv);
    }
    for (int64_t r = 0; r < kTile; ++r) _mm512_storeu_ps(scores + r * n_pad + c * 16, acc[r]);
  }
}

// tile_pv_amx with VDPBF16PS: GR rows at a time, their GR x DV accumulators (lanes: dims) in registers across the
// key pairs; each packed value vector (16 dims x one key pair) is loaded once for the GR rows' broadcast pairs
template <int DV, int GR>
void tile_pv_vec_dv(const c10::BFloat16* probs, int64_t n_pad, int64_t pairs, const uint32_t* vpairs, float* acc) {
  const uint32_t* pw = reinterpret_cast<const uint32_t*>(probs);  // row r's key pair m at r * n_pad / 2 + m
  const int64_t row_words = n_pad / 2;
  for (int64_t r0 = 0; r0 < kTile; r0 += GR) {
    __m512 a[GR][DV];
    for (int b = 0; b < GR; ++b)
      for (int i = 0; i < DV; ++i) a[b][i] = _mm512_setzero_ps();
    for (int64_t m = 0; m < pairs; ++m) {
      const uint32_t* vm = vpairs + m * DV * 16;
      for (int b = 0; b < GR; ++b) {
        const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[(r0 + b) * row_words + m]));
        for (int i = 0; i < DV; ++i) a[b][i] = _mm512_dpbf16_ps(a[b][i], p, (__m512bh)_mm512_loadu_si512(vm + 16 * i));
      }
    }
    for (int b = 0; b < GR; ++b)
      for (int i = 0; i < DV; ++i) _mm512_storeu_ps(acc + (r0 + b) * DV * 16 + 16 * i, a[b][i]);
  }
}

void tile_pv_vec(const c10::BFloat16* probs, int64_t n_pad, int64_t blocks, int64_t dim, const uint32_t* vpairs,
                 float* acc) {
  const int64_t pairs = blocks * kKeyBlock / 2;
  switch (dim / 16) {  // head_dim a multiple of 32 up to 256; about 16 accumulators
    case 2: return tile_pv_vec_dv<2, 8>(probs, n_pad, pairs, vpairs, acc);
    case 4: return tile_pv_vec_dv<4, 4>(probs, n_pad, pairs, vpairs, acc);
    case 6: return tile_pv_vec_dv<6, 2>(probs, n_pad, pairs, vpairs, acc);
    case 8: return tile_pv_vec_dv<8, 2>(probs, n_pad, pairs, vpairs, acc);
    case 10: return tile_pv_vec_dv<10, 1>(probs, n_pad, pairs, vpairs, acc);
    case 12: return tile_pv_vec_dv<12, 1>(probs, n_pad, pairs, vpairs, acc);
    case 14: return tile_pv_vec_dv<14, 1>(probs, n_pad, pairs, vpairs, acc);
    case 16: return tile_pv_vec_dv<16, 1>(probs, n_pad, pairs, vpairs, acc);
    default: TORCH_CHECK(false, "prefill_attention: head_dim ", dim, " is not a multiple of 32 up to 256");
  }
}

// One query head's tile: q (16, dim) bf16 rows, n[r] keys each (n_pad >= max n, a multiple of 32) -> out rows.
void head_tile(bool amx, const c10::BFloat16* q, const int64_t* n, int64_t n_pad, int64_t dim, float scale,
               const uint32_t* keys, const uint32_t* vpairs, float* scores, c10::BFloat16* probs, float* acc,
               c10::BFloat16* const* out, int64_t rows) {
  const int64_t dv = dim / 16;
#ifdef RAYPD_AMX
  if (amx) tile_scores_amx(q, n_pad, dim, keys, scores);
  else
#endif
    tile_scores_vec(q, n_pad, dim, keys, scores);
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < kTile * n_pad; i += 16) _mm512_storeu_ps(scores + i, _mm512_mul_ps(_mm512_loadu_ps(scores + i), sv));
  float inv[kTile];
  tile_softmax(scores, n_pad, n, probs, inv);
  int64_t keys_max = 0;
  for (int64_t r = 0; r < kTile; ++r) keys_max = std::max(keys_max, n[r]);
  const int64_t blocks = (keys_max + kKeyBlock - 1) / kKeyBlock;
#ifdef RAYPD_AMX
  if (amx) tile_pv_amx(probs, n_pad, blocks, dim, vpairs, acc);
  else
#endif
    tile_pv_vec(probs, n_pad, blocks, dim, vpairs, acc);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 iv = _mm512_set1_ps(inv[r]);
    for (int64_t i = 0; i < dv; ++i)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[r] + 16 * i),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + r * dim + 16 * i), iv)));
  }
}

bool prefill_available() { return true; }

void prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                       torch::Tensor table, int64_t row, int64_t start, int64_t n, double scale, bool use_amx) {
  check_prefill_args(out, q, k_cache, v_cache, table, row, start, n, torch::kBFloat16, 32, "prefill_attention");
  const int64_t ctx = start + n;
  const int64_t heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(2), group = heads / kv_heads;
  const int64_t tiles = (n + kTile - 1) / kTile, keys_pad = (ctx + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  const int64_t words = keys_pad * dim / 2;  // per KV head, keys and values alike
  const auto* kc = k_cache.data_ptr<c10::BFloat16>();
  const auto* vc = v_cache.data_ptr<c10::BFloat16>();
  const auto* qp = q.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const float fscale = static_cast<float>(scale);
  std::vector<uint32_t> packed(kv_heads * words), vpairs(kv_heads * words);
  for_each_kv_head(k_cache, table, ctx, [&](int64_t kh, const int64_t* offs) {
    pack_keys(kc, offs, ctx, keys_pad, dim, packed.data() + kh * words);
    pack_values(vc, offs, ctx, keys_pad, dim, vpairs.data() + kh * words);
  });
  const bool amx = use_amx && amx_ready();
  at::parallel_for(0, heads * tiles, 1, [&](int64_t begin, int64_t end) {
#ifdef RAYPD_AMX
    const TileConfig config;
    if (amx) _tile_loadconfig(&config);
#endif
    std::vector<c10::BFloat16> qbuf(kTile * dim), probs;
    std::vector<float> scores, acc(kTile * dim);
    c10::BFloat16* orows[kTile];
    int64_t keys[kTile];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / tiles, t0 = item % tiles * kTile, tn = std::min(kTile, n - t0);
      const int64_t n_pad = (start + t0 + tn + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
      std::fill(qbuf.begin(), qbuf.end(), c10::BFloat16(0.f));
      for (int64_t t = 0; t < kTile; ++t) {
        const int64_t tt = std::min(t, tn - 1);  // rows past the chunk repeat its last (their output is dropped)
        std::memcpy(qbuf.data() + t * dim, qp + ((row + t0 + tt) * heads + h) * dim, dim * 2);
        orows[t] = op + (row + t0 + tt) * out.stride(0) + h * out.stride(1);
        keys[t] = start + t0 + tt + 1;  // causal: a query sees keys up to its own position
      }
      scores.resize(kTile * n_pad);
      probs.resize(kTile * n_pad);
      const int64_t kh = h / group;
      head_tile(amx, qbuf.data(), keys, n_pad, dim, fscale, packed.data() + kh * words, vpairs.data() + kh * words,
                scores.data(), probs.data(), acc.data(), orows, tn);
    }
#ifdef RAYPD_AMX
    if (amx) _tile_release();
#endif
  });
}
#else
bool prefill_available() { return false; }
void prefill_attention(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t,
                       int64_t, double, bool) {
  TORCH_CHECK(false, "prefill_attention: this build has no AVX512-BF16");
}
#endif

// ---- fp32 prefill attention, 8 lanes (AVX2 + FMA, no AVX-512) ----
// The bf16 kernel's plan in fp32: a KV head's keys packed 8 at a time (dims as rows) and its values as contiguous
// rows, then per tile of 16 queries their score rows in full, a softmax, and P V. torch's flash SDPA ran a 345-token
// chunk of the tiny model's heads at ~7-14 GFLOP/s a core on Zen 3 (docs/performance.md); here every product is an
// FMA with 8 independent accumulators.
#ifdef RAYPD_AVX2
constexpr int64_t kRows8 = 16;  // queries per tile: two score passes of 8 rows, four P V passes of 4

// keys [0, ctx) of one KV head -> packed[(c * dim + d) * 8 + j] = dim d of key 8 c + j (zero past ctx)
void pack_keys8(const float* kc, const int64_t* offs, int64_t ctx, int64_t keys_pad, int64_t dim, float* packed) {
  std::memset(packed, 0, keys_pad * dim * sizeof(float));
  for (int64_t j = 0; j < ctx; ++j) {
    const float* row = kc + offs[j];
    float* dst = packed + (j / 8) * dim * 8 + (j % 8);
    for (int64_t d = 0; d < dim; ++d) dst[d * 8] = row[d];
  }
}

// values [0, ctx) of one KV head as contiguous rows (zero past ctx)
void pack_values8(const float* vc, const int64_t* offs, int64_t ctx, int64_t keys_pad, int64_t dim, float* rows) {
  std::memset(rows + ctx * dim, 0, (keys_pad - ctx) * dim * sizeof(float));
  for (int64_t j = 0; j < ctx; ++j) std::memcpy(rows + j * dim, vc + offs[j], dim * sizeof(float));
}

// scores[r * n_pad + 8 c + j] = q_r . key(8 c + j) for 8 query rows over key chunks [0, chunks)
void scores_rows8(const float* q, int64_t dim, const float* keys, int64_t chunks, int64_t n_pad, float* scores) {
  for (int64_t c = 0; c < chunks; ++c) {
    __m256 acc[8];
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
    const float* kb = keys + c * dim * 8;
    for (int64_t d = 0; d < dim; ++d) {
      const __m256 kv = _mm256_loadu_ps(kb + d * 8);
      for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(q + r * dim + d), kv, acc[r]);
    }
    for (int r = 0; r < 8; ++r) _mm256_storeu_ps(scores + r * n_pad + c * 8, acc[r]);
  }
}

// one row's scores [0, 8 chunks) -> exp((s - max) * scale) over its first n keys, zero after; returns 1 / their sum
float softmax_row8(float* s, int64_t n, int64_t chunks, float scale) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  auto keep = [&](int64_t j) { return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(n - j)), lane)); };
  __m256 mx = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n; j += 8) mx = _mm256_max_ps(mx, _mm256_blendv_ps(mx, _mm256_loadu_ps(s + j), keep(j)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const __m256 m = _mm256_set1_ps(_mm_cvtss_f32(m4)), sv = _mm256_set1_ps(scale);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < chunks * 8; j += 8) {
    const __m256 e = _mm256_and_ps(keep(j), exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), m), sv)));
    sum = _mm256_add_ps(sum, e);
    _mm256_storeu_ps(s + j, e);
  }
  return 1.f / hsum8(sum);
}

// out rows r0..r0+3 <- (probs rows P V) * inv over keys [0, keys), 16 dims at a time with the 4 x 2 sums in registers
void pv_rows4(const float* probs, int64_t n_pad, int64_t keys, const float* vals, int64_t dim, const float* inv,
              float* const* out) {
  for (int64_t e = 0; e < dim; e += 16) {
    __m256 a[4][2];
    for (int b = 0; b < 4; ++b) a[b][0] = a[b][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < keys; ++j) {
      const __m256 v0 = _mm256_loadu_ps(vals + j * dim + e), v1 = _mm256_loadu_ps(vals + j * dim + e + 8);
      for (int b = 0; b < 4; ++b) {
        const __m256 p = _mm256_broadcast_ss(probs + b * n_pad + j);
        a[b][0] = _mm256_fmadd_ps(p, v0, a[b][0]);
        a[b][1] = _mm256_fmadd_ps(p, v1, a[b][1]);
      }
    }
    for (int b = 0; b < 4; ++b) {
      const __m256 iv = _mm256_set1_ps(inv[b]);
      _mm256_storeu_ps(out[b] + e, _mm256_mul_ps(a[b][0], iv));
      _mm256_storeu_ps(out[b] + e + 8, _mm256_mul_ps(a[b][1], iv));
    }
  }
}

// One query head's tile: q (16, dim) rows with n[r] keys each (ascending; rows past `rows` repeat the last one) ->
// out rows; scores (16, n_pad) with n_pad >= the last row's keys rounded up to 8.
void head_tile8(const float* q, const int64_t* n, int64_t rows, int64_t n_pad, int64_t dim, float scale,
                const float* keys, const float* vals, float* scores, float* const* out) {
  float inv[kRows8];
  for (int64_t h = 0; h < rows; h += 8) {
    const int64_t chunks = (n[h + 7] + 7) / 8;
    scores_rows8(q + h * dim, dim, keys, chunks, n_pad, scores + h * n_pad);
    for (int64_t r = h; r < h + 8; ++r) inv[r] = softmax_row8(scores + r * n_pad, n[r], chunks, scale);
  }
  for (int64_t g = 0; g < rows; g += 4)
    pv_rows4(scores + g * n_pad, n_pad, n[g + 3], vals, dim, inv + g, out + g);
}

bool prefill_f32_available() { return true; }

void prefill_attention_f32(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor table, int64_t row, int64_t start, int64_t n, double scale) {
  check_prefill_args(out, q, k_cache, v_cache, table, row, start, n, torch::kFloat, 16, "prefill_attention_f32");
  const int64_t ctx = start + n;
  const int64_t heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(2), group = heads / kv_heads;
  const int64_t tiles = (n + kRows8 - 1) / kRows8, keys_pad = (ctx + 7) / 8 * 8, floats = keys_pad * dim;
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  std::vector<float> packed(kv_heads * floats), vals(kv_heads * floats);
  for_each_kv_head(k_cache, table, ctx, [&](int64_t kh, const int64_t* offs) {
    pack_keys8(kc, offs, ctx, keys_pad, dim, packed.data() + kh * floats);
    pack_values8(vc, offs, ctx, keys_pad, dim, vals.data() + kh * floats);
  });
  at::parallel_for(0, heads * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qbuf(kRows8 * dim), scores;
    float* orows[kRows8];
    int64_t keys[kRows8];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / tiles, t0 = item % tiles * kRows8, tn = std::min(kRows8, n - t0);
      for (int64_t t = 0; t < kRows8; ++t) {
        const int64_t tt = std::min(t, tn - 1);  // rows past the chunk repeat its last (and write its output again)
        std::memcpy(qbuf.data() + t * dim, qp + ((row + t0 + tt) * heads + h) * dim, dim * sizeof(float));
        orows[t] = op + (row + t0 + tt) * out.stride(0) + h * out.stride(1);
        keys[t] = start + t0 + tt + 1;  // causal: a query sees keys up to its own position
      }
      const int64_t n_pad = (keys[kRows8 - 1] + 7) / 8 * 8;
      scores.resize(kRows8 * n_pad);
      const int64_t kh = h / group;
      head_tile8(qbuf.data(), keys, tn, n_pad, dim, static_cast<float>(scale), packed.data() + kh * floats,
                 vals.data() + kh * floats, scores.data(), orows);
    }
  });
}
#else
bool prefill_f32_available() { return false; }
void prefill_attention_f32(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t,
                           int64_t, double) {
  TORCH_CHECK(false, "prefill_attention_f32: this build is not for a CPU with AVX2 + FMA and no AVX-512");
}
#endif

// ---- fused elementwise ops (mirroring the torch reference's roundings) ----
// torch rounds each product before it adds: no contraction of a * b + c into one fused multiply-add here (GCC
// contracts by default wherever the target has FMA, e.g. in the loops it vectorizes for AVX2).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T>
void rms_norm_row(T* x, const T* residual, const T* w, T* out, int64_t n, float eps) {
  int64_t i = 0;
  float ss = 0.f;
#ifdef RAYPD_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m512 v = load16(x + i);
    if (residual) {
      v = round16<T>(_mm512_add_ps(v, load16(residual + i)));
      store16(x + i, v);
    }
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  ss = _mm512_reduce_add_ps(acc);
#else
  // The order of torch's own sum on an AVX2 build (ATen's vectorized inner reduction: four accumulators of 8
  // lanes, added in turn, then the lanes left to right), so a row's norm rounds as the reference's does: a single
  // running sum drifted past the parity tests' tolerance on an AVX2-only CPU.
  float acc[4][8] = {};
  for (; i + 32 <= n; i += 32) {
    for (int k = 0; k < 4; ++k) {
      for (int l = 0; l < 8; ++l) {
        const int64_t j = i + 8 * k + l;
        if (residual) x[j] = from_f<T>(to_f(x[j]) + to_f(residual[j]));
        const float v = to_f(x[j]);
        acc[k][l] += v * v;
      }
    }
  }
  for (int k = 1; k < 4; ++k)
    for (int l = 0; l < 8; ++l) acc[0][l] += acc[k][l];
  for (int l = 0; l < 8; ++l) ss += acc[0][l];
#endif
  for (; i < n; ++i) {
    if (residual) x[i] = from_f<T>(to_f(x[i]) + to_f(residual[i]));
    ss += to_f(x[i]) * to_f(x[i]);
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  // reference: weight * (x.float() * rsqrt(mean(x^2) + eps)).to(dtype)
  i = 0;
#ifdef RAYPD_AVX512
  const __m512 iv = _mm512_set1_ps(inv);
  for (; i + 16 <= n; i += 16)
    store16(out + i, _mm512_mul_ps(load16(w + i), round16<T>(_mm512_mul_ps(load16(x + i), iv))));
#endif
  for (; i < n; ++i) out[i] = from_f<T>(to_f(w[i]) * round_to<T>(to_f(x[i]) * inv));
}

template <typename T>
void rms_norm_impl(torch::Tensor& x, const c10::optional<torch::Tensor>& residual, const torch::Tensor& weight,
                   torch::Tensor& out, float eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  T* xp = x.data_ptr<T>();
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * n, rp ? rp + r * n : nullptr, wp, op + r * n, n, eps);
  });
}

// out = rms_norm(x) * weight, per row of x (R, N). When residual is given, x += residual first (in place, rounded
// to the dtype as torch's add is), so x then holds the new residual stream.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, c10::optional<torch::Tensor> residual) {
  check_cpu(x, "rms_norm x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.numel() == x.size(1) &&
              weight.scalar_type() == x.scalar_type(), "rms_norm: x must be contiguous (R, N), weight (N,)");
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                residual->scalar_type() == x.scalar_type(), "rms_norm: residual must match x");
  }
  auto out = torch::empty_like(x);
  DISPATCH_FLOATS(x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(x, residual, weight, out, static_cast<float>(eps));
  });
  return out;
}

template <typename T>
void silu_and_mul_impl(const torch::Tensor& gate_up, torch::Tensor& out) {
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  const T* ip = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = ip + r * 2 * inter;
      const T* u = g + inter;
      T* o = op + r * inter;
      int64_t i = 0;
#ifdef RAYPD_AVX512
      for (; i + 16 <= inter; i += 16)
        store16(o + i, _mm512_mul_ps(round16<T>(silu16(load16(g + i))), load16(u + i)));
#elif defined(RAYPD_AVX2)
      for (; i + 8 <= inter; i += 8)
        store8(o + i, _mm256_mul_ps(round8<T>(silu8(load8(g + i))), load8(u + i)));
#endif
      for (; i < inter; ++i) o[i] = from_f<T>(round_to<T>(silu_f(to_f(g[i]))) * to_f(u[i]));
    }
  });
}

// gate_up (R, 2I) -> silu(gate) * up (R, I); silu rounded to the dtype before the product, as in the reference.
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_cpu(gate_up, "silu_and_mul input");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_and_mul: input must be contiguous (R, 2I)");
  auto out = torch::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  DISPATCH_FLOATS(gate_up.scalar_type(), "silu_and_mul", [&] { silu_and_mul_impl<scalar_t>(gate_up, out); });
  return out;
}

// Rotates, in place, heads [0, num_heads) of every row of x (T, >= num_heads * head_dim), by halves:
// x * cos + rotate_half(x) * sin, with each token's cos/sin rows (T, head_dim).
template <typename T>
void rope_impl(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t num_heads,
               int64_t head_dim) {
  const int64_t tokens = x.size(0), stride = x.stride(0), half = head_dim / 2;
  T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> a(half), b(half);
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + t * head_dim;
      const T* s = sp + t * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        T* v = xp + t * stride + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          a[i] = to_f(v[i]);
          b[i] = to_f(v[i + half]);
        }
        // first half: x1 cos - x2 sin; second half: x2 cos + x1 sin (each product rounded, then the sum)
        for (int64_t i = 0; i < half; ++i) {
          v[i] = from_f<T>(round_to<T>(a[i] * to_f(c[i])) + round_to<T>(-b[i] * to_f(s[i])));
          v[i + half] = from_f<T>(round_to<T>(b[i] * to_f(c[i + half])) + round_to<T>(a[i] * to_f(s[i + half])));
        }
      }
    }
  });
}

void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t num_heads, int64_t head_dim) {
  check_cpu(x, "rope_ x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) >= num_heads * head_dim && head_dim % 2 == 0,
              "rope_: x must be (T, >= heads * head_dim) with contiguous rows");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == x.size(0) &&
              cos.size(1) == head_dim && sin.sizes() == cos.sizes() && cos.scalar_type() == x.scalar_type() &&
              sin.scalar_type() == x.scalar_type(), "rope_: cos/sin must be contiguous (T, head_dim) in x's dtype");
  DISPATCH_FLOATS(x.scalar_type(), "rope_", [&] { rope_impl<scalar_t>(x, cos, sin, num_heads, head_dim); });
}

#pragma GCC pop_options

// ---- sampling of rows whose logits need no processing ----
// The first index of the largest of x[0..V) (ties go to the lowest index, as torch's max(dim) does); *mx: that value.
inline int64_t first_argmax(const float* x, int64_t V, float* mx) {
  int64_t j = 0, arg = 0;
  float best = -INFINITY;
#ifdef RAYPD_AVX512
  if (V >= 16) {
    __m512 bv = _mm512_loadu_ps(x);
    __m512i bi = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), idx = bi;
    const __m512i step = _mm512_set1_epi32(16);
    for (j = 16; j + 16 <= V; j += 16) {
      idx = _mm512_add_epi32(idx, step);
      const __m512 v = _mm512_loadu_ps(x + j);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, bv, _CMP_GT_OQ);  // strict: each lane keeps its first maximum
      bv = _mm512_mask_mov_ps(bv, gt, v);
      bi = _mm512_mask_mov_epi32(bi, gt, idx);
    }
    best = _mm512_reduce_max_ps(bv);
    const __mmask16 at = _mm512_cmp_ps_mask(bv, _mm512_set1_ps(best), _CMP_EQ_OQ);
    arg = _mm512_mask_reduce_min_epi32(at, bi);  // the lowest index among the lanes holding the maximum
  }
#elif defined(RAYPD_AVX2)
  if (V >= 8) {
    __m256 bv = _mm256_loadu_ps(x);
    __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), bi = idx;
    const __m256i step = _mm256_set1_epi32(8);
    for (j = 8; j + 8 <= V; j += 8) {
      idx = _mm256_add_epi32(idx, step);
      const __m256 v = _mm256_loadu_ps(x + j);
      const __m256 gt = _mm256_cmp_ps(v, bv, _CMP_GT_OQ);  // strict: each lane keeps its first maximum
      bv = _mm256_blendv_ps(bv, v, gt);
      bi = _mm256_blendv_epi8(bi, idx, _mm256_castps_si256(gt));
    }
    float vals[8];
    int32_t ids[8];
    _mm256_storeu_ps(vals, bv);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(ids), bi);
    best = *std::max_element(vals, vals + 8);
    arg = V;
    for (int l = 0; l < 8; ++l)  // the lowest index among the lanes holding the maximum
      if (vals[l] == best && ids[l] < arg) arg = ids[l];
    if (arg == V) arg = ids[0];  // no lane equals it (NaNs): the scalar loop below decides from here
  }
#endif
  for (; j < V; ++j)
    if (x[j] > best) best = x[j], arg = j;
  *mx = best;
  return arg;
}

// One row: greedy (temp 0: the first maximal logit) or an inverse-CDF draw at temperature temp with the uniform u
// (the first token whose cumulative weight exceeds u times the total, summed in float64); the token's logprob under
// log_softmax(x / temp) (x itself when greedy). buf: V floats of scratch, blocks: V / 16 + 1 doubles.
void sample_row(const float* x, int64_t V, float temp, double u, float* buf, double* blocks, int64_t* token,
                float* logprob) {
  const bool greedy = temp <= 0.f;
  const float t = greedy ? 1.f : temp;
  float mx;
  int64_t arg = first_argmax(x, V, &mx);
  const float m = mx / t;
  const int64_t nb = (V + 15) / 16;
  double total = 0.0;
  int64_t j = 0;
#ifdef RAYPD_AVX512
  // x * (1 / t): one multiply instead of a division per token; the scaled logits differ from x / t in the last bit
  const __m512 mv = _mm512_set1_ps(m), iv = _mm512_set1_ps(1.f / t);
  for (int64_t b = 0; b < nb; ++b, j += 16) {
    const __mmask16 k = V - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (V - j)) - 1);
    const __m512 xs = greedy ? _mm512_maskz_loadu_ps(k, x + j) : _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + j), iv);
    // exp16 clamps its input at -87 (~1e-38): a token further down (a -inf logit, one no draw may pick) weighs 0
    const __m512 d = _mm512_sub_ps(xs, mv);
    const __m512 e = _mm512_maskz_mov_ps(k & _mm512_cmp_ps_mask(d, _mm512_set1_ps(-87.f), _CMP_GE_OQ), exp16(d));
    _mm512_mask_storeu_ps(buf + j, k, e);
    blocks[b] = static_cast<double>(_mm512_reduce_add_ps(e));
    total += blocks[b];
  }
#else
  int64_t b0 = 0;  // blocks done on 8 lanes
#ifdef RAYPD_AVX2
  // whole blocks of 16 as two 8-lane halves; the last, partial block goes to the scalar loop below
  const __m256 mv = _mm256_set1_ps(m), iv = _mm256_set1_ps(1.f / t), lowest = _mm256_set1_ps(-87.f);
  for (; b0 < V / 16; ++b0, j += 16) {
    __m256 sum = _mm256_setzero_ps();
    for (int h = 0; h < 16; h += 8) {
      const __m256 xs = greedy ? _mm256_loadu_ps(x + j + h) : _mm256_mul_ps(_mm256_loadu_ps(x + j + h), iv);
      const __m256 d = _mm256_sub_ps(xs, mv);
      const __m256 e = _mm256_and_ps(_mm256_cmp_ps(d, lowest, _CMP_GE_OQ), exp8(d));
      _mm256_storeu_ps(buf + j + h, e);
      sum = _mm256_add_ps(sum, e);
    }
    blocks[b0] = static_cast<double>(hsum8(sum));
    total += blocks[b0];
  }
#endif
  for (int64_t b = b0; b < nb; ++b) {
    double s = 0.0;
    for (int64_t i = 0; i < 16 && j < V; ++i, ++j) {
      const float d = x[j] / t - m;
      s += (buf[j] = d >= -87.f ? exp_f(d) : 0.f);
    }
    blocks[b] = s;
    total += s;
  }
#endif
  if (!greedy) {
    const double target = u * total;
    double cum = 0.0;
    int64_t b = 0;
    while (b < nb - 1 && cum + blocks[b] <= target) cum += blocks[b++];
    arg = -1;
    for (int64_t i = b * 16; i < std::min<int64_t>(V, b * 16 + 16); ++i) {
      if (buf[i] > 0.f) arg = i;  // the last token with weight, should rounding leave the target past the end
      cum += buf[i];
      if (cum > target && buf[i] > 0.f) break;
    }
    if (arg < 0) arg = std::max_element(x, x + V) - x;  // no weight at all in the block: the most likely token
  }
  *token = arg;
  *logprob = static_cast<float>(x[arg] / t - m - std::log(total));
}

// logits (R, V) float32; temps (R,) float32, 0 = greedy; u (R,) float64 uniforms in [0, 1) (read for sampled rows)
// -> (tokens (R,) int64, logprobs (R,) float32). One pass to find the maximum, one to weigh every token (kept with
// per-16 block sums), then the draw walks the block sums and one block.
std::tuple<torch::Tensor, torch::Tensor> sample_rows(torch::Tensor logits, torch::Tensor temps, torch::Tensor u) {
  check_cpu(logits, "sample_rows logits");
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == torch::kFloat,
              "sample_rows: logits must be contiguous float32 (R, V)");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V >= 1 && temps.scalar_type() == torch::kFloat && temps.is_contiguous() && temps.numel() == R &&
              u.scalar_type() == torch::kDouble && u.is_contiguous() && u.numel() == R,
              "sample_rows: temps must be float32 (R,), u float64 (R,)");
  auto tokens = torch::empty({R}, torch::kLong);
  auto logprobs = torch::empty({R}, torch::kFloat);
  const float* xp = logits.data_ptr<float>();
  const float* tp = temps.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* top = tokens.data_ptr<int64_t>();
  float* lp = logprobs.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(V);
    std::vector<double> blocks(V / 16 + 1);
    for (int64_t r = begin; r < end; ++r)
      sample_row(xp + r * V, V, tp[r], up[r], buf.data(), blocks.data(), top + r, lp + r);
  });
  return {tokens, logprobs};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_kv", &write_kv, "store new keys and values into their paged-cache slots");
  m.def("decode_attention", &decode_attention, "one-query-per-sequence attention over the paged cache, in place");
  m.def("prefill_attention", &prefill_attention,
        "a bf16 prompt chunk's causal attention over the paged cache (use_amx: on AMX tiles where granted)");
  m.def("prefill_attention_f32", &prefill_attention_f32,
        "a float32 prompt chunk's causal attention over the paged cache (AVX2 + FMA without AVX-512)");
  m.def("prefill_f32_available", &prefill_f32_available, "whether prefill_attention_f32 runs here");
  m.def("prefill_available", &prefill_available, "whether prefill_attention runs here (AVX512-BF16; AMX tiles where granted)");
  m.def("rms_norm", &rms_norm, "RMSNorm (optionally after an in-place residual add)", py::arg("x"),
        py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused gate_up projection");
  m.def("rope_", &rope_, "rotary embedding by halves, in place");
  m.def("sample_rows", &sample_rows, "greedy or inverse-CDF draws of unprocessed logits, with the chosen logprobs");
}
