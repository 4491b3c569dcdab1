// Runs the vectorized row kernels alone, without TensorFlow, so that their instructions can be
// counted (load on a shared machine does not move them) and their time taken beside the memory
// floor's passes. It runs what CustomLoss() runs in training: the forward op writing the loss,
// the row statistics and the scaled gradient (row scales 1 / N), int32 labels, float32 logits
// (or float16 / bfloat16), standard normal logits; with a margin, the labelled logit of each
// row is raised by it, as in a trained model's confident rows (p_y near 1).
//
//   g++ -O3 -std=c++17 -fno-strict-aliasing -ffp-contract=off -pthread -I. \
//     -I"$(python -c 'import tensorflow as tf, os; print(os.path.dirname(tf.__file__))')/include" \
//     tests/cpu_math/rows_driver.cc csrc/cpu/simd/rows_*.cc csrc/cpu/thread_pool.cc \
//     csrc/cpu/memory_floor.cc -o rows_driver
//   valgrind --tool=callgrind ./rows_driver 65536 10 3 1   # N C repeats threads
//                                                           #   [eps gamma dtype margin]
//   callgrind_annotate --inclusive=yes callgrind.out.* | grep 'ComputeRows<\|ComputeSplitRows<'
//
// It prints the median milliseconds of the kernel and of the floor's two passes.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "csrc/cpu/float_types.h"
#include "csrc/cpu/memory_floor.h"
#include "csrc/cpu/parallel_for.h"
#include "csrc/cpu/simd/rows_dispatch.h"

namespace tf_metal_ops {
// The library keeps the thread cap in csrc/runtime.cc, which this driver does not link.
namespace {
std::atomic<int> thread_limit{1};
}
int CpuThreadLimit() { return thread_limit.load(); }
void SetCpuThreadLimit(int threads) { thread_limit.store(threads > 0 ? threads : 1); }
}  // namespace tf_metal_ops

namespace {
using namespace tf_metal_ops;

void RunTasks(int64_t count, int64_t cost, void (*task)(void*, int64_t), void* context) {
  ParallelFor(count, cost, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) task(context, i);
  });
}

// The logits in the storage type under test, and a gradient buffer of that type.
struct TypedRows {
  StorageType type = StorageType::kFloat;
  std::vector<float> floats;
  std::vector<Half> halves;
  std::vector<BFloat16> bfloats;
  void* data() {
    switch (type) {
      case StorageType::kHalf: return halves.data();
      case StorageType::kBFloat16: return bfloats.data();
      case StorageType::kFloat: break;
    }
    return floats.data();
  }
  // The bytes of one element.
  size_t itemsize() const { return type == StorageType::kFloat ? 4 : 2; }
};

TypedRows MakeRows(StorageType type, const std::vector<float>& values) {
  TypedRows rows;
  rows.type = type;
  if (type == StorageType::kFloat) {
    rows.floats = values;
  } else if (type == StorageType::kHalf) {
    rows.halves.resize(values.size());
    for (size_t i = 0; i < values.size(); ++i) Store(values[i], &rows.halves[i]);
  } else {
    rows.bfloats.resize(values.size());
    for (size_t i = 0; i < values.size(); ++i) Store(values[i], &rows.bfloats[i]);
  }
  return rows;
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr,
                 "usage: %s N C repeats threads [label_smoothing gamma "
                 "[float32|float16|bfloat16 [margin]]]\n",
                 argv[0]);
    return 2;
  }
  const int64_t rows = std::atoll(argv[1]);
  const int64_t classes = std::atoll(argv[2]);
  const int repeats = std::atoi(argv[3]);
  SetCpuThreadLimit(std::atoi(argv[4]));
  const float eps = argc > 5 ? static_cast<float>(std::atof(argv[5])) : 0.0f;
  const float gamma = argc > 6 ? static_cast<float>(std::atof(argv[6])) : 0.0f;
  const std::string dtype = argc > 7 ? argv[7] : "float32";
  const float margin = argc > 8 ? static_cast<float>(std::atof(argv[8])) : 0.0f;
  if (rows < 1 || classes < 1 || repeats < 1) {
    std::fprintf(stderr, "N, C and repeats must be >= 1\n");
    return 2;
  }
  StorageType type = StorageType::kFloat;
  if (dtype == "float16") {
    type = StorageType::kHalf;
  } else if (dtype == "bfloat16") {
    type = StorageType::kBFloat16;
  } else if (dtype != "float32") {
    std::fprintf(stderr, "dtype must be float32, float16 or bfloat16; got %s\n", dtype.c_str());
    return 2;
  }
  std::vector<float> values(rows * classes), stats(rows * 3), floor_out(rows * classes),
      scales(rows, 1.0f / static_cast<float>(rows));
  std::vector<int32_t> labels(rows);
  std::mt19937 random(0);
  std::normal_distribution<float> normal;
  for (float& z : values) z = normal(random);
  for (int32_t& y : labels) y = static_cast<int32_t>(random() % classes);
  for (int64_t row = 0; row < rows; ++row) values[row * classes + labels[row]] += margin;
  TypedRows logits = MakeRows(type, values);
  TypedRows gradient = MakeRows(type, values);
  TypedRows loss = MakeRows(type, std::vector<float>(rows));
  // The floor moves the type's bytes: a row of float32 holds itemsize / 4 of the type's rows.
  const int64_t floor_columns = (classes * static_cast<int64_t>(logits.itemsize()) + 3) / 4;

  RowsArgs args;
  args.type = type;
  args.num_classes = classes;
  args.gamma = gamma;
  args.smoothing_share = eps / static_cast<float>(classes);
  args.target_share = 1.0f - eps;
  args.sum_class_weights = static_cast<float>(classes);
  args.logits = logits.data();
  args.labels = labels.data();
  args.out = loss.data();
  args.stats_out = stats.data();
  args.scaled_gradient = gradient.data();
  args.row_scales = scales.data();
  const RowsKernel kernel = SelectRowsKernel();
  const SplitRowsKernel split = SelectSplitRowsKernel();

  std::vector<double> kernel_ms, floor_ms;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    if (!split(args, rows, CpuThreadLimit(), &RunTasks)) {
      ParallelFor(rows, classes, [&](int64_t begin, int64_t end) { kernel(args, begin, end); });
    }
    const auto middle = std::chrono::steady_clock::now();
    StreamReadPass(values.data(), rows, floor_columns);
    StreamCopyPass(values.data(), floor_out.data(), rows, floor_columns);
    const auto end = std::chrono::steady_clock::now();
    kernel_ms.push_back(std::chrono::duration<double, std::milli>(middle - start).count());
    floor_ms.push_back(std::chrono::duration<double, std::milli>(end - middle).count());
  }
  std::printf("%s, %s, %lld x %lld, %d thread(s): kernel %.3f ms, floor %.3f ms (medians of %d)\n",
              SelectedRowsIsa(), dtype.c_str(), static_cast<long long>(rows), static_cast<long long>(classes),
              CpuThreadLimit(), Median(kernel_ms), Median(floor_ms), repeats);
  return 0;
}
