// Stand-alone driver for the ThreadSanitizer build (a sanitized shared library cannot be loaded
// into an unsanitized Python). Two modes:
//
//   custom_loss_driver_main case DIR
//     DIR/case.txt: "key value" lines naming the TfmoEmuCase fields; DIR/{logits,labels,
//     class_weights,upstream,row_scales,row_stats}.bin: raw arrays. Runs tfmo_emu_run and writes
//     DIR/output.bin and DIR/error_record.bin, and for a forward DIR/row_stats_out.bin (when
//     has_row_stats) and DIR/scaled_gradient.bin (when has_row_scales). With alias_gradient 1
//     the gradient is written over the logits' memory, and those files hold it. Exit 0 on
//     success, 1 with the error on stderr.
//
//   custom_loss_driver_main raw KERNEL THREADS GROUPS TG_BYTES FLOATS
//     Runs any registered kernel whose only buffer is [[buffer(0)]] float[FLOATS] (zeros) on the
//     OS-thread executor, all GROUPS threadgroups at once, and prints the buffer. For the race
//     detection tests' small kernels.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "custom_loss_case.h"
#include "custom_loss_driver.h"
#include "emulator.h"

namespace {

using msl_host::DtypeBytes;
using msl_host::ReadFileBytes;
using msl_host::WriteFileBytes;

int run_case(const std::string& dir) {
  TfmoEmuCase c = msl_host::ReadCaseFile(dir);  // the buffers are filled in below

  std::vector<char> logits = ReadFileBytes(dir + "/logits.bin");
  std::vector<char> labels = ReadFileBytes(dir + "/labels.bin");
  std::vector<char> weights = ReadFileBytes(dir + "/class_weights.bin");
  std::vector<char> upstream = ReadFileBytes(dir + "/upstream.bin");
  const size_t out_elements =
      static_cast<size_t>(c.num_rows) * (c.direction == 1 ? static_cast<size_t>(c.num_classes) : 1);
  std::vector<char> output(out_elements * DtypeBytes(c.dtype) + 1);
  std::vector<uint32_t> record(8, 0);
  // A forward writes row_stats (when has_row_stats) and the scaled gradient (given row_scales);
  // a gradient reads row_stats.bin.
  const bool forward = c.direction == 0;
  const size_t n = static_cast<size_t>(c.num_rows);
  std::vector<char> row_scales = ReadFileBytes(dir + "/row_scales.bin");
  std::vector<char> row_stats =
      forward ? std::vector<char>(n * 12 + 1) : ReadFileBytes(dir + "/row_stats.bin");
  const size_t scaled_bytes = n * static_cast<size_t>(c.num_classes) * DtypeBytes(c.dtype);
  std::vector<char> scaled(scaled_bytes + 1);
  c.row_stats = reinterpret_cast<float*>(row_stats.data());
  c.row_scales = reinterpret_cast<const float*>(row_scales.data());
  c.scaled_gradient = scaled.data();
  c.logits = logits.data();
  c.labels = labels.data();
  c.class_weights = reinterpret_cast<const float*>(weights.data());
  c.upstream = upstream.data();
  c.output = output.data();
  c.error_record = record.data();

  TfmoEmuResult r;
  tfmo_emu_run(&c, &r);
  if (!r.ok) {
    std::cerr << "error: " << r.error << "\n";
    return 1;
  }
  if (c.alias_gradient != 0) {  // the gradient is where the logits were
    if (forward && c.has_row_scales) {
      std::memcpy(scaled.data(), logits.data(), scaled_bytes);
    } else if (!forward) {
      std::memcpy(output.data(), logits.data(), out_elements * DtypeBytes(c.dtype));
    }
  }
  std::cout << "kernel " << r.kernel_name << " threadgroups " << r.threadgroups_per_grid[0] << "x"
            << r.threadgroups_per_grid[1] << " threads " << r.threads_per_threadgroup[0] << "\n";
  if (!WriteFileBytes(dir + "/output.bin", output.data(), out_elements * DtypeBytes(c.dtype)) ||
      !WriteFileBytes(dir + "/error_record.bin", record.data(), record.size() * 4) ||
      (forward && c.has_row_stats &&
       !WriteFileBytes(dir + "/row_stats_out.bin", row_stats.data(), n * 12)) ||
      (forward && c.has_row_scales &&
       !WriteFileBytes(dir + "/scaled_gradient.bin", scaled.data(), scaled_bytes))) {
    std::cerr << "error: cannot write the outputs\n";
    return 1;
  }
  return 0;
}

int run_raw(const std::string& kernel, uint32_t threads, uint32_t groups, uint32_t tg_bytes,
            size_t floats) {
  std::vector<float> buffer(floats, 0.0f);
  char error[512];
  if (!tfmo_emu_run_raw(kernel.c_str(), threads, groups, tg_bytes, buffer.data(), 1, error,
                        sizeof(error))) {
    std::cerr << "error: " << error << "\n";
    return 1;
  }
  for (float v : buffer) std::cout << v << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::strcmp(argv[1], "case") == 0) return run_case(argv[2]);
  if (argc == 7 && std::strcmp(argv[1], "raw") == 0) {
    return run_raw(argv[2], std::stoul(argv[3]), std::stoul(argv[4]), std::stoul(argv[5]),
                   std::stoul(argv[6]));
  }
  std::cerr << "usage: " << argv[0] << " case DIR | raw KERNEL THREADS GROUPS TG_BYTES FLOATS\n";
  return 2;
}
