// edge-infer's 4-bit CPU kernels: W4A16 and W4A8 GEMV, and dequantized tiles (fp32, or bf16
// for bf16 activations on AVX512-BF16 CPUs) for the prefill GEMM. One translation unit; each instruction-set path is a function compiled for
// its target (GCC/Clang `target` attribute) and chosen at run time, so the same build runs
// on any x86-64 and a CPU without AVX2 takes the portable path instead of crashing.
//
// Two packed layouts of a row of K codes, each K/2 bytes, chosen for its inner loop:
// - blocks32 (W4A8): blocks of 32 codes in 16 bytes, byte i holding code k=32b+i in its low
//   nibble and k=32b+16+i in its high nibble: one 16-byte load, masked and shifted, is 32
//   consecutive unsigned bytes ready for `vpmaddubsw` against 32 int8 activations.
// - lanes64 (W4A16): blocks of 64 codes in 32 bytes = eight 32-bit lanes; lane i holds code
//   k=64c+8j+i in bits 4j..4j+3. Shifting the whole vector by one amount yields nibble j of all
//   eight lanes, i.e. 8 consecutive k, with no byte shuffles. Each code becomes the float
//   1 + q/16 by OR-ing it into the mantissa of 1.0 (no int->float conversion), so
//   sum_k q x = 16 (sum_k (1 + q/16) x - sum_k x).
// - words128 (W4A16 with bf16 activations on AVX512-BF16 CPUs): blocks of 128 codes in 64
//   bytes = 32 little-endian 16-bit words; word i holds code k=128c+32j+i in bits 4j..4j+3.
//   One 64-byte load; a shift and a `vpternlogd` per j turn nibble j of all 32 words into the
//   bf16 1 + q/16 (no widening or shuffle), and `vdpbf16ps` multiplies 32 of them into fp32
//   sums per instruction, as in lanes64. (1 + q/128, straight from the low bits, saves a
//   shift but cancels 3 bits more against sum_k x: it moved smollm2's prompt logprobs.) A
//   K % 128 == 64 tail is one 32-byte block, byte i holding k=i in its low nibble and k=32+i
//   in its high nibble.
// - nib128 (W4A8 on AVX-512 CPUs, every M): blocks of 128 codes in 64 bytes, byte i holding
//   code k=128c+i in its low nibble and k=128c+64+i in its high one (see tile_nib128_vnni).
// - lanes1k (W4A8 on AVX-512 CPUs where K % 1024 == 0 and the group divides 1024): super-blocks
//   of 1024 codes in 512 bytes. Each 32-bit lane j of a vector owns the 64 codes 64j..64j+63,
//   so a lane's `vpdpbusd` sums stay within one group and the fold to fp32 happens once per
//   super-block instead of once per group (see tile_lanes1k).
// Scales are fp32 [N, K/group]; zero points uint8 [N, K/group] or absent (symmetric: 8).
// Meaning of the codes: w = (q - z) * s, as in edge_infer.quant.primitives.
//
// Zero points never enter the inner loop: sum_k (q_k - z) s x_k = s (sum_k q_k x_k - z X_g)
// with X_g the sum of the activations over the group, computed once per token.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
// How far ahead of the codes being read the GEMV loops prefetch (rows are contiguous), in
// bytes; 0 turns software prefetch off. Settable for the microbenchmark (set_prefetch).
// Measured on a 2-core AMD EPYC (Zen 4 class), one decode step's weights of qwen3-0.6b (316 MB,
// from DRAM), words128 4-row loop: off 26.4 ms, 2048 B 17.2, 4096 B 13.1, 8192 B 12.1,
// 16384 B 13.1; W4A8 4096 B 15.4, 8192 B 14.5. The hardware prefetcher alone does not follow
// four interleaved rows.
int64_t g_prefetch = 8192;

// Paths in increasing order: a higher one may use every lower one's code (an AVX-512 CPU runs
// the AVX2 W4A16 loop and dequantization where its own 512-bit loops do not apply).
enum Isa : int64_t { kPortable = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3 };
enum Layout : int64_t { kBlocks32 = 0, kLanes64 = 1, kWords128 = 2, kNib128 = 3, kLanes1k = 4, kStripes16 = 5 };
constexpr int64_t kNibMaxGroups = 256;  // the nib128 loop's per-tile table of s_g sx_g

bool cpu_has(const std::string& feature) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (feature == "avx2") return __builtin_cpu_supports("avx2");
  if (feature == "fma") return __builtin_cpu_supports("fma");
  if (feature == "f16c") return __builtin_cpu_supports("f16c");
  if (feature == "avx512f") return __builtin_cpu_supports("avx512f");
  if (feature == "avx512bw") return __builtin_cpu_supports("avx512bw");
  if (feature == "avx512vl") return __builtin_cpu_supports("avx512vl");
  if (feature == "avx512vnni") return __builtin_cpu_supports("avx512vnni");
  if (feature == "avx512bf16") return __builtin_cpu_supports("avx512bf16");
#endif
  return false;
}

void check_isa(int64_t isa) {
  TORCH_CHECK(isa >= kPortable && isa <= kAvx512Vnni, "edge_w4: unknown instruction-set path ", isa);
  if (isa >= kAvx2) {
    TORCH_CHECK(cpu_has("avx2") && cpu_has("fma"),
                "edge_w4: the AVX2 path was requested but this CPU lacks AVX2/FMA");
  }
  if (isa >= kAvx512) {
    TORCH_CHECK(cpu_has("avx512f") && cpu_has("avx512bw") && cpu_has("avx512vl"),
                "edge_w4: the AVX-512 path was requested but this CPU lacks AVX-512 F/BW/VL");
  }
  if (isa == kAvx512Vnni) {
    TORCH_CHECK(cpu_has("avx512vnni"), "edge_w4: the VNNI path was requested but this CPU lacks AVX512-VNNI");
  }
}

struct Weights {
  const uint8_t* q;   // [N, K/2]
  const float* s;     // [N, G]
  const uint8_t* z;   // [N, G] or nullptr
  int64_t n, k, group, groups;
  int64_t layout;
};

// The words128 layout's kernels need AVX512-BF16 and the AVX-512 path.
void check_words128(int64_t isa) {
  TORCH_CHECK(cpu_has("avx512bf16") && isa >= kAvx512,
              "edge_w4: the words128 layout needs an AVX512-BF16 CPU and the AVX-512 path");
  check_isa(isa);
}

Weights weights(const torch::Tensor& q, const torch::Tensor& s, const c10::optional<torch::Tensor>& z,
                int64_t group, int64_t layout) {
  TORCH_CHECK(layout >= kBlocks32 && layout <= kStripes16, "edge_w4: unknown layout ", layout);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kUInt8 && q.is_contiguous(),
              "edge_w4: packed codes must be contiguous uint8 [N, K/2]");
  TORCH_CHECK(group % kBlock == 0 && group > 0, "edge_w4: group ", group, " is not a multiple of 32");
  TORCH_CHECK(s.dim() == 2 && s.scalar_type() == torch::kFloat && s.is_contiguous() && s.size(0) == q.size(0),
              "edge_w4: scales must be contiguous fp32 [N, K/group]");
  const int64_t n = q.size(0), k = q.size(1) * 2;
  TORCH_CHECK(k % group == 0, "edge_w4: K=", k, " is not a multiple of the group ", group);
  const int64_t groups = k / group;
  TORCH_CHECK(layout == kBlocks32 || k % 64 == 0, "edge_w4: the lanes64/words128 layouts need K % 64 == 0, got ", k);
  if (layout == kNib128) {
    TORCH_CHECK(k % 128 == 0 && group % 64 == 0 && groups <= kNibMaxGroups,
                "edge_w4: nib128 needs K % 128 == 0, a group multiple of 64 and at most ", kNibMaxGroups,
                " groups");
  }
  if (layout == kLanes1k) {
    TORCH_CHECK(k % 1024 == 0 && group % 64 == 0 && 1024 % group == 0,
                "edge_w4: lanes1k needs K % 1024 == 0 and a group of 64, 128, 256, 512 or 1024");
  }
  if (layout == kStripes16) {
    TORCH_CHECK(n % 16 == 0 && k % 128 == 0 && group % 64 == 0,
                "edge_w4: stripes16 needs N % 16 == 0, K % 128 == 0 and a group multiple of 64");
  }
  TORCH_CHECK(s.size(1) == groups, "edge_w4: scales must be contiguous fp32 [N, K/group]");
  const uint8_t* zp = nullptr;
  if (z.has_value() && z->defined()) {
    TORCH_CHECK(z->scalar_type() == torch::kUInt8 && z->is_contiguous() && z->size(0) == n &&
                    z->size(1) == groups,
                "edge_w4: zero points must be contiguous uint8 [N, K/group]");
    zp = z->data_ptr<uint8_t>();
  }
  return {q.data_ptr<uint8_t>(), s.data_ptr<float>(), zp, n, k, group, groups, layout};
}

inline float zero_of(const Weights& w, int64_t row, int64_t g) {
  return w.z ? static_cast<float>(w.z[row * w.groups + g]) : 8.0f;
}

template <typename V>
V* scratch(std::vector<V>& buf, int64_t count);
template <typename V>
V* scratch64(std::vector<V>& buf, int64_t count);
int64_t grain_for(int64_t k);

// ---------------------------------------------------------------- portable paths
// Code k of a row in either layout (the portable paths and the tests' view of the layouts).
inline int code_at(const Weights& w, const uint8_t* q, int64_t k) {
  if (w.layout == kWords128) {
    const int64_t main = (w.k / 128) * 128;
    if (k >= main) {  // the 64-code tail
      const uint8_t byte = q[main / 2 + (k - main) % 32];
      return (k - main) < 32 ? (byte & 0xF) : (byte >> 4);
    }
    const int64_t c = k / 128, j = (k % 128) / 32, i = k % 32;
    const uint8_t byte = q[c * 64 + 2 * i + (j >> 1)];
    return (j & 1) ? (byte >> 4) : (byte & 0xF);
  }
  if (w.layout == kNib128) {
    const uint8_t byte = q[(k / 128) * 64 + (k % 64)];
    return (k % 128) < 64 ? (byte & 0xF) : (byte >> 4);
  }
  if (w.layout == kLanes1k) {  // lane j, step i (4 codes), line i / 2, nibble i % 2
    const int64_t r = k % 1024, j = r / 64, i = (r % 64) / 4, b = r % 4;
    const uint8_t byte = q[(k / 1024) * 512 + (i / 2) * 64 + 4 * j + b];
    return (i & 1) ? (byte >> 4) : (byte & 0xF);
  }
  if (w.layout == kBlocks32) {
    const int64_t b = k / kBlock, i = k % kBlock;
    const uint8_t byte = q[b * 16 + (i & 15)];
    return i < 16 ? (byte & 0xF) : (byte >> 4);
  }
  const int64_t c = k / 64, r = k % 64, j = r / 8, i = r % 8;
  const uint8_t byte = q[c * 32 + i * 4 + j / 2];
  return (j & 1) ? (byte >> 4) : (byte & 0xF);
}

float dot_w4a16_portable(const Weights& w, int64_t row, const float* x, const float* xsum) {
  const uint8_t* q = w.q + row * (w.k / 2);
  const float* s = w.s + row * w.groups;
  float y = 0.f;
  for (int64_t g = 0; g < w.groups; ++g) {
    float acc = 0.f;
    for (int64_t k = g * w.group; k < (g + 1) * w.group; ++k) acc += static_cast<float>(code_at(w, q, k)) * x[k];
    y += s[g] * (acc - zero_of(w, row, g) * xsum[g]);
  }
  return y;
}

float dot_w4a8_portable(const Weights& w, int64_t row, const int8_t* xq, const float* sx,
                        const float* xsum) {
  const uint8_t* q = w.q + row * (w.k / 2);
  const float* s = w.s + row * w.groups;
  const int64_t per_group = w.group / kBlock;
  float y = 0.f;
  for (int64_t g = 0; g < w.groups; ++g) {
    float acc = 0.f;
    for (int64_t bb = 0; bb < per_group; ++bb) {
      const int64_t b = g * per_group + bb;
      const uint8_t* p = q + b * 16;
      const int8_t* xb = xq + b * kBlock;
      int32_t d = 0;
      for (int i = 0; i < 16; ++i) d += (p[i] & 0xF) * xb[i] + (p[i] >> 4) * xb[16 + i];
      acc += static_cast<float>(d) * sx[b];
    }
    y += s[g] * (acc - zero_of(w, row, g) * xsum[g]);
  }
  return y;
}

void dequant_rows_portable(const Weights& w, int64_t r0, int64_t r1, float* out) {
  for (int64_t row = r0; row < r1; ++row) {
    const uint8_t* q = w.q + row * (w.k / 2);
    float* o = out + (row - r0) * w.k;
    for (int64_t k = 0; k < w.k; ++k) {
      const int64_t g = k / w.group;
      o[k] = (static_cast<float>(code_at(w, q, k)) - zero_of(w, row, g)) * w.s[row * w.groups + g];
    }
  }
}

// ---------------------------------------------------------------- AVX2 + FMA paths
#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The lane sums of eight vectors, as one vector (lane i: the sum of a[i]): a tree of six
// `vhaddps` and two cross-half shuffles instead of eight hsum (the AVX2 twin of sum4).
__attribute__((target("avx2,fma"))) inline __m256 sum8(const __m256* a) {
  const __m256 q0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));  // a0..a3, per half
  const __m256 q1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));  // a4..a7, per half
  return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

// Nibble j of every lane of a lanes64 block, as the float 1 + q/16 (see the header).
template <int J>
__attribute__((target("avx2,fma"))) inline __m256 lane_codes(__m256i v) {
  constexpr int shift = 19 - 4 * J;  // move bits 4J..4J+3 to mantissa bits 19..22
  const __m256i t = shift >= 0 ? _mm256_slli_epi32(v, shift >= 0 ? shift : 0)
                               : _mm256_srli_epi32(v, shift < 0 ? -shift : 0);
  const __m256i mant = _mm256_and_si256(t, _mm256_set1_epi32(0x00780000));
  return _mm256_castsi256_ps(_mm256_or_si256(mant, _mm256_set1_epi32(0x3F800000)));
}

// sum over one 64-block of (1 + q/16) x, the codes j=0..3 (k 0..31) and 4..7 (k 32..63) apart.
__attribute__((target("avx2,fma"))) inline void lanes64_block(const uint8_t* p, const float* xb, __m256& h0,
                                                             __m256& h1, __m256& h2, __m256& h3) {
  if (g_prefetch) _mm_prefetch(reinterpret_cast<const char*>(p + g_prefetch), _MM_HINT_T1);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  h0 = _mm256_fmadd_ps(lane_codes<0>(v), _mm256_loadu_ps(xb), h0);
  h1 = _mm256_fmadd_ps(lane_codes<1>(v), _mm256_loadu_ps(xb + 8), h1);
  h0 = _mm256_fmadd_ps(lane_codes<2>(v), _mm256_loadu_ps(xb + 16), h0);
  h1 = _mm256_fmadd_ps(lane_codes<3>(v), _mm256_loadu_ps(xb + 24), h1);
  h2 = _mm256_fmadd_ps(lane_codes<4>(v), _mm256_loadu_ps(xb + 32), h2);
  h3 = _mm256_fmadd_ps(lane_codes<5>(v), _mm256_loadu_ps(xb + 40), h3);
  h2 = _mm256_fmadd_ps(lane_codes<6>(v), _mm256_loadu_ps(xb + 48), h2);
  h3 = _mm256_fmadd_ps(lane_codes<7>(v), _mm256_loadu_ps(xb + 56), h3);
}

