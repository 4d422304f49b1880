// The int8 codec of infinity._compact ([Note: compact state format] there says what the codes
// and scales are): one block's scale and codes from its fp32 values, and back. Used by the
// codec's own bindings (compact.cpp) and by the one-pass Adam update (adam_int8.h).
//
// How an element's code is found: the code is the count of the map's 255 boundaries strictly
// below v = x / scale (what torch.bucketize(right=False) returns; NaN counts all 255). The top
// 16 bits of a float32 (sign, exponent, 7 bits of mantissa) cut the floats into intervals in
// which v is monotone in the low 16 bits, and each interval is narrower than the map's closest
// pair of values (checked when a Codec is made), so the count takes at most two values in it:
// `a` below a cut `c` of the low bits, `b` from it. One 32-bit table entry per interval holds
// the three (a | b << 8 | c << 16), so a code is one table load and one comparison, which
// AVX2 does eight at a time and AVX-512 sixteen, with one gather. The infinities and NaNs are
// entries like any other (+inf 255, -inf 0, NaN 255), so nothing is searched at run time.
//
// What costs is the division by the scale and the gather, about 0.25 and 0.3 ns an element
// each in cache on one core here (AVX-512: 16 elements a step, so fewer instructions around
// them). The division stays a division: a product with the double reciprocal rounds to the
// same float (a quotient of two floats is never within 2^-49 of a rounding midpoint) but its
// conversions cost more than the divider does, measured.
//
// Every path (scalar, AVX2, AVX-512; `set_isa` picks one for tests) computes the same bytes:
// IEEE division and products are exactly rounded whatever the width, and the build turns
// contraction into FMA off, so a machine without AVX gets the same states, only slower.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define INFINITY_X86 1
#define INFINITY_AVX2 __attribute__((target("avx2,fma")))
#define INFINITY_AVX512 __attribute__((target("avx512f,avx512bw,avx2,fma")))
#else
#define INFINITY_X86 0
#endif

namespace infinity_native {

constexpr int kCodes = 256;
constexpr int kBounds = kCodes - 1;
constexpr int64_t kMaxBlock = 4096;  // the largest block the codec takes (_compact's BLOCK is 256)

inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// The instruction sets the codec and the update use: the best the CPU has, or less where a test
// asks (`set_isa`), so that each path can be held to the reference on one machine.
enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

inline Isa best_isa() {
#if INFINITY_X86
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kScalar;
}

inline Isa& isa_in_use() {
  static Isa in_use = best_isa();
  return in_use;
}

inline Isa isa() { return isa_in_use(); }

// At most the best the CPU has; returns what is in use after.
inline Isa set_isa(Isa wanted) {
  isa_in_use() = static_cast<Isa>(std::min(static_cast<int>(wanted), static_cast<int>(best_isa())));
  return isa_in_use();
}

class Codec {
 public:
  // ``bounds``: the 255 ascending midpoints between the map's values; ``values``: the 256
  // values. Both as _compact computes them, so the map has one definition.
  Codec(const std::vector<float>& bounds, const std::vector<float>& values) {
    if (bounds.size() != kBounds || values.size() != kCodes)
      throw std::invalid_argument("a code map has 256 values and 255 boundaries, got " +
                                  std::to_string(values.size()) + " and " +
                                  std::to_string(bounds.size()));
    std::copy(bounds.begin(), bounds.end(), bounds_);
    std::copy(values.begin(), values.end(), values_);
    table_.resize(65536);
    for (uint32_t top = 0; top < 65536; ++top) table_[top] = entry(top);
  }

  // One block of ``n`` elements: its scale, the first element of largest magnitude (a NaN
  // counts as largest, as torch.argmax has it), and its codes.
  void encode_block(const float* x, uint8_t* codes, float* scale, int64_t n) const {
#if INFINITY_X86
    if (isa() == Isa::kAvx512) return encode_block_avx512(x, codes, scale, n);
    if (isa() == Isa::kAvx2) return encode_block_avx2(x, codes, scale, n);
#endif
    const float d = find_scale(x, n, scale);
    for (int64_t i = 0; i < n; ++i) codes[i] = code(x[i] / d);  // division, as torch: the same floats
  }

