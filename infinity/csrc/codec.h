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
// AVX2 does eight at a time with one gather. The infinities and NaNs are entries like any
// other (+inf 255, -inf 0, NaN 255), so nothing is searched at run time. AVX-512 computes most
// codes without the table (ArithmeticCodes below): its gather was most of the encode's time.
//
// The division stays a division: a product with the double reciprocal rounds to the same
// float (a quotient of two floats is never within 2^-49 of a rounding midpoint) but its
// conversions cost more than the divider does, measured.
//
// Every path (scalar, AVX2, AVX-512, AVX-512 with VBMI; `set_isa` picks one for tests) computes the same bytes:
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
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define INFINITY_X86 1
#define INFINITY_AVX2 __attribute__((target("avx2,fma")))
#define INFINITY_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx2,fma")))
#define INFINITY_AVX512_VBMI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vbmi,avx2,fma")))
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
// asks (`set_isa`), so that each path can be held to the reference on one machine. kAvx512Vbmi
// is AVX-512 with its byte permutes (the decode looks values up 64 codes at a time).
enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vbmi = 3 };

inline Isa best_isa() {
#if INFINITY_X86
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq"))
    return __builtin_cpu_supports("avx512vbmi") ? Isa::kAvx512Vbmi : Isa::kAvx512;
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

// The codes of a map like _compact's without a table load (AVX-512). Gathers are slow on AMD's
// cores: on a Zen 5 the table's gather took 0.37 ns of the encode's 0.52 an element, in cache,
// one core; the codes here take 0.23-0.26 (the one-pass Adam update encodes two moments).
//
// The map's positive boundaries fall into regions cut by a few of them (the edges): in each
// region the boundaries between (its internal ones, those of one decade of the map) are evenly
// spaced, so there p = |v| A + B, one FMA, is within kSlack / 2 of k at the region's k-th
// internal boundary, for every one of them (checked when the codec is made). Where p's fraction is
// farther than kSlack from an integer, floor(p) counts the internal boundaries below |v|
// exactly: p is monotone in |v|, so a boundary whose p is below p(|v|) is below |v|, and one
// whose p is above is above. The region comes from |v|'s binade (a table in two registers)
// and one comparison with the edge above it, there being at most one edge a binade (checked).
// A lane whose fraction is within kSlack of an integer, whose |v| is an edge, or NaN, takes
// the table (one lane in 3700 on the 106M Llama's states). The negative boundaries must be the
// positive ones negated (the signed map's are, but for the map's lone 1.0) and there are no
// more of them: then the count below a negative v is n_neg less those of the first n_neg
// positive boundaries at or below |v|, which are those below it where |v| is no boundary.
//
// Where a map is not of this shape (`usable` false), the encode takes the table everywhere.
class ArithmeticCodes {
 public:
  ArithmeticCodes() = default;
  explicit ArithmeticCodes(const float* bounds) { usable_ = build(bounds); }

  bool usable() const { return usable_; }

#if INFINITY_X86
  // The codes of the sixteen v; returns the lanes whose code must come from the table instead.
  INFINITY_AVX512 inline __mmask16 codes16(__m512 v, __m512i& code) const {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i abits = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
    const __m512 av = _mm512_castsi512_ps(abits);
    // the binade: exponent - 96, at least 0 (a 16-bit saturating subtract: the top half is 0), at most 31
    const __m512i binade = _mm512_min_epi32(_mm512_subs_epu16(_mm512_srli_epi32(abits, 23), _mm512_set1_epi32(96)),
                                            _mm512_set1_epi32(31));
    __m512i r = _mm512_permutex2var_epi32(_mm512_load_si512(region_of_), binade, _mm512_load_si512(region_of_ + 16));
    const __m512 edge = _mm512_permutexvar_ps(r, _mm512_load_ps(edge_));
    const __mmask16 above = _mm512_cmp_ps_mask(edge, av, _CMP_LT_OQ), at_edge = _mm512_cmp_ps_mask(edge, av, _CMP_EQ_OQ);
    r = _mm512_mask_add_epi32(r, above, r, _mm512_set1_epi32(1));
    const __m512 p = _mm512_fmadd_ps(av, _mm512_permutexvar_ps(r, _mm512_load_ps(a_)), _mm512_permutexvar_ps(r, _mm512_load_ps(b_)));
    const __m512 frac = _mm512_reduce_ps(p, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // p - floor(p), exact
    // near an integer, or NaN (the unordered predicates hold for it)
    const __mmask16 table = _mm512_cmp_ps_mask(frac, _mm512_set1_ps(kSlack), _CMP_NGE_UQ) |
                            _mm512_cmp_ps_mask(frac, _mm512_set1_ps(1 - kSlack), _CMP_NLE_UQ) | at_edge;
    // internal boundaries below |v|: trunc(p) within [0, the region's]
    const __m512i j = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvttps_epi32(p), _mm512_setzero_si512()),
                                       _mm512_permutexvar_epi32(r, _mm512_load_si512(internal_)));
    const __m512i up = _mm512_add_epi32(_mm512_permutexvar_epi32(r, _mm512_load_si512(base_)), j);  // n_neg + below |v|
    // negative v: n_neg - min(below, n_neg) = max(2 n_neg - up, 0)
    const __mmask16 neg = _mm512_movepi32_mask(bits);
    code = _mm512_mask_max_epi32(up, neg, _mm512_sub_epi32(_mm512_set1_epi32(2 * n_neg_), up), _mm512_setzero_si512());
    return table;
  }
#endif

 private:
  static constexpr float kSlack = 1.0f / 4096;
  static constexpr int kRegions = 16;

  bool build(const float* bounds) {
    std::vector<float> pos, neg;
    for (int k = 0; k < kBounds; ++k) {
      if (std::isnan(bounds[k]) || bounds[k] == 0.0f || std::isinf(bounds[k])) return false;
      (bounds[k] > 0 ? pos : neg).push_back(bounds[k]);
    }
    if (pos.empty() || neg.size() > pos.size() || pos.back() >= 1.0f) return false;  // |v| <= 1: the top region has none
    for (size_t k = 0; k < neg.size(); ++k)
      if (float_to_bits(neg[neg.size() - 1 - k]) != (float_to_bits(pos[k]) ^ 0x80000000u)) return false;
    n_neg_ = static_cast<int32_t>(neg.size());
    // Regions from the bottom: an edge, then a run of evenly spaced boundaries while the next
    // one continues it, then the next edge. The FMA's check below decides, not this rule.
    std::vector<float> edges{pos[0]};
    std::vector<std::vector<float>> runs{{}};  // region 0, below the first edge, has none
    for (size_t i = 1; i < pos.size();) {
      std::vector<float> run{pos[i++]};
      if (i < pos.size()) run.push_back(pos[i++]);
      while (i < pos.size()) {
        const double spacing = static_cast<double>(run[1]) - run[0];
        if (std::abs((pos[i] - static_cast<double>(run[0])) / spacing - static_cast<double>(run.size())) >= 1e-3) break;
        run.push_back(pos[i++]);
      }
      runs.push_back(run);
      if (i < pos.size()) edges.push_back(pos[i++]);
    }
    if (runs.size() == edges.size()) runs.emplace_back();  // above the last edge
    if (runs.size() > kRegions) return false;
    int32_t below = n_neg_;
    for (int r = 0; r < kRegions; ++r) {
      const bool real = r < static_cast<int>(runs.size());
      edge_[r] = r < static_cast<int>(edges.size()) ? edges[r] : INFINITY;
      a_[r] = 0, b_[r] = 0.5f, internal_[r] = 0, base_[r] = below;
      if (!real) continue;
      const auto& run = runs[r];
      internal_[r] = static_cast<int32_t>(run.size());
      if (run.size() == 1) {
        a_[r] = static_cast<float>(1.0 / run[0]), b_[r] = 0;
      } else if (run.size() > 1) {
        const double a = static_cast<double>(run.size() - 1) / (static_cast<double>(run.back()) - run.front());
        a_[r] = static_cast<float>(a), b_[r] = static_cast<float>(1.0 - run.front() * a);
      }
      for (size_t k = 0; k < run.size(); ++k)  // the arithmetic of codes16
        if (!(std::abs(std::fma(run[k], a_[r], b_[r]) - static_cast<float>(k + 1)) < kSlack / 2)) return false;
      below += internal_[r] + (r < static_cast<int>(edges.size()) ? 1 : 0);
    }
    for (int k = 0; k < 32; ++k) {  // binade k: [2^(k-31), 2^(k-30)), 0: below 2^-30, 31: from 1 up
      const double lo = k == 0 ? 0.0 : std::ldexp(1.0, k - 31), hi = k == 31 ? INFINITY : std::ldexp(1.0, k - 30);
      int32_t r = 0, inside = 0;
      for (float e : edges) r += e < lo, inside += e >= lo && e <= hi;
      if (inside > 1) return false;
      region_of_[k] = r;
    }
    return true;
  }

  bool usable_ = false;
  int32_t n_neg_ = 0;
  alignas(64) float edge_[kRegions] = {}, a_[kRegions] = {}, b_[kRegions] = {};
  alignas(64) int32_t base_[kRegions] = {}, internal_[kRegions] = {}, region_of_[32] = {};
};

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
    arithmetic_ = ArithmeticCodes(bounds_);
    for (int k = 0; k < 4; ++k)
      for (int c = 0; c < kCodes; ++c) planes_[k][c] = static_cast<uint8_t>(float_to_bits(values_[c]) >> (8 * k));
    // The order the VBMI decode permutes 64 codes into, so that its unpacks (which work within
    // 128-bit lanes) leave the values in order: byte j = 16 L + 4 q + u of the permuted codes
    // becomes value 16 q + 4 L + u.
    for (int j = 0; j < 64; ++j) vbmi_order_[j] = static_cast<uint8_t>(16 * ((j % 16) / 4) + 4 * (j / 16) + j % 4);
  }

  // Whether the AVX-512 encode computes codes without the table (ArithmeticCodes).
  bool arithmetic() const { return arithmetic_.usable(); }

  // One block of ``n`` elements: its scale, the first element of largest magnitude (a NaN
  // counts as largest, as torch.argmax has it), and its codes.
  void encode_block(const float* x, uint8_t* codes, float* scale, int64_t n) const {
#if INFINITY_X86
    if (isa() >= Isa::kAvx512) return encode_block_avx512(x, codes, scale, n);
    if (isa() == Isa::kAvx2) return encode_block_avx2(x, codes, scale, n);
#endif
    const float d = find_scale(x, n, scale);
    for (int64_t i = 0; i < n; ++i) codes[i] = code(x[i] / d);  // division, as torch: the same floats
  }

  void decode_block(const uint8_t* codes, float scale, float* out, int64_t n) const {
#if INFINITY_X86
    if (isa() == Isa::kAvx512Vbmi) return decode_block_vbmi(codes, scale, out, n);
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
    if (arithmetic_.usable()) {
      // 64 at a time: four vectors of codes packed into one store (12% faster than four
      // truncating stores here); packs work per 128-bit lane, a permute puts the bytes in order
      const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
      for (i = 0; i + 64 <= n; i += 64) {
        __m512i code[4];
        for (int k = 0; k < 4; ++k) {
          const __m512 v = _mm512_div_ps(_mm512_loadu_ps(x + i + 16 * k), dv);
          const __mmask16 table = arithmetic_.codes16(v, code[k]);
          if (table) code[k] = table_codes16(v, code[k], table);
        }
        const __m512i bytes = _mm512_packus_epi16(_mm512_packus_epi32(code[0], code[1]), _mm512_packus_epi32(code[2], code[3]));
        _mm512_storeu_si512(codes + i, _mm512_permutexvar_epi32(order, bytes));
      }
      for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_div_ps(_mm512_loadu_ps(x + i), dv);
        __m512i code;
        const __mmask16 table = arithmetic_.codes16(v, code);
        if (table) code = table_codes16(v, code, table);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(code));  // the low byte of each
      }
    } else {
      for (i = 0; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_div_ps(_mm512_loadu_ps(x + i), dv);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(table_codes16(v, _mm512_setzero_si512(), 0xFFFF)));
      }
    }
    for (; i < n; ++i) codes[i] = code(x[i] / d);
  }

  // The codes of v's ``lanes`` by the table (one gather), the other lanes' from ``others``; each
  // an int32 of 0 to 255.
  INFINITY_AVX512 inline __m512i table_codes16(__m512 v, __m512i others, __mmask16 lanes) const {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i e = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lanes, _mm512_srli_epi32(bits, 16),
                                                  reinterpret_cast<const int*>(table_.data()), 4);
    const __mmask16 from_b = _mm512_cmpge_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0xFFFF)), _mm512_srli_epi32(e, 16));
    const __m512i code = _mm512_and_si512(_mm512_mask_blend_epi32(from_b, e, _mm512_srli_epi32(e, 8)), _mm512_set1_epi32(0xFF));
    return _mm512_mask_mov_epi32(others, lanes, code);
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

  // With VBMI's byte permutes, 64 codes at a time: each of a value's four bytes looked up in its
  // plane (256 bytes in four registers: two 128-entry permutes and a blend on the code's top
  // bit), then interleaved back into floats. Fewer instructions an element than the sixteen
  // lanes' permutes and blends above: 0.04 ns an element against 0.12 (Zen 5, one core, in cache).
  INFINITY_AVX512_VBMI void decode_block_vbmi(const uint8_t* codes, float scale, float* out, int64_t n) const {
    __m512i plane[4][4];
    for (int k = 0; k < 4; ++k)
      for (int q = 0; q < 4; ++q) plane[k][q] = _mm512_load_si512(planes_[k] + 64 * q);
    const __m512i order = _mm512_load_si512(vbmi_order_);
    const __m512 s = _mm512_set1_ps(scale);
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
      const __m512i idx = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(codes + i));
      const __mmask64 high = _mm512_movepi8_mask(idx);  // codes 128-255
      __m512i b[4];
      for (int k = 0; k < 4; ++k)
        b[k] = _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(plane[k][0], idx, plane[k][1]),
                                      _mm512_permutex2var_epi8(plane[k][2], idx, plane[k][3]));
      const __m512i w01lo = _mm512_unpacklo_epi8(b[0], b[1]), w01hi = _mm512_unpackhi_epi8(b[0], b[1]);
      const __m512i w23lo = _mm512_unpacklo_epi8(b[2], b[3]), w23hi = _mm512_unpackhi_epi8(b[2], b[3]);
      _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(w01lo, w23lo)), s));
      _mm512_storeu_ps(out + i + 16, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(w01lo, w23lo)), s));
      _mm512_storeu_ps(out + i + 32, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(w01hi, w23hi)), s));
      _mm512_storeu_ps(out + i + 48, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(w01hi, w23hi)), s));
    }
    if (i < n) decode_block_avx512(codes + i, scale, out + i, n - i);
  }
#endif

  float bounds_[kBounds];
  float values_[kCodes];
  alignas(64) uint8_t planes_[4][kCodes];  // byte k of each value, by code (the VBMI decode)
  alignas(64) uint8_t vbmi_order_[64];
  std::vector<uint32_t> table_;  // 65536 entries: a | b << 8 | c << 16, see the file's comment
  ArithmeticCodes arithmetic_;   // the AVX-512 encode's codes without the table, where the map allows
};

// fn(first, last) over [0, n) cut into ``parts`` runs whose cuts are multiples of ``align``, on
// OpenMP's threads: the pool torch's own kernels use where the extension loads torch's libgomp
// (the same soname, already loaded), so no thread is started per call and none of torch's
// workers spins beside this work, waiting for its next kernel. Every run is done before this
// returns, also when one failed (an allocation in fn): the first error is raised after.
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
#pragma omp parallel for num_threads(parts) schedule(static, 1)
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t a = std::min(n, p * per * align), b = std::min(n, (p + 1) * per * align);
    try {
      if (a < b) fn(a, b);
    } catch (...) {
      errors[p] = std::current_exception();
    }
  }
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace infinity_native