// y = sum_g s_g (sum_k q x - z_g X_g) = sum_g 16 s_g S_g - s_g (16 + z_g) X_g, S_g = sum (1+q/16) x.
// One row against T tokens (x rows xs floats apart, y entries ys apart): each 64-block of codes
// is loaded and turned into floats once, then multiplied into all T tokens, so a batch of T
// decodes costs one pass over the weights. CH = 8 / T partial sums per token keep 8 FMA
// chains in flight whatever T is (FMA latency 4 x 2 pipes on Zen 3).
template <int T>
__attribute__((target("avx2,fma"))) void dot_w4a16_avx2(const Weights& w, int64_t row, const float* x,
                                                        int64_t xs, const float* xsum, int64_t gs,
                                                        float* y, int64_t ys) {
  constexpr int CH = 8 / T;
  const uint8_t* q = w.q + row * (w.k / 2);
  const float* s = w.s + row * w.groups;
  __m256 acc[T], h[T][CH];
  for (int t = 0; t < T; ++t) {
    acc[t] = _mm256_setzero_ps();
    for (int c = 0; c < CH; ++c) h[t][c] = _mm256_setzero_ps();
  }
  // the partial sums of one group -> acc, scaled by 16 s_g (a macro: a lambda would not
  // inherit this function's target attribute)
#define EDGE_W4A16_FLUSH(SG)                                                                \
  {                                                                                         \
    const __m256 scale = _mm256_set1_ps(16.f * (SG));                                       \
    for (int t = 0; t < T; ++t) {                                                           \
      __m256 sum = h[t][0];                                                                 \
      for (int c = 1; c < CH; ++c) sum = _mm256_add_ps(sum, h[t][c]);                       \
      acc[t] = _mm256_fmadd_ps(sum, scale, acc[t]);                                         \
      for (int c = 0; c < CH; ++c) h[t][c] = _mm256_setzero_ps();                           \
    }                                                                                       \
  }
#define EDGE_W4A16_STEP(J)                                                                  \
  {                                                                                         \
    const __m256 cj = lane_codes<J>(v);                                                     \
    for (int t = 0; t < T; ++t)                                                             \
      h[t][(J) % CH] = _mm256_fmadd_ps(cj, _mm256_loadu_ps(xb + t * xs + 8 * (J)), h[t][(J) % CH]); \
  }
  const int64_t blocks = w.k / 64;
  const int64_t half_groups = w.group / 32;  // group boundaries fall on 32-code halves
  for (int64_t c = 0; c < blocks; ++c) {
    const uint8_t* p = q + c * 32;
    if (g_prefetch) _mm_prefetch(reinterpret_cast<const char*>(p + g_prefetch), _MM_HINT_T1);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const float* xb = x + c * 64;
    EDGE_W4A16_STEP(0) EDGE_W4A16_STEP(1) EDGE_W4A16_STEP(2) EDGE_W4A16_STEP(3)
    if (half_groups == 1) EDGE_W4A16_FLUSH(s[2 * c])
    EDGE_W4A16_STEP(4) EDGE_W4A16_STEP(5) EDGE_W4A16_STEP(6) EDGE_W4A16_STEP(7)
    if ((2 * c + 2) % half_groups == 0) EDGE_W4A16_FLUSH(s[(2 * c + 1) / half_groups])
  }
#undef EDGE_W4A16_STEP
#undef EDGE_W4A16_FLUSH
  for (int t = 0; t < T; ++t) {
    float corr = 0.f;
    for (int64_t g = 0; g < w.groups; ++g) corr += s[g] * (16.f + zero_of(w, row, g)) * xsum[t * gs + g];
    y[t * ys] = hsum(acc[t]) - corr;
  }
}

// 32 unsigned codes of a blocks32 block: the 16 bytes broadcast to both halves, the upper
// half shifted right by 4, then masked: low nibbles (k 0..15) | high nibbles (k 16..31).
__attribute__((target("avx2,fma"))) inline __m256i blocks32_codes(const uint8_t* p) {
  const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i t = _mm256_srlv_epi64(v, _mm256_set_epi64x(4, 4, 0, 0));
  return _mm256_and_si256(t, _mm256_set1_epi8(0x0F));
}

// Blocks of a group whose int16 `vpmaddubsw` sums may be added before widening: a pair of
// products is at most 15 * 127 * 2 = 3810 in magnitude, so 8 blocks stay under 2^15. The
// activations' scale is one per (token, group), so a chunk of blocks needs one fold to fp32.
inline int64_t w4a8_chunk(int64_t per_group) {
  for (int64_t c = 8; c > 1; --c)
    if (per_group % c == 0) return c;
  return 1;
}

// R rows against T tokens at once (R x T <= 4 accumulator pairs): each activation block is
// loaded once for the R rows, and each block of codes is unpacked once for the T tokens. Per
// block and (row, token) one `vpmaddubsw` and one int16 add; per chunk of up to 8 blocks of a
// group (w4a8_chunk) one `vpmaddwd` to int32, a convert and an FMA by s_g sx_g. (Folding every
// block to fp32, as this loop once did, cost three more instructions per block, token and row.)
// Token t's int8 activations are xs bytes apart, its block scales bs floats apart, its group
// sums gs floats apart, its outputs ys floats apart.
template <int R, int T>
__attribute__((target("avx2,fma"))) void dot_w4a8_avx2(const Weights& w, int64_t row, const int8_t* xq,
                                                       int64_t xs, const float* sx, int64_t bs,
                                                       const float* xsum, int64_t gs, float* y,
                                                       int64_t ys) {
  const int64_t per_group = w.group / kBlock, row_bytes = w.k / 2, blocks = w.k / kBlock;
  const int64_t chunk = w4a8_chunk(per_group);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t b0 = 0; b0 < blocks; b0 += chunk) {
    __m256i h[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) h[r][t] = _mm256_setzero_si256();
    for (int64_t b = b0; b < b0 + chunk; ++b) {
      __m256i codes[R];
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = w.q + (row + r) * row_bytes + b * 16;
        if (g_prefetch && (b & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(p + g_prefetch), _MM_HINT_T1);
        codes[r] = blocks32_codes(p);
      }
      for (int t = 0; t < T; ++t) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + t * xs + b * kBlock));
        for (int r = 0; r < R; ++r) h[r][t] = _mm256_add_epi16(h[r][t], _mm256_maddubs_epi16(codes[r], xv));
      }
    }
    const int64_t g = b0 / per_group;
    for (int r = 0; r < R; ++r) {
      const float sg = w.s[(row + r) * w.groups + g];
      for (int t = 0; t < T; ++t) {
        const __m256 d = _mm256_cvtepi32_ps(_mm256_madd_epi16(h[r][t], ones));
        acc[r][t] = _mm256_fmadd_ps(d, _mm256_set1_ps(sg * sx[t * bs + b0]), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) {
      float corr = 0.f;
      for (int64_t g = 0; g < w.groups; ++g)
        corr += w.s[(row + r) * w.groups + g] * zero_of(w, row + r, g) * xsum[t * gs + g];
      y[t * ys + r] = hsum(acc[r][t]) - corr;
    }
  }
}

// AVX-512 W4A8: two 32-blocks per step. Their 32 code bytes become 64 unsigned codes ordered
// like the 64 activations (low nibbles b, high b, low b+1, high b+1); one u8 x s8 dot per lane
// group of 4 (VNNI `vpdpbusd`, else `vpmaddubsw` + `vpmaddwd`), then one FMA with a scale
// vector holding s_g(b) sx_b in lanes 0-7 and s_g(b+1) sx_(b+1) in lanes 8-15. Needs an even
// number of blocks (K % 64 == 0); the caller sends other rows to the AVX2 loop. Not yet run on
// an AVX-512 CPU: the engine checks it against the reference at load (self_check).
#define EDGE_AVX512 "avx512f,avx512bw,avx512vl,avx2,fma"
#define EDGE_AVX512_VNNI "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma"

// acc += u8 . s8 per 4-byte lane, the sum register updated in place. With the intrinsic, GCC
// 12 gave a tile's loop-carried sums new registers on every step and copied them back (25 zmm
// moves and 5 stack stores per 32 dots in the 4 x 4 lanes1k loop); the tied operand leaves
// no copy to make.
__attribute__((target(EDGE_AVX512_VNNI))) inline __m512i dpbusd_in_place(__m512i acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "vm"(s8));
  return acc;
}

// The same sum without VNNI: `vpmaddubsw` into int16 pairs (no saturation: codes are at most
// 15), then `vpmaddwd` by ones into the int32 lanes.
__attribute__((target(EDGE_AVX512), always_inline)) inline __m512i dpbusd_bw(__m512i acc, __m512i u8, __m512i s8) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u8, s8), _mm512_set1_epi16(1)));
}

// One 64-byte line of codes: its low nibbles and its high nibbles, each as 64 unsigned bytes.
__attribute__((target(EDGE_AVX512), always_inline)) inline void unpack_nibbles(const uint8_t* p, __m512i& lo,
                                                                              __m512i& hi) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i v = _mm512_loadu_si512(reinterpret_cast<const void*>(p));
  lo = _mm512_and_si512(v, m4);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
}

// One body, compiled twice with the dot product as the only difference (a macro, because a
// function's target attribute cannot depend on a template parameter).
#define EDGE_W4A8_AVX512_BODY(DOT)                                                                    \
  const int64_t row_bytes = w.k / 2, per_group = w.group / kBlock, blocks = w.k / kBlock;              \
  const __m512i m4 = _mm512_set1_epi8(0x0F);                                                          \
  [[maybe_unused]] const __m512i ones = _mm512_set1_epi16(1);                                         \
  __m512 acc[R];                                                                                      \
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();                                           \
  for (int64_t b = 0; b < blocks; b += 2) {                                                           \
    const __m512i xv = _mm512_loadu_si512(reinterpret_cast<const void*>(xq + b * kBlock));            \
    const int64_t g0 = b / per_group, g1 = (b + 1) / per_group;                                       \
    for (int r = 0; r < R; ++r) {                                                                     \
      const uint8_t* p = w.q + (row + r) * row_bytes + b * 16;                                        \
      if (g_prefetch && (b & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(p + g_prefetch), _MM_HINT_T1); \
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));                      \
      __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);      \
      codes = _mm512_and_si512(codes, m4); /* 128-bit lanes: lo b, lo b+1, hi b, hi b+1 */            \
      codes = _mm512_shuffle_i64x2(codes, codes, _MM_SHUFFLE(3, 1, 2, 0)); /* lo b, hi b, lo b+1, hi b+1 */ \
      const __m512i d = DOT;                                                                          \
      const float* srow = w.s + (row + r) * w.groups;                                                 \
      const __m512 scale = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(srow[g0] * sx[b]),             \
                                                _mm512_set1_ps(srow[g1] * sx[b + 1]));                \
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale, acc[r]);                                 \
    }                                                                                                 \
  }                                                                                                   \
  for (int r = 0; r < R; ++r) {                                                                       \
    float corr = 0.f;                                                                                 \
    for (int64_t g = 0; g < w.groups; ++g)                                                            \
      corr += w.s[(row + r) * w.groups + g] * zero_of(w, row + r, g) * xsum[g];                       \
    y[r] = _mm512_reduce_add_ps(acc[r]) - corr;                                                       \
  }

template <int R>
__attribute__((target(EDGE_AVX512))) void dot_w4a8_avx512(const Weights& w, int64_t row, const int8_t* xq,
                                                          const float* sx, const float* xsum, float* y) {
  EDGE_W4A8_AVX512_BODY(_mm512_madd_epi16(_mm512_maddubs_epi16(codes, xv), ones))
}

template <int R>
__attribute__((target(EDGE_AVX512_VNNI))) void dot_w4a8_avx512_vnni(const Weights& w, int64_t row,
                                                                    const int8_t* xq, const float* sx,
                                                                    const float* xsum, float* y) {
  EDGE_W4A8_AVX512_BODY(_mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, xv))
}
#undef EDGE_W4A8_AVX512_BODY

// Lanes 0-7 plus lanes 8-15.
__attribute__((target(EDGE_AVX512))) inline __m256 fold_halves(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v),
                       _mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(v), 1)));
}

// The lane sums of four vectors, as one 128-bit vector (a, b, c, d): 13 shuffles and adds
// instead of four full reductions.
__attribute__((target(EDGE_AVX512))) inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m256 ab = _mm256_hadd_ps(fold_halves(a), fold_halves(b));
  const __m256 cd = _mm256_hadd_ps(fold_halves(c), fold_halves(d));
  const __m256 abcd = _mm256_hadd_ps(ab, cd);  // lanes a b c d of each 128-bit half
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// The last step of a W4A8 int8 tile (nib128 and lanes1k alike): subtract the zero-point term
// sum_g z_g s_g xs_g of each (row, token) from its fp32 sums, then reduce each to one output.
template <int R, int T>
__attribute__((target(EDGE_AVX512))) inline void finish_w4a8_tile(const Weights& w, int64_t row, __m512 (&acc)[R][T],
                                                                  const float* xs, float* y, int64_t ys) {
  const int64_t G = w.groups;
  for (int r = 0; r < R; ++r) {
    __m512 corr[T];
    for (int t = 0; t < T; ++t) corr[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g += 16) {
      const __mmask16 mk = G - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (G - g)) - 1);
      const __m512 z = w.z ? _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mk, w.z + (row + r) * G + g)))
                           : _mm512_set1_ps(8.f);
      const __m512 zs = _mm512_mul_ps(z, _mm512_maskz_loadu_ps(mk, w.s + (row + r) * G + g));
      for (int t = 0; t < T; ++t) corr[t] = _mm512_fmadd_ps(zs, _mm512_maskz_loadu_ps(mk, xs + t * G + g), corr[t]);
    }
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_sub_ps(acc[r][t], corr[t]);
  }
  for (int t = 0; t < T; ++t) {
    if constexpr (R == 4) {
      _mm_storeu_ps(y + t * ys, sum4(acc[0][t], acc[1][t], acc[2][t], acc[3][t]));
    } else {
      for (int r = 0; r < R; ++r) y[t * ys + r] = _mm512_reduce_add_ps(acc[r][t]);
    }
  }
}

