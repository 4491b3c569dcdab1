// The stand-alone program of tests/msl_cuda (compute-sanitizer runs it; so does run_on_gpu.sh):
//
//   tfmo_cuda_main compile REPO CUBIN [ARCH]
//     NVRTC: REPO/kernels/custom_loss.metal -> CUBIN (sm_ARCH, default 90); prints the log.
//   tfmo_cuda_main info CUBIN
//     Loads CUBIN; prints each kernel's host_name, registers, max threads per block, local bytes.
//   tfmo_cuda_main cases CUBIN DIR...
//     Each DIR is a case in the format of tests/msl_host/custom_loss_driver_main.cc (case.txt and
//     {logits,labels,class_weights,upstream,row_scales,row_stats}.bin, written by gpu_cases.py).
//     Runs it with the plan's geometry on device memory: the outputs start as 0x7B bytes (so an
//     element the kernel does not write cannot pass) and the error record as the encoder
//     initializes it. Writes DIR/output.bin, DIR/error_record.bin and DIR/plan.txt, and for a
//     forward DIR/row_stats_out.bin (has_row_stats) and DIR/scaled_gradient.bin
//     (has_row_scales). Exit 0 when every case ran.
//   tfmo_cuda_main synth CUBIN N C DTYPE
//     One forward (writing row_stats) and one gradient launch (reading them) on N x C random
//     logits (DTYPE 0 float32, 2 bfloat16; normal, sd 2), int64 labels, upstream 1/N, planned as
//     the encoder plans them: the program that ncu profiles (run_on_gpu.sh).
#include <cuda.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "tests/msl_cuda/cuda_driver.h"
#include "tests/msl_host/custom_loss_case.h"

namespace {

using msl_host::DtypeBytes;
using msl_host::ReadFileBytes;
using msl_host::WriteFileBytes;

// The few driver calls the case runner needs beyond cuda_driver.cc (same library, same context).
struct Memory {
  decltype(&::cuMemAlloc) alloc;
  decltype(&::cuMemFree) free;
  decltype(&::cuMemcpyHtoD) to_device;
  decltype(&::cuMemcpyDtoH) to_host;
  decltype(&::cuMemsetD8) set;
  decltype(&::cuCtxSynchronize) sync;
};
#define TFMO_STR2(x) #x
#define TFMO_STR(x) TFMO_STR2(x)

bool load_memory(Memory* m) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (lib == nullptr) return false;
  m->alloc = reinterpret_cast<decltype(m->alloc)>(dlsym(lib, TFMO_STR(cuMemAlloc)));
  m->free = reinterpret_cast<decltype(m->free)>(dlsym(lib, TFMO_STR(cuMemFree)));
  m->to_device = reinterpret_cast<decltype(m->to_device)>(dlsym(lib, TFMO_STR(cuMemcpyHtoD)));
  m->to_host = reinterpret_cast<decltype(m->to_host)>(dlsym(lib, TFMO_STR(cuMemcpyDtoH)));
  m->set = reinterpret_cast<decltype(m->set)>(dlsym(lib, TFMO_STR(cuMemsetD8)));
  m->sync = reinterpret_cast<decltype(m->sync)>(dlsym(lib, TFMO_STR(cuCtxSynchronize)));
  return m->alloc && m->free && m->to_device && m->to_host && m->set && m->sync;
}

// A device copy of a host array (null for an empty one, as the encoder binds a nil buffer).
struct DeviceArray {
  CUdeviceptr ptr = 0;
  size_t bytes = 0;
};

bool upload(const Memory& m, const std::vector<char>& host, DeviceArray* out) {
  out->bytes = host.size();
  if (host.empty()) return true;
  return m.alloc(&out->ptr, host.size()) == CUDA_SUCCESS &&
         m.to_device(out->ptr, host.data(), host.size()) == CUDA_SUCCESS;
}

