// splitstack's native CPU kernels as torch operators (namespace splitstack_cpu), so that a
// compiled decode step (services/engine/compiled_decode.py) calls them straight from
// inductor's wrapper: a dispatcher call into C++ instead of a Python custom op, whose body
// (checks, allocations, ctypes) cost more than the int8 product it wrapped at batch 1.
//
// The kernels themselves stay in their C files (kernels/linear/cpu_int8.c,
// kernels/attention/cpu_paged.c), loaded by ctypes; `bind` hands this library their
// addresses; bf16 products call oneDNN's packed product through the dispatcher. What a
// step needs besides its tensors (the weight table, the block tables)
// is set per thread before the graph runs (`set_step`), as the Python ops read `_STEP`.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

using Int8Fn = int (*)(const void*, int, int64_t, int, int, const uint8_t*, const float*, int,
                       int, void*, int, int, int8_t*, float*, float*);
using PagedFn = int (*)(const float*, const void*, const void*, int, const int64_t*, int64_t,
                        const int64_t*, int, int, int, int, int, int64_t, int64_t, int64_t, float,
                        int, int, int, float*, float*, float*, float*);

Int8Fn int8_fn = nullptr;
PagedFn paged_fn = nullptr;

struct Entry {
  at::Tensor data;    // int8 copy: uint8 [blocks, ceil(K/4), 4, 16, 4] (cpu_int8.Packed.data)
  at::Tensor scales;  // and its fp32 [blocks * 64]
  at::Tensor packed;  // bf16 weight in oneDNN's blocked layout (models.layers._packed_bf16)
  std::optional<at::Tensor> bias;   // of the bf16 product
  int64_t in_features;
  int64_t out_features;
};

// Registered weight tables, by id (one per compiled engine); released with the engine.
std::mutex tables_mutex;
std::unordered_map<int64_t, std::shared_ptr<std::vector<Entry>>> tables;
int64_t next_table = 1;

struct Step {
  std::shared_ptr<std::vector<Entry>> weights;
  at::Tensor block_tables, lens, part_acc, part_ml;   // cpu_paged.Prepared
  int64_t rows = 0, chunk = 0, chunks = 0, threads = 1;
  std::vector<uint8_t> scratch;                       // the int8 product's activations
};
thread_local Step step;

void bind(int64_t int8_addr, int64_t paged_addr) {
  int8_fn = reinterpret_cast<Int8Fn>(static_cast<intptr_t>(int8_addr));
  paged_fn = reinterpret_cast<PagedFn>(static_cast<intptr_t>(paged_addr));
}

// One entry per weight key: its native int8 copy (data, scales), its oneDNN-packed bf16 copy
// (packed, bias), either, or neither (empty tensors).
int64_t weight_table(at::TensorList data, at::TensorList scales, at::TensorList packed,
                     const c10::List<std::optional<at::Tensor>>& bias,
                     c10::IntArrayRef in_features, c10::IntArrayRef out_features) {
  const size_t n = data.size();
  TORCH_CHECK(scales.size() == n && packed.size() == n && bias.size() == n &&
                  in_features.size() == n && out_features.size() == n,
              "weight_table: the lists differ in length");
  auto entries = std::make_shared<std::vector<Entry>>();
  for (size_t i = 0; i < n; i++) {
    Entry e{at::Tensor(), at::Tensor(), at::Tensor(), std::nullopt, in_features[i],
            out_features[i]};
    if (data[i].defined() && data[i].numel() > 0) {
      TORCH_CHECK(data[i].scalar_type() == at::kByte && data[i].is_contiguous() &&
                      scales[i].scalar_type() == at::kFloat && scales[i].is_contiguous(),
                  "weight_table: entry ", i, " is not a packed int8 weight");
      e.data = data[i];
      e.scales = scales[i];
    }
    if (packed[i].defined() && packed[i].numel() > 0) {
      e.packed = packed[i];
      e.bias = bias.get(i);
    }
    entries->push_back(std::move(e));
  }
  std::lock_guard<std::mutex> lock(tables_mutex);
  int64_t id = next_table++;
  tables[id] = std::move(entries);
  return id;
}