  void decode_block(const uint8_t* codes, float scale, float* out, int64_t n) const {
#if INFINITY_X86
    if (isa() == Isa::kAvx512) return decode_block_avx512(codes, scale, out, n);
    if (isa() == Isa::kAvx2) return decode_block_avx2(codes, scale, out, n);
#endif
    for (int64_t i = 0; i < n; ++i) out[i] = values_[codes[i]] * scale;
  }

  // Blocks of ``block`` elements over ``n`` (the last one shorter), ``scales`` one per block.
  void encode(const float* x, uint8_t* codes, float* scales, int64_t n, int64_t block) const {
    for (int64_t b = 0, start = 0; start < n; ++b, start += block)
      encode_block(x + start, codes + start, scales + b, std::min(block, n - start));
  }

  void decode(const uint8_t* codes, const float* scales, float* out, int64_t n, int64_t block) const {
    for (int64_t b = 0, start = 0; start < n; ++b, start += block)
      decode_block(codes + start, scales[b], out + start, std::min(block, n - start));
  }

  const float* values() const { return values_; }  // the 256 values of the map, by code

  inline uint8_t code(float v) const {
    const uint32_t bits = float_to_bits(v), e = table_[bits >> 16];
    return static_cast<uint8_t>((bits & 0xFFFF) >= (e >> 16) ? (e >> 8) & 0xFF : e & 0xFF);
  }

 private:
  // Boundaries strictly below v; NaN gives 255 (torch.bucketize's lower bound).
  int search(float v) const {
    int start = 0, end = kBounds;
    while (start < end) {
      const int mid = start + ((end - start) >> 1);
      if (!(bounds_[mid] >= v))
        start = mid + 1;
      else
        end = mid;
    }
    return start;
  }

  // The table entry of the floats whose top 16 bits are ``top``: a | b << 8 | c << 16.
  uint32_t entry(uint32_t top) const {
    auto at = [&](uint32_t low) { return search(bits_to_float((top << 16) | low)); };
    const int a = at(0), b = at(0xFFFF);
    if (a == b) return static_cast<uint32_t>(a) | static_cast<uint32_t>(a) << 8;
    // The count is monotone in the low bits (v is, and NaN, above every boundary, sits only
    // above an infinity at low bits 0), so it changes once; the first low bits past the change:
    uint32_t lo = 0, hi = 0xFFFF;  // at(lo) == a, at(hi) == b
    while (hi - lo > 1) {
      const uint32_t mid = (lo + hi) / 2;
      (at(mid) == a ? lo : hi) = mid;
    }
    const bool special = ((top >> 7) & 0xFF) == 0xFF;  // an infinity then NaNs
    if (!special && std::abs(a - b) > 1)
      throw std::invalid_argument("two boundaries of the code map fall between two floats with the same "
                                  "top 16 bits; the table cannot serve this map");
    return static_cast<uint32_t>(a) | static_cast<uint32_t>(b) << 8 | hi << 16;
  }

  // The block's scale into ``*scale``; returns what its elements are divided by.
  static float find_scale(const float* x, int64_t n, float* scale) {
    // Magnitudes compare as their bits with the sign cleared (a NaN's are above +inf's), so
    // the largest is an integer max, which vectorises.
    uint32_t most = 0;
    for (int64_t i = 0; i < n; ++i) most = std::max(most, float_to_bits(x[i]) & 0x7FFFFFFFu);
    return scale_at(x, most, scale);
  }