// nib128 (W4A8 on AVX-512 CPUs; decode, batched decode and prefill alike): per 128 codes 64
// bytes, byte i holding code 128c+i in its low nibble and 128c+64+i in its high one, so one
// 64-byte load and an AND (or a shift and an AND) give 64 consecutive unsigned codes for
// `vpdpbusd` against 64 int8 activations. Each group's int32 sums are folded once per (row,
// token): float, times P = s_g sx_g (a table made per tile with one multiply per 16 groups),
// into fp32. The zero points stay out of the loop: the last step subtracts
// sum_g (z_g s_g) xsum_g, one dot over the groups per (row, token), xsum_g = sx_g sum xq.
// Measured on a 2-core AMD EPYC (Zen 4 class): `vpdpbusd` zmm issues once per cycle (64 int8
// MACs), `vdpbf16ps` zmm once per cycle (32 bf16 MACs), so past M=1, where the bf16 loop is
// compute-bound, the int8 loop has up to twice its arithmetic rate.
#define EDGE_NIB128_TILE(DOT)                                                                        \
  const __m512i zero = _mm512_setzero_si512();                                                       \
  const int64_t G = w.groups;                                                                         \
  alignas(64) float P[R][T][kNibMaxGroups];                                                           \
  for (int64_t g = 0; g < G; g += 16) {                                                               \
    const __mmask16 mk = G - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (G - g)) - 1);         \
    for (int r = 0; r < R; ++r) {                                                                     \
      const __m512 sr = _mm512_maskz_loadu_ps(mk, w.s + (row + r) * G + g);                           \
      for (int t = 0; t < T; ++t)                                                                     \
        _mm512_storeu_ps(&P[r][t][g], _mm512_mul_ps(sr, _mm512_maskz_loadu_ps(mk, sx + t * G + g)));  \
    }                                                                                                 \
  }                                                                                                   \
  __m512 acc[R][T];                                                                                   \
  for (int r = 0; r < R; ++r)                                                                         \
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();                                      \
  /* 128 codes per step: one 64-byte line per row, its low nibbles k..k+63, high k+64..k+127. */     \
  /* The group index is counted, not divided: a 64-bit division per step stalled every fold. */     \
  const int64_t lines_per_group = w.group >= 128 ? w.group / 128 : 1;                                 \
  int64_t g0 = 0, line_in_group = 0;                                                                  \
  for (int64_t c = 0; c < w.k / 128; ++c) {                                                           \
    const int64_t k0 = c * 128;                                                                       \
    __m512i lo[R], hi[R];                                                                             \
    for (int r = 0; r < R; ++r) {                                                                     \
      const uint8_t* p = w.q + (row + r) * (w.k / 2) + c * 64;                                        \
      if (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(p + g_prefetch), _MM_HINT_T1);         \
      unpack_nibbles(p, lo[r], hi[r]);                                                                \
    }                                                                                                 \
    for (int t = 0; t < T; ++t) {                                                                     \
      const int8_t* xt = xq + t * w.k + k0;                                                           \
      const __m512i x0 = _mm512_loadu_si512(reinterpret_cast<const void*>(xt));                      \
      const __m512i x1 = _mm512_loadu_si512(reinterpret_cast<const void*>(xt + 64));                 \
      for (int r = 0; r < R; ++r) {                                                                   \
        if (GROUP64) { /* two groups per line: fold each half with its own scale */                   \
          acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(DOT(zero, lo[r], x0)),                       \
                                      _mm512_set1_ps(P[r][t][g0]), acc[r][t]);                        \
          acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(DOT(zero, hi[r], x1)),                       \
                                      _mm512_set1_ps(P[r][t][g0 + 1]), acc[r][t]);                    \
        } else {                                                                                      \
          acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(DOT(DOT(zero, lo[r], x0), hi[r], x1)),       \
                                      _mm512_set1_ps(P[r][t][g0]), acc[r][t]);                        \
        }                                                                                             \
      }                                                                                               \
    }                                                                                                 \
    if (GROUP64) {                                                                                    \
      g0 += 2;                                                                                        \
    } else if (++line_in_group == lines_per_group) {                                                  \
      line_in_group = 0;                                                                              \
      ++g0;                                                                                           \
    }                                                                                                 \
  }                                                                                                   \
  finish_w4a8_tile<R, T>(w, row, acc, xs, y, ys);

// R rows against T tokens (int8 activations xq [T, K], scales sx and group sums xs [T,
// groups]) into y[t * ys + r]. PREFETCH for rows streamed from memory once (decode), not for a
// block re-read from cache for every 4 tokens (prefill).
template <int R, int T, bool PREFETCH, bool GROUP64>
__attribute__((target(EDGE_AVX512_VNNI))) void tile_nib128_vnni(const Weights& w, int64_t row, const int8_t* xq,
                                                                const float* sx, const float* xs, float* y,
                                                                int64_t ys) {
  EDGE_NIB128_TILE(dpbusd_in_place)
}

template <int R, int T, bool PREFETCH, bool GROUP64>
__attribute__((target(EDGE_AVX512))) void tile_nib128_bw(const Weights& w, int64_t row, const int8_t* xq,
                                                         const float* sx, const float* xs, float* y, int64_t ys) {
  EDGE_NIB128_TILE(dpbusd_bw)
}
#undef EDGE_NIB128_TILE

// lanes1k: per super-block of 1024 codes, 8 lines of 64 bytes per row. Byte 4j+b of line p
// holds code 64j+8p+b in its low nibble and 64j+8p+4+b in its high one: the low nibbles are
// step 2p, the high ones step 2p+1, and step i gives lane j its codes 64j+4i..64j+4i+3. The
// activations are put in the same order once per call (lanes1k_order), so step i is 64
// consecutive bytes. Lane j's int32 sum then covers codes 64j..64j+63, one group's, and the
// R x T sums are folded once per super-block: float, times a vector of s_g sx_g with lane j's
// group, into fp32. In nib128 every group of 128 codes costs a convert and an FMA per (row,
// token) beside its two dots; here 16 dots share one of each.
#define EDGE_LANES1K_TILE(DOT)                                                                       \
  const int gshift = __builtin_ctzll(static_cast<uint64_t>(w.group)); /* no division per tile */     \
  const int64_t G = w.groups, per_block = int64_t{1024} >> gshift;                                    \
  const __mmask16 mk = static_cast<__mmask16>((1u << per_block) - 1);                                 \
  /* lane j's group within the super-block, 64j / group: a shift (the group is a power of 2) */  \
  const __m512i gidx = _mm512_srl_epi32(                                                              \
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),                         \
      _mm_cvtsi32_si128(gshift - 6));                                                                 \
  __m512 acc[R][T];                                                                                   \
  for (int r = 0; r < R; ++r)                                                                         \
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();                                      \
  for (int64_t b = 0; b < w.k / 1024; ++b) {                                                          \
    __m512i dot[R][T];                                                                                \
    for (int r = 0; r < R; ++r)                                                                       \
      for (int t = 0; t < T; ++t) dot[r][t] = _mm512_setzero_si512();                                 \
    for (int p = 0; p < 8; ++p) {                                                                     \
      __m512i lo[R], hi[R];                                                                           \
      for (int r = 0; r < R; ++r) {                                                                   \
        const uint8_t* c = w.q + (row + r) * (w.k / 2) + b * 512 + p * 64;                            \
        if (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(c + g_prefetch), _MM_HINT_T1);       \
        unpack_nibbles(c, lo[r], hi[r]);                                                              \
      }                                                                                               \
      for (int t = 0; t < T; ++t) {                                                                   \
        const int8_t* xt = xq + t * w.k + b * 1024 + p * 128;                                         \
        const __m512i x0 = _mm512_loadu_si512(reinterpret_cast<const void*>(xt));                    \
        const __m512i x1 = _mm512_loadu_si512(reinterpret_cast<const void*>(xt + 64));               \
        for (int r = 0; r < R; ++r) dot[r][t] = DOT(DOT(dot[r][t], lo[r], x0), hi[r], x1);           \
      }                                                                                               \
    }                                                                                                 \
    const int64_t g = b * per_block;                                                                  \
    __m512 xsc[T];                                                                                    \
    for (int t = 0; t < T; ++t)                                                                       \
      xsc[t] = _mm512_permutexvar_ps(gidx, _mm512_maskz_loadu_ps(mk, sx + t * G + g));                \
    for (int r = 0; r < R; ++r) {                                                                     \
      const __m512 wsc = _mm512_permutexvar_ps(gidx, _mm512_maskz_loadu_ps(mk, w.s + (row + r) * G + g)); \
      for (int t = 0; t < T; ++t)                                                                     \
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][t]), _mm512_mul_ps(wsc, xsc[t]), acc[r][t]); \
    }                                                                                                 \
  }                                                                                                   \
  finish_w4a8_tile<R, T>(w, row, acc, xs, y, ys);

template <int R, int T, bool PREFETCH>
__attribute__((target(EDGE_AVX512_VNNI))) void tile_lanes1k_vnni(const Weights& w, int64_t row, const int8_t* xq,
                                                                 const float* sx, const float* xs, float* y,
                                                                 int64_t ys) {
  EDGE_LANES1K_TILE(dpbusd_in_place)
}

template <int R, int T, bool PREFETCH>
__attribute__((target(EDGE_AVX512))) void tile_lanes1k_bw(const Weights& w, int64_t row, const int8_t* xq,
                                                          const float* sx, const float* xs, float* y, int64_t ys) {
  EDGE_LANES1K_TILE(dpbusd_bw)
}
#undef EDGE_LANES1K_TILE

// int8 activations [M, K] in natural order -> the lanes1k order, in place: per super-block of
// 1024, the 16 x 16 matrix of 4-byte words (lane j, step i) transposed, so that step i's 64
// bytes (word j = codes 64j+4i..64j+4i+3) are consecutive.
void lanes1k_order(int8_t* xq, int64_t rows, int64_t k) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < k / 1024; ++b) {
      int32_t* block = reinterpret_cast<int32_t*>(xq + r * k + b * 1024);
      int32_t tmp[256];
      std::memcpy(tmp, block, sizeof tmp);
      for (int j = 0; j < 16; ++j)
        for (int i = 0; i < 16; ++i) block[i * 16 + j] = tmp[j * 16 + i];
    }
  }
}

// stripes16 (W4A8 on AVX-512 CPUs where N % 16 == 0): rows in stripes of 16, and per stripe
// and step of 8 codes one 64-byte line, byte 4i+b holding code 8j+b of the stripe's row i in
// its low nibble and code 8j+4+b in its high one (pack_stripes16). An AND, or a shift and an
// AND, gives each 32-bit lane (one row) 4 consecutive codes, and `vpdpbusd` takes the
// activations as 4 bytes broadcast to every lane: each lane's sum is one output, so no
// horizontal sum is ever made and the int8 activations stay in their natural order. The
// scales and zero points come in the same stripe order ([N/16][G][16]), one 64-byte load per
// stripe and group. A tile is RV stripes x T tokens over groups [g0, g1): the unpacked codes
// of a step serve T tokens, each broadcast serves RV stripes, and the int32 sums are folded
// once per group (with the zero-point term) into fp32 sums F [RV][T][16] that the caller
// keeps in L1 across calls.
#define EDGE_STRIPES16_TILE(DOT)                                                                     \
  const int64_t G = w.groups, steps = w.group / 8, stripe_bytes = 8 * w.k;                            \
  const uint8_t* codes = w.q + stripe * stripe_bytes;                                                \
  for (int64_t g = g0; g < g1; ++g) {                                                                 \
    __m512i acc[RV][T];                                                                               \
    for (int v = 0; v < RV; ++v)                                                                      \
      for (int t = 0; t < T; ++t) acc[v][t] = _mm512_setzero_si512();                                 \
    for (int64_t j = g * steps; j < (g + 1) * steps; ++j) {                                           \
      __m512i lo[RV], hi[RV];                                                                         \
      for (int v = 0; v < RV; ++v) {                                                                  \
        const uint8_t* c = codes + v * stripe_bytes + j * 64;                                         \
        if (pf) _mm_prefetch(reinterpret_cast<const char*>(c + pf), _MM_HINT_T1);                     \
        unpack_nibbles(c, lo[v], hi[v]);                                                              \
      }                                                                                               \
      for (int t = 0; t < T; ++t) {                                                                   \
        int32_t b0, b1;                                                                               \
        std::memcpy(&b0, xq + t * w.k + j * 8, 4);                                                    \
        std::memcpy(&b1, xq + t * w.k + j * 8 + 4, 4);                                                \
        const __m512i x0 = _mm512_set1_epi32(b0), x1 = _mm512_set1_epi32(b1);                         \
        for (int v = 0; v < RV; ++v) acc[v][t] = DOT(DOT(acc[v][t], lo[v], x0), hi[v], x1);           \
      }                                                                                               \
    }                                                                                                 \
    for (int v = 0; v < RV; ++v) {                                                                    \
      const int64_t at = ((stripe + v) * G + g) * 16;                                                 \
      const __m512 ws = _mm512_loadu_ps(w.s + at);                                                    \
      const __m512 zs = _mm512_mul_ps(ws, w.z ? _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128( \
                                                    reinterpret_cast<const __m128i*>(w.z + at))))     \
                                              : _mm512_set1_ps(8.f));                                 \
      for (int t = 0; t < T; ++t) {                                                                   \
        float* f = F + (v * T + t) * 16;                                                              \
        const __m512 p = _mm512_mul_ps(ws, _mm512_set1_ps(sx[t * G + g]));                            \
        const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[v][t]), p, _mm512_loadu_ps(f));     \
        _mm512_storeu_ps(f, _mm512_fnmadd_ps(zs, _mm512_set1_ps(xs[t * G + g]), sum));               \
      }                                                                                               \
    }                                                                                                 \
  }

template <int RV, int T>
__attribute__((target(EDGE_AVX512_VNNI))) void tile_stripes16_vnni(const Weights& w, int64_t stripe, const int8_t* xq,
                                                                   const float* sx, const float* xs, float* F,
                                                                   int64_t g0, int64_t g1, int64_t pf) {
  EDGE_STRIPES16_TILE(dpbusd_in_place)
}

template <int RV, int T>
__attribute__((target(EDGE_AVX512))) void tile_stripes16_bw(const Weights& w, int64_t stripe, const int8_t* xq,
                                                            const float* sx, const float* xs, float* F, int64_t g0,
                                                            int64_t g1, int64_t pf) {
  EDGE_STRIPES16_TILE(dpbusd_bw)
}
#undef EDGE_STRIPES16_TILE

// One tile of RV stripes x T (1..8) tokens, T chosen at run time.
template <int RV>
void stripes16_tile(int64_t T, bool vnni, const Weights& w, int64_t stripe, const int8_t* xq, const float* sx,
                    const float* xs, float* F, int64_t g0, int64_t g1, int64_t pf) {
  auto run = [&](auto tag) {
    constexpr int TT = decltype(tag)::value;
    (vnni ? tile_stripes16_vnni<RV, TT> : tile_stripes16_bw<RV, TT>)(w, stripe, xq, sx, xs, F, g0, g1, pf);
  };
  switch (T) {
    case 8: run(std::integral_constant<int, 8>{}); break;
    case 7: run(std::integral_constant<int, 7>{}); break;
    case 6: run(std::integral_constant<int, 6>{}); break;
    case 5: run(std::integral_constant<int, 5>{}); break;
    case 4: run(std::integral_constant<int, 4>{}); break;
    case 3: run(std::integral_constant<int, 3>{}); break;
    case 2: run(std::integral_constant<int, 2>{}); break;
    default: run(std::integral_constant<int, 1>{}); break;
  }
}

// R rows against tokens [t0, t1), 4 at a time, then the 1-3 left.
template <int R, bool PREFETCH>
void rows_nib128(const Weights& w, int64_t row, const int8_t* xq, const float* sx, const float* xs, int64_t t0,
                 int64_t t1, float* y, bool vnni) {
  auto tile = [&](auto tag, int64_t t) {
    constexpr int TT = decltype(tag)::value;
    const int8_t* xt = xq + t * w.k;
    const float* st = sx + t * w.groups;
    const float* gt = xs + t * w.groups;
    float* yt = y + t * w.n + row;
    const bool g64 = w.group == 64;
    if (w.layout == kLanes1k) {
      (vnni ? tile_lanes1k_vnni<R, TT, PREFETCH> : tile_lanes1k_bw<R, TT, PREFETCH>)(w, row, xt, st, gt, yt, w.n);
    } else if (vnni) {
      (g64 ? tile_nib128_vnni<R, TT, PREFETCH, true> : tile_nib128_vnni<R, TT, PREFETCH, false>)(w, row, xt, st, gt, yt, w.n);
    } else {
      (g64 ? tile_nib128_bw<R, TT, PREFETCH, true> : tile_nib128_bw<R, TT, PREFETCH, false>)(w, row, xt, st, gt, yt, w.n);
    }
  };
  int64_t t = t0;
  for (; t + 4 <= t1; t += 4) tile(std::integral_constant<int, 4>{}, t);
  switch (t1 - t) {
    case 3: tile(std::integral_constant<int, 3>{}, t); break;
    case 2: tile(std::integral_constant<int, 2>{}, t); break;
    case 1: tile(std::integral_constant<int, 1>{}, t); break;
    default: break;
  }
}

