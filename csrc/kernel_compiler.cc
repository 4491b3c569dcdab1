// See kernel_compiler.h. Layout of the cache directory:
//   runtime-<key>/{emulator.o, kernel_entry.o}  the emulator, once per compiler and emulator
//   kernel-<key>/{kernel.cc, kernel.so}         one generated source; kernel.cc is kept so that
//                                                a hash collision is caught, and for reading
// Keys hash what decides the output: the source, the compiler's --version, the flags and the
// emulator's own files. A file lock per directory lets processes share the cache.
#include "csrc/kernel_compiler.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

#include "csrc/msl_source.h"

#if defined(__APPLE__)
#include <crt_externs.h>  // a bundle cannot link `environ` directly on macOS
#define TFMO_ENVIRON (*_NSGetEnviron())
#else
extern char** environ;
#define TFMO_ENVIRON environ
#endif

namespace tf_metal_ops {
namespace {

// Bumped with any change to the flags or the layout below.
constexpr const char* kCacheFormat = "tfmo-kernel-cache-1";
// tfmo_kernel_entry_version() of csrc/emulator/kernel_entry.cc, whose arguments
// KernelRunFunction mirrors.
constexpr int kKernelEntryVersion = 2;

// $TF_METAL_OPS_KERNEL_SANITIZE=address compiles kernels and the emulator with
// AddressSanitizer, so that a kernel reading or writing outside its buffers is reported instead
// of silently corrupting memory. The process must already run under ASan's runtime (an ASan
// build of the package, or the runtime of the same compiler in LD_PRELOAD), as in CI's native
// step (tests/sanitizer/build_and_run.sh). Read once per process; part of every cache key.
constexpr const char* kSanitizeEnv = "TF_METAL_OPS_KERNEL_SANITIZE";

// The sanitizer flags, or an error naming the variable's unsupported value.
std::string SanitizerFlags(std::vector<std::string>* flags) {
  const char* value = std::getenv(kSanitizeEnv);
  if (value == nullptr || *value == '\0') return "";
  if (std::string(value) == "address") {
    flags->insert(flags->end(), {"-fsanitize=address", "-fno-omit-frame-pointer", "-g"});
    return "";
  }
  return std::string("$") + kSanitizeEnv + " is '" + value +
         "'; the supported value is 'address' (or leave it unset)";
}

// -fsigned-char: MSL's char is signed on every target (C++'s is unsigned on aarch64).
const std::vector<std::string>& CompileFlags() {
  static const std::vector<std::string> flags = [] {
    std::vector<std::string> f = {"-std=c++17",  "-O2",         "-fPIC",
                                  "-w",          "-D__METAL__", "-DTFMO_MSL_HOST",
                                  "-fsigned-char"};
    SanitizerFlags(&f);
    return f;
  }();
  return flags;
}

struct State {
  std::mutex mu;
  KernelToolchain toolchain;
  bool toolchain_set = false;
  std::string compiler_id;  // --version's first line; empty until first needed
  std::string runtime_key;
  std::map<std::string, KernelRunFunction> loaded;  // by source
  KernelCacheStats stats;
};
State& TheState() {
  static State* state = new State();  // never destroyed: kernels may run during exit
  return *state;
}

uint64_t Fnv1a(const std::string& text, uint64_t hash = 1469598103934665603ull) {
  for (unsigned char c : text) {
    hash ^= c;
    hash *= 1099511628211ull;
  }
  return hash;
}

// 128 bits from two FNV-1a passes with different seeds: a directory name, not a security
// boundary (kernel.cc is compared in full before a cached object is used).
std::string Key(const std::string& text) {
  char out[33];
  std::snprintf(out, sizeof(out), "%016llx%016llx",
                static_cast<unsigned long long>(Fnv1a(text)),
                static_cast<unsigned long long>(Fnv1a(text, 0x9e3779b97f4a7c15ull)));
  return out;
}

bool ReadFile(const std::string& path, std::string* text) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream buffer;
  buffer << in.rdbuf();
  *text = buffer.str();
  return true;
}

bool WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  return static_cast<bool>(out);
}

bool Exists(const std::string& path) {
  struct stat info;
  return ::stat(path.c_str(), &info) == 0;
}

