// The one-pass Adam / AdamW update of int8 moments (infinity/_adam_int8.py calls it).
//
// The update of 8-bit states, as it was, made three passes over memory (decode both moments of
// a sub-group into fp32 temporaries, torch's fused kernel over those, encode them back) and
// its encode cost 2.9 ns an element on 2 cores: 8x the fp32 step (benchmarks/host_step.py).
// Here each unit's part goes by tiles of one block: both moments of a tile decoded into
// buffers that stay in the core's first-level cache with the tile's weights and gradient, the
// update over the tile, the tile encoded back, so memory sees the 16 bytes an element of the
// states and weights once (28 with fp32 states). Tiles of 16 blocks (80 KiB with the weights
// and gradient, over the 48 KiB of a Zen 5's L1) took 1.55 ns an element, one block 1.20
// (one core, 8M elements, interleaved).
//
// The arithmetic is torch's fused CPU Adam (aten/src/ATen/native/cpu/FusedAdamKernel.cpp, its
// vectorised loop as torch's AVX2 build compiles it), operation for operation, so that an
// element's result is what torch's kernel gives wherever its vector loop covers it: the
// constants rounded from double to float as torch rounds them, exp_avg by lerp as one FMA, and
// the two sums the compiler contracts there (its default -ffp-contract=fast) as FMAs too:
// exp_avg_sq = fma((1 - beta2) g, g, exp_avg_sq beta2) and Adam's decayed gradient
// fma(p, weight_decay, g), found by comparing against torch's results
// (tests/infinity/test_adam_int8.py holds them equal). torch's own scalar loop (the last
// n % 8 or n % 16 elements of each tensor) rounds some elements differently; here every
// element, whatever its position, takes the vector loop's arithmetic, so an update does not
// depend on how the parameters are cut into units, sub-groups or ranks' shards.

#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "codec.h"

namespace infinity_native {

// One parameter's run of a unit's part, with its group's hyperparameters.
struct AdamSegment {
  int64_t start = 0, len = 0;  // within the unit's part
  float* grad = nullptr;       // its gradient, ``len`` elements
  // torch's constants, rounded to float as its kernel rounds them
  bool has_decay = false, adamw = true, small = true;
  float decay = 1, wd = 0, lerp = 0, beta2 = 0, c2 = 0, bc2s = 1, eps = 0, neg_step = 0;

  AdamSegment(int64_t start_, int64_t len_, float* grad_, double lr, double beta1, double beta2_,
              double eps_, double weight_decay, double step, bool adamw_)
      : start(start_), len(len_), grad(grad_), adamw(adamw_) {
    const double bc1 = 1 - std::pow(beta1, step), bc2 = 1 - std::pow(beta2_, step);
    has_decay = weight_decay != 0.0;
    decay = static_cast<float>(1 - lr * weight_decay);
    wd = static_cast<float>(weight_decay);
    const float w = static_cast<float>(1 - beta1);
    small = std::abs(w) < 0.5f;
    lerp = small ? w : w - 1.0f;
    beta2 = static_cast<float>(beta2_);
    c2 = static_cast<float>(1 - beta2_);
    bc2s = static_cast<float>(std::sqrt(bc2));
    eps = static_cast<float>(eps_);
    neg_step = static_cast<float>(-(lr / bc1));
  }
};

// One element, the arithmetic of torch's vector loop (see the file's comment).
inline void adam_one(const AdamSegment& s, float& p, float& g, float& m, float& v, const float* grad_scale) {
  if (grad_scale) g = g / *grad_scale;
  float gv = g;
  if (s.has_decay) {
    if (s.adamw)
      p = p * s.decay;
    else
      gv = std::fma(p, s.wd, gv);
  }
  m = s.small ? std::fma(s.lerp, gv - m, m) : std::fma(s.lerp, gv - m, gv);
  v = std::fma(s.c2 * gv, gv, v * s.beta2);
  const float denom = std::sqrt(v) / s.bc2s + s.eps;
  p = p + (s.neg_step * m) / denom;
}

inline void adam_run_scalar(const AdamSegment& s, float* p, float* g, float* m, float* v, int64_t n,
                            const float* grad_scale) {
  for (int64_t i = 0; i < n; ++i) {
    float gi = g[i];
    adam_one(s, p[i], gi, m[i], v[i], grad_scale);
    if (grad_scale) g[i] = gi;  // torch's kernel leaves the gradient unscaled
  }
}

#if INFINITY_X86
INFINITY_AVX2 inline void adam_run_avx2(const AdamSegment& s, float* p, float* g, float* m, float* v, int64_t n,
                                        const float* grad_scale) {
  const __m256 decay = _mm256_set1_ps(s.decay), wd = _mm256_set1_ps(s.wd), lerp = _mm256_set1_ps(s.lerp),
               beta2 = _mm256_set1_ps(s.beta2), c2 = _mm256_set1_ps(s.c2), bc2s = _mm256_set1_ps(s.bc2s),
               eps = _mm256_set1_ps(s.eps), neg_step = _mm256_set1_ps(s.neg_step);
  const __m256 scale = _mm256_set1_ps(grad_scale ? *grad_scale : 1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 pv = _mm256_loadu_ps(p + i), gv = _mm256_loadu_ps(g + i);
    if (grad_scale) {
      gv = _mm256_div_ps(gv, scale);
      _mm256_storeu_ps(g + i, gv);
    }
    if (s.has_decay) {
      if (s.adamw)
        pv = _mm256_mul_ps(pv, decay);
      else
        gv = _mm256_fmadd_ps(pv, wd, gv);
    }
    const __m256 mv = _mm256_loadu_ps(m + i);
    const __m256 mn = _mm256_fmadd_ps(lerp, _mm256_sub_ps(gv, mv), s.small ? mv : gv);
    const __m256 vn = _mm256_fmadd_ps(_mm256_mul_ps(c2, gv), gv, _mm256_mul_ps(_mm256_loadu_ps(v + i), beta2));
    _mm256_storeu_ps(m + i, mn);
    _mm256_storeu_ps(v + i, vn);
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vn), bc2s), eps);
    _mm256_storeu_ps(p + i, _mm256_add_ps(pv, _mm256_div_ps(_mm256_mul_ps(neg_step, mn), denom)));
  }
  adam_run_scalar(s, p + i, g + i, m + i, v + i, n - i, grad_scale);
}
#endif