// Activations (fp32 or bf16) [M, K] -> xq int8 [M, K], sx and xs [M, K/group], 16 at a time:
// the same rounding, bit for bit, as quantize_act_into and the torch reference (a true
// division, round half to even), xs = sx * sum xq per group.
template <typename In>
__attribute__((target(EDGE_AVX512))) inline __m512 load16(const In* p) {
  if constexpr (std::is_same_v<In, float>) {
    return _mm512_loadu_ps(p);
  } else {  // bf16 bits: the top half of an fp32
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <typename In>
__attribute__((target(EDGE_AVX512))) void quantize_rows_avx512(const In* xp, int64_t t0, int64_t t1, int64_t k,
                                                               int64_t group, int8_t* qp, float* sp, float* xs) {
  const int64_t groups = k / group;
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t g = 0; g < groups; ++g) {
      const In* xg = xp + t * k + g * group;
      __m512 mx = _mm512_setzero_ps();
      for (int64_t i = 0; i < group; i += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load16(xg + i)));
      const float scale = _mm512_reduce_max_ps(mx) / 127.f;
      sp[t * groups + g] = scale;
      int8_t* o = qp + t * k + g * group;
      if (!(scale > 0.f)) {
        std::memset(o, 0, group);
        xs[t * groups + g] = 0.f;
        continue;
      }
      const __m512 sv = _mm512_set1_ps(scale);
      __m512i total = _mm512_setzero_si512();
      for (int64_t i = 0; i < group; i += 16) {
        const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(load16(xg + i), sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512i v = _mm512_cvtps_epi32(r);
        v = _mm512_min_epi32(_mm512_max_epi32(v, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
        total = _mm512_add_epi32(total, v);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i), _mm512_cvtepi32_epi8(v));
      }
      xs[t * groups + g] = scale * static_cast<float>(_mm512_reduce_add_epi32(total));
    }
  }
}

// AVX-512 W4A16: two lanes64 blocks (128 codes, 64 bytes) per load. Nibble j of every 32-bit
// lane is then codes 8j..8j+7 of block 2p (lanes 0-7) and of block 2p+1 (lanes 8-15), so the
// activations are read in "pair order" (pair_order_x): per pair, for each j, x[128p+8j..+8]
// then x[128p+64+8j..+8]. Half the vector instructions per weight of the AVX2 loop. Needs K % 128 == 0
// and a group of 64 (one scale per half) or a multiple of 128 (one per pair); the caller sends
// anything else to the AVX2 loop.
#define EDGE_AVX512_W4A16 "avx512f,avx512bw,avx512vl,avx2,fma"

template <int J>
__attribute__((target(EDGE_AVX512_W4A16))) inline __m512 lane_codes512(__m512i v) {
  constexpr int shift = 19 - 4 * J;
  const __m512i t = shift >= 0 ? _mm512_slli_epi32(v, shift >= 0 ? shift : 0)
                               : _mm512_srli_epi32(v, shift < 0 ? -shift : 0);
  const __m512i mant = _mm512_and_si512(t, _mm512_set1_epi32(0x00780000));
  return _mm512_castsi512_ps(_mm512_or_si512(mant, _mm512_set1_epi32(0x3F800000)));
}

// One row against one token (the decode GEMV): 8 FMA chains, flushed once per group.
__attribute__((target(EDGE_AVX512_W4A16))) float dot_w4a16_avx512(const Weights& w, int64_t row,
                                                                  const float* xp, const float* xsum) {
  const uint8_t* q = w.q + row * (w.k / 2);
  const float* s = w.s + row * w.groups;
  __m512 acc = _mm512_setzero_ps(), h[8];
  for (int c = 0; c < 8; ++c) h[c] = _mm512_setzero_ps();
  const int64_t pairs = w.k / 128, pairs_per_group = w.group >= 128 ? w.group / 128 : 1;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint8_t* qp = q + p * 64;
    if (g_prefetch) _mm_prefetch(reinterpret_cast<const char*>(qp + g_prefetch), _MM_HINT_T1);
    const __m512i v = _mm512_loadu_si512(reinterpret_cast<const void*>(qp));
    const float* xb = xp + p * 128;
#define EDGE_W4A16_512_STEP(J) h[J] = _mm512_fmadd_ps(lane_codes512<J>(v), _mm512_loadu_ps(xb + 16 * (J)), h[J]);
    EDGE_W4A16_512_STEP(0) EDGE_W4A16_512_STEP(1) EDGE_W4A16_512_STEP(2) EDGE_W4A16_512_STEP(3)
    EDGE_W4A16_512_STEP(4) EDGE_W4A16_512_STEP(5) EDGE_W4A16_512_STEP(6) EDGE_W4A16_512_STEP(7)
#undef EDGE_W4A16_512_STEP
    if ((p + 1) % pairs_per_group == 0) {
      // 16 s_g per half: one group per pair or per several pairs, or (group 64) one per half
      const __m512 scale = w.group == 64
          ? _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(16.f * s[2 * p]), _mm512_set1_ps(16.f * s[2 * p + 1]))
          : _mm512_set1_ps(16.f * s[(p * 128) / w.group]);
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(h[0], h[1]), _mm512_add_ps(h[2], h[3])),
                                       _mm512_add_ps(_mm512_add_ps(h[4], h[5]), _mm512_add_ps(h[6], h[7])));
      acc = _mm512_fmadd_ps(sum, scale, acc);
      for (int c = 0; c < 8; ++c) h[c] = _mm512_setzero_ps();
    }
  }
  float corr = 0.f;
  for (int64_t g = 0; g < w.groups; ++g) corr += s[g] * (16.f + zero_of(w, row, g)) * xsum[g];
  return _mm512_reduce_add_ps(acc) - corr;
}

bool avx512_w4a16_fits(const Weights& w) {
  return w.k % 128 == 0 && (w.group == 64 || w.group % 128 == 0);
}

// x [M, K] -> out [M, K] in the pair order dot_w4a16_avx512 reads.
void pair_order_x(const float* x, int64_t m, int64_t k, float* out) {
  for (int64_t t = 0; t < m; ++t)
    for (int64_t p = 0; p < k / 128; ++p)
      for (int64_t j = 0; j < 8; ++j)
        for (int64_t half = 0; half < 2; ++half)
          std::copy_n(x + t * k + p * 128 + half * 64 + 8 * j, 8, out + t * k + p * 128 + 16 * j + 8 * half);
}

// AVX512-BF16 W4A16 (words128 codes, bf16 activations): R rows against T tokens, 128 codes
// (one 64-byte line per row) per step. One load, four shifts and four `vpternlogd` make a
// row's 4 x 32 bf16 weights 1 + q/16, then one `vdpbf16ps` per 32 weights and token adds
// their products into 16 fp32 sums; y = s_g (16 S_g - (16 + z_g) X_g) per group. Each
// weight vector serves T tokens and each activation vector R rows, and the R x T (x C) sums are
// independent chains: the dot's latency, not memory, bounded a one-row one-chain loop at ~13
// GB/s per core. Groups of 128 (or a multiple) sum into C chains flushed once per group with
// one FMA; groups of 32 and 64 are scaled as each quarter or half is made, into two
// accumulators (acc and h[..][0]).
#define EDGE_AVX512_BF16 "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma"

template <int R, int T, int G>
__attribute__((target(EDGE_AVX512_BF16))) void dot_w4a16_bf16(const Weights& w, int64_t row,
                                                              const c10::BFloat16* x, int64_t xs,
                                                              const float* xsum, int64_t gs, float* y,
                                                              int64_t ys) {
  constexpr int C = R * T >= 8 ? 1 : 2;
  const int64_t row_bytes = w.k / 2;
  const __m512i nib = _mm512_set1_epi16(0x0078), one = _mm512_set1_epi16(0x3F80);
  const __m512 zero = _mm512_setzero_ps();
  __m512 acc[R][T], h[R][T][C];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      acc[r][t] = zero;
      for (int c = 0; c < C; ++c) h[r][t][c] = zero;
    }
  // nibble at bits 3..6: (v & 0x78) | 0x3F80, ternlog A & B | C = 0xEA
#define EDGE_BF16_W(V) (__m512bh) _mm512_ternarylogic_epi32(V, nib, one, 0xEA)
#define EDGE_BF16_S(R_, I) _mm512_set1_ps(16.f * w.s[(row + (R_)) * w.groups + (I)])
#define EDGE_BF16_XV(T_, OFF) (__m512bh) _mm512_loadu_si512(reinterpret_cast<const void*>(x + (T_) * xs + (OFF)))
  const int64_t steps = w.k / 128;
  // groups of 128 or more: which group, and the step within it, counted (a division per step
  // put a 64-bit idiv on the path of every flush)
  [[maybe_unused]] const int64_t steps_per_group = G != 32 && G != 64 ? w.group / 128 : 1;
  [[maybe_unused]] int64_t group_index = 0, step_in_group = 0;
  for (int64_t p = 0; p < steps; ++p) {
    const int64_t k0 = p * 128;
    __m512bh x1[4];  // one token: its four slices in registers for the R rows
    if constexpr (T == 1)
      for (int i = 0; i < 4; ++i) x1[i] = EDGE_BF16_XV(0, k0 + 32 * i);
#define EDGE_BF16_X(T_, I) (T == 1 ? x1[I] : EDGE_BF16_XV(T_, k0 + 32 * (I)))
    for (int r = 0; r < R; ++r) {
      const uint8_t* pp = w.q + (row + r) * row_bytes + p * 64;
      if (g_prefetch) _mm_prefetch(reinterpret_cast<const char*>(pp + g_prefetch), _MM_HINT_T1);
      const __m512i v = _mm512_loadu_si512(reinterpret_cast<const void*>(pp));
      const __m512bh w0 = EDGE_BF16_W(_mm512_slli_epi16(v, 3)), w1 = EDGE_BF16_W(_mm512_srli_epi16(v, 1));
      const __m512bh w2 = EDGE_BF16_W(_mm512_srli_epi16(v, 5)), w3 = EDGE_BF16_W(_mm512_srli_epi16(v, 9));
      if constexpr (G == 32) {
        const __m512 s0 = EDGE_BF16_S(r, 4 * p), s1 = EDGE_BF16_S(r, 4 * p + 1);
        const __m512 s2 = EDGE_BF16_S(r, 4 * p + 2), s3 = EDGE_BF16_S(r, 4 * p + 3);
        for (int t = 0; t < T; ++t) {
          acc[r][t] = _mm512_fmadd_ps(_mm512_dpbf16_ps(zero, w0, EDGE_BF16_X(t, 0)), s0, acc[r][t]);
          h[r][t][0] = _mm512_fmadd_ps(_mm512_dpbf16_ps(zero, w1, EDGE_BF16_X(t, 1)), s1, h[r][t][0]);
          acc[r][t] = _mm512_fmadd_ps(_mm512_dpbf16_ps(zero, w2, EDGE_BF16_X(t, 2)), s2, acc[r][t]);
          h[r][t][0] = _mm512_fmadd_ps(_mm512_dpbf16_ps(zero, w3, EDGE_BF16_X(t, 3)), s3, h[r][t][0]);
        }
      } else if constexpr (G == 64) {
        const __m512 s0 = EDGE_BF16_S(r, 2 * p), s1 = EDGE_BF16_S(r, 2 * p + 1);
        for (int t = 0; t < T; ++t) {
          const __m512 d0 = _mm512_dpbf16_ps(_mm512_dpbf16_ps(zero, w0, EDGE_BF16_X(t, 0)), w1, EDGE_BF16_X(t, 1));
          const __m512 d1 = _mm512_dpbf16_ps(_mm512_dpbf16_ps(zero, w2, EDGE_BF16_X(t, 2)), w3, EDGE_BF16_X(t, 3));
          acc[r][t] = _mm512_fmadd_ps(d0, s0, acc[r][t]);
          h[r][t][0] = _mm512_fmadd_ps(d1, s1, h[r][t][0]);
        }
      } else {
        for (int t = 0; t < T; ++t) {
          h[r][t][0] = _mm512_dpbf16_ps(h[r][t][0], w0, EDGE_BF16_X(t, 0));
          h[r][t][1 % C] = _mm512_dpbf16_ps(h[r][t][1 % C], w1, EDGE_BF16_X(t, 1));
          h[r][t][0] = _mm512_dpbf16_ps(h[r][t][0], w2, EDGE_BF16_X(t, 2));
          h[r][t][1 % C] = _mm512_dpbf16_ps(h[r][t][1 % C], w3, EDGE_BF16_X(t, 3));
        }
      }
    }
#undef EDGE_BF16_X
    if constexpr (G != 32 && G != 64) {
      if (++step_in_group == steps_per_group) {
        step_in_group = 0;
        for (int r = 0; r < R; ++r) {
          const __m512 sg = EDGE_BF16_S(r, group_index);
          for (int t = 0; t < T; ++t) {
            const __m512 sum = C == 2 ? _mm512_add_ps(h[r][t][0], h[r][t][C - 1]) : h[r][t][0];
            acc[r][t] = _mm512_fmadd_ps(sum, sg, acc[r][t]);
            for (int c = 0; c < C; ++c) h[r][t][c] = zero;
          }
        }
        ++group_index;
      }
    }
  }
  if (w.k % 128) {  // the 64-code tail (G = 32 or 64): byte i = k i | k 32+i << 4
    const int64_t k0 = steps * 128;
    for (int r = 0; r < R; ++r) {
      const uint8_t* pp = w.q + (row + r) * row_bytes + steps * 64;
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pp)));
      const __m512bh wl = EDGE_BF16_W(_mm512_slli_epi16(v, 3)), wh = EDGE_BF16_W(_mm512_srli_epi16(v, 1));
      for (int t = 0; t < T; ++t) {
        const __m512 lo = _mm512_dpbf16_ps(zero, wl, EDGE_BF16_XV(t, k0));
        const __m512 hi = _mm512_dpbf16_ps(zero, wh, EDGE_BF16_XV(t, k0 + 32));
        if constexpr (G == 32) {
          acc[r][t] = _mm512_fmadd_ps(lo, EDGE_BF16_S(r, k0 / 32), acc[r][t]);
          h[r][t][0] = _mm512_fmadd_ps(hi, EDGE_BF16_S(r, k0 / 32 + 1), h[r][t][0]);
        } else {
          acc[r][t] = _mm512_fmadd_ps(_mm512_add_ps(lo, hi), EDGE_BF16_S(r, k0 / 64), acc[r][t]);
        }
      }
    }
  }
#undef EDGE_BF16_W
#undef EDGE_BF16_S
#undef EDGE_BF16_XV
  for (int r = 0; r < R; ++r) {
    const float* s = w.s + (row + r) * w.groups;
    for (int t = 0; t < T; ++t) {
      float corr = 0.f;
      for (int64_t g = 0; g < w.groups; ++g) corr += s[g] * (16.f + zero_of(w, row + r, g)) * xsum[t * gs + g];
      // G = 32/64 use h[..][0] as a second accumulator; G >= 128 left it flushed (zero)
      y[t * ys + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][t], h[r][t][0])) - corr;
    }
  }
}