  static float scale_at(const float* x, uint32_t most, float* scale) {
    int64_t at = 0;
    if (most > 0x7F800000u) {  // a NaN: the first one, whatever its payload
      while (!std::isnan(x[at])) ++at;
    } else {
      while ((float_to_bits(x[at]) & 0x7FFFFFFFu) != most) ++at;
    }
    const float s = x[at];
    *scale = s;
    return s == 0.0f ? 1.0f : s;  // an all-zero block: all code 0.0
  }

#if INFINITY_X86
  INFINITY_AVX2 void encode_block_avx2(const float* x, uint8_t* codes, float* scale, int64_t n) const {
    const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i most8 = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      most8 = _mm256_max_epu32(most8, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), magnitude));
    alignas(32) uint32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), most8);
    uint32_t most = 0;
    for (uint32_t v : lanes) most = std::max(most, v);
    for (; i < n; ++i) most = std::max(most, float_to_bits(x[i]) & 0x7FFFFFFFu);
    float d;
    if (most > 0x7F800000u) {
      d = scale_at(x, most, scale);  // a NaN: the first one
    } else {  // the first element of that magnitude, eight compared at a time
      const __m256i want = _mm256_set1_epi32(static_cast<int>(most));
      int64_t at = 0;
      for (; at + 8 <= n; at += 8) {
        const __m256i eq = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + at)), magnitude), want);
        const int mask = _mm256_movemask_ps(_mm256_castsi256_ps(eq));
        if (mask) {
          at += __builtin_ctz(static_cast<unsigned>(mask));
          break;
        }
      }
      while ((float_to_bits(x[at]) & 0x7FFFFFFFu) != most) ++at;  // past the last whole eight
      const float sv = x[at];
      *scale = sv;
      d = sv == 0.0f ? 1.0f : sv;
    }

    const __m256 dv = _mm256_set1_ps(d);
    i = 0;
    for (; i + 32 <= n; i += 32) {
      const __m256i w01 = _mm256_packus_epi32(codes8(x + i, dv), codes8(x + i + 8, dv));  // lanes interleave
      const __m256i w23 = _mm256_packus_epi32(codes8(x + i + 16, dv), codes8(x + i + 24, dv));
      const __m256i b = _mm256_packus_epi16(w01, w23);
      // packs work per 128-bit lane: bytes 0-3 of each 8-byte group come from one lane
      const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), _mm256_permutevar8x32_epi32(b, order));
    }
    for (; i < n; ++i) codes[i] = code(x[i] / d);
  }

  // The codes of x[0..8) / d as eight int32 (the lambda it would be gets no target attribute).
  INFINITY_AVX2 inline __m256i codes8(const float* x, __m256 dv) const {
    const __m256i bits = _mm256_castps_si256(_mm256_div_ps(_mm256_loadu_ps(x), dv));
    const __m256i e = _mm256_i32gather_epi32(reinterpret_cast<const int*>(table_.data()), _mm256_srli_epi32(bits, 16), 4);
    // low bits >= c, as low > c - 1 (both below 2^16: a signed compare serves)
    const __m256i from_b = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0xFFFF)),
                                              _mm256_sub_epi32(_mm256_srli_epi32(e, 16), _mm256_set1_epi32(1)));
    const __m256i byte = _mm256_set1_epi32(0xFF);
    return _mm256_blendv_epi8(_mm256_and_si256(e, byte), _mm256_and_si256(_mm256_srli_epi32(e, 8), byte), from_b);
  }

  INFINITY_AVX2 void decode_block_avx2(const uint8_t* codes, float scale, float* out, int64_t n) const {
    const __m256 s = _mm256_set1_ps(scale);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_i32gather_ps(values_, idx, 4), s));
    }
    for (; i < n; ++i) out[i] = values_[codes[i]] * scale;
  }
  // The same with sixteen lanes: fewer instructions around the division and the table's
  // gather, which each cost about as much as the other (0.25 and 0.3 ns an element in cache).
  INFINITY_AVX512 void encode_block_avx512(const float* x, uint8_t* codes, float* scale, int64_t n) const {
    const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i most16 = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) most16 = _mm512_max_epu32(most16, _mm512_and_si512(_mm512_loadu_si512(x + i), magnitude));
    uint32_t most = _mm512_reduce_max_epu32(most16);
    for (; i < n; ++i) most = std::max(most, float_to_bits(x[i]) & 0x7FFFFFFFu);
    float d;
    if (most > 0x7F800000u) {
      d = scale_at(x, most, scale);  // a NaN: the first one
    } else {  // the first element of that magnitude, sixteen compared at a time
      const __m512i want = _mm512_set1_epi32(static_cast<int>(most));
      int64_t at = 0;
      for (; at + 16 <= n; at += 16) {
        const __mmask16 eq = _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_loadu_si512(x + at), magnitude), want);
        if (eq) {
          at += __builtin_ctz(static_cast<unsigned>(eq));
          break;
        }
      }
      while ((float_to_bits(x[at]) & 0x7FFFFFFFu) != most) ++at;  // past the last whole sixteen
      const float sv = x[at];
      *scale = sv;
      d = sv == 0.0f ? 1.0f : sv;
    }
    const __m512 dv = _mm512_set1_ps(d);
    const __m512i low = _mm512_set1_epi32(0xFFFF);
    const int* table = reinterpret_cast<const int*>(table_.data());
    for (i = 0; i + 16 <= n; i += 16) {
      const __m512i bits = _mm512_castps_si512(_mm512_div_ps(_mm512_loadu_ps(x + i), dv));
      const __m512i e = _mm512_i32gather_epi32(_mm512_srli_epi32(bits, 16), table, 4);
      const __mmask16 from_b = _mm512_cmpge_epu32_mask(_mm512_and_si512(bits, low), _mm512_srli_epi32(e, 16));
      const __m512i code = _mm512_mask_blend_epi32(from_b, e, _mm512_srli_epi32(e, 8));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(code));  // the low byte of each
    }
    for (; i < n; ++i) codes[i] = code(x[i] / d);
  }

  // The 256 values sit in sixteen registers and each code picks its value by permutes, not a
  // gather: eight two-register permutes (the low five bits of the code) and a tree of blends
  // (bits 5, 6, 7). Gathers are slow on AMD's cores: measured on an EPYC (Zen 5), one core,
  // 4M elements, 0.14 ns an element against 0.32 with the gather, the same bytes.
  INFINITY_AVX512 void decode_block_avx512(const uint8_t* codes, float scale, float* out, int64_t n) const {
    const __m512 s = _mm512_set1_ps(scale);
    __m512 table[16];
    for (int k = 0; k < 16; ++k) table[k] = _mm512_loadu_ps(values_ + 16 * k);
    const __m512i bit5 = _mm512_set1_epi32(32), bit6 = _mm512_set1_epi32(64), bit7 = _mm512_set1_epi32(128);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
      __m512 of32[8];  // the value if the code is in [32k, 32k + 32)
      for (int k = 0; k < 8; ++k) of32[k] = _mm512_permutex2var_ps(table[2 * k], idx, table[2 * k + 1]);
      const __mmask16 b5 = _mm512_test_epi32_mask(idx, bit5), b6 = _mm512_test_epi32_mask(idx, bit6),
                      b7 = _mm512_test_epi32_mask(idx, bit7);
      const __m512 of64a = _mm512_mask_blend_ps(b5, of32[0], of32[1]), of64b = _mm512_mask_blend_ps(b5, of32[2], of32[3]);
      const __m512 of64c = _mm512_mask_blend_ps(b5, of32[4], of32[5]), of64d = _mm512_mask_blend_ps(b5, of32[6], of32[7]);
      const __m512 lo = _mm512_mask_blend_ps(b6, of64a, of64b), hi = _mm512_mask_blend_ps(b6, of64c, of64d);
      _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mask_blend_ps(b7, lo, hi), s));
    }
    for (; i < n; ++i) out[i] = values_[codes[i]] * scale;
  }
