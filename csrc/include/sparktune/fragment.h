// Register-fragment helpers: layout views of MMA accumulators and packed type conversion.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

namespace sparktune {

using namespace cute;

// An m16n8k16 accumulator fragment ((2 cols, 2 row halves), M, N) seen as
// ((2 row halves, M) rows, (2 cols, N) cols).
template <class L>
CUTE_HOST_DEVICE constexpr auto rowcol_view(L const& l) {
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<2>(l)));
}

// The same accumulator seen as the A operand of the next m16n8k16 product: two neighbouring
// n8 accumulator tiles hold exactly the 16 k-columns a thread owns in an A fragment, so
// ((2,2), M, N) becomes (((2,2),2), M, N/2) without moving a register.
template <class L>
CUTE_HOST_DEVICE constexpr auto acc_as_operand_a(L const& l) {
  auto d = logical_divide(l, Shape<Underscore, Underscore, _2>{});  // ((2,2), M, (2, N/2))
  return make_layout(make_layout(get<0>(d), get<2, 0>(d)), get<1>(d), get<2, 1>(d));
}

// Packed conversion of a whole register fragment (f32 -> f16x2 etc.).
template <class To, class Src>
CUTE_DEVICE auto convert_fragment(Src const& src) {
  using From = typename Src::value_type;
  constexpr int N = decltype(size(src))::value;
  Tensor dst = make_tensor<To>(src.layout());
  cutlass::NumericArrayConverter<To, From, N> convert;
  *reinterpret_cast<cutlass::Array<To, N>*>(dst.data()) =
      convert(*reinterpret_cast<cutlass::Array<From, N> const*>(src.data()));
  return dst;
}

template <int kOffsetMax, class F>
CUTE_DEVICE float allreduce_xor(float x, F op) {
  CUTE_UNROLL
  for (int offset = kOffsetMax; offset > 0; offset /= 2) {
    x = op(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}

struct MaxOp {
  CUTE_DEVICE float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
  CUTE_DEVICE float operator()(float a, float b) const { return a + b; }
};

}  // namespace sparktune
