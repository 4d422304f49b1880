// infinity._compact_native: the int8 codec of infinity._compact (codec.h), the one-pass Adam
// update of int8 moments (adam_int8.h) and the sum of squares of the gradient norms
// (norms.h, for infinity._grad_norms), for the host.
//
// The Python module keeps the codec's reference (torch ops: argmax, division, bucketize); the
// C++ one computes the same bytes, bit for bit (tests/infinity/test_compact.py holds the two
// equal; benchmarks/codec.py times them). Every function takes addresses of contiguous host
// tensors (the caller checks dtypes, devices, sizes and contiguity) and releases the GIL.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <tuple>
#include <vector>

#include "adam_int8.h"
#include "codec.h"
#include "norms.h"

namespace py = pybind11;
using infinity_native::AdamSegment;
using infinity_native::Codec;

namespace {

const char* const kIsaNames[] = {"scalar", "avx2", "avx512", "avx512vbmi"};

// Below this many elements a call runs on the calling thread: a parallel region costs more.
constexpr int64_t kThreadMin = 1 << 20;

int64_t parts_for(int64_t n, int64_t threads) { return std::min(threads, std::max<int64_t>(1, n / kThreadMin)); }

void check_block(int64_t block) {
  if (block <= 0 || block > infinity_native::kMaxBlock)
    throw std::invalid_argument("block must be 1 to " + std::to_string(infinity_native::kMaxBlock) +
                                " elements, got " + std::to_string(block));
}

void encode(const Codec& c, uintptr_t x, uintptr_t codes, uintptr_t scales, int64_t n, int64_t block,
            int64_t threads) {
  check_block(block);
  infinity_native::in_parts(n, block, parts_for(n, threads), [&](int64_t a, int64_t b) {
    c.encode(reinterpret_cast<const float*>(x) + a, reinterpret_cast<uint8_t*>(codes) + a,
             reinterpret_cast<float*>(scales) + a / block, b - a, block);
  });
}

void decode(const Codec& c, uintptr_t codes, uintptr_t scales, uintptr_t out, int64_t n, int64_t block,
            int64_t threads) {
  check_block(block);
  infinity_native::in_parts(n, block, parts_for(n, threads), [&](int64_t a, int64_t b) {
    c.decode(reinterpret_cast<const uint8_t*>(codes) + a, reinterpret_cast<const float*>(scales) + a / block,
             reinterpret_cast<float*>(out) + a, b - a, block);
  });
}

using SegmentArgs = std::tuple<int64_t, int64_t, uintptr_t, double, double, double, double, double, double>;
// master, m_codes, m_scales, v_codes, v_scales, n, segments
using UnitArgs = std::tuple<uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, int64_t, std::vector<SegmentArgs>>;

infinity_native::Int8Unit to_unit(const UnitArgs& args, bool adamw) {
  const auto& [master, m_codes, m_scales, v_codes, v_scales, n, segments] = args;
  infinity_native::Int8Unit u;
  u.master = reinterpret_cast<float*>(master);
  u.m_codes = reinterpret_cast<uint8_t*>(m_codes), u.m_scales = reinterpret_cast<float*>(m_scales);
  u.v_codes = reinterpret_cast<uint8_t*>(v_codes), u.v_scales = reinterpret_cast<float*>(v_scales);
  u.n = n;
  u.segments.reserve(segments.size());
  for (const auto& [start, len, grad, lr, beta1, beta2, eps, wd, step] : segments)
    u.segments.emplace_back(start, len, reinterpret_cast<float*>(grad), lr, beta1, beta2, eps, wd, step, adamw);
  return u;
}

void adam_int8_units(const Codec& signed_codec, const Codec& unsigned_codec, const std::vector<UnitArgs>& units,
                     int64_t block, bool adamw, py::object grad_scale, int64_t threads) {
  std::vector<infinity_native::Int8Unit> work;
  work.reserve(units.size());
  for (const auto& u : units) work.push_back(to_unit(u, adamw));
  float scale = 0;
  const bool scaled = !grad_scale.is_none();
  if (scaled) scale = static_cast<float>(grad_scale.cast<double>());
  py::gil_scoped_release released;
  infinity_native::adam_int8(signed_codec, unsigned_codec, work, block, scaled ? &scale : nullptr, threads);
}

void adam_int8(const Codec& signed_codec, const Codec& unsigned_codec, uintptr_t master, uintptr_t m_codes,
               uintptr_t m_scales, uintptr_t v_codes, uintptr_t v_scales, int64_t n, int64_t block,
               const std::vector<SegmentArgs>& segments, bool adamw, py::object grad_scale, int64_t threads) {
  adam_int8_units(signed_codec, unsigned_codec, {UnitArgs{master, m_codes, m_scales, v_codes, v_scales, n, segments}},
                  block, adamw, std::move(grad_scale), threads);
}

double sum_squares(uintptr_t x, int64_t n) {
  if (n < 0) throw std::invalid_argument("sum_squares: n must be >= 0, got " + std::to_string(n));
  return infinity_native::sum_squares(reinterpret_cast<const float*>(x), n);
}

}  // namespace

