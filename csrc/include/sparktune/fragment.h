// Register-fragment helpers: layout views of MMA accumulators, packed type conversion and
// the online softmax's row steps.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include <cmath>

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

// The online softmax's steps for one row (base 2), shared by the forward families.
// The largest of row r's scores in a row-column view, starting from `init`.
template <class RowCol>
CUTE_DEVICE float row_max_of(RowCol const& s_rc, int r, float init) {
  CUTE_UNROLL
  for (int c = 0; c < size<1>(s_rc); ++c) init = fmaxf(init, s_rc(r, c));
  return init;
}

// The row's running maximum moves to `mx` (already reduced over the lanes that share the
// row): returns the base the row's exponents take (0 while no key is visible, mx = -inf) and
// sets `alpha`, the factor of the row's old sum and of its output row.
CUTE_DEVICE float softmax_row_step(float& row_max, float mx, float scale_log2, float& alpha) {
  const float base = mx == -INFINITY ? 0.f : mx * scale_log2;
  alpha = exp2f(row_max * scale_log2 - base);
  row_max = mx;
  return base;
}

// Row r of a row-column view of scores becomes exp2(s * scale_log2 - base) in place; returns
// the row's sum.
template <class RowCol>
CUTE_DEVICE float exp2_row(RowCol& s_rc, int r, float scale_log2, float base) {
  float sum = 0.f;
  CUTE_UNROLL
  for (int c = 0; c < size<1>(s_rc); ++c) {
    const float e = exp2f(fmaf(s_rc(r, c), scale_log2, -base));
    s_rc(r, c) = e;
    sum += e;
  }
  return sum;
}

}  // namespace sparktune