int run_case(const Memory& m, const std::string& dir) {
  TfmoEmuCase c = msl_host::ReadCaseFile(dir);  // the buffers are filled in below

  DeviceArray logits, labels, weights, upstream, output, record, row_scales, row_stats, scaled;
  const bool forward = c.direction == 0;
  bool ok = upload(m, ReadFileBytes(dir + "/logits.bin"), &logits) &&
            upload(m, ReadFileBytes(dir + "/labels.bin"), &labels) &&
            upload(m, ReadFileBytes(dir + "/class_weights.bin"), &weights) &&
            upload(m, ReadFileBytes(dir + "/upstream.bin"), &upstream) &&
            upload(m, ReadFileBytes(dir + "/row_scales.bin"), &row_scales) &&
            (forward || upload(m, ReadFileBytes(dir + "/row_stats.bin"), &row_stats));
  // What a forward writes besides the loss: row_stats (has_row_stats) and the scaled gradient
  // (has_row_scales), 0x7B bytes until then.
  if (ok && forward && c.has_row_stats) {
    row_stats.bytes = static_cast<size_t>(c.num_rows) * 12;
    ok = m.alloc(&row_stats.ptr, row_stats.bytes + 1) == CUDA_SUCCESS &&
         m.set(row_stats.ptr, 0x7B, row_stats.bytes + 1) == CUDA_SUCCESS;
  }
  if (ok && forward && c.has_row_scales) {
    scaled.bytes = static_cast<size_t>(c.num_rows) * static_cast<size_t>(c.num_classes) *
                   DtypeBytes(c.dtype);
    ok = m.alloc(&scaled.ptr, scaled.bytes + 1) == CUDA_SUCCESS &&
         m.set(scaled.ptr, 0x7B, scaled.bytes + 1) == CUDA_SUCCESS;
  }
  const size_t out_elements =
      static_cast<size_t>(c.num_rows) * (c.direction == 1 ? static_cast<size_t>(c.num_classes) : 1);
  output.bytes = out_elements * DtypeBytes(c.dtype);
  record.bytes = 32;
  ok = ok && m.alloc(&output.ptr, output.bytes + 1) == CUDA_SUCCESS &&
       m.set(output.ptr, 0x7B, output.bytes + 1) == CUDA_SUCCESS &&
       m.alloc(&record.ptr, record.bytes) == CUDA_SUCCESS &&
       m.set(record.ptr, 0xEE, record.bytes) == CUDA_SUCCESS;  // the init must overwrite it
  if (!ok) {
    std::cerr << dir << ": cannot set up device memory\n";
    return 1;
  }
  c.logits = reinterpret_cast<const void*>(logits.ptr);
  c.labels = reinterpret_cast<const void*>(labels.ptr);
  c.class_weights = reinterpret_cast<const float*>(weights.ptr);
  c.upstream = reinterpret_cast<const void*>(upstream.ptr);
  c.output = reinterpret_cast<void*>(output.ptr);
  c.error_record = reinterpret_cast<uint32_t*>(record.ptr);
  c.row_scales = reinterpret_cast<const float*>(row_scales.ptr);
  c.row_stats = reinterpret_cast<float*>(row_stats.ptr);
  c.scaled_gradient = reinterpret_cast<void*>(scaled.ptr);

  TfmoEmuResult r;
  tfmo_cuda_run(&c, &r, nullptr, 1);
  CUresult sync = m.sync();
  if (!r.ok || sync != CUDA_SUCCESS) {
    std::cerr << dir << ": " << (r.ok ? "execution failed, CUDA error " + std::to_string(sync)
                                      : std::string(r.error)) << "\n";
    return 1;
  }
  std::vector<char> out(output.bytes);
  std::vector<char> words(record.bytes);
  std::vector<char> stats_out(forward ? row_stats.bytes : 0);
  std::vector<char> scaled_out(scaled.bytes);
  if ((output.bytes > 0 && m.to_host(out.data(), output.ptr, output.bytes) != CUDA_SUCCESS) ||
      m.to_host(words.data(), record.ptr, record.bytes) != CUDA_SUCCESS ||
      (!stats_out.empty() &&
       m.to_host(stats_out.data(), row_stats.ptr, stats_out.size()) != CUDA_SUCCESS) ||
      (!scaled_out.empty() &&
       m.to_host(scaled_out.data(), scaled.ptr, scaled_out.size()) != CUDA_SUCCESS)) {
    std::cerr << dir << ": cannot read the results back\n";
    return 1;
  }
  std::ofstream plan(dir + "/plan.txt");
  plan << "kernel " << r.kernel_name << "\ngrid " << r.threadgroups_per_grid[0] << " "
       << r.threadgroups_per_grid[1] << " " << r.threadgroups_per_grid[2] << "\nthreads "
       << r.threads_per_threadgroup[0] << "\nthreadgroup_memory " << r.threadgroup_memory_length
       << "\nthreads_per_row " << r.threads_per_row << "\nrows_per_threadgroup "
       << r.rows_per_threadgroup << "\ndispatched " << r.dispatched << "\n";
  if (!WriteFileBytes(dir + "/output.bin", out.data(), out.size()) ||
      !WriteFileBytes(dir + "/error_record.bin", words.data(), words.size()) ||
      (forward && c.has_row_stats &&
       !WriteFileBytes(dir + "/row_stats_out.bin", stats_out.data(), stats_out.size())) ||
      (forward && c.has_row_scales &&
       !WriteFileBytes(dir + "/scaled_gradient.bin", scaled_out.data(), scaled_out.size()))) {
    std::cerr << dir << ": cannot write the outputs\n";
    return 1;
  }
  for (DeviceArray* a : {&logits, &labels, &weights, &upstream, &output, &record, &row_scales,
                         &row_stats, &scaled}) {
    if (a->ptr != 0) m.free(a->ptr);
  }
  return 0;
}

