// infinity._compact_native: the int8 codec of infinity._compact in C++, for the host.
//
// The Python module keeps the reference (torch ops: argmax, division, bucketize); this file
// computes the same bytes, bit for bit, 15-20 times faster to encode and 6-7 to decode
// (benchmarks/codec.py): bucketize's binary search over the 255 boundaries of the code map
// costs 16-21 ns an element, and an update encodes two moments of every element it steps ([Note: compact state format] in _compact.py
// says what the codes and scales are). tests/infinity/test_compact.py holds the two equal.
//
// How an element's code is found: the code is the count of boundaries below x / scale (what
// torch.bucketize(right=False) returns). x / scale lies in [-1, 1] (the scale is the block's
// extreme), and the top 16 bits of a float32 (sign, exponent, 7 bits of mantissa) cut that
// range into intervals narrower than the map's closest pair of values (checked when a Codec
// is made), so at most one boundary falls inside each: a 65536-entry table gives the count
// below an interval's smallest value, and one comparison adds the boundary inside. NaN and
// the infinities take the binary search, as torch does.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int kCodes = 256;
constexpr int kBounds = kCodes - 1;
// Below this many elements a call runs on the calling thread: starting threads costs more.
constexpr int64_t kThreadMin = 1 << 20;
constexpr int64_t kMaxBlock = 4096;  // the largest block encode takes (_compact's BLOCK is 256)

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
    bounds_[kBounds] = INFINITY;  // the comparison after the last table entry never adds one
    for (uint32_t top = 0; top < 65536; ++top) {
      const float a = bits_to_float(top << 16), b = bits_to_float((top << 16) | 0xFFFF);
      if (!std::isfinite(a) || !std::isfinite(b)) {
        below_[top] = 0;  // never used: code() searches for these
        continue;
      }
      const float lo = std::min(a, b), hi = std::max(a, b);
      const int below = search(lo);
      // For lo <= v <= hi the count below v lies between these two: one comparison (with the
      // first boundary not below lo) tells which where they differ by at most one.
      if (search(hi) - below > 1)
        throw std::invalid_argument("two boundaries of the code map fall between two floats "
                                    "with the same top 16 bits; the table cannot serve this map");
      below_[top] = static_cast<uint8_t>(below);  // at most 255: bounds_[255] is +inf
    }
  }

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

  inline uint8_t code(float v) const {
    if (!std::isfinite(v)) return static_cast<uint8_t>(search(v));
    const uint32_t top = float_to_bits(v) >> 16;
    const int below = below_[top];
    return static_cast<uint8_t>(below + (v > bounds_[below] ? 1 : 0));
  }

  // One block of ``n`` elements: its scale, the first element of largest magnitude (a NaN
  // counts as largest, as torch.argmax has it), and its codes.
  void encode_block(const float* x, uint8_t* codes, float* scale, int64_t n) const {
    // Magnitudes compare as their bits with the sign cleared (a NaN's are above +inf's), so
    // the largest is an integer max, which vectorises.
    uint32_t most = 0;
    for (int64_t i = 0; i < n; ++i) most = std::max(most, float_to_bits(x[i]) & 0x7FFFFFFFu);
    int64_t at = 0;
    if (most > 0x7F800000u) {  // a NaN: the first one, whatever its payload
      while (!std::isnan(x[at])) ++at;
    } else {
      while ((float_to_bits(x[at]) & 0x7FFFFFFFu) != most) ++at;
    }
    const float s = x[at];
    *scale = s;
    const float d = s == 0.0f ? 1.0f : s;  // an all-zero block: all code 0.0
    float normal[kMaxBlock];
    for (int64_t i = 0; i < n; ++i) normal[i] = x[i] / d;  // division, as torch: the same floats
    for (int64_t i = 0; i < n; ++i) codes[i] = code(normal[i]);
  }

  void decode_block(const uint8_t* codes, float scale, float* out, int64_t n) const {
    for (int64_t i = 0; i < n; ++i) out[i] = values_[codes[i]] * scale;
  }

  void encode(uintptr_t x, uintptr_t codes, uintptr_t scales, int64_t n, int64_t block) const {
    over_blocks(n, block, [&](int64_t b, int64_t start, int64_t len) {
      encode_block(reinterpret_cast<const float*>(x) + start,
                   reinterpret_cast<uint8_t*>(codes) + start, reinterpret_cast<float*>(scales) + b,
                   len);
    });
  }

  void decode(uintptr_t codes, uintptr_t scales, uintptr_t out, int64_t n, int64_t block) const {
    over_blocks(n, block, [&](int64_t b, int64_t start, int64_t len) {
      decode_block(reinterpret_cast<const uint8_t*>(codes) + start,
                   reinterpret_cast<const float*>(scales)[b], reinterpret_cast<float*>(out) + start,
                   len);
    });
  }

 private:
  // fn(block index, first element, elements) over the ceil(n / block) blocks, the last one
  // shorter, split over the cores for large n.
  template <typename Fn>
  static void over_blocks(int64_t n, int64_t block, Fn fn) {
    if (n <= 0) return;
    if (block <= 0 || block > kMaxBlock)
      throw std::invalid_argument("block must be 1 to " + std::to_string(kMaxBlock) + " elements, got " +
                                  std::to_string(block));
    const int64_t nblocks = (n + block - 1) / block;
    auto run = [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) fn(b, b * block, std::min(block, n - b * block));
    };
    const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
    const int64_t parts = std::min<int64_t>(cores, std::max<int64_t>(1, n / kThreadMin));
    if (parts <= 1) {
      run(0, nblocks);
      return;
    }
    std::vector<std::thread> threads;
    const int64_t per = (nblocks + parts - 1) / parts;
    for (int64_t p = 1; p < parts; ++p)
      threads.emplace_back(run, std::min(nblocks, p * per), std::min(nblocks, (p + 1) * per));
    run(0, std::min(nblocks, per));
    for (auto& t : threads) t.join();
  }

  float bounds_[kBounds + 1];
  float values_[kCodes];
  uint8_t below_[65536];  // boundaries below the smallest float with these top 16 bits
};

}  // namespace

PYBIND11_MODULE(_compact_native, m) {
  m.doc() = "int8 codec of infinity._compact (use infinity._compact, not this module)";
  py::class_<Codec>(m, "Codec")
      .def(py::init<const std::vector<float>&, const std::vector<float>&>(), py::arg("bounds"),
           py::arg("values"))
      // Addresses of contiguous host tensors: x and out float32, codes uint8, scales float32
      // (ceil(n / block) of them). The caller checks dtypes, devices and contiguity.
      .def("encode", &Codec::encode, py::arg("x"), py::arg("codes"), py::arg("scales"),
           py::arg("n"), py::arg("block"), py::call_guard<py::gil_scoped_release>())
      .def("decode", &Codec::decode, py::arg("codes"), py::arg("scales"), py::arg("out"),
           py::arg("n"), py::arg("block"), py::call_guard<py::gil_scoped_release>());
}