#endif

  float bounds_[kBounds];
  float values_[kCodes];
  std::vector<uint32_t> table_;  // 65536 entries: a | b << 8 | c << 16, see the file's comment
};

// fn(first, last) over [0, n) cut into ``parts`` runs whose cuts are multiples of ``align``,
// the first on the calling thread, the others on threads of their own. Every thread is joined
// before this returns, also when one failed (a thread that cannot start, an allocation in
// fn): the first error is raised after, none ends the process.
template <typename Fn>
void in_parts(int64_t n, int64_t align, int64_t parts, Fn fn) {
  if (n <= 0) return;
  const int64_t units = (n + align - 1) / align;
  parts = std::max<int64_t>(1, std::min(parts, units));
  if (parts == 1) {
    fn(int64_t{0}, n);
    return;
  }
  const int64_t per = (units + parts - 1) / parts;
  std::vector<std::exception_ptr> errors(parts);
  auto guarded = [&](int64_t p, int64_t a, int64_t b) {
    try {
      fn(a, b);
    } catch (...) {
      errors[p] = std::current_exception();
    }
  };
  std::vector<std::thread> threads;
  try {
    for (int64_t p = 1; p < parts; ++p) {
      const int64_t a = std::min(n, p * per * align), b = std::min(n, (p + 1) * per * align);
      if (a < b) threads.emplace_back(guarded, p, a, b);
    }
  } catch (...) {
    errors[0] = std::current_exception();  // a thread that could not start: the rest runs nothing more
  }
  if (!errors[0]) guarded(0, 0, std::min(n, per * align));
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace infinity_native