std::string MakeDirs(const std::string& path) {
  std::string partial;
  for (size_t i = 0; i <= path.size(); ++i) {
    if (i == path.size() || (path[i] == '/' && i > 0)) {
      partial = path.substr(0, i);
      if (::mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) {
        return "cannot create " + partial + ": " + std::strerror(errno);
      }
    }
  }
  return "";
}

// Holds an exclusive flock on dir/.lock while alive.
class DirectoryLock {
 public:
  explicit DirectoryLock(const std::string& dir)
      : fd_(::open((dir + "/.lock").c_str(), O_CREAT | O_RDWR, 0644)) {
    if (fd_ >= 0) ::flock(fd_, LOCK_EX);
  }
  ~DirectoryLock() {
    if (fd_ >= 0) ::close(fd_);  // releases the lock
  }
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  int fd_;
};

// Runs argv with stdout and stderr into `log`; the exit status, or -1 when it cannot start.
int Run(const std::vector<std::string>& argv, const std::string& log) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid = 0;
  const int spawned = posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), TFMO_ENVIRON);
  posix_spawn_file_actions_destroy(&actions);
  if (spawned != 0) {
    WriteFile(log, std::string("cannot start ") + argv[0] + ": " + std::strerror(spawned));
    return -1;
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string Joined(const std::vector<std::string>& argv) {
  std::string out;
  for (const std::string& a : argv) out += (out.empty() ? "" : " ") + a;
  return out;
}

// Runs a compile; "" or the failure with the compiler's output.
std::string Compile(const std::vector<std::string>& argv, const std::string& log,
                    const std::string& what) {
  if (Run(argv, log) == 0) return "";
  std::string output;
  ReadFile(log, &output);
  if (output.size() > 6000) output = output.substr(0, 6000) + "\n[... cut]";
  return what + " failed (" + Joined(argv) + "):\n" + output;
}

// The first line of `compiler --version`: part of every cache key.
std::string CompilerId(State& s) {
  if (!s.compiler_id.empty()) return s.compiler_id;
  const std::string log = s.toolchain.cache_dir + "/version.log." + std::to_string(::getpid());
  std::vector<std::string> argv = s.toolchain.compiler;
  argv.push_back("--version");
  Run(argv, log);
  std::string text;
  ReadFile(log, &text);
  ::unlink(log.c_str());
  s.compiler_id = text.substr(0, text.find('\n'));
  if (s.compiler_id.empty()) s.compiler_id = Joined(s.toolchain.compiler);
  s.stats.compiler = s.compiler_id;
  return s.compiler_id;
}

const char* const kRuntimeFiles[] = {
    "include/metal_stdlib", "include/tfmo_msl/vector.h", "include/tfmo_msl/math.h",
    "include/tfmo_msl/simd.h", "msl_host_runtime.h", "emulator.h", "emulator.cc",
    "kernel_entry.cc",
    // The parts of <metal_stdlib> a kernel may include alone, each forwarding to it.
    "include/metal_atomic", "include/metal_common", "include/metal_compute",
    "include/metal_geometric", "include/metal_integer", "include/metal_math",
    "include/metal_relational", "include/metal_simdgroup"};

std::vector<std::string> BaseCommand(const State& s) {
  std::vector<std::string> argv = s.toolchain.compiler;
  argv.insert(argv.end(), CompileFlags().begin(), CompileFlags().end());
  argv.insert(argv.end(), {"-I", s.toolchain.emulator_dir + "/include", "-I",
                           s.toolchain.emulator_dir});
  return argv;
}

// The emulator's objects for this compiler, built once into the cache; their directory.
std::string RuntimeObjects(State& s, std::string* dir) {
  std::string identity = std::string(kCacheFormat) + "\n" + CompilerId(s) + "\n" +
                         Joined(BaseCommand(s));
  for (const char* name : kRuntimeFiles) {
    std::string text;
    if (!ReadFile(s.toolchain.emulator_dir + "/" + name, &text)) {
      return "the MSL emulator's file " + s.toolchain.emulator_dir + "/" + name +
             " is missing: reinstall tf_metal_ops";
    }
    identity += "\n" + std::string(name) + "\n" + text;
  }
  s.runtime_key = Key(identity);
  *dir = s.toolchain.cache_dir + "/runtime-" + s.runtime_key;
  if (std::string e = MakeDirs(*dir); !e.empty()) return e;
  DirectoryLock lock(*dir);
  for (const char* name : {"emulator", "kernel_entry"}) {
    const std::string object = *dir + "/" + name + ".o";
    if (Exists(object)) continue;
    std::vector<std::string> argv = BaseCommand(s);
    argv.insert(argv.end(), {"-c", s.toolchain.emulator_dir + "/" + name + ".cc", "-o",
                             object + ".tmp"});
    if (std::string e = Compile(argv, *dir + "/" + name + ".log", "compiling the MSL emulator");
        !e.empty()) {
      return e;
    }
    std::rename((object + ".tmp").c_str(), object.c_str());
  }
  return "";
}

std::string Open(const std::string& path, KernelRunFunction* run) {
  // RTLD_LOCAL: the object's C++ runtime (possibly libc++) stays out of the global namespace.
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) return std::string("dlopen failed: ") + ::dlerror();
  using VersionFunction = int (*)();
  auto version = reinterpret_cast<VersionFunction>(::dlsym(handle, "tfmo_kernel_entry_version"));
  if (version == nullptr || version() != kKernelEntryVersion) {
    return path + " was built for another version of the emulator's entry point; delete it";
  }
  *run = reinterpret_cast<KernelRunFunction>(::dlsym(handle, "tfmo_kernel_run"));
  if (*run == nullptr) return path + " has no tfmo_kernel_run";
  return "";  // the handle stays open for the life of the process
}

}  // namespace