// Per-token group sums of bf16 activations [M, K] (a bf16 is the top half of an fp32).
__attribute__((target(EDGE_AVX512_BF16))) void group_sums_bf16(const c10::BFloat16* x, int64_t m, int64_t k,
                                                               int64_t group, float* xsum) {
  const auto* u = reinterpret_cast<const uint16_t*>(x);
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t g = 0; g < k / group; ++g) {
      const uint16_t* p = u + t * k + g * group;
      __m512 a = _mm512_setzero_ps();
      int64_t i = 0;
      for (; i + 16 <= group; i += 16) {
        const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
        a = _mm512_add_ps(a, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
      }
      float sum = _mm512_reduce_add_ps(a);
      for (; i < group; ++i) sum += static_cast<float>(x[t * k + g * group + i]);
      xsum[t * (k / group) + g] = sum;
    }
  }
}

// fp32 -> bf16 (round to nearest even, as c10::BFloat16), 16 at a time; threads only for
// outputs as large as an LM head's.
__attribute__((target(EDGE_AVX512_BF16))) void to_bf16_range(const float* y, int64_t a, int64_t b,
                                                             c10::BFloat16* out) {
  int64_t i = a;
  for (; i + 16 <= b; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(y + i)));
  for (; i < b; ++i) out[i] = c10::BFloat16(y[i]);
}

void to_bf16(const float* y, int64_t count, c10::BFloat16* out) {
  at::parallel_for(0, count, int64_t{1} << 16, [&](int64_t a, int64_t b) { to_bf16_range(y, a, b, out); });
}

// 16 codes (32-bit lanes) of one row at k -> 16 bf16 weights (q - z) s in o[k..k+16).
__attribute__((target(EDGE_AVX512_BF16))) inline void put16_bf16(const Weights& w, int64_t row, c10::BFloat16* o,
                                                                 __m512i codes, int64_t k) {
  const int64_t g = k / w.group;
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(codes), _mm512_set1_ps(zero_of(w, row, g))),
                                 _mm512_set1_ps(w.s[row * w.groups + g]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + k), (__m256i)_mm512_cvtneps_pbh(f));
}

// words128 rows [r0, r1) dequantized to bf16, w = (q - z) s rounded to nearest even, into out
// [r1 - r0, K]: the prefill GEMM's weight tile when the activations are bf16.
__attribute__((target(EDGE_AVX512_BF16))) void dequant_rows_bf16(const Weights& w, int64_t r0, int64_t r1,
                                                                 c10::BFloat16* out) {
  const __m512i m4 = _mm512_set1_epi32(0xF);
  const int64_t steps = w.k / 128;
  for (int64_t row = r0; row < r1; ++row) {
    const uint8_t* q = w.q + row * (w.k / 2);
    c10::BFloat16* o = out + (row - r0) * w.k;
    for (int64_t c = 0; c < steps; ++c)
      for (int h = 0; h < 2; ++h) {  // words 16h..16h+15; nibble j of word i is k = 32j + i
        const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 64 + 32 * h)));
        put16_bf16(w, row, o, _mm512_and_si512(v, m4), c * 128 + 16 * h);
        put16_bf16(w, row, o, _mm512_and_si512(_mm512_srli_epi32(v, 4), m4), c * 128 + 32 + 16 * h);
        put16_bf16(w, row, o, _mm512_and_si512(_mm512_srli_epi32(v, 8), m4), c * 128 + 64 + 16 * h);
        put16_bf16(w, row, o, _mm512_srli_epi32(v, 12), c * 128 + 96 + 16 * h);
      }
    if (w.k % 128)  // tail: byte i = k i | k 32+i << 4
      for (int h = 0; h < 2; ++h) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + steps * 64 + 16 * h)));
        put16_bf16(w, row, o, _mm512_and_si512(b, m4), steps * 128 + 16 * h);
        put16_bf16(w, row, o, _mm512_srli_epi32(b, 4), steps * 128 + 32 + 16 * h);
      }
  }
}

// Rows of words128 codes against M bf16 tokens. A task of 4 rows meets the tokens 4 at a time
// (2 rows per call), then in pairs (4 rows), then one (4 rows): every call keeps at least 8
// chains and fits the registers. The last N % 4 rows go one at a time (R = 1).
template <int G, int R>
void rows_tile_w4a16_bf16(const Weights& w, int64_t row, const c10::BFloat16* x, int64_t m, const float* xsum,
                          float* yp) {
  auto call = [&](auto rt, auto tt, int64_t r0, int64_t t0) {
    constexpr int RR = decltype(rt)::value, TT = decltype(tt)::value;
    dot_w4a16_bf16<RR, TT, G>(w, r0, x + t0 * w.k, w.k, xsum + t0 * w.groups, w.groups, yp + t0 * w.n + r0, w.n);
  };
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  using I4 = std::integral_constant<int, 4>;
  int64_t t = 0;
  if constexpr (R == 4) {
    for (; t + 4 <= m; t += 4) {
      call(I2{}, I4{}, row, t);
      call(I2{}, I4{}, row + 2, t);
    }
    for (; t + 2 <= m; t += 2) call(I4{}, I2{}, row, t);
    if (t < m) call(I4{}, I1{}, row, t);
  } else {
    for (; t + 4 <= m; t += 4) call(I1{}, I4{}, row, t);
    for (; t + 2 <= m; t += 2) call(I1{}, I2{}, row, t);
    if (t < m) call(I1{}, I1{}, row, t);
  }
}

// y [M, N] for words128 codes and bf16 activations [M, K], every row in one parallel region
// over tasks of 4 rows.
void rows_w4a16_bf16(const Weights& w, const c10::BFloat16* x, int64_t m, float* yp) {
  TORCH_CHECK(w.group == 32 || w.group == 64 || w.group % 128 == 0,
              "edge_w4: the words128 layout takes groups of 32, 64 or a multiple of 128, got ", w.group);
  thread_local std::vector<float> xsum_buf;
  float* xsum = scratch(xsum_buf, m * w.groups);
  group_sums_bf16(x, m, w.k, w.group, xsum);
  using Fn = void (*)(const Weights&, int64_t, const c10::BFloat16*, int64_t, const float*, float*);
  const Fn quad = w.group == 32 ? &rows_tile_w4a16_bf16<32, 4> : w.group == 64 ? &rows_tile_w4a16_bf16<64, 4>
                                                                               : &rows_tile_w4a16_bf16<128, 4>;
  const Fn single = w.group == 32 ? &rows_tile_w4a16_bf16<32, 1> : w.group == 64 ? &rows_tile_w4a16_bf16<64, 1>
                                                                                 : &rows_tile_w4a16_bf16<128, 1>;
  constexpr int64_t R = 4;
  at::parallel_for(0, (w.n + R - 1) / R, std::max<int64_t>(1, grain_for(w.k) / R), [&](int64_t a, int64_t b) {
    for (int64_t task = a; task < b; ++task) {
      const int64_t row = task * R;
      if (row + R <= w.n) {
        quad(w, row, x, m, xsum, yp);
      } else {
        for (int64_t r = row; r < w.n; ++r) single(w, r, x, m, xsum, yp);
      }
    }
  });
}

// 16 codes (16-bit lanes) of one row at k, dequantized into o[k..k+16).
__attribute__((target("avx2,fma"))) inline void put16_avx2(const Weights& w, int64_t row, float* o, __m256i codes16,
                                                           int64_t k) {
  const int64_t g = k / w.group;
  const __m256 sv = _mm256_set1_ps(w.s[row * w.groups + g]);
  const __m256 zv = _mm256_set1_ps(zero_of(w, row, g));
  const __m256 f0 = _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(codes16)));
  const __m256 f1 = _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(codes16, 1)));
  _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_sub_ps(f0, zv), sv));
  _mm256_storeu_ps(o + k + 8, _mm256_mul_ps(_mm256_sub_ps(f1, zv), sv));
}

__attribute__((target("avx2,fma"))) void dequant_rows_avx2(const Weights& w, int64_t r0, int64_t r1,
                                                           float* out) {
  for (int64_t row = r0; row < r1; ++row) {
    const uint8_t* q = w.q + row * (w.k / 2);
    float* o = out + (row - r0) * w.k;
    if (w.layout == kLanes64) {
      // w = (q - z) s = (1 + q/16) 16 s - (16 + z) s: one FMA per 8 weights.
      for (int64_t c = 0; c < w.k / 64; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 32));
        const int64_t g0 = (c * 64) / w.group, g1 = (c * 64 + 32) / w.group;
        const float s0 = w.s[row * w.groups + g0], s1 = w.s[row * w.groups + g1];
        const __m256 m0 = _mm256_set1_ps(16.f * s0), b0 = _mm256_set1_ps(-(16.f + zero_of(w, row, g0)) * s0);
        const __m256 m1 = _mm256_set1_ps(16.f * s1), b1 = _mm256_set1_ps(-(16.f + zero_of(w, row, g1)) * s1);
        float* ob = o + c * 64;
        _mm256_storeu_ps(ob, _mm256_fmadd_ps(lane_codes<0>(v), m0, b0));
        _mm256_storeu_ps(ob + 8, _mm256_fmadd_ps(lane_codes<1>(v), m0, b0));
        _mm256_storeu_ps(ob + 16, _mm256_fmadd_ps(lane_codes<2>(v), m0, b0));
        _mm256_storeu_ps(ob + 24, _mm256_fmadd_ps(lane_codes<3>(v), m0, b0));
        _mm256_storeu_ps(ob + 32, _mm256_fmadd_ps(lane_codes<4>(v), m1, b1));
        _mm256_storeu_ps(ob + 40, _mm256_fmadd_ps(lane_codes<5>(v), m1, b1));
        _mm256_storeu_ps(ob + 48, _mm256_fmadd_ps(lane_codes<6>(v), m1, b1));
        _mm256_storeu_ps(ob + 56, _mm256_fmadd_ps(lane_codes<7>(v), m1, b1));
      }
    } else if (w.layout == kWords128) {
      // per 128 codes, 16 words at a time: nibble j of word i is k = 32j + i
      const __m256i m4 = _mm256_set1_epi16(0x000F);
      const int64_t steps = w.k / 128;
      for (int64_t c = 0; c < steps; ++c) {
        for (int h = 0; h < 2; ++h) {  // words 0..15, then 16..31
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 64 + 32 * h));
          put16_avx2(w, row, o, _mm256_and_si256(v, m4), c * 128 + 16 * h);
          put16_avx2(w, row, o, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4), c * 128 + 32 + 16 * h);
          put16_avx2(w, row, o, _mm256_and_si256(_mm256_srli_epi16(v, 8), m4), c * 128 + 64 + 16 * h);
          put16_avx2(w, row, o, _mm256_srli_epi16(v, 12), c * 128 + 96 + 16 * h);
        }
      }
      if (w.k % 128) {  // tail: byte i = k i | k 32+i << 4, 16 bytes at a time
        const int64_t k0 = steps * 128;
        for (int h = 0; h < 2; ++h) {
          const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + steps * 64 + 16 * h)));
          put16_avx2(w, row, o, _mm256_and_si256(b, m4), k0 + 16 * h);
          put16_avx2(w, row, o, _mm256_srli_epi16(b, 4), k0 + 32 + 16 * h);
        }
      }
    } else {
      const int64_t per_group = w.group / kBlock;
      for (int64_t g = 0; g < w.groups; ++g) {
        const __m256 s = _mm256_set1_ps(w.s[row * w.groups + g]);
        const __m256 z = _mm256_set1_ps(zero_of(w, row, g));
        for (int64_t bb = 0; bb < per_group; ++bb) {
          const int64_t b = g * per_group + bb;
          const __m256i codes = blocks32_codes(q + b * 16);
          float* ob = o + b * kBlock;
          const __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
          const __m128i parts[4] = {lo, _mm_unpackhi_epi64(lo, lo), hi, _mm_unpackhi_epi64(hi, hi)};
          for (int j = 0; j < 4; ++j) {
            const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j]));
            _mm256_storeu_ps(ob + 8 * j, _mm256_mul_ps(_mm256_sub_ps(f, z), s));
          }
        }
      }
    }
  }
}
#endif

torch::Tensor as_float(const torch::Tensor& x);

// ---------------------------------------------------------------- activations
// Dynamic int8 activations, one scale per (token, weight group) along K: xq = round(x / sx),
// sx = absmax / 127 over the group. (llama.cpp's Q8_K, which its Q4_K dots use, has one
// scale per 256; a scale per 32 cost the int8 loops a float fold per 32 codes and token.)
// x fp32 [M, K] -> xq int8 [M, K], sx [M, K/32] (each group's scale repeated for its blocks of
// 32, as the blocks32 loops read it), xsum [M, K/group] (sx times the sum of the group's xq),
// into the caller's buffers.
void quantize_rows_portable(const float* xp, int64_t m, int64_t k, int64_t group, int8_t* qp, float* sp,
                            float* xs) {
  const int64_t groups = k / group, per_group = group / kBlock;
  for (int64_t gg = 0; gg < m * groups; ++gg) {
    const float* xg = xp + gg * group;
    float amax = 0.f;
    for (int64_t i = 0; i < group; ++i) amax = std::max(amax, std::fabs(xg[i]));
    const float scale = amax / 127.f;
    int32_t total = 0;
    for (int64_t i = 0; i < group; ++i) {
      // a division, not a multiply by 127/amax: bit-identical to the torch reference
      const int32_t v = scale > 0.f ? static_cast<int32_t>(std::nearbyint(xg[i] / scale)) : 0;
      const int32_t c = std::min(127, std::max(-127, v));
      qp[gg * group + i] = static_cast<int8_t>(c);
      total += c;
    }
    std::fill(sp + gg * per_group, sp + (gg + 1) * per_group, scale);
    xs[gg] = scale * static_cast<float>(total);
  }
}

#if defined(__x86_64__)
// The same, 32 activations at a time: the same division and round half to even, so the same
// codes bit for bit (test_kernels compares them with the torch reference). At pp512 the scalar
// loop's division was ~10% of a qkv call's time, single-threaded.
__attribute__((target("avx2,fma"))) void quantize_rows_avx2(const float* xp, int64_t m, int64_t k, int64_t group,
                                                            int8_t* qp, float* sp, float* xs) {
  const int64_t groups = k / group, per_group = group / kBlock;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo the packs' lane split
  for (int64_t gg = 0; gg < m * groups; ++gg) {
    const float* xg = xp + gg * group;
    __m256 mx = _mm256_setzero_ps();
    for (int64_t i = 0; i < group; i += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(xg + i), absmask));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float scale = _mm_cvtss_f32(m4) / 127.f;
    std::fill(sp + gg * per_group, sp + (gg + 1) * per_group, scale);
    int8_t* o = qp + gg * group;
    if (!(scale > 0.f)) {
      std::memset(o, 0, group);
      xs[gg] = 0.f;
      continue;
    }
    const __m256 sv = _mm256_set1_ps(scale);
    __m256i total = _mm256_setzero_si256();
    for (int64_t i = 0; i < group; i += 32) {
      __m256i c[4];
      for (int j = 0; j < 4; ++j) {
        const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(xg + i + 8 * j), sv),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        c[j] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(r), lo), hi);
        total = _mm256_add_epi32(total, c[j]);
      }
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), _mm256_permutevar8x32_epi32(bytes, order));
    }
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
    xs[gg] = scale * static_cast<float>(_mm_cvtsi128_si32(t4));
  }
}
#endif