// bfloat16 bits of a float, round to nearest even (finite inputs only).
uint16_t to_bfloat16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

int run_synthetic(const Memory& m, int64_t n, int64_t c, int32_t dtype) {
  uint64_t state = 0x9E3779B97F4A7C15ull;
  auto uniform = [&state] {  // xorshift64*, 24 bits
    state ^= state >> 12;
    state ^= state << 25;
    state ^= state >> 27;
    return static_cast<float>((state * 0x2545F4914F6CDD1Dull) >> 40) * (1.0f / 16777216.0f);
  };
  const size_t elements = static_cast<size_t>(n) * static_cast<size_t>(c);
  const size_t es = DtypeBytes(dtype);
  std::vector<char> logits(elements * es);
  for (size_t i = 0; i < elements; ++i) {
    // Irwin-Hall: the sum of 4 uniforms, centred and scaled to sd 2.
    const float z = (uniform() + uniform() + uniform() + uniform() - 2.0f) * 3.4641016f;
    if (dtype == 0) {
      std::memcpy(&logits[i * 4], &z, 4);
    } else {
      const uint16_t b = to_bfloat16(z);
      std::memcpy(&logits[i * 2], &b, 2);
    }
  }
  std::vector<char> labels(static_cast<size_t>(n) * 8);
  std::vector<char> upstream(static_cast<size_t>(n) * es);
  const float up = 1.0f / static_cast<float>(n);
  for (int64_t r = 0; r < n; ++r) {
    const int64_t y = static_cast<int64_t>(uniform() * static_cast<float>(c)) % c;
    std::memcpy(&labels[static_cast<size_t>(r) * 8], &y, 8);
    if (dtype == 0) {
      std::memcpy(&upstream[static_cast<size_t>(r) * 4], &up, 4);
    } else {
      const uint16_t b = to_bfloat16(up);
      std::memcpy(&upstream[static_cast<size_t>(r) * 2], &b, 2);
    }
  }
  DeviceArray d_logits, d_labels, d_upstream, d_loss, d_grad, d_record, d_stats;
  bool ok = upload(m, logits, &d_logits) && upload(m, labels, &d_labels) &&
            upload(m, upstream, &d_upstream) &&
            m.alloc(&d_loss.ptr, static_cast<size_t>(n) * es) == CUDA_SUCCESS &&
            m.alloc(&d_stats.ptr, static_cast<size_t>(n) * 12) == CUDA_SUCCESS &&
            m.alloc(&d_grad.ptr, elements * es) == CUDA_SUCCESS &&
            m.alloc(&d_record.ptr, 32) == CUDA_SUCCESS;
  if (!ok) {
    std::cerr << "synth: cannot set up device memory\n";
    return 1;
  }
  for (int32_t direction = 0; direction < 2; ++direction) {
    TfmoEmuCase k;
    std::memset(&k, 0, sizeof(k));
    k.num_rows = n;
    k.num_classes = c;
    k.dtype = dtype;
    k.label_kind = 1;
    k.direction = direction;
    k.variant = -1;
    k.has_ignore_class = 1;
    k.ignore_class = -100;
    k.max_total_threads_per_threadgroup = 1024;
    k.thread_execution_width = 32;
    k.logits = reinterpret_cast<const void*>(d_logits.ptr);
    k.labels = reinterpret_cast<const void*>(d_labels.ptr);
    k.upstream = reinterpret_cast<const void*>(d_upstream.ptr);
    k.output = reinterpret_cast<void*>(direction == 0 ? d_loss.ptr : d_grad.ptr);
    k.error_record = reinterpret_cast<uint32_t*>(d_record.ptr);
    k.has_row_stats = 1;  // the forward writes them, the gradient reads them (custom_loss)
    k.row_stats = reinterpret_cast<float*>(d_stats.ptr);
    TfmoEmuResult r;
    if (!tfmo_cuda_run(&k, &r, nullptr, 1) || m.sync() != CUDA_SUCCESS) {
      std::cerr << "synth: " << r.error << "\n";
      return 1;
    }
    std::printf("%s grid %ux%u threads %u threads_per_row %u\n", r.kernel_name,
                r.threadgroups_per_grid[0], r.threadgroups_per_grid[1],
                r.threads_per_threadgroup[0], r.threads_per_row);
  }
  for (DeviceArray* a :
       {&d_logits, &d_labels, &d_upstream, &d_loss, &d_grad, &d_record, &d_stats}) {
    if (a->ptr != 0) m.free(a->ptr);
  }
  return 0;
}