void release_table(int64_t id) {
  std::lock_guard<std::mutex> lock(tables_mutex);
  tables.erase(id);
}

void set_step(int64_t table, const at::Tensor& block_tables, const at::Tensor& lens,
              const at::Tensor& part_acc, const at::Tensor& part_ml, int64_t rows,
              int64_t chunk, int64_t chunks, int64_t threads) {
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                  block_tables.stride(1) == 1 && lens.scalar_type() == at::kLong &&
                  lens.is_contiguous() && part_acc.is_contiguous() && part_ml.is_contiguous(),
              "set_step: tables and lengths must be int64 (cpu_paged.prepare)");
  if (table > 0) {
    std::lock_guard<std::mutex> lock(tables_mutex);
    auto found = tables.find(table);
    TORCH_CHECK(found != tables.end(), "set_step: no weight table ", table);
    step.weights = found->second;
  } else {
    step.weights.reset();
  }
  step.block_tables = block_tables;
  step.lens = lens;
  step.part_acc = part_acc;
  step.part_ml = part_ml;
  step.rows = rows;
  step.chunk = chunk;
  step.chunks = chunks;
  step.threads = threads > 0 ? threads : 1;
}

void clear_step() {
  step.weights.reset();
  step.block_tables = step.lens = step.part_acc = step.part_ml = at::Tensor();
}

const Entry& entry(int64_t key, const char* op) {
  TORCH_CHECK(step.weights && key >= 0 && key < static_cast<int64_t>(step.weights->size()),
              op, ": no weight ", key, " in this step");
  return (*step.weights)[key];
}

// x [M, K] (bf16 or fp32, contiguous K) @ the table's weight `key`ᵀ -> [M, out_features]
at::Tensor int8_linear(const at::Tensor& x_in, int64_t key, int64_t out_features) {
  TORCH_CHECK(int8_fn != nullptr, "int8_linear: the native int8 kernel is not bound");
  const Entry& w = entry(key, "int8_linear");
  TORCH_CHECK(w.data.defined(), "int8_linear: weight ", key, " has no native int8 copy");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == w.in_features &&
                  out_features == w.out_features &&
                  (x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat),
              "int8_linear: x does not fit weight ", key);
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t m = x.size(0), k = w.in_features;
  at::Tensor y = at::empty({m, out_features}, x.options());
  if (m == 0) return y;
  const int64_t group = 32, k4 = (k + 3) / 4, ng = (k + group - 1) / group;
  const int64_t xq_bytes = (m * k4 * 4 + 63) / 64 * 64;
  const size_t need = static_cast<size_t>(xq_bytes + 4 * (m * ng + m) + 64);
  if (step.scratch.size() < need) step.scratch.resize(need);
  uint8_t* base = step.scratch.data();
  base += (64 - reinterpret_cast<uintptr_t>(base) % 64) % 64;
  const int bf16 = x.scalar_type() == at::kBFloat16;
  int rc = int8_fn(x.data_ptr(), bf16, x.stride(0), static_cast<int>(m), static_cast<int>(k),
                   w.data.data_ptr<uint8_t>(), w.scales.data_ptr<float>(),
                   static_cast<int>(out_features), static_cast<int>(group), y.data_ptr(), bf16,
                   static_cast<int>(step.threads), reinterpret_cast<int8_t*>(base),
                   reinterpret_cast<float*>(base + xq_bytes),
                   reinterpret_cast<float*>(base + xq_bytes + 4 * m * ng));
  TORCH_CHECK(rc == 0, "int8_linear refused rows=", m, " k=", k);
  return y;
}

