// The decoder layer of a decode step in two calls around vLLM's attention (ops
// edge_w4::attn_in and edge_w4::mlp_out), for the fused decode path
// (edge_infer.vllm_ext.fused). A pre-norm layer is
//     residual += x; h = rmsnorm(residual) * ln1; qkv = W_qkv h (+ bias); per-head q/k norm; rope
//     [vLLM attention: KV-cache write, attention over the cache]
//     residual += W_o attn; h = rmsnorm(residual) * ln2; x = W_down (act(W_gate h) * W_up h)
// At decode the norms, rope and activation cost a few microseconds; run as separate ops
// (inductor's kernels and vLLM's wrappers) each one cost more in dispatch than in arithmetic.
// Here they run in the same call as the 4-bit GEMVs (edge_w4_linear, csrc/edge_w4.cpp) that
// need them. Rows (tokens) are independent; the arithmetic is fp32, rounded to the
// activations' dtype where the eager model rounds: the residual, the normed input of each
// GEMV, q and k after rope, and the activation product. The activations are bf16 (where the
// CPU multiplies bf16) or fp32 (AVX2 without it): each op is a template on that type, and for
// fp32 the rounding is the identity.
#include <ATen/record_function.h>
#include <torch/extension.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

// csrc/edge_w4.cpp: the op edge_w4::linear, as a plain function.
torch::Tensor edge_w4_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s,
                             const c10::optional<torch::Tensor>& z, int64_t group, int64_t layout,
                             int64_t isa, int64_t small_m_max, int64_t tile);