int load(const char* cubin) {
  char error[1024];
  const int n = tfmo_cuda_load(cubin, error, sizeof(error));
  if (n < 0) std::cerr << "load: " << error << "\n";
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string command = argc > 1 ? argv[1] : "";
  if (command == "compile" && (argc == 4 || argc == 5)) {
    std::vector<char> log(1 << 20);
    const int ok = tfmo_cuda_compile(argv[2], argc == 5 ? std::stoi(argv[4]) : 90, argv[3],
                                     log.data(), static_cast<uint32_t>(log.size()));
    std::cout << log.data() << (log[0] ? "\n" : "");
    return ok ? 0 : 1;
  }
  if (command == "info" && argc == 3) {
    const int n = load(argv[2]);
    if (n < 0) return 1;
    for (int i = 0; i < n; ++i) {
      char name[128];
      int32_t regs, max_threads, local;
      tfmo_cuda_kernel_info(i, name, sizeof(name), &regs, &max_threads, &local);
      std::printf("%-44s registers %3d  max threads/block %4d  local bytes %d\n", name, regs,
                  max_threads, local);
    }
    std::printf("%d kernels\n", n);
    return n > 0 ? 0 : 1;
  }
  if (command == "cases" && argc >= 3) {
    if (load(argv[2]) <= 0) return 1;
    Memory m;
    if (!load_memory(&m)) {
      std::cerr << "cannot load the CUDA memory functions\n";
      return 1;
    }
    int failed = 0;
    for (int i = 3; i < argc; ++i) failed += run_case(m, argv[i]);
    std::printf("%d cases run, %d failed\n", argc - 3, failed);
    return failed == 0 ? 0 : 1;
  }
  if (command == "synth" && argc == 6) {
    Memory m;
    if (load(argv[2]) <= 0 || !load_memory(&m)) return 1;
    return run_synthetic(m, std::stoll(argv[3]), std::stoll(argv[4]), std::stoi(argv[5]));
  }
  std::cerr << "usage: " << argv[0]
            << " compile REPO CUBIN [ARCH] | info CUBIN | cases CUBIN DIR... |"
               " synth CUBIN N C DTYPE\n";
  return 2;
}