// Tokens split over the threads when there are enough of them (prefill); one thread for a
// few (decode: 1 k activations per token quantize in ~1 us, less than waking a second one).
void quantize_act_into(const float* xp, int64_t m, int64_t k, int64_t group, int8_t* qp, float* sp,
                       float* xs) {
  static const bool avx2 = cpu_has("avx2") && cpu_has("fma");
  const int64_t groups = k / group, blocks = k / kBlock;
  auto rows = [&](int64_t t0, int64_t t1) {
    const float* x = xp + t0 * k;
    int8_t* q = qp + t0 * k;
    float* s = sp + t0 * blocks;
    float* g = xs + t0 * groups;
#if defined(__x86_64__)
    if (avx2) return quantize_rows_avx2(x, t1 - t0, k, group, q, s, g);
#endif
    quantize_rows_portable(x, t1 - t0, k, group, q, s, g);
  };
  if (m * k < (int64_t{1} << 15)) return rows(0, m);
  at::parallel_for(0, m, std::max<int64_t>(1, (int64_t{1} << 14) / k), rows);
}

// Dynamic int8 activations, one scale per (token, group): see quantize_act_into.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> quantize_act(const torch::Tensor& x_in,
                                                                     int64_t group) {
  const torch::Tensor x = as_float(x_in);
  TORCH_CHECK(group > 0 && group % kBlock == 0, "edge_w4: group ", group, " is not a multiple of 32");
  TORCH_CHECK(x.size(1) % group == 0, "edge_w4: activations must be [M, K], K % group == 0, got K=",
              x.size(1), ", group ", group);
  const int64_t m = x.size(0), k = x.size(1);
  auto xq = torch::empty({m, k}, torch::kChar);
  auto sx = torch::empty({m, k / kBlock}, torch::kFloat);
  auto xsum = torch::empty({m, k / group}, torch::kFloat);
  quantize_act_into(x.data_ptr<float>(), m, k, group, xq.data_ptr<int8_t>(), sx.data_ptr<float>(),
                    xsum.data_ptr<float>());
  return {xq, sx, xsum};
}

int64_t grain_for(int64_t k) {
  // rows per task: enough work (~64 KiB of codes) to amortize the scheduling
  return std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(k, 1));
}

// ---------------------------------------------------------------- ops
// Activations in, fp32 out of a plain loop: the per-call torch ops are what a decode step of
// small layers pays most for, so the kernels keep them to a minimum.
torch::Tensor as_float(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "edge_w4: activations must be 2-D [M, K]");
  if (x.scalar_type() == torch::kFloat) return x.contiguous();
  const torch::Tensor xc = x.contiguous();
  auto out = torch::empty(xc.sizes(), torch::kFloat);
  float* o = out.data_ptr<float>();
  const int64_t count = xc.numel();
  if (xc.scalar_type() == torch::kBFloat16) {
    const auto* p = xc.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < count; ++i) o[i] = static_cast<float>(p[i]);
  } else if (xc.scalar_type() == torch::kHalf) {
    const auto* p = xc.data_ptr<c10::Half>();
    for (int64_t i = 0; i < count; ++i) o[i] = static_cast<float>(p[i]);
  } else {
    TORCH_CHECK(false, "edge_w4: activations of dtype ", xc.scalar_type(), " are unsupported");
  }
  return out;
}

// y fp32 [M, N] -> the activations' dtype.
torch::Tensor finish(const torch::Tensor& y, c10::ScalarType dtype) {
  if (dtype == torch::kFloat) return y;
  auto out = torch::empty(y.sizes(), dtype);
  const float* p = y.data_ptr<float>();
  const int64_t count = y.numel();
  if (dtype == torch::kBFloat16) {
    auto* o = out.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < count; ++i) o[i] = c10::BFloat16(p[i]);
  } else {
    auto* o = out.data_ptr<c10::Half>();
    for (int64_t i = 0; i < count; ++i) o[i] = c10::Half(p[i]);
  }
  return out;
}

// Per-call scratch (activation codes, scales, group sums), kept per thread and grown, never
// freed: a decode step calls the kernels ~200 times, and each allocation costs as much as a
// small layer's arithmetic.
template <typename V>
V* scratch(std::vector<V>& buf, int64_t count) {
  if (static_cast<int64_t>(buf.size()) < count) buf.resize(count);
  return buf.data();
}

// The same, its start on a 64-byte line: a 32-byte load from a 16-byte-aligned vector splits
// across two cache lines every other time, which cost the int8 prefill tile (tile_w4a8_u8)
// 30% in a loop that stays in L1.
template <typename V>
V* scratch64(std::vector<V>& buf, int64_t count) {
  static_assert(64 % sizeof(V) == 0, "scratch64: element size must divide 64");
  V* p = scratch(buf, count + 64 / static_cast<int64_t>(sizeof(V)));
  const auto addr = reinterpret_cast<std::uintptr_t>(p);
  return reinterpret_cast<V*>((addr + 63) & ~std::uintptr_t{63});
}

// W4A16 (lanes64 codes): y [M, N] = x [M, K] fp32 against every row, in one parallel region
// over the rows; each row meets the M tokens 4 at a time (weights read from memory once).
void rows_w4a16(const Weights& w, const float* xp, int64_t m, float* yp, int64_t isa) {
  thread_local std::vector<float> xsum_buf;
  float* xsum = scratch(xsum_buf, m * w.groups);
  std::fill(xsum, xsum + m * w.groups, 0.f);  // per-token group sums of x
  for (int64_t t = 0; t < m; ++t)
    for (int64_t k = 0; k < w.k; ++k) xsum[t * w.groups + k / w.group] += xp[t * w.k + k];
#if defined(__x86_64__)
  // 512-bit loop for one token only: with more, the AVX2 loop over 4 tokens at a time measured
  // faster (qkv 4096x1024, M=2: 0.19 against 0.27 ms); at M=1 it streams 10-20% more GB/s
  if (isa >= kAvx512 && m == 1 && avx512_w4a16_fits(w)) {
    thread_local std::vector<float> xo_buf;
    float* xo = scratch(xo_buf, w.k);
    pair_order_x(xp, 1, w.k, xo);
    at::parallel_for(0, w.n, grain_for(w.k), [&](int64_t r0, int64_t r1) {
      for (int64_t row = r0; row < r1; ++row) yp[row] = dot_w4a16_avx512(w, row, xo, xsum);
    });
    return;
  }
#endif
  at::parallel_for(0, w.n, grain_for(w.k), [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
#if defined(__x86_64__)
      if (isa >= kAvx2) {
        int64_t t = 0;
        for (; t + 4 <= m; t += 4)
          dot_w4a16_avx2<4>(w, row, xp + t * w.k, w.k, xsum + t * w.groups, w.groups, yp + t * w.n + row, w.n);
        const float* xt = xp + t * w.k;
        const float* st = xsum + t * w.groups;
        float* yt = yp + t * w.n + row;
        switch (m - t) {
          case 1: dot_w4a16_avx2<1>(w, row, xt, w.k, st, w.groups, yt, w.n); break;
          case 2: dot_w4a16_avx2<2>(w, row, xt, w.k, st, w.groups, yt, w.n); break;
          case 3: dot_w4a16_avx2<2>(w, row, xt, w.k, st, w.groups, yt, w.n);
                  dot_w4a16_avx2<1>(w, row, xt + 2 * w.k, w.k, st + 2 * w.groups, w.groups, yt + 2 * w.n, w.n);
                  break;
          default: break;
        }
        continue;
      }
#endif
      for (int64_t t = 0; t < m; ++t)
        yp[t * w.n + row] = dot_w4a16_portable(w, row, xp + t * w.k, xsum + t * w.groups);
    }
  });
}

#if defined(__x86_64__)
// One row against tokens [t0, t1), 4 at a time, then a pair, then one (the AVX2 W4A8 loop's
// tiling past M=1).
__attribute__((target("avx2,fma"))) void w4a8_row_tokens(const Weights& w, int64_t row, const int8_t* xq,
                                                         const float* sx, const float* xsum, int64_t t0,
                                                         int64_t t1, float* yp) {
  const int64_t blocks = w.k / kBlock;
  auto at = [&](auto tag, int64_t t) {
    constexpr int TT = decltype(tag)::value;
    dot_w4a8_avx2<1, TT>(w, row, xq + t * w.k, w.k, sx + t * blocks, blocks, xsum + t * w.groups,
                         w.groups, yp + t * w.n + row, w.n);
  };
  int64_t t = t0;
  for (; t + 4 <= t1; t += 4) at(std::integral_constant<int, 4>{}, t);
  for (; t + 2 <= t1; t += 2) at(std::integral_constant<int, 2>{}, t);
  for (; t < t1; ++t) at(std::integral_constant<int, 1>{}, t);
}
#endif

#if defined(__x86_64__)
// W4A8 past M=4 on AVX2 (M >= kU8MinM or M = 3, below): each block of rows is unpacked once to unsigned bytes,
// one code per byte in the blocks32 order (byte 32b+i is code k=32b+i), then met by every
// token. The unpack that dot_w4a8_avx2 repeats per block, row and 4 tokens (a broadcast, a
// shift, a mask) happens once per row per call, and a tile of R rows x T tokens spends per
// 32-code block R loads of codes, T loads of activations and R x T `vpmaddubsw` + int16 adds.
__attribute__((target("avx2,fma"))) void unpack_blocks32_rows(const Weights& w, int64_t r0, int64_t r1,
                                                              uint8_t* out) {
  const int64_t row_bytes = w.k / 2, blocks = w.k / kBlock;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t b = 0; b < blocks; ++b)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (r - r0) * w.k + b * kBlock),
                          blocks32_codes(w.q + r * row_bytes + b * 16));
}

// R rows against T tokens. Codes u8 and activations xq are both w.k bytes a row apart; the
// tokens' block scales sx are bs floats apart, the rows' group scales srow w.groups apart; y
// has the rows contiguous and the tokens w.n apart. Without the zero points' share (see
// w4a8_zero_share). The scales of a chunk are broadcast from memory (loads, not shuffles).
//
// Two things measured on a 2-core Zen 3, in an in-L1 copy of this tile (2 x 4, K=1024, g128, one
// thread, 6 interleaved runs): GCC's loop unrolling, here only, 67 -> 70 GMAC/s (without it
// GCC's register allocation adds a register move per `vpaddw` to the block loop); and the 8
// sums of a 2 x 4 tile as one tree of `vhaddps` rather than 8 horizontal sums, 70 -> 77.
template <int R, int T>
__attribute__((target("avx2,fma"), optimize("unroll-loops")))
void tile_w4a8_u8(const Weights& w, const uint8_t* u8, const int8_t* xq, const float* sx, int64_t bs,
                  const float* srow, float* y) {
  const int64_t k = w.k, blocks = k / kBlock, per_group = w.group / kBlock;
  const int64_t chunk = w4a8_chunk(per_group);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t b0 = 0, g = 0, in_group = 0; b0 < blocks; b0 += chunk) {
    __m256i h[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) h[r][t] = _mm256_setzero_si256();
    for (int64_t b = b0; b < b0 + chunk; ++b) {
      __m256i c[R];
      for (int r = 0; r < R; ++r) c[r] = _mm256_load_si256(reinterpret_cast<const __m256i*>(u8 + r * k + b * kBlock));
      for (int t = 0; t < T; ++t) {
        const __m256i xv = _mm256_load_si256(reinterpret_cast<const __m256i*>(xq + t * k + b * kBlock));
        for (int r = 0; r < R; ++r) h[r][t] = _mm256_add_epi16(h[r][t], _mm256_maddubs_epi16(c[r], xv));
      }
    }
    __m256 sxv[T];
    for (int t = 0; t < T; ++t) sxv[t] = _mm256_broadcast_ss(sx + t * bs + b0);
    for (int r = 0; r < R; ++r) {
      const __m256 sg = _mm256_broadcast_ss(srow + r * w.groups + g);
      for (int t = 0; t < T; ++t) {
        const __m256 d = _mm256_cvtepi32_ps(_mm256_madd_epi16(h[r][t], ones));
        acc[r][t] = _mm256_fmadd_ps(d, _mm256_mul_ps(sg, sxv[t]), acc[r][t]);
      }
    }
    in_group += chunk;
    if (in_group == per_group) in_group = 0, ++g;
  }
  if constexpr (R * T == 8) {
    alignas(32) float sums[8];  // sums[r * T + t]: acc is row-major
    _mm256_store_ps(sums, sum8(&acc[0][0]));
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) y[t * w.n + r] = sums[r * T + t];
  } else {
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) y[t * w.n + r] = hsum(acc[r][t]);
  }
}

template <int R>
void tile_w4a8_u8_tokens(int64_t tt, const Weights& w, const uint8_t* u8, const int8_t* xq, const float* sx,
                         int64_t bs, const float* srow, float* y) {
  switch (tt) {
    case 4: tile_w4a8_u8<R, 4>(w, u8, xq, sx, bs, srow, y); break;
    case 3: tile_w4a8_u8<R, 3>(w, u8, xq, sx, bs, srow, y); break;
    case 2: tile_w4a8_u8<R, 2>(w, u8, xq, sx, bs, srow, y); break;
    default: tile_w4a8_u8<R, 1>(w, u8, xq, sx, bs, srow, y); break;
  }
}

// y[t, r0:r1] -= sum_g s_rg z_rg X_tg for every token: the zero points' share, taken out of
// the tiles (there a scalar loop per row and token cost as much as the tile's dots at K=1024),
// as rows-wide FMAs over a [groups, rows] table sz.
__attribute__((target("avx2,fma"))) void w4a8_zero_share(const Weights& w, int64_t r0, int64_t r1,
                                                         const float* xsum, int64_t m, float* sz, float* yp) {
  const int64_t rows = r1 - r0;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t g = 0; g < w.groups; ++g) sz[g * rows + (r - r0)] = w.s[r * w.groups + g] * zero_of(w, r, g);
  for (int64_t t = 0; t < m; ++t) {
    float* yt = yp + t * w.n + r0;
    for (int64_t g = 0; g < w.groups; ++g) {
      const float xs = xsum[t * w.groups + g];
      const float* zg = sz + g * rows;
      for (int64_t i = 0; i < rows; ++i) yt[i] -= xs * zg[i];
    }
  }
}