namespace {

using bf16 = c10::BFloat16;

// exp(x) with AVX2 as 2^n p(r), r = x - n ln2 in [-ln2/2, ln2/2], p the degree-6 Taylor
// polynomial (relative error ~2e-7, far below bf16's 4e-3).
__attribute__((target("avx2,fma"))) __m256 exp_avx2(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

__attribute__((target("avx2,fma"))) __m256 load_bf16_avx2(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// fp32 -> bf16, round to nearest even (finite inputs), as c10::BFloat16's constructor
__attribute__((target("avx2,fma"))) __m256 round_bf16_avx2(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

__attribute__((target("avx2,fma"))) void store_bf16_avx2(bf16* p, __m256 v) {
  // v already rounded to bf16 (round_bf16_avx2): keep the high halves, 8 words
  const __m256i y = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(y, _mm256_setzero_si256()), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

__attribute__((target("avx2,fma"))) float hsum_avx2(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// Eight activations of type T as fp32, and back: load, round to T (as T's constructor does),
// store (the value already rounded).
template <typename T>
struct Vec;

template <>
struct Vec<bf16> {
  __attribute__((target("avx2,fma"))) static __m256 load(const bf16* p) { return load_bf16_avx2(p); }
  __attribute__((target("avx2,fma"))) static __m256 round(__m256 v) { return round_bf16_avx2(v); }
  __attribute__((target("avx2,fma"))) static void store(bf16* p, __m256 v) { store_bf16_avx2(p, v); }
};

template <>
struct Vec<float> {
  __attribute__((target("avx2,fma"))) static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  __attribute__((target("avx2,fma"))) static __m256 round(__m256 v) { return v; }
  __attribute__((target("avx2,fma"))) static void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
};

// the op's activation type, and its name in errors
template <typename T>
constexpr c10::ScalarType kType = std::is_same_v<T, float> ? torch::kFloat : torch::kBFloat16;
template <typename T>
constexpr const char* kName = std::is_same_v<T, float> ? "fp32" : "bf16";

// sum_i a[i] b[i], fp32 sums
template <typename T>
__attribute__((target("avx2,fma"))) float dot_avx2(const T* a, const T* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(Vec<T>::load(a + i), Vec<T>::load(b + i), acc0);
    acc1 = _mm256_fmadd_ps(Vec<T>::load(a + i + 8), Vec<T>::load(b + i + 8), acc1);
  }
  float sum = hsum_avx2(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) sum += static_cast<float>(a[i]) * static_cast<float>(b[i]);
  return sum;
}

template <typename T>
float dot(const T* a, const T* b, int64_t n) {
  if (has_avx2()) return dot_avx2(a, b, n);
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<float>(a[i]) * static_cast<float>(b[i]);
  return sum;
}

// One 4-bit linear as the fused ops receive it: codes, scales, zero points and the five
// integers of edge_w4::linear (group, layout, isa, small_m_max, tile).
torch::Tensor apply(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s,
                    const c10::optional<torch::Tensor>& z, c10::IntArrayRef meta) {
  TORCH_CHECK(meta.size() == 5, "edge_w4: a linear's meta is [group, layout, isa, small_m_max, tile]");
  return edge_w4_linear(x, q, s, z, meta[0], meta[1], meta[2], meta[3], meta[4]);
}

template <typename T>
void check_rows(const torch::Tensor& t, int64_t cols, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.size(1) == cols && t.is_contiguous() && t.scalar_type() == kType<T>,
              "edge_w4: ", what, " must be contiguous ", kName<T>, " [M, ", cols, "]");
}

// residual += x (x may be absent: the first layer's residual is the embedding), then
// out = T(rmsnorm(residual) * w). The sum is rounded to T before it is normed, as the
// eager model keeps its residual stream in T.
template <typename T>
void add_rms_portable(const T* x, T* res, const float* w, double eps, int64_t k, T* out) {
  float sq = 0.f;
  for (int64_t i = 0; i < k; ++i) {
    res[i] = T(static_cast<float>(res[i]) + (x ? static_cast<float>(x[i]) : 0.f));
    const float r = static_cast<float>(res[i]);
    sq += r * r;
  }
  const float scale = 1.f / std::sqrt(sq / static_cast<float>(k) + static_cast<float>(eps));
  for (int64_t i = 0; i < k; ++i) out[i] = T(static_cast<float>(res[i]) * scale * w[i]);
}

template <typename T>
__attribute__((target("avx2,fma"))) void add_rms_avx2(const T* x, T* res, const float* w, double eps,
                                                        int64_t k, T* out) {
  __m256 sq = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8) {
    __m256 r = Vec<T>::load(res + i);
    if (x) r = Vec<T>::round(_mm256_add_ps(r, Vec<T>::load(x + i)));
    Vec<T>::store(res + i, r);
    sq = _mm256_fmadd_ps(r, r, sq);
  }
  const __m256 scale = _mm256_set1_ps(1.f / std::sqrt(hsum_avx2(sq) / static_cast<float>(k) + static_cast<float>(eps)));
  for (int64_t i = 0; i < k; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_mul_ps(Vec<T>::load(res + i), scale), _mm256_loadu_ps(w + i));
    Vec<T>::store(out + i, Vec<T>::round(v));
  }
}

template <typename T>
void add_rms(const T* x, T* res, const float* w, double eps, int64_t k, T* out) {
  if (has_avx2() && k % 8 == 0) return add_rms_avx2(x, res, w, eps, k, out);
  add_rms_portable(x, res, w, eps, k, out);
}

// In place on one head of `d` values: optional RMS norm (weight w), then NeoX rope over the
// first `rot` dims (cos/sin: rot/2 each).
template <typename T>
void head_norm_rope(T* h, int64_t d, const float* w, double eps, const float* cos, const float* sin,
                    int64_t rot) {
  float v[1024];
  for (int64_t i = 0; i < d; ++i) v[i] = static_cast<float>(h[i]);
  if (w != nullptr) {
    double sq = 0.0;
    for (int64_t i = 0; i < d; ++i) sq += static_cast<double>(v[i]) * v[i];
    const float scale = static_cast<float>(1.0 / std::sqrt(sq / static_cast<double>(d) + eps));
    for (int64_t i = 0; i < d; ++i) v[i] = static_cast<float>(T(v[i] * scale * w[i]));
  }
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * cos[i] - b * sin[i];
    v[i + half] = b * cos[i] + a * sin[i];
  }
  for (int64_t i = 0; i < d; ++i) h[i] = T(v[i]);
}

const float* f32_or_null(const c10::optional<torch::Tensor>& t, int64_t n, const char* what) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous() && t->numel() == n,
              "edge_w4: ", what, " must be contiguous fp32 with ", n, " values");
  return t->data_ptr<float>();
}