// x [M, K] bf16 @ the table's bf16 weight `key`ᵀ (+ its bias), on oneDNN's packed copy:
// what `models.layers.project` runs for a bf16 weight
at::Tensor bf16_linear(const at::Tensor& x, int64_t key, int64_t out_features) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&, c10::string_view,
                                         c10::List<std::optional<at::Scalar>>,
                                         std::optional<c10::string_view>)>();
  const Entry& w = entry(key, "bf16_linear");
  TORCH_CHECK(w.packed.defined(), "bf16_linear: weight ", key, " has no packed bf16 copy");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.in_features && out_features == w.out_features &&
                  x.scalar_type() == at::kBFloat16,
              "bf16_linear: x does not fit weight ", key);
  return op.call(x.is_contiguous() ? x : x.contiguous(), w.packed, w.bias, "none",
                 c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

template <typename To, typename From>
void copy_row(To* dst, const From* src, int64_t n) {
  if constexpr (std::is_same_v<To, From>) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(To));
  } else {
    for (int64_t i = 0; i < n; i++) dst[i] = static_cast<To>(static_cast<float>(src[i]));
  }
}

template <typename To, typename From>
void write_rows(at::Tensor& cache, const at::Tensor& src, const int64_t* slots, int64_t rows) {
  // cache [blocks, block_size, KV, D] (a view of one layer), src [B, KV, D]
  const int64_t bs = cache.size(1), kvh = cache.size(2), d = cache.size(3);
  To* base = static_cast<To*>(cache.data_ptr());
  const From* from = static_cast<const From*>(src.data_ptr());
  for (int64_t r = 0; r < rows; r++) {
    const int64_t s = slots[r], b = s / bs, o = s % bs;
    TORCH_CHECK(s >= 0 && b < cache.size(0), "paged_decode: slot ", s, " is outside the cache");
    for (int64_t h = 0; h < kvh; h++)
      copy_row(base + b * cache.stride(0) + o * cache.stride(1) + h * cache.stride(2),
               from + r * src.stride(0) + h * src.stride(1), d);
  }
}

void write_cache(at::Tensor cache, const at::Tensor& src, const int64_t* slots, int64_t rows) {
  TORCH_CHECK(src.dim() == 3 && src.size(1) == cache.size(2) && src.size(2) == cache.size(3) &&
                  src.stride(2) == 1,
              "paged_decode: k/v [B, KV, D] do not fit the cache");
  const auto to = cache.scalar_type(), from = src.scalar_type();
  if (to == at::kBFloat16 && from == at::kBFloat16)
    write_rows<c10::BFloat16, c10::BFloat16>(cache, src, slots, rows);
  else if (to == at::kBFloat16 && from == at::kFloat)
    write_rows<c10::BFloat16, float>(cache, src, slots, rows);
  else if (to == at::kFloat && from == at::kFloat)
    write_rows<float, float>(cache, src, slots, rows);
  else if (to == at::kFloat && from == at::kBFloat16)
    write_rows<float, c10::BFloat16>(cache, src, slots, rows);
  else
    TORCH_CHECK(false, "paged_decode: cache ", to, " from ", from, " is not supported");
}