// The path of rows_w4a8 on AVX2 from kU8MinM tokens and for 3 (batched decode and prefill).
// Tasks of 64 rows, their unpacked codes (64 x K bytes) kept in L2 and split over the threads;
// within one, tokens 16 at a time against sub-blocks of 16 rows, in tiles of 2 rows x 4
// tokens, so each row's codes are read
// by 16 tokens and each token's activations by 16 rows before either leaves L1. Measured on
// a 2-core AMD EPYC (Zen 3, AVX2), qwen3-0.6b's four prefill shapes at M=512, g128, against
// the 1 x 4 loop it replaces for M >= 16 (GFLOP/s, 2 threads, the same run): qkv 4096x1024
// 216 / 169, o 1024x2048 245 / 181, gate_up 6144x1024 237 / 173, down 1024x3072 262 / 190.
// Slicing K as well (1024 codes, to keep the tokens' activations in L1 at K=3072) measured the
// same within this host's noise, so K is not sliced.
//
// The crossover with the register loop of rows_w4a8 (which unpacks each row's codes once per
// pass of up to 4 tokens) measured on the same CPU, qwen3-0.6b's four shapes, g128, 2 threads,
// 7 interleaved rounds of 200 back-to-back calls over cold weight copies: at M=2 and M=4 one
// pass of the register loop serves every token and it wins (M=4: 0.36 / 0.37, 0.14 / 0.15,
// 0.39 / 0.44, 0.17 / 0.22 ms, register / unpacked); at M=3 it takes two passes (a pair and
// one) and loses (0.43 / 0.31, 0.17 / 0.16, 0.49 / 0.36, 0.21 / 0.19); from M=5 the unpacked
// tiles win (M=8: 0.48 / 0.42, 0.23 / 0.22, 0.75 / 0.63, 0.34 / 0.29; M=12: 0.71 / 0.55,
// 0.34 / 0.26, 1.16 / 0.86, 0.49 / 0.42). A prefetch in the unpack measured no difference.
constexpr int64_t kU8MinM = 5, kU8Rows = 64, kU8SubRows = 16, kU8Tokens = 16;
void rows_w4a8_unpacked(const Weights& w, const int8_t* xq, const float* sx, const float* xsum, int64_t m,
                        float* yp) {
  const int64_t blocks = w.k / kBlock;
  const int64_t nblk = (w.n + kU8Rows - 1) / kU8Rows;
  at::parallel_for(0, nblk, 1, [&](int64_t a, int64_t b) {
    thread_local std::vector<uint8_t> u8_buf;
    thread_local std::vector<float> sz_buf;
    uint8_t* u8 = scratch64(u8_buf, kU8Rows * w.k);
    float* sz = scratch(sz_buf, kU8Rows * w.groups);
    for (int64_t blk = a; blk < b; ++blk) {
      const int64_t r0 = blk * kU8Rows, r1 = std::min(w.n, r0 + kU8Rows);
      unpack_blocks32_rows(w, r0, r1, u8);
      for (int64_t t0 = 0; t0 < m; t0 += kU8Tokens) {
        const int64_t t1 = std::min(m, t0 + kU8Tokens);
        for (int64_t s0 = r0; s0 < r1; s0 += kU8SubRows) {
          const int64_t s1 = std::min(r1, s0 + kU8SubRows);
          for (int64_t t = t0; t < t1; t += 4) {
            const int64_t tt = std::min<int64_t>(4, t1 - t);
            const int8_t* xt = xq + t * w.k;
            const float* st = sx + t * blocks;
            float* yt = yp + t * w.n;
            int64_t r = s0;
            for (; r + 2 <= s1; r += 2)
              tile_w4a8_u8_tokens<2>(tt, w, u8 + (r - r0) * w.k, xt, st, blocks, w.s + r * w.groups, yt + r);
            if (r < s1)
              tile_w4a8_u8_tokens<1>(tt, w, u8 + (r - r0) * w.k, xt, st, blocks, w.s + r * w.groups, yt + r);
          }
        }
      }
      w4a8_zero_share(w, r0, r1, xsum, m, sz, yp);
    }
  });
}
#endif

// W4A8 (blocks32 codes): the activations quantized once per call, then y [M, N] in one parallel
// region. One token: tasks of 4 rows that share each activation block. 2 or 4 tokens
// (batched decode, where the codes stream from memory): blocks of rows whose codes fit in
// ~8 KiB of L1, each met by the tokens 4 at a time, so each block of codes is unpacked once
// per 4 tokens and a quad's activations are read from L1 by the whole block. 3 tokens and from
// kU8MinM on AVX2: rows_w4a8_unpacked (codes unpacked once per call; crossover measured there).
void rows_w4a8(const Weights& w, const float* xp, int64_t m, float* yp, int64_t isa) {
  thread_local std::vector<int8_t> xq_buf;
  thread_local std::vector<float> sx_buf, xsum_buf;
  const int64_t blocks = w.k / kBlock;
  int8_t* xq = scratch64(xq_buf, m * w.k);
  float* sx = scratch(sx_buf, m * blocks);
  float* xsum = scratch(xsum_buf, m * w.groups);
  quantize_act_into(xp, m, w.k, w.group, xq, sx, xsum);
#if defined(__x86_64__)
  if (isa >= kAvx2 && (m >= kU8MinM || m == 3)) {
    rows_w4a8_unpacked(w, xq, sx, xsum, m, yp);
    return;
  }
  if (isa >= kAvx2 && m > 1) {
    const int64_t rb = std::max<int64_t>(1, int64_t{8192} / (w.k / 2));
    const int64_t nblk = (w.n + rb - 1) / rb;
    at::parallel_for(0, nblk, 1, [&](int64_t a, int64_t b) {
      for (int64_t blk = a; blk < b; ++blk) {
        const int64_t r0 = blk * rb, r1 = std::min(w.n, r0 + rb);
        for (int64_t t = 0; t < m; t += 4)
          for (int64_t r = r0; r < r1; ++r) w4a8_row_tokens(w, r, xq, sx, xsum, t, std::min(m, t + 4), yp);
      }
    });
    return;
  }
#endif
  constexpr int64_t R = 4;
  const int64_t tasks = (w.n + R - 1) / R;
  at::parallel_for(0, tasks, std::max<int64_t>(1, grain_for(w.k) / R), [&](int64_t a, int64_t b) {
    for (int64_t task = a; task < b; ++task) {
      const int64_t row = task * R;
      const int64_t rows = std::min(R, w.n - row);
#if defined(__x86_64__)
      // 512-bit loop for one token: for more, the AVX2 loop above measured faster (qkv
      // 4096x1024, M=8: 0.43 against 0.58 ms)
      if (isa >= kAvx512 && rows == R && w.k % 64 == 0) {
        if (isa == kAvx512Vnni) {
          dot_w4a8_avx512_vnni<R>(w, row, xq, sx, xsum, yp + row);
        } else {
          dot_w4a8_avx512<R>(w, row, xq, sx, xsum, yp + row);
        }
        continue;
      }
      if (isa >= kAvx2) {
        if (rows == R) {
          dot_w4a8_avx2<R, 1>(w, row, xq, w.k, sx, blocks, xsum, w.groups, yp + row, w.n);
        } else {
          for (int64_t r = row; r < row + rows; ++r)
            dot_w4a8_avx2<1, 1>(w, r, xq, w.k, sx, blocks, xsum, w.groups, yp + r, w.n);
        }
        continue;
      }
#endif
      for (int64_t t = 0; t < m; ++t)
        for (int64_t r = 0; r < rows; ++r)
          yp[t * w.n + row + r] = dot_w4a8_portable(w, row + r, xq + t * w.k, sx + t * blocks,
                                                    xsum + t * w.groups);
    }
  });
}

#if defined(__x86_64__)
// nib128 codes against M quantized tokens into y [M, N], one parallel region. One token
// (decode): rows 4 at a time, streamed from memory with prefetch. More: blocks of rows whose
// codes fit in ~16 KiB of L1, each met by the tokens 4 at a time, 4 rows per tile, so a
// block's codes and a quad's activations stay in L1 while the other is reused.
void rows_nib128_all(const Weights& w, const int8_t* xq, const float* sx, const float* xs, int64_t m, float* y,
                     bool vnni) {
  if (m == 1) {
    constexpr int64_t R = 4;
    const int64_t tasks = (w.n + R - 1) / R;
    at::parallel_for(0, tasks, std::max<int64_t>(1, grain_for(w.k) / R), [&](int64_t a, int64_t b) {
      for (int64_t task = a; task < b; ++task) {
        const int64_t row = task * R;
        if (row + R <= w.n) {
          rows_nib128<4, true>(w, row, xq, sx, xs, 0, 1, y, vnni);
        } else {
          for (int64_t r = row; r < w.n; ++r) rows_nib128<1, true>(w, r, xq, sx, xs, 0, 1, y, vnni);
        }
      }
    });
    return;
  }
  const int64_t rb = std::max<int64_t>(4, (int64_t{16384} / (w.k / 2)) / 4 * 4);
  const int64_t blocks = (w.n + rb - 1) / rb;
  at::parallel_for(0, blocks, 1, [&](int64_t a, int64_t b) {
    for (int64_t blk = a; blk < b; ++blk) {
      const int64_t r0 = blk * rb, r1 = std::min(w.n, r0 + rb);
      for (int64_t t = 0; t < m; t += 4) {
        const int64_t t1 = std::min(m, t + 4);
        auto block = [&](auto prefetch) {
          constexpr bool P = decltype(prefetch)::value;
          int64_t r = r0;
          for (; r + 4 <= r1; r += 4) rows_nib128<4, P>(w, r, xq, sx, xs, t, t1, y, vnni);
          for (; r < r1; ++r) rows_nib128<1, P>(w, r, xq, sx, xs, t, t1, y, vnni);
        };
        // the first quad streams the block from memory (prefetched), the others from L1
        if (t == 0) {
          block(std::true_type{});
        } else {
          block(std::false_type{});
        }
      }
    }
  });
}

// stripes16 codes against M quantized tokens into y [M, N], one parallel region over groups
// of stripes: 4 stripes (64 rows, each stripe a stream of its own) per token at M=1, 2 stripes
// (32 rows) past it, prefetched one group of stripes ahead. The tokens go 8 at a time over the
// same stripes; when that takes more than one pass, the stripes are walked in chunks of K
// whose codes fit ~16 KiB, every pass over a chunk before the next, so the codes of the later
// passes come from L1 even where a stripe is longer than L1 (K = 6656: 53 KB).
void rows_stripes16_all(const Weights& w, const int8_t* xq, const float* sx, const float* xs, int64_t m, float* y,
                        bool vnni) {
  const int64_t stripes = w.n / 16, stripe_bytes = 8 * w.k;
  const int64_t rv = m == 1 ? 4 : 2, passes = (m + 7) / 8;
  const int64_t chunk = passes == 1 ? w.groups : std::max<int64_t>(1, int64_t{16384} / (rv * 8 * w.group));
  const int64_t tasks = (stripes + rv - 1) / rv;
  at::parallel_for(0, tasks, 1, [&](int64_t a, int64_t b) {
    thread_local std::vector<float> f_buf;
    float* F = scratch(f_buf, rv * m * 16);
    for (int64_t task = a; task < b; ++task) {
      const int64_t s0 = task * rv, nv = std::min(rv, stripes - s0);
      std::fill(F, F + nv * m * 16, 0.f);
      for (int64_t g0 = 0; g0 < w.groups; g0 += chunk) {
        const int64_t g1 = std::min(w.groups, g0 + chunk);
        for (int64_t t = 0; t < m; t += 8) {
          const int64_t T = std::min<int64_t>(8, m - t);
          float* Ft = F + nv * t * 16;  // this pass's sums: [nv][T][16]
          const int8_t* xt = xq + t * w.k;
          const float *st = sx + t * w.groups, *gt = xs + t * w.groups;
          if (nv == 4) {
            (vnni ? tile_stripes16_vnni<4, 1> : tile_stripes16_bw<4, 1>)(w, s0, xt, st, gt, Ft, g0, g1,
                                                                       4 * stripe_bytes);
          } else if (nv == 2) {
            stripes16_tile<2>(T, vnni, w, s0, xt, st, gt, Ft, g0, g1, 2 * stripe_bytes);
          } else {
            for (int64_t v = 0; v < nv; ++v)
              stripes16_tile<1>(T, vnni, w, s0 + v, xt, st, gt, Ft + v * T * 16, g0, g1, stripe_bytes);
          }
        }
      }
      for (int64_t t = 0; t < m; t += 8) {  // [nv][T][16] per pass -> y [M, N]
        const int64_t T = std::min<int64_t>(8, m - t);
        const float* Ft = F + nv * t * 16;
        for (int64_t v = 0; v < nv; ++v)
          for (int64_t tt = 0; tt < T; ++tt)
            std::memcpy(y + (t + tt) * w.n + (s0 + v) * 16, Ft + (v * T + tt) * 16, 16 * sizeof(float));
      }
    }
  });
}
#endif

// W4A8 with nib128 codes (AVX-512 CPUs), every M: decode, batched decode and prefill all run
// the int8 loop (no dequantized tiles). Activations fp32, bf16 or fp16 [M, K]; out in their
// dtype.
torch::Tensor linear_nib128(const torch::Tensor& x_in, const Weights& w, int64_t isa) {
  check_isa(isa);
  TORCH_CHECK(isa >= kAvx512, "edge_w4: the nib128 and lanes1k layouts need the AVX-512 path");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == w.k, "edge_w4: activations [M, ", w.k, "] expected");
  const torch::Tensor x = x_in.scalar_type() == torch::kBFloat16 ? x_in.contiguous() : as_float(x_in);
  const int64_t m = x.size(0);
  // fp32 sums in per-thread scratch: an LM head's output (600 KB per token) freshly allocated
  // would be new pages, faulted in on every call
  thread_local std::vector<float> y_buf;
  float* yp = scratch(y_buf, m * w.n);
#if defined(__x86_64__)
  thread_local std::vector<int8_t> xq_buf;
  thread_local std::vector<float> sx_buf, xs_buf;
  int8_t* xq = scratch(xq_buf, m * w.k);
  float* sx = scratch(sx_buf, m * w.groups);
  float* xs = scratch(xs_buf, m * w.groups);
  auto quant = [&](int64_t a, int64_t b) {
    if (x.scalar_type() == torch::kBFloat16) {
      quantize_rows_avx512(reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()), a, b, w.k, w.group, xq, sx, xs);
    } else {
      quantize_rows_avx512(x.data_ptr<float>(), a, b, w.k, w.group, xq, sx, xs);
    }
    if (w.layout == kLanes1k) lanes1k_order(xq + a * w.k, b - a, w.k);
  };
  if (m * w.k >= (int64_t{1} << 16)) {
    at::parallel_for(0, m, 1, quant);
  } else {
    quant(0, m);
  }
  if (w.layout == kStripes16) {
    rows_stripes16_all(w, xq, sx, xs, m, yp, isa == kAvx512Vnni);
  } else {
    rows_nib128_all(w, xq, sx, xs, m, yp, isa == kAvx512Vnni);
  }
#endif
  static const bool bf16_ok = cpu_has("avx512bf16");
  if (x_in.scalar_type() == torch::kBFloat16 && m * w.n >= 4096 && bf16_ok) {
    auto out = torch::empty({m, w.n}, torch::kBFloat16);
    to_bf16(yp, m * w.n, out.data_ptr<c10::BFloat16>());
    return out;
  }
  // the returned tensor must own its memory (the scratch is reused by the next call): finish
  // copies into a new one for bf16/fp16, fp32 needs the clone
  const torch::Tensor y = torch::from_blob(yp, {m, w.n}, torch::kFloat);
  return x_in.scalar_type() == torch::kFloat ? y.clone() : finish(y, x_in.scalar_type());
}

// What every GEMV checks first: the instruction-set path, the packed weights, and fp32 [M, K]
// activations of the right K.
std::pair<Weights, torch::Tensor> gemv_inputs(const torch::Tensor& x_in, const torch::Tensor& q,
                                              const torch::Tensor& s,
                                              const c10::optional<torch::Tensor>& z, int64_t group,
                                              int64_t layout, int64_t isa) {
  check_isa(isa);
  const Weights w = weights(q, s, z, group, layout);
  torch::Tensor x = as_float(x_in);
  TORCH_CHECK(x.size(1) == w.k, "edge_w4: activations [M, ", w.k, "] expected, got K=", x.size(1));
  return {w, x};
}