// The op's body for the residual's dtype: f(T{}) with T bf16 or float.
template <typename F>
auto by_dtype(const torch::Tensor& residual, F&& f) {
  if (residual.scalar_type() == torch::kFloat) return f(float{});
  TORCH_CHECK(residual.scalar_type() == torch::kBFloat16, "edge_w4: the fused ops take bf16 or fp32 "
              "activations, not ", residual.scalar_type());
  return f(bf16{});
}

// residual [M, H] (updated in place), x [M, H] or absent -> qkv [M, (nq + 2 nkv) d] (plus
// qkv_bias, T [(nq + 2 nkv) d], when given: Qwen2's) with q and
// k normed per head (when q_norm/k_norm are given) and rotated at `positions`; and, when
// gate_w (T [nq, H], an unquantized per-head output gate) is given, the gates
// sigmoid(gate_w h) [M, nq] T (else an empty tensor). T is the residual's dtype.
// cos_sin: fp32 [max_position, rot] (cos then sin, vLLM's cos_sin_cache).
std::tuple<torch::Tensor, torch::Tensor> attn_in(torch::Tensor residual, const c10::optional<torch::Tensor>& x,
                      const torch::Tensor& ln, double eps, const torch::Tensor& wq,
                      const torch::Tensor& ws, const c10::optional<torch::Tensor>& wz,
                      c10::IntArrayRef meta, const c10::optional<torch::Tensor>& q_norm,
                      const c10::optional<torch::Tensor>& k_norm, double head_eps,
                      const torch::Tensor& cos_sin, const torch::Tensor& positions, int64_t nq,
                      int64_t nkv, int64_t d, int64_t rot, const c10::optional<torch::Tensor>& gate_w,
                      const c10::optional<torch::Tensor>& qkv_bias) {
  return by_dtype(residual, [&](auto t) {
    using T = decltype(t);
    const int64_t m = residual.size(0), hidden = residual.size(1);
    check_rows<T>(residual, hidden, "residual");
    if (x.has_value()) {
      check_rows<T>(*x, hidden, "x");
      TORCH_CHECK(x->size(0) == m, "edge_w4: x and residual differ in rows");
    }
    TORCH_CHECK(d <= 1024 && rot <= d && rot % 2 == 0, "edge_w4: head size ", d, " / rotary ", rot);
    TORCH_CHECK(cos_sin.scalar_type() == torch::kFloat && cos_sin.is_contiguous() && cos_sin.dim() == 2 &&
                    cos_sin.size(1) == rot,
                "edge_w4: cos_sin must be contiguous fp32 [positions, rot]");
    TORCH_CHECK(positions.scalar_type() == torch::kLong && positions.numel() == m,
                "edge_w4: positions must be int64 [M]");
    const float* lw = f32_or_null(ln, hidden, "the input norm weight");
    const float* qw = f32_or_null(q_norm, d, "q_norm");
    const float* kw = f32_or_null(k_norm, d, "k_norm");

    auto h = torch::empty({m, hidden}, residual.options());
    const T* xp = x.has_value() ? x->data_ptr<T>() : nullptr;
    for (int64_t r = 0; r < m; ++r) {
      add_rms(xp ? xp + r * hidden : nullptr, residual.data_ptr<T>() + r * hidden, lw, eps, hidden,
              h.data_ptr<T>() + r * hidden);
    }
    torch::Tensor gates = torch::empty({0}, residual.options());
    if (gate_w.has_value()) {
      check_rows<T>(*gate_w, hidden, "gate_w");
      TORCH_CHECK(gate_w->size(0) == nq, "edge_w4: gate_w must have one row per query head");
      gates = torch::empty({m, nq}, residual.options());
      const T* gw = gate_w->data_ptr<T>();
      for (int64_t r = 0; r < m; ++r) {
        const T* hr = h.data_ptr<T>() + r * hidden;
        for (int64_t j = 0; j < nq; ++j) {
          const float logit = static_cast<float>(T(dot(hr, gw + j * hidden, hidden)));  // T, as the eager linear
          gates.data_ptr<T>()[r * nq + j] = T(1.f / (1.f + std::exp(-logit)));
        }
      }
    }
    auto qkv = apply(h, wq, ws, wz, meta);
    const int64_t width = (nq + 2 * nkv) * d;
    check_rows<T>(qkv, width, "qkv");
    const T* bias = nullptr;
    if (qkv_bias.has_value()) {
      TORCH_CHECK(qkv_bias->scalar_type() == residual.scalar_type() && qkv_bias->is_contiguous() &&
                      qkv_bias->numel() == width,
                  "edge_w4: qkv_bias must be contiguous, in the activations' dtype, with ", width, " values");
      bias = qkv_bias->data_ptr<T>();
    }
    const auto pos = positions.contiguous();
    const int64_t* pp = pos.data_ptr<int64_t>();
    const int64_t max_pos = cos_sin.size(0);
    for (int64_t r = 0; r < m; ++r) {
      TORCH_CHECK(pp[r] >= 0 && pp[r] < max_pos, "edge_w4: position ", pp[r], " outside the rope table");
      const float* cs = cos_sin.data_ptr<float>() + pp[r] * rot;
      T* row = qkv.data_ptr<T>() + r * width;
      // the linear's output rounded to T, then the bias added and rounded, as the eager `y + bias`
      if (bias) {
        for (int64_t i = 0; i < width; ++i) row[i] = T(static_cast<float>(row[i]) + static_cast<float>(bias[i]));
      }
      for (int64_t hd = 0; hd < nq; ++hd) head_norm_rope(row + hd * d, d, qw, head_eps, cs, cs + rot / 2, rot);
      for (int64_t hd = 0; hd < nkv; ++hd) {
        head_norm_rope(row + (nq + hd) * d, d, kw, head_eps, cs, cs + rot / 2, rot);
      }
    }
    return std::make_tuple(qkv, gates);
  });
}