#if INFINITY_X86
INFINITY_AVX512 inline void adam_run_avx512(const AdamSegment& s, float* p, float* g, float* m, float* v, int64_t n,
                                            const float* grad_scale) {
  const __m512 decay = _mm512_set1_ps(s.decay), wd = _mm512_set1_ps(s.wd), lerp = _mm512_set1_ps(s.lerp),
               beta2 = _mm512_set1_ps(s.beta2), c2 = _mm512_set1_ps(s.c2), bc2s = _mm512_set1_ps(s.bc2s),
               eps = _mm512_set1_ps(s.eps), neg_step = _mm512_set1_ps(s.neg_step);
  const __m512 scale = _mm512_set1_ps(grad_scale ? *grad_scale : 1.0f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 pv = _mm512_loadu_ps(p + i), gv = _mm512_loadu_ps(g + i);
    if (grad_scale) {
      gv = _mm512_div_ps(gv, scale);
      _mm512_storeu_ps(g + i, gv);
    }
    if (s.has_decay) {
      if (s.adamw)
        pv = _mm512_mul_ps(pv, decay);
      else
        gv = _mm512_fmadd_ps(pv, wd, gv);
    }
    const __m512 mv = _mm512_loadu_ps(m + i);
    const __m512 mn = _mm512_fmadd_ps(lerp, _mm512_sub_ps(gv, mv), s.small ? mv : gv);
    const __m512 vn = _mm512_fmadd_ps(_mm512_mul_ps(c2, gv), gv, _mm512_mul_ps(_mm512_loadu_ps(v + i), beta2));
    _mm512_storeu_ps(m + i, mn);
    _mm512_storeu_ps(v + i, vn);
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vn), bc2s), eps);
    _mm512_storeu_ps(p + i, _mm512_add_ps(pv, _mm512_div_ps(_mm512_mul_ps(neg_step, mn), denom)));
  }
  adam_run_scalar(s, p + i, g + i, m + i, v + i, n - i, grad_scale);
}
#endif

inline void adam_run(const AdamSegment& s, float* p, float* g, float* m, float* v, int64_t n, const float* grad_scale) {
#if INFINITY_X86
  if (isa() >= Isa::kAvx512) return adam_run_avx512(s, p, g, m, v, n, grad_scale);
  if (isa() == Isa::kAvx2) return adam_run_avx2(s, p, g, m, v, n, grad_scale);
#endif
  adam_run_scalar(s, p, g, m, v, n, grad_scale);
}

constexpr int64_t kTileBlocks = 1;  // blocks per tile: see the file's comment

// One unit's part of ``n`` elements: ``master`` its fp32 weights, the moments' codes and
// scales (blocks of ``block`` from the part's first element), ``segments`` its parameters'
// runs in order (elements of no segment keep their codes: decode then encode is the identity).
struct Int8Unit {
  float* master = nullptr;
  uint8_t* m_codes = nullptr;
  float* m_scales = nullptr;
  uint8_t* v_codes = nullptr;
  float* v_scales = nullptr;
  int64_t n = 0;
  std::vector<AdamSegment> segments;
};