void SetKernelToolchain(KernelToolchain toolchain) {
  State& s = TheState();
  std::lock_guard<std::mutex> lock(s.mu);
  s.toolchain = std::move(toolchain);
  s.toolchain_set = true;
  s.compiler_id.clear();
  s.stats.compiler.clear();
}

KernelCacheStats GetKernelCacheStats() {
  State& s = TheState();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.stats;
}

std::string LoadKernel(const std::string& source, KernelRunFunction* run) {
  State& s = TheState();
  // One lock for the whole load: a second caller of the same source waits for the first
  // compile instead of starting its own.
  std::lock_guard<std::mutex> lock(s.mu);
  if (auto it = s.loaded.find(source); it != s.loaded.end()) {
    ++s.stats.in_memory;
    *run = it->second;
    return "";
  }
  if (std::string e = UnsupportedFeature(source); !e.empty()) return e;
  std::vector<std::string> sanitizer_flags;
  if (std::string e = SanitizerFlags(&sanitizer_flags); !e.empty()) return e;
  if (!s.toolchain_set) {
    return "the kernel compiler is not configured: import tf_metal_ops before running a "
           "MetalKernel op";
  }
  if (s.toolchain.compiler.empty()) return s.toolchain.missing_reason;
  if (std::string e = MakeDirs(s.toolchain.cache_dir); !e.empty()) return e;
  std::string runtime_dir;
  if (std::string e = RuntimeObjects(s, &runtime_dir); !e.empty()) return e;

  const std::string host_source = HostSource(source);
  const std::string dir =
      s.toolchain.cache_dir + "/kernel-" + Key(s.runtime_key + "\n" + host_source);
  if (std::string e = MakeDirs(dir); !e.empty()) return e;
  DirectoryLock dir_lock(dir);
  const std::string cc = dir + "/kernel.cc";
  const std::string so = dir + "/kernel.so";
  std::string cached;
  const bool reuse = Exists(so) && ReadFile(cc, &cached) && cached == host_source;
  if (reuse) {
    ++s.stats.from_disk;
  } else {
    if (!WriteFile(cc, host_source)) return "cannot write " + cc;
    std::vector<std::string> argv = BaseCommand(s);
    argv.insert(argv.end(), {"-shared", "-x", "c++", cc, "-x", "none",
                             runtime_dir + "/emulator.o", runtime_dir + "/kernel_entry.o", "-o",
                             so + ".tmp", "-lpthread"});
    if (std::string e = Compile(argv, dir + "/compile.log", "compiling the kernel");
        !e.empty()) {
      return e;
    }
    std::rename((so + ".tmp").c_str(), so.c_str());
    ++s.stats.compiled;
  }
  if (std::string e = Open(so, run); !e.empty()) return e;
  s.loaded[source] = *run;
  return "";
}

}  // namespace tf_metal_ops