inline float act_of(float g, int64_t act) {
  if (act == 0) return g / (1.f + std::exp(-g));                      // SiLU
  return 0.5f * g * (1.f + std::erf(g * 0.70710678118654752f));      // exact GELU
}

// out[i] = T(T(act(gate[i])) * up[i]), the eager rounding (act(gate) is rounded to T before
// the product).
template <typename T>
void act_mul_portable(const T* gate, const T* up, int64_t f, int64_t act, T* out) {
  for (int64_t i = 0; i < f; ++i) {
    out[i] = T(static_cast<float>(T(act_of(static_cast<float>(gate[i]), act))) * static_cast<float>(up[i]));
  }
}

// exact GELU 0.5 g (1 + erf(g / sqrt 2)), erf by Abramowitz & Stegun 7.1.26 (absolute error
// below 1.5e-7): erf|x| = 1 - t (a1 + t (a2 + ... a5)) exp(-x^2), t = 1 / (1 + p |x|).
__attribute__((target("avx2,fma"))) __m256 gelu_avx2(__m256 g) {
  const __m256 signbit = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256 x = _mm256_mul_ps(g, _mm256_set1_ps(0.70710678118654752f));
  const __m256 sign = _mm256_and_ps(x, signbit);
  const __m256 ax = _mm256_andnot_ps(signbit, x);
  const __m256 t = _mm256_div_ps(_mm256_set1_ps(1.f), _mm256_fmadd_ps(ax, _mm256_set1_ps(0.3275911f), _mm256_set1_ps(1.f)));
  __m256 p = _mm256_set1_ps(1.061405429f);
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-1.453152027f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.421413741f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-0.284496736f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.254829592f));
  p = _mm256_mul_ps(p, t);
  const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(ax, ax)));
  const __m256 erf = _mm256_or_ps(_mm256_fnmadd_ps(p, e, _mm256_set1_ps(1.f)), sign);
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(_mm256_set1_ps(1.f), erf));
}