// Elements [first, last) of ``u`` (tile-aligned from its first element), tile by tile.
inline void adam_int8_tiles(const Codec& signed_codec, const Codec& unsigned_codec, const Int8Unit& u, int64_t first,
                            int64_t last, int64_t block, const float* grad_scale, float* mbuf, float* vbuf) {
  const int64_t tile = kTileBlocks * block;
  const auto& segments = u.segments;
  // the first segment that may reach the first tile
  size_t k = std::partition_point(segments.begin(), segments.end(),
                                  [&](const AdamSegment& s) { return s.start + s.len <= first; }) - segments.begin();
  for (int64_t t0 = first; t0 < last; t0 += tile) {
    const int64_t t1 = std::min(last, t0 + tile), len = t1 - t0, b0 = t0 / block;
    signed_codec.decode(u.m_codes + t0, u.m_scales + b0, mbuf, len, block);
    unsigned_codec.decode(u.v_codes + t0, u.v_scales + b0, vbuf, len, block);
    while (k < segments.size() && segments[k].start + segments[k].len <= t0) ++k;
    for (size_t j = k; j < segments.size() && segments[j].start < t1; ++j) {
      const auto& s = segments[j];
      const int64_t a = std::max(t0, s.start), b = std::min(t1, s.start + s.len);
      if (a < b) adam_run(s, u.master + a, s.grad + (a - s.start), mbuf + (a - t0), vbuf + (a - t0), b - a, grad_scale);
    }
    signed_codec.encode(mbuf, u.m_codes + t0, u.m_scales + b0, len, block);
    unsigned_codec.encode(vbuf, u.v_codes + t0, u.v_scales + b0, len, block);
  }
}

constexpr int64_t kChunkTiles = 4096;  // tiles a thread takes at a time: 1M elements of 256 (16K: 10% slower)

// The updates of ``units`` (a sub-group's that step), ``grad_scale`` what the gradients are
// divided by (null: none), over ``threads`` of OpenMP's threads (in_parts says why those) for
// them all: one parallel region a sub-group, not one a unit. The threads take chunks of tiles
// from one counter, so that one slowed down (its core shared with another process) does less
// rather than holding the others up at the end. In the 106M Llama's step the update took 0.082
// s on std::threads (beside torch's workers spinning after backward), 0.063 s on OpenMP's.
inline void adam_int8(const Codec& signed_codec, const Codec& unsigned_codec, const std::vector<Int8Unit>& units,
                      int64_t block, const float* grad_scale, int64_t threads) {
  if (block <= 0 || block > kMaxBlock)
    throw std::invalid_argument("block must be 1 to " + std::to_string(kMaxBlock) + " elements, got " +
                                std::to_string(block));
  const int64_t chunk = kChunkTiles * kTileBlocks * block;
  std::vector<int64_t> first_chunk{0};  // by unit, and the total last
  int64_t elements = 0;
  for (const auto& u : units) {
    int64_t prev = 0;
    for (const auto& s : u.segments) {
      if (s.start < prev || s.len < 0 || s.start + s.len > u.n)
        throw std::invalid_argument("adam_int8: segments must be in order, apart, and within the unit's " +
                                    std::to_string(u.n) + " elements");
      prev = s.start + s.len;
    }
    if (u.n < 0) throw std::invalid_argument("adam_int8: a unit of " + std::to_string(u.n) + " elements");
    first_chunk.push_back(first_chunk.back() + (u.n + chunk - 1) / chunk);
    elements += u.n;
  }
  const int64_t chunks = first_chunk.back();
  // A parallel region costs microseconds: one thread per 256K elements at most.
  const int64_t parts = std::min<int64_t>(threads, std::max<int64_t>(1, elements >> 18));
  std::atomic<int64_t> next{0};
  in_parts(parts, 1, parts, [&](int64_t, int64_t) {  // one worker a part; in_parts raises the first error
    try {
      const int64_t tile = kTileBlocks * block;
      std::vector<float> mbuf(tile), vbuf(tile);
      for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
        const size_t i = std::upper_bound(first_chunk.begin(), first_chunk.end(), c) - first_chunk.begin() - 1;
        const Int8Unit& u = units[i];
        const int64_t first = (c - first_chunk[i]) * chunk;
        adam_int8_tiles(signed_codec, unsigned_codec, u, first, std::min(u.n, first + chunk), block, grad_scale,
                        mbuf.data(), vbuf.data());
      }
    } catch (...) {
      next.store(chunks);  // the others stop at their next chunk
      throw;
    }
  });
}

}  // namespace infinity_native
