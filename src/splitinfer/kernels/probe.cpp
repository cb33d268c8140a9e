// A measurement, not a kernel: the rate of the instruction the VNNI integer kernels multiply with (vpdpbusd) on
// the threads torch runs, which `bench step` sets an integer product's compute bound from, measured on the
// machine that runs the step rather than taken from a datasheet. splitinfer::int8_dot_peak(iterations) -> GOP/s.
// (AMX's counterpart, amx_peak, lives beside the AMX product in w8a8_amx.cpp, which owns the tile setup.)
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <chrono>
#include <cstdint>

namespace {

// Twelve independent chains of vpdpbusd (enough to cover its latency on two ports), `iterations` times, on
// operands the compiler cannot see through; a multiply and an add per byte pair.
void chains(int64_t iterations) {
  __m512i c0 = _mm512_set1_epi32(1), c1 = _mm512_set1_epi32(2), c2 = _mm512_set1_epi32(3), c3 = _mm512_set1_epi32(4);
  __m512i c4 = _mm512_set1_epi32(5), c5 = _mm512_set1_epi32(6), c6 = _mm512_set1_epi32(7), c7 = _mm512_set1_epi32(8);
  __m512i c8 = _mm512_set1_epi32(9), c9 = _mm512_set1_epi32(10);
  __m512i c10 = _mm512_set1_epi32(11), c11 = _mm512_set1_epi32(12);
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
  for (int64_t i = 0; i < iterations; ++i) {
    asm volatile("" : "+v"(a), "+v"(b));  // new operands every pass, as far as the compiler knows
    c0 = _mm512_dpbusd_epi32(c0, a, b), c1 = _mm512_dpbusd_epi32(c1, a, b), c2 = _mm512_dpbusd_epi32(c2, a, b);
    c3 = _mm512_dpbusd_epi32(c3, a, b), c4 = _mm512_dpbusd_epi32(c4, a, b), c5 = _mm512_dpbusd_epi32(c5, a, b);
    c6 = _mm512_dpbusd_epi32(c6, a, b), c7 = _mm512_dpbusd_epi32(c7, a, b), c8 = _mm512_dpbusd_epi32(c8, a, b);
    c9 = _mm512_dpbusd_epi32(c9, a, b), c10 = _mm512_dpbusd_epi32(c10, a, b), c11 = _mm512_dpbusd_epi32(c11, a, b);
  }
  __m512i sum = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(c0, c1), _mm512_add_epi32(c2, c3)),
                                 _mm512_add_epi32(_mm512_add_epi32(c4, c5), _mm512_add_epi32(c6, c7)));
  sum = _mm512_add_epi32(sum, _mm512_add_epi32(_mm512_add_epi32(c8, c9), _mm512_add_epi32(c10, c11)));
  volatile int32_t sink = _mm512_reduce_add_epi32(sum);  // the chains are used, so computed
  (void)sink;
}

// `iterations` of `chains` on each of torch's threads at once: the peak of the threads a step runs on.
double int8_dot_peak(int64_t iterations) {
  const int64_t threads = at::get_num_threads();
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) chains(iterations);
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return static_cast<double>(threads * iterations) * 12 * 64 * 2 / seconds / 1e9;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitinfer, m) { m.def("int8_dot_peak(int iterations) -> float"); }

// No tensor argument to dispatch on: registered for every backend.
TORCH_LIBRARY_IMPL(splitinfer, CompositeExplicitAutograd, m) { m.impl("int8_dot_peak", &int8_dot_peak); }