__attribute__((target("avx2,fma"))) __m256 silu_avx2(__m256 g) {
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

template <typename T>
__attribute__((target("avx2,fma"))) void act_mul_avx2(const T* gate, const T* up, int64_t f, int64_t act,
                                                        T* out) {
  int64_t i = 0;
  for (; i + 8 <= f; i += 8) {
    const __m256 g = Vec<T>::load(gate + i);
    const __m256 a = Vec<T>::round(act == 0 ? silu_avx2(g) : gelu_avx2(g));
    Vec<T>::store(out + i, Vec<T>::round(_mm256_mul_ps(a, Vec<T>::load(up + i))));
  }
  act_mul_portable(gate + i, up + i, f - i, act, out + i);
}

template <typename T>
void act_mul(const T* gate, const T* up, int64_t f, int64_t act, T* out) {
  if (has_avx2()) return act_mul_avx2(gate, up, f, act, out);
  act_mul_portable(gate, up, f, act, out);
}

// attn [M, A] -> o = W_o attn; residual += o; h = rmsnorm(residual) * ln;
// gu = W_gate_up h ([gate; up], F each); returns W_down (act(gate) * up), [M, H] T (the
// residual's dtype). act: 0 SiLU, 1 exact (erf) GELU.
torch::Tensor mlp_out(torch::Tensor residual, const torch::Tensor& attn, const torch::Tensor& oq,
                      const torch::Tensor& os, const c10::optional<torch::Tensor>& oz,
                      c10::IntArrayRef ometa, const torch::Tensor& ln, double eps,
                      const torch::Tensor& gq, const torch::Tensor& gs,
                      const c10::optional<torch::Tensor>& gz, c10::IntArrayRef gmeta,
                      const torch::Tensor& dq, const torch::Tensor& ds,
                      const c10::optional<torch::Tensor>& dz, c10::IntArrayRef dmeta, int64_t act,
                      const c10::optional<torch::Tensor>& head_gate) {
  return by_dtype(residual, [&](auto t) {
    using T = decltype(t);
    const int64_t m = residual.size(0), hidden = residual.size(1);
    check_rows<T>(residual, hidden, "residual");
    TORCH_CHECK(act == 0 || act == 1, "edge_w4: activation must be 0 (silu) or 1 (gelu)");
    const float* lw = f32_or_null(ln, hidden, "the post-attention norm weight");
    auto in = attn.contiguous();
    check_rows<T>(in, in.size(1), "attn");
    if (head_gate.has_value() && head_gate->numel() > 0) {
      // attention output per head times its gate, rounded to T as the eager product
      const int64_t heads = head_gate->size(1), width = in.size(1);
      check_rows<T>(*head_gate, heads, "head_gate");
      TORCH_CHECK(head_gate->size(0) == m && width % heads == 0, "edge_w4: head_gate does not fit attn");
      in = in.clone();
      const int64_t d = width / heads;
      T* p = in.data_ptr<T>();
      const T* g = head_gate->data_ptr<T>();
      for (int64_t r = 0; r < m; ++r) {
        for (int64_t j = 0; j < width; ++j) {
          p[r * width + j] = T(static_cast<float>(p[r * width + j]) * static_cast<float>(g[r * heads + j / d]));
        }
      }
    }
    auto o = apply(in, oq, os, oz, ometa);
    check_rows<T>(o, hidden, "o_proj output");
    auto h = torch::empty({m, hidden}, residual.options());
    for (int64_t r = 0; r < m; ++r) {
      add_rms(o.data_ptr<T>() + r * hidden, residual.data_ptr<T>() + r * hidden, lw, eps, hidden,
              h.data_ptr<T>() + r * hidden);
    }
    auto gu = apply(h, gq, gs, gz, gmeta);
    TORCH_CHECK(gu.size(1) % 2 == 0, "edge_w4: gate_up width must be even");
    const int64_t f = gu.size(1) / 2;
    check_rows<T>(gu, 2 * f, "gate_up output");
    auto a = torch::empty({m, f}, residual.options());
    for (int64_t r = 0; r < m; ++r) {
      const T* g = gu.data_ptr<T>() + r * 2 * f;
      act_mul(g, g + f, f, act, a.data_ptr<T>() + r * f);
    }
    return apply(a, dq, ds, dz, dmeta);
  });
}

// vLLM's CPU attention ops (its _C library, loaded by vLLM before any model runs), called
// boxed: the schema is vLLM's, so the arguments go as on its Python side.
c10::OperatorHandle vllm_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// One decoder layer's constants: all but the step's activations, KV-cache views and
// attention metadata.
struct LayerArgs {
  torch::Tensor ln;
  double eps;
  torch::Tensor wq, ws;
  c10::optional<torch::Tensor> wz;
  std::vector<int64_t> meta;
  c10::optional<torch::Tensor> q_norm, k_norm;
  double head_eps;
  torch::Tensor cos_sin;
  int64_t rot;
  c10::optional<torch::Tensor> gate_w, qkv_bias;
  std::string isa;
  double k_scale, v_scale, scale;
  c10::optional<torch::Tensor> alibi;
  int64_t window;
  double softcap;
  torch::Tensor oq, os;
  c10::optional<torch::Tensor> oz;
  std::vector<int64_t> ometa;
  torch::Tensor ln2;
  double eps2;
  torch::Tensor gq, gs;
  c10::optional<torch::Tensor> gz;
  std::vector<int64_t> gmeta;
  torch::Tensor dq, ds;
  c10::optional<torch::Tensor> dz;
  std::vector<int64_t> dmeta;
  int64_t act;
};

// A decode step's shape and attention metadata, the same for every layer of one KV-cache group.
struct StepArgs {
  torch::Tensor positions;
  int64_t nq, nkv, d;
  torch::Tensor slot_mapping, query_start_loc, seq_lens;
  bool causal;
  torch::Tensor block_table, scheduler_metadata;
  c10::optional<torch::Tensor> dynamic_causal;
  int64_t num_actual_tokens;
};

// One decoder layer of a decode step: attn_in, then vLLM's KV-cache write and attention over
// the cache (what CPUAttentionBackendImpl.do_kv_cache_update and .forward call for decoder
// self-attention), then mlp_out. Returns the layer's output x.
torch::Tensor run_layer(const LayerArgs& L, const StepArgs& S, torch::Tensor residual,
                        const c10::optional<torch::Tensor>& x, const torch::Tensor& key_cache,
                        const torch::Tensor& value_cache) {
  const int64_t nq = S.nq, nkv = S.nkv, d = S.d;
  auto [qkv, gates] = attn_in(residual, x, L.ln, L.eps, L.wq, L.ws, L.wz, L.meta, L.q_norm, L.k_norm,
                              L.head_eps, L.cos_sin, S.positions, nq, nkv, d, L.rot, L.gate_w, L.qkv_bias);
  const int64_t m = residual.size(0);
  TORCH_CHECK(S.num_actual_tokens >= 0 && S.num_actual_tokens <= m, "edge_w4: num_actual_tokens out of range");
  auto q = qkv.narrow(1, 0, nq * d).view({m, nq, d});
  auto k = qkv.narrow(1, nq * d, nkv * d).view({m, nkv, d});
  auto v = qkv.narrow(1, (nq + nkv) * d, nkv * d).view({m, nkv, d});
  // looked up once (every layer of every decode step calls them)
  static const c10::OperatorHandle cache_op = vllm_op("_C::cpu_attn_reshape_and_cache");
  static const c10::OperatorHandle attn_op = vllm_op("_C::cpu_attention_with_kv_cache");
  torch::jit::Stack cache_args{k, v, key_cache, value_cache, S.slot_mapping, L.isa, L.k_scale, L.v_scale,
                               std::string("auto")};
  cache_op.callBoxed(&cache_args);
  auto out = torch::empty({m, nq, d}, residual.options());
  auto none = c10::IValue();
  torch::jit::Stack attn_args{
      q.narrow(0, 0, S.num_actual_tokens), key_cache, value_cache, out.narrow(0, 0, S.num_actual_tokens),
      S.query_start_loc, S.seq_lens, L.scale, S.causal, L.alibi.has_value() ? c10::IValue(*L.alibi) : none,
      L.window, S.block_table, L.softcap, S.scheduler_metadata, none,
      S.dynamic_causal.has_value() ? c10::IValue(*S.dynamic_causal) : none, L.k_scale, L.v_scale,
      std::string("auto")};
  attn_op.callBoxed(&attn_args);
  return mlp_out(residual, out.view({m, nq * d}), L.oq, L.os, L.oz, L.ometa, L.ln2, L.eps2, L.gq, L.gs, L.gz,
                 L.gmeta, L.dq, L.ds, L.dz, L.dmeta, L.act,
                 gates.numel() ? c10::optional<torch::Tensor>(gates) : c10::nullopt);
}

// Every decoder layer's constants, given once when the fused path is built (edge_w4.DecodeStack
// in Python), so that a decode step crosses from Python into C++ once (edge_w4::decode_step)
// instead of once per layer with some fifty arguments to convert. The cache views are
// remade only when a layer's cache tensor moves.
struct DecodeStack : torch::CustomClassHolder {
  std::vector<LayerArgs> layers;
  std::vector<std::tuple<const void*, torch::Tensor, torch::Tensor>> views;

  // one layer's constants, in the order of run_layer's LayerArgs
  void add(const torch::Tensor& ln, double eps, const torch::Tensor& wq, const torch::Tensor& ws,
           const c10::optional<torch::Tensor>& wz, std::vector<int64_t> meta,
           const c10::optional<torch::Tensor>& q_norm, const c10::optional<torch::Tensor>& k_norm,
           double head_eps, const torch::Tensor& cos_sin, int64_t rot,
           const c10::optional<torch::Tensor>& gate_w, const c10::optional<torch::Tensor>& qkv_bias,
           std::string isa, double k_scale, double v_scale, double scale,
           const c10::optional<torch::Tensor>& alibi, int64_t window, double softcap,
           const torch::Tensor& oq, const torch::Tensor& os, const c10::optional<torch::Tensor>& oz,
           std::vector<int64_t> ometa, const torch::Tensor& ln2, double eps2, const torch::Tensor& gq,
           const torch::Tensor& gs, const c10::optional<torch::Tensor>& gz, std::vector<int64_t> gmeta,
           const torch::Tensor& dq, const torch::Tensor& ds, const c10::optional<torch::Tensor>& dz,
           std::vector<int64_t> dmeta, int64_t act) {
    layers.push_back(LayerArgs{ln, eps, wq, ws, wz, std::move(meta), q_norm, k_norm, head_eps, cos_sin, rot,
                               gate_w, qkv_bias, std::move(isa), k_scale, v_scale, scale, alibi, window,
                               softcap, oq, os, oz, std::move(ometa), ln2, eps2, gq, gs, gz,
                               std::move(gmeta), dq, ds, dz, std::move(dmeta), act});
    views.emplace_back(nullptr, torch::Tensor(), torch::Tensor());
  }

  int64_t size() const { return static_cast<int64_t>(layers.size()); }

  // layer i's K and V views of its cache block tensor, as the backend makes them
  // ([blocks, kv heads, block size, 2 d] -> two [blocks, kv heads, block size, d])
  const std::tuple<const void*, torch::Tensor, torch::Tensor>& cache_views(size_t i, const torch::Tensor& cache) {
    auto& v = views[i];
    if (std::get<0>(v) != cache.data_ptr()) {
      TORCH_CHECK(cache.dim() == 4 && cache.size(3) % 2 == 0, "edge_w4: layer ", i,
                  "'s KV cache is not [blocks, kv heads, block size, 2 d]");
      auto kv = cache.view({cache.size(0), cache.size(1), cache.size(2) * 2, -1}).chunk(2, 2);
      v = std::make_tuple(cache.data_ptr(), kv[0], kv[1]);
    }
    return v;
  }
};

// Every layer of a decode step. The layers fall in KV-cache groups (vLLM's: e.g. sliding-window
// and full-attention layers), each with its own slot mapping and attention metadata, given
// once per group; group[i] is layer i's. caches: each layer's cache block tensor. Returns the
// last layer's output x.
torch::Tensor decode_step(const c10::intrusive_ptr<DecodeStack>& stack, torch::Tensor residual,
                          const torch::Tensor& positions, int64_t nq, int64_t nkv, int64_t d,
                          at::TensorList caches, c10::IntArrayRef group, at::TensorList slot_mapping,
                          at::TensorList query_start_loc, at::TensorList seq_lens, c10::IntArrayRef causal,
                          at::TensorList block_table, at::TensorList scheduler_metadata,
                          const c10::List<c10::optional<torch::Tensor>>& dynamic_causal,
                          c10::IntArrayRef num_actual_tokens) {
  const size_t layers = stack->layers.size(), groups = slot_mapping.size();
  TORCH_CHECK(layers > 0, "edge_w4: decode_step over no layers");
  TORCH_CHECK(caches.size() == layers && group.size() == layers, "edge_w4: decode_step got ",
              caches.size(), " caches and ", group.size(), " group indices for ", layers, " layers");
  TORCH_CHECK(query_start_loc.size() == groups && seq_lens.size() == groups && causal.size() == groups &&
                  block_table.size() == groups && scheduler_metadata.size() == groups &&
                  dynamic_causal.size() == groups && num_actual_tokens.size() == groups,
              "edge_w4: decode_step needs each metadata list once per KV-cache group (", groups, ")");
  std::vector<StepArgs> steps;
  steps.reserve(groups);
  for (size_t g = 0; g < groups; ++g) {
    steps.push_back(StepArgs{positions, nq, nkv, d, slot_mapping[g], query_start_loc[g], seq_lens[g],
                             causal[g] != 0, block_table[g], scheduler_metadata[g], dynamic_causal.get(g),
                             num_actual_tokens[g]});
  }
  c10::optional<torch::Tensor> x;
  for (size_t i = 0; i < layers; ++i) {
    TORCH_CHECK(group[i] >= 0 && static_cast<size_t>(group[i]) < groups, "edge_w4: layer ", i,
                "'s KV-cache group ", group[i], " is out of range");
    // each layer under its own name in torch's profiler (bench profile's per-layer calls)
    RECORD_FUNCTION("edge_w4::decode_layer", std::vector<c10::IValue>());
    const auto& [ptr, kc, vc] = stack->cache_views(i, caches[i]);
    x = run_layer(stack->layers[i], steps[group[i]], residual, x, kc, vc);
  }
  return *x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(edge_w4, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<>())
      .def("add", &DecodeStack::add)
      .def("size", &DecodeStack::size);
  m.def("decode_step(__torch__.torch.classes.edge_w4.DecodeStack stack, Tensor(a!) residual, "
        "Tensor positions, int nq, int nkv, int d, Tensor(b!)[] caches, int[] group, "
        "Tensor[] slot_mapping, Tensor[] query_start_loc, Tensor[] seq_lens, int[] causal, "
        "Tensor[] block_table, Tensor[] scheduler_metadata, Tensor?[] dynamic_causal, "
        "int[] num_actual_tokens) -> Tensor");
  m.def("attn_in(Tensor(a!) residual, Tensor? x, Tensor ln, float eps, Tensor wq, Tensor ws, "
        "Tensor? wz, int[] meta, Tensor? q_norm, Tensor? k_norm, float head_eps, Tensor cos_sin, "
        "Tensor positions, int nq, int nkv, int d, int rot, Tensor? gate_w, Tensor? qkv_bias) "
        "-> (Tensor, Tensor)");
  m.def("mlp_out(Tensor(a!) residual, Tensor attn, Tensor oq, Tensor os, Tensor? oz, int[] ometa, "
        "Tensor ln, float eps, Tensor gq, Tensor gs, Tensor? gz, int[] gmeta, Tensor dq, Tensor ds, "
        "Tensor? dz, int[] dmeta, int act, Tensor? head_gate) -> Tensor");
}

TORCH_LIBRARY_IMPL(edge_w4, CPU, m) {
  m.impl("attn_in", &attn_in);
  m.impl("mlp_out", &mlp_out);
  m.impl("decode_step", &decode_step);
}