PYBIND11_MODULE(_compact_native, m) {
  m.doc() = "int8 codec and one-pass int8 Adam of infinity._compact, sum of squares of infinity._grad_norms (use those, not this module)";
  // The instruction set the codec and the update run ("scalar", "avx2", "avx512", "avx512vbmi"): the best the
  // CPU has; set_isa asks for less (tests hold each path to the reference), returns what runs.
  m.def("isa", [] { return kIsaNames[static_cast<int>(infinity_native::isa())]; });
  m.def("set_isa", [](const std::string& name) {
    for (int i = 0; i < 4; ++i)
      if (name == kIsaNames[i]) return std::string(kIsaNames[static_cast<int>(infinity_native::set_isa(static_cast<infinity_native::Isa>(i)))]);
    throw std::invalid_argument("set_isa: no instruction set " + name + "; scalar, avx2, avx512 or avx512vbmi");
  }, py::arg("name"));
  py::class_<Codec>(m, "Codec")
      .def(py::init<const std::vector<float>&, const std::vector<float>&>(), py::arg("bounds"),
           py::arg("values"))
      // whether the AVX-512 encode computes this map's codes without its table (codec.h)
      .def_property_readonly("arithmetic", &Codec::arithmetic);
  // x and out float32, codes uint8, scales float32 (ceil(n / block) of them)
  m.def("encode", &encode, py::arg("codec"), py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("n"),
        py::arg("block"), py::arg("threads"), py::call_guard<py::gil_scoped_release>());
  m.def("decode", &decode, py::arg("codec"), py::arg("codes"), py::arg("scales"), py::arg("out"), py::arg("n"),
        py::arg("block"), py::arg("threads"), py::call_guard<py::gil_scoped_release>());
  // x float32: the sum of its n squares, in double (norms.h)
  m.def("sum_squares", &sum_squares, py::arg("x"), py::arg("n"), py::call_guard<py::gil_scoped_release>());
  // Several units' parts at once, each (master, m_codes, m_scales, v_codes, v_scales, n,
  // segments as below): one parallel region for them all.
  m.def("adam_int8_units", &adam_int8_units, py::arg("signed_codec"), py::arg("unsigned_codec"), py::arg("units"),
        py::arg("block"), py::arg("adamw"), py::arg("grad_scale"), py::arg("threads"));
  // One unit's part: segments (start, len, grad address, lr, beta1, beta2, eps, weight_decay,
  // step) in order; grad_scale a float or None.
  m.def("adam_int8", &adam_int8, py::arg("signed_codec"), py::arg("unsigned_codec"), py::arg("master"),
        py::arg("m_codes"), py::arg("m_scales"), py::arg("v_codes"), py::arg("v_scales"), py::arg("n"),
        py::arg("block"), py::arg("segments"), py::arg("adamw"), py::arg("grad_scale"), py::arg("threads"));
}