// Write the step's k, v [B, KV, D] (its first `rows` rows) into layer `layer` of
// kv [2, layers, blocks, block_size, KV, D] at flat `slots`, then attend q [B, H, D] fp32
// over each row's keys (the step's tables). Returns O [B, H, D] fp32 (q in fp32 and
// contiguous saves a conversion).
at::Tensor paged_decode(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                        at::Tensor& kv, int64_t layer, const at::Tensor& slots, double scale) {
  TORCH_CHECK(paged_fn != nullptr, "paged_decode: the native paged kernel is not bound");
  TORCH_CHECK(step.block_tables.defined(), "paged_decode: no step is set");
  TORCH_CHECK(q_in.dim() == 3, "paged_decode: q must be [B, H, D]");
  const at::Tensor q = q_in.scalar_type() == at::kFloat && q_in.is_contiguous()
                           ? q_in : q_in.to(at::kFloat).contiguous();
  TORCH_CHECK(kv.dim() == 6 && kv.size(0) == 2 && layer >= 0 && layer < kv.size(1) &&
                  kv.stride(5) == 1 &&
                  (kv.scalar_type() == at::kBFloat16 || kv.scalar_type() == at::kFloat),
              "paged_decode: kv must be [2, layers, blocks, block_size, KV, D], fp32 or bf16");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.numel() >= step.rows,
              "paged_decode: slots must be int64, one per row");
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2);
  TORCH_CHECK(step.lens.numel() == b && step.block_tables.size(0) == b,
              "paged_decode: the step's tables are for ", step.lens.numel(), " rows, q has ", b);
  at::Tensor k_cache = kv.select(0, 0).select(0, layer);
  at::Tensor v_cache = kv.select(0, 1).select(0, layer);
  TORCH_CHECK(k_cache.size(3) == d, "paged_decode: q's head dim differs from the cache's");
  const int64_t* slot = slots.data_ptr<int64_t>();
  write_cache(k_cache, k, slot, step.rows);
  write_cache(v_cache, v, slot, step.rows);
  at::Tensor o = at::empty({b, h, d}, q.options());
  at::Tensor lse = at::empty({b, h}, q.options());
  const int64_t kvh = k_cache.size(2);
  TORCH_CHECK(step.part_acc.numel() >= b * step.chunks * h * d &&
                  step.part_ml.numel() >= b * step.chunks * h * 2,
              "paged_decode: the step's scratch is too small");
  int rc = paged_fn(q.data_ptr<float>(), k_cache.data_ptr(), v_cache.data_ptr(),
                    kv.scalar_type() == at::kBFloat16, step.block_tables.data_ptr<int64_t>(),
                    step.block_tables.stride(0), step.lens.data_ptr<int64_t>(),
                    static_cast<int>(b), static_cast<int>(h), static_cast<int>(kvh),
                    static_cast<int>(d), static_cast<int>(k_cache.size(1)), k_cache.stride(0),
                    k_cache.stride(1), k_cache.stride(2), static_cast<float>(scale),
                    static_cast<int>(step.chunk), static_cast<int>(step.chunks),
                    static_cast<int>(step.threads), step.part_acc.data_ptr<float>(),
                    step.part_ml.data_ptr<float>(), o.data_ptr<float>(), lse.data_ptr<float>());
  TORCH_CHECK(rc == 0, "paged_decode refused shapes h=", h, " kv=", kvh, " d=", d);
  return o;
}

}  // namespace

TORCH_LIBRARY(splitstack_cpu, m) {
  m.def("bind(int int8_fn, int paged_fn) -> ()", &bind);
  m.def("weight_table(Tensor[] data, Tensor[] scales, Tensor[] packed, Tensor?[] bias, "
        "int[] in_features, int[] out_features) -> int", &weight_table);
  m.def("release_table(int table) -> ()", &release_table);
  m.def("set_step(int table, Tensor block_tables, Tensor lens, Tensor part_acc, "
        "Tensor part_ml, int rows, int chunk, int chunks, int threads) -> ()", &set_step);
  m.def("clear_step() -> ()", &clear_step);
  m.def("int8_linear(Tensor x, int key, int out_features) -> Tensor");
  m.impl("int8_linear", c10::DispatchKey::CPU, TORCH_FN(int8_linear));
  m.def("bf16_linear(Tensor x, int key, int out_features) -> Tensor");
  m.impl("bf16_linear", c10::DispatchKey::CPU, TORCH_FN(bf16_linear));
  m.def("paged_decode(Tensor q, Tensor k, Tensor v, Tensor(a!) kv, int layer, Tensor slots, "
        "float scale) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
}