torch::Tensor gemv(const torch::Tensor& x_in, const torch::Tensor& q, const torch::Tensor& s,
                   const c10::optional<torch::Tensor>& z, int64_t group, int64_t layout, int64_t isa) {
  if (layout == kWords128) {  // bf16 activations straight into vdpbf16ps
    check_words128(isa);
    const Weights w = weights(q, s, z, group, layout);
    TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == w.k, "edge_w4: activations [M, ", w.k, "] expected");
    const torch::Tensor x = x_in.to(torch::kBFloat16).contiguous();
    const int64_t m = x.size(0);
#if defined(__x86_64__)
    if (x_in.scalar_type() == torch::kBFloat16) {  // fp32 sums in scratch, rounded once to bf16
      thread_local std::vector<float> y_buf;
      float* yp = scratch(y_buf, m * w.n);
      rows_w4a16_bf16(w, x.data_ptr<c10::BFloat16>(), m, yp);
      auto out = torch::empty({m, w.n}, torch::kBFloat16);
      to_bf16(yp, m * w.n, out.data_ptr<c10::BFloat16>());
      return out;
    }
#endif
    auto y = torch::empty({m, w.n}, torch::kFloat);
#if defined(__x86_64__)
    rows_w4a16_bf16(w, x.data_ptr<c10::BFloat16>(), m, y.data_ptr<float>());
#endif
    return finish(y, x_in.scalar_type());
  }
  if (layout >= kNib128) return linear_nib128(x_in, weights(q, s, z, group, layout), isa);
  const auto [w, x] = gemv_inputs(x_in, q, s, z, group, layout, isa);
  auto y = torch::empty({x.size(0), w.n}, torch::kFloat);
  (layout == kLanes64 ? rows_w4a16 : rows_w4a8)(w, x.data_ptr<float>(), x.size(0), y.data_ptr<float>(), isa);
  return finish(y, x_in.scalar_type());
}

torch::Tensor gemv_w4a16(const torch::Tensor& x_in, const torch::Tensor& q, const torch::Tensor& s,
                         const c10::optional<torch::Tensor>& z, int64_t group, int64_t isa) {
  return gemv(x_in, q, s, z, group, kLanes64, isa);
}

torch::Tensor gemv_w4a8(const torch::Tensor& x_in, const torch::Tensor& q, const torch::Tensor& s,
                        const c10::optional<torch::Tensor>& z, int64_t group, int64_t isa) {
  return gemv(x_in, q, s, z, group, kBlocks32, isa);
}

// Rows [r0, r1) dequantized to fp32 into out [r1 - r0, K].
void dequant_into(const Weights& w, int64_t r0, int64_t r1, float* out, int64_t isa) {
  at::parallel_for(r0, r1, std::max<int64_t>(1, grain_for(w.k) / 4), [&](int64_t a, int64_t b) {
#if defined(__x86_64__)
    if (isa >= kAvx2 && w.layout < kNib128) return dequant_rows_avx2(w, a, b, out + (a - r0) * w.k);
#endif
    dequant_rows_portable(w, a, b, out + (a - r0) * w.k);
  });
}

torch::Tensor dequantize(const torch::Tensor& q, const torch::Tensor& s, const c10::optional<torch::Tensor>& z,
                         int64_t group, int64_t layout, int64_t isa) {
  check_isa(isa);
  const Weights w = weights(q, s, z, group, layout);
  auto out = torch::empty({w.n, w.k}, torch::kFloat);
  dequant_into(w, 0, w.n, out.data_ptr<float>(), isa);
  return out;
}

// Prefill: x [M, K] against the codes, a tile of `tile` rows at a time dequantized by
// fill(r0, r1, buf) into a buffer of x's dtype and multiplied by torch's GEMM in that dtype.
// The tile bounds the scratch memory (an LM head of 151936 rows would otherwise need its whole
// dequantized copy). Out in x's dtype.
template <typename Fill>
torch::Tensor gemm_tiles(const torch::Tensor& x, const Weights& w, int64_t tile, Fill fill) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.k, "edge_w4: activations [M, ", w.k, "] expected");
  TORCH_CHECK(tile > 0, "edge_w4: tile must be positive");
  const int64_t nt = std::min(tile, w.n);
  auto buf = torch::empty({nt, w.k}, x.scalar_type());
  auto y = torch::empty({x.size(0), w.n}, x.scalar_type());
  for (int64_t r0 = 0; r0 < w.n; r0 += nt) {
    const int64_t r1 = std::min(w.n, r0 + nt);
    fill(r0, r1, buf);
    if (r1 - r0 == w.n) {
      at::mm_out(y, x, buf.t());
    } else {
      y.narrow(1, r0, r1 - r0).copy_(at::mm(x, buf.narrow(0, 0, r1 - r0).t()));
    }
  }
  return y;
}

// fp32 x, fp32 tiles and torch's fp32 GEMM; out in `dtype`.
torch::Tensor gemm_dq_float(const torch::Tensor& x, const Weights& w, int64_t isa, int64_t tile,
                            c10::ScalarType dtype) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat, "edge_w4: fp32 activations expected");
  return finish(gemm_tiles(x, w, tile, [&](int64_t r0, int64_t r1, torch::Tensor& buf) {
                  dequant_into(w, r0, r1, buf.data_ptr<float>(), isa);
                }),
                dtype);
}

// Prefill with bf16 activations (words128 codes, AVX512-BF16 CPUs): tiles dequantized to bf16
// and torch's bf16 GEMM (oneDNN's `vdpbf16ps` kernels, several times the fp32 GEMM's rate on
// such CPUs). Out in bf16, as F.linear in bf16 would give.
torch::Tensor gemm_dq_bf16(const torch::Tensor& x, const Weights& w, int64_t tile) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "edge_w4: bf16 activations expected");
  return gemm_tiles(x, w, tile, [&](int64_t r0, int64_t r1, torch::Tensor& buf) {
    auto* bp = buf.data_ptr<c10::BFloat16>();
    at::parallel_for(r0, r1, std::max<int64_t>(1, grain_for(w.k) / 4), [&](int64_t a, int64_t b) {
#if defined(__x86_64__)
      dequant_rows_bf16(w, a, b, bp + (a - r0) * w.k);
#endif
    });
  });
}

torch::Tensor gemm_dq(const torch::Tensor& x_in, const torch::Tensor& q, const torch::Tensor& s,
                      const c10::optional<torch::Tensor>& z, int64_t group, int64_t layout, int64_t isa,
                      int64_t tile) {
  check_isa(isa);
  const Weights w = weights(q, s, z, group, layout);
  return gemm_dq_float(as_float(x_in), w, isa, tile, x_in.scalar_type());
}

// x rounded to w4a8's int8 grid (xq * sx per block of 32), in fp32: what the prefill GEMM of
// the w4a8 scheme multiplies, so that prefill and decode see the same activations.
torch::Tensor round_act(const torch::Tensor& x, int64_t group) {
  const int64_t m = x.size(0), k = x.size(1), blocks = k / kBlock;
  std::vector<int8_t> xq(m * k);
  std::vector<float> sx(m * blocks), xsum(m * (k / group));
  quantize_act_into(x.data_ptr<float>(), m, k, group, xq.data(), sx.data(), xsum.data());
  auto out = torch::empty({m, k}, torch::kFloat);
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < m * k; ++i) o[i] = static_cast<float>(xq[i]) * sx[i / kBlock];
  return out;
}

// The one entry the engine calls (op edge_w4::linear): activations [M, K] (fp32, bf16 or
// fp16) -> [M, N] in their dtype. Up to small_m_max rows (decode, batched decode): one pass
// over the codes for all rows. More (prefill): the fp32 tile GEMM, after rounding the
// activations to the int8 grid for w4a8 (blocks32).
torch::Tensor linear(const torch::Tensor& x_in, const torch::Tensor& q, const torch::Tensor& s,
                     const c10::optional<torch::Tensor>& z, int64_t group, int64_t layout, int64_t isa,
                     int64_t small_m_max, int64_t tile) {
  TORCH_CHECK(x_in.dim() == 2, "edge_w4: activations must be 2-D [M, K]");
  if (layout >= kNib128) return linear_nib128(x_in, weights(q, s, z, group, layout), isa);
  if (x_in.size(0) <= small_m_max) return gemv(x_in, q, s, z, group, layout, isa);
  if (layout == kWords128 && x_in.scalar_type() == torch::kBFloat16) {
    check_words128(isa);
    return gemm_dq_bf16(x_in.contiguous(), weights(q, s, z, group, layout), tile);
  }
  const auto [w, x] = gemv_inputs(x_in, q, s, z, group, layout, isa);
  return gemm_dq_float(layout == kBlocks32 ? round_act(x, group) : x, w, isa, tile, x_in.scalar_type());
}

// `calls` calls of the op above back to back from C++, call i on weight copy (first + i) %
// copies: the kernel's time per call as the fused decoder-layer ops meet it (no Python or
// dispatcher between calls), for the GEMM microbenchmark. Returns the wall seconds.
double time_linear(const torch::Tensor& x, const std::vector<torch::Tensor>& q, const std::vector<torch::Tensor>& s,
                   const std::vector<c10::optional<torch::Tensor>>& z, int64_t group, int64_t layout, int64_t isa,
                   int64_t small_m_max, int64_t tile, int64_t first, int64_t calls) {
  const auto copies = static_cast<int64_t>(q.size());
  TORCH_CHECK(copies > 0 && s.size() == q.size() && z.size() == q.size(),
              "edge_w4: time_linear needs as many scales and zero points as codes, at least one");
  TORCH_CHECK(calls >= 0 && first >= 0, "edge_w4: time_linear needs first >= 0 and calls >= 0");
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < calls; ++i) {
    const auto c = static_cast<size_t>((first + i) % copies);
    linear(x, q[c], s[c], z[c], group, layout, isa, small_m_max, tile);
  }
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(t1 - t0).count();
}

// The cost of entering one parallel region (what every kernel call pays once), for the
// threading analysis: `reps` empty regions over `threads` threads, total seconds.
double parallel_region_cost(int64_t reps) {
  std::atomic<int64_t> sink{0};
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < reps; ++r) {
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t a, int64_t b) { sink += b - a; });
  }
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(t1 - t0).count();
}

// The arithmetic ceiling beside the streaming one: how many multiply-accumulates per second
// one instruction can issue on this CPU, to hold a compute-bound kernel (batched decode,
// prefill) against. Each thread runs `iters` rounds of 12 independent chains of one
// instruction on registers (no memory traffic), all threads in one parallel region; returns
// the wall seconds. kind: 0 `vpdpbusd` zmm (64 u8 x s8 MACs), 1 `vdpbf16ps` zmm (32 bf16
// MACs), 2 `vfmadd231ps` ymm (8 fp32 MACs), 3 `vpmaddubsw` + `vpmaddwd` ymm (AVX2's int8 dot:
// 32 MACs per pair).
#define EDGE_PEAK_LOOP(TYPE, INIT, STEP)                             \
  TYPE a[12];                                                        \
  for (int i = 0; i < 12; ++i) a[i] = INIT;                          \
  for (int64_t n = 0; n < iters; ++n) {                              \
    for (int i = 0; i < 12; ++i) a[i] = STEP;                        \
    asm volatile("" : "+v"(w), "+v"(x)); /* not hoisted or folded */ \
  }                                                                  \
  for (int i = 1; i < 12; ++i) a[0] = a[0] + a[i];                   \
  return a[0][0] != 0;

__attribute__((target(EDGE_AVX512_VNNI))) bool peak_vnni(int64_t iters) {
  __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
  EDGE_PEAK_LOOP(__m512i, _mm512_set1_epi32(i), _mm512_dpbusd_epi32(a[i], w, x))
}
__attribute__((target(EDGE_AVX512_BF16))) bool peak_bf16(int64_t iters) {
  __m512bh w = (__m512bh)_mm512_set1_epi16(0x3F80), x = (__m512bh)_mm512_set1_epi16(0x3F80);
  EDGE_PEAK_LOOP(__m512, _mm512_set1_ps(static_cast<float>(i)), _mm512_dpbf16_ps(a[i], w, x))
}
__attribute__((target("avx2,fma"))) bool peak_fma(int64_t iters) {
  __m256 w = _mm256_set1_ps(1.f), x = _mm256_set1_ps(0.f);
  EDGE_PEAK_LOOP(__m256, _mm256_set1_ps(static_cast<float>(i)), _mm256_fmadd_ps(a[i], w, x))
}
__attribute__((target("avx2,fma"))) bool peak_avx2_int8(int64_t iters) {
  __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(5);
  const __m256i ones = _mm256_set1_epi16(1);
  EDGE_PEAK_LOOP(__m256i, _mm256_set1_epi32(i),
                 _mm256_add_epi32(a[i], _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones)))
}
#undef EDGE_PEAK_LOOP

double dot_peak(int64_t kind, int64_t iters) {
  TORCH_CHECK(iters > 0, "edge_w4: dot_peak needs iters > 0");
  bool (*fn)(int64_t) = nullptr;
  if (kind == 0) {
    TORCH_CHECK(cpu_has("avx512f") && cpu_has("avx512bw") && cpu_has("avx512vl") && cpu_has("avx512vnni"),
                "edge_w4: dot_peak kind 0 (vpdpbusd) needs AVX512-VNNI, which this CPU lacks");
    fn = &peak_vnni;
  } else if (kind == 1) {
    TORCH_CHECK(cpu_has("avx512f") && cpu_has("avx512bw") && cpu_has("avx512vl") && cpu_has("avx512bf16"),
                "edge_w4: dot_peak kind 1 (vdpbf16ps) needs AVX512-BF16, which this CPU lacks");
    fn = &peak_bf16;
  } else if (kind == 2 || kind == 3) {
    TORCH_CHECK(cpu_has("avx2") && cpu_has("fma"), "edge_w4: dot_peak kinds 2-3 need AVX2/FMA, which this CPU lacks");
    fn = kind == 2 ? &peak_fma : &peak_avx2_int8;
  } else {
    TORCH_CHECK(false, "edge_w4: dot_peak kind must be 0-3, got ", kind);
  }
  std::atomic<int64_t> sink{0};
  const int64_t threads = at::get_num_threads();
  const auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) sink += fn(iters);
  });
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(t1 - t0).count();
}

void set_prefetch(int64_t bytes) {
  TORCH_CHECK(bytes >= 0 && bytes <= (int64_t{1} << 20), "edge_w4: prefetch distance out of range");
  g_prefetch = bytes;
}

}  // namespace

// For the fused decoder-layer ops (csrc/edge_layer.cpp), which run the same GEMVs.
torch::Tensor edge_w4_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s,
                             const c10::optional<torch::Tensor>& z, int64_t group, int64_t layout,
                             int64_t isa, int64_t small_m_max, int64_t tile) {
  return linear(x, q, s, z, group, layout, isa, small_m_max, tile);
}

TORCH_LIBRARY(edge_w4, m) {
  m.def("linear(Tensor x, Tensor q, Tensor s, Tensor? z, int group, int layout, int isa, "
        "int small_m_max, int tile) -> Tensor");
}

TORCH_LIBRARY_IMPL(edge_w4, CPU, m) { m.impl("linear", &linear); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cpu_has", &cpu_has, "whether the CPU has an instruction-set feature (x86 names)");
  m.def("gemv_w4a16", &gemv_w4a16, "[M,K] activations x lanes64 codes -> [M,N] (decode)");
  m.def("gemv_w4a8", &gemv_w4a8, "int8-quantized [M,K] x blocks32 codes -> [M,N] (decode)");
  m.def("gemm_dq", &gemm_dq, "prefill: dequantize tiles to fp32, torch fp32 GEMM");
  m.def("dequantize", &dequantize, "codes -> fp32 [N,K]");
  m.def("quantize_act", &quantize_act, "fp32 [M,K] -> int8 codes, block scales, group sums");
  m.def("set_prefetch", &set_prefetch, "software prefetch distance of the GEMV loops, bytes (0: off)");
  m.def("time_linear", &time_linear, "seconds for `calls` back-to-back linear calls over weight copies");
  m.def("parallel_region_cost", &parallel_region_cost, "seconds for `reps` empty parallel regions");
  m.def("dot_peak", &dot_peak, "seconds for `iters` rounds of 12 chains of one dot instruction per thread");
}
