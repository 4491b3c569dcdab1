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

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

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
    "kernel_entry.cc"};

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

namespace {

bool IsWordChar(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }
bool IsSpaceChar(char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; }
// Whether `prefix` stands in `text` at `i`. strncmp, not std::string::compare: the macOS
// cross-link's libc++ stub lacks compare, and operator== with a const char* calls it.
bool StartsAt(const std::string& text, size_t i, const char* prefix) {
  return i <= text.size() && std::strncmp(text.c_str() + i, prefix, std::strlen(prefix)) == 0;
}

// Whether `text`, what follows the word `threadgroup` up to the next ';', declares objects:
// whitespace, a type (word characters, "::", template brackets, commas, spaces: no * or &, so a
// pointer or reference into threadgroup memory is left alone), whitespace, a name, and array
// bounds, which may hold any expression without ']'. Read from the right.
bool DeclaresThreadgroupObjects(const std::string& text) {
  size_t end = text.size();
  for (;;) {  // the array bounds
    while (end > 0 && IsSpaceChar(text[end - 1])) --end;
    if (end == 0 || text[end - 1] != ']') break;
    const size_t open = text.rfind('[', end - 1);
    if (open == std::string::npos || text.find(']', open) != end - 1) return false;
    end = open;
  }
  const size_t name_end = end;
  while (end > 0 && IsWordChar(text[end - 1])) --end;
  if (end == name_end) return false;  // no name
  const size_t name_start = end;
  while (end > 0 && IsSpaceChar(text[end - 1])) --end;
  if (end == name_start || end == 0) return false;  // no space before the name, or no type
  bool has_type = false;
  for (size_t i = 0; i < end; ++i) {
    const char c = text[i];
    if (IsWordChar(c) || c == ':' || c == '<' || c == '>' || c == ',') {
      has_type = true;
    } else if (!IsSpaceChar(c)) {
      return false;
    }
  }
  return has_type && IsSpaceChar(text[0]);
}

}  // namespace

namespace {

// ---- features the CPU path refuses by name ----------------------------------------------------

// How a refused name is recognised: as a type (followed by `<`, `::` or a declared name), as a
// function (followed by `(` or `<`) or as a namespace (followed by `::`). So an input or a local
// variable of the same name is left alone.
enum class Use { kType, kFunction, kNamespace };
struct Refused {
  const char* name;
  Use use;
  const char* feature;
};
const Refused kRefused[] = {
    {"texture1d", Use::kType, "textures"},
    {"texture1d_array", Use::kType, "textures"},
    {"texture2d", Use::kType, "textures"},
    {"texture2d_array", Use::kType, "textures"},
    {"texture2d_ms", Use::kType, "textures"},
    {"texture2d_ms_array", Use::kType, "textures"},
    {"texture3d", Use::kType, "textures"},
    {"texturecube", Use::kType, "textures"},
    {"texturecube_array", Use::kType, "textures"},
    {"texture_buffer", Use::kType, "textures"},
    {"depth2d", Use::kType, "textures"},
    {"depth2d_array", Use::kType, "textures"},
    {"depth2d_ms", Use::kType, "textures"},
    {"depth2d_ms_array", Use::kType, "textures"},
    {"depthcube", Use::kType, "textures"},
    {"depthcube_array", Use::kType, "textures"},
    {"sampler", Use::kType, "textures (samplers)"},
    {"access", Use::kNamespace, "textures (access qualifiers)"},
    {"imageblock", Use::kType, "imageblocks"},
    {"simdgroup_matrix", Use::kType, "simdgroup_matrix"},
    {"simdgroup_float8x8", Use::kType, "simdgroup_matrix"},
    {"simdgroup_half8x8", Use::kType, "simdgroup_matrix"},
    {"simdgroup_bfloat8x8", Use::kType, "simdgroup_matrix"},
    {"simdgroup_load", Use::kFunction, "simdgroup_matrix"},
    {"simdgroup_store", Use::kFunction, "simdgroup_matrix"},
    {"simdgroup_multiply", Use::kFunction, "simdgroup_matrix"},
    {"simdgroup_multiply_accumulate", Use::kFunction, "simdgroup_matrix"},
    {"make_filled_simdgroup_matrix", Use::kFunction, "simdgroup_matrix"},
    {"raytracing", Use::kNamespace, "ray tracing"},
    {"intersector", Use::kType, "ray tracing"},
    {"intersection_result", Use::kType, "ray tracing"},
    {"acceleration_structure", Use::kType, "ray tracing"},
    {"primitive_acceleration_structure", Use::kType, "ray tracing"},
    {"instance_acceleration_structure", Use::kType, "ray tracing"},
    {"intersection_function_table", Use::kType, "ray tracing"},
    {"visible_function_table", Use::kType, "function tables"},
    {"float2x2", Use::kType, "matrix types"},
    {"float2x3", Use::kType, "matrix types"},
    {"float2x4", Use::kType, "matrix types"},
    {"float3x2", Use::kType, "matrix types"},
    {"float3x3", Use::kType, "matrix types"},
    {"float3x4", Use::kType, "matrix types"},
    {"float4x2", Use::kType, "matrix types"},
    {"float4x3", Use::kType, "matrix types"},
    {"float4x4", Use::kType, "matrix types"},
    {"half2x2", Use::kType, "matrix types"},
    {"half3x3", Use::kType, "matrix types"},
    {"half4x4", Use::kType, "matrix types"},
    {"matrix", Use::kType, "matrix types"},
};

// Functions of the C and C++ math libraries that the Metal Shading Language does not have (its
// math functions are those docs/kernels.md lists, from the MSL specification's tables). The
// emulator's host compiler would take them from <cmath>, and the kernel would then pass every
// test off the Mac and fail to compile on it, so they are refused where called, unless the
// source declares a function of that name itself (MLX, for one, writes its own erf:
// mlx/backend/metal/kernels/erf.h).
const char* const kNotMslFunctions[] = {
    "erf", "erff", "erfc", "erfcf", "log1p", "log1pf", "expm1", "expm1f", "cbrt", "cbrtf", "hypot",
    "hypotf", "lgamma", "lgammaf", "tgamma", "tgammaf", "logb", "logbf", "scalbn", "scalbnf",
    "scalbln", "scalblnf", "nearbyint", "nearbyintf", "lrint", "lrintf", "llrint", "llrintf",
    "lround", "lroundf", "llround", "llroundf", "remainder", "remainderf", "remquo", "remquof",
    "nexttoward", "nexttowardf", "fpclassify", "isgreater", "isgreaterequal", "isless",
    "islessequal", "islessgreater",
};

// `text` with comments, string and character literals blanked out (same length, so that
// positions still match), as far as a C++ scanner needs for naming identifiers.
std::string WithoutCommentsAndLiterals(const std::string& text) {
  std::string out = text;
  size_t i = 0;
  while (i < out.size()) {
    if (StartsAt(out, i, "//")) {
      while (i < out.size() && out[i] != '\n') out[i++] = ' ';
    } else if (StartsAt(out, i, "/*")) {
      const size_t end = out.find("*/", i + 2);
      const size_t stop = end == std::string::npos ? out.size() : end + 2;
      for (; i < stop; ++i) {
        if (out[i] != '\n') out[i] = ' ';
      }
    } else if (out[i] == '"' || out[i] == '\'') {
      const char quote = out[i];
      out[i++] = ' ';
      while (i < out.size() && out[i] != quote && out[i] != '\n') {
        if (out[i] == '\\' && i + 1 < out.size()) out[i++] = ' ';
        out[i++] = ' ';
      }
      if (i < out.size() && out[i] == quote) out[i++] = ' ';
    } else {
      ++i;
    }
  }
  return out;
}

// The word before `text[at]`, skipping spaces ("" if something else stands there).
std::string WordBefore(const std::string& text, size_t at) {
  size_t end = at;
  while (end > 0 && IsSpaceChar(text[end - 1])) --end;
  size_t start = end;
  while (start > 0 && IsWordChar(text[start - 1])) --start;
  return text.substr(start, end - start);
}

// Whether `text` (without comments and literals) declares a function called `name`: the name
// followed by '(' after a word that is not a statement's keyword (`float erf(float x)`, not
// `return erf(x)` or `= erf(x)`).
bool DeclaresFunction(const std::string& text, const std::string& name) {
  static const char* const kBeforeCalls[] = {"return", "else", "case", "do", "throw", "new",
                                             "sizeof", "co_return", "co_yield", "delete"};
  for (size_t at = text.find(name); at != std::string::npos; at = text.find(name, at + 1)) {
    const size_t end = at + name.size();
    if ((at > 0 && IsWordChar(text[at - 1])) || (end < text.size() && IsWordChar(text[end]))) {
      continue;
    }
    size_t next = end;
    while (next < text.size() && IsSpaceChar(text[next])) ++next;
    if (next >= text.size() || text[next] != '(') continue;
    const std::string before = WordBefore(text, at);
    if (before.empty() || std::isdigit(static_cast<unsigned char>(before[0]))) continue;
    bool keyword = false;
    for (const char* word : kBeforeCalls) {
      keyword = keyword || std::strcmp(before.c_str(), word) == 0;
    }
    if (!keyword) return true;
  }
  return false;
}

}  // namespace

std::string UnsupportedFeature(const std::string& msl_source) {
  const std::string text = WithoutCommentsAndLiterals(msl_source);
  size_t i = 0;
  while (i < text.size()) {
    if (!IsWordChar(text[i]) || (i > 0 && IsWordChar(text[i - 1]))) {
      ++i;
      continue;
    }
    size_t end = i;
    while (end < text.size() && IsWordChar(text[end])) ++end;
    const std::string word = text.substr(i, end - i);
    size_t next = end;
    while (next < text.size() && IsSpaceChar(text[next])) ++next;
    const char after = next < text.size() ? text[next] : '\0';
    const bool scope = StartsAt(text, next, "::");
    for (const Refused& refused : kRefused) {
      if (std::strcmp(word.c_str(), refused.name) != 0) continue;  // see StartsAt
      bool used = false;
      switch (refused.use) {
        case Use::kType:
          used = after == '<' || scope || (next > end && IsWordChar(after));
          break;
        case Use::kFunction:
          used = after == '(' || after == '<';
          break;
        case Use::kNamespace:
          used = scope;
          break;
      }
      if (used) {
        return word + " (" + refused.feature +
               ") is not supported by the CPU path of metal_kernel: the MSL emulator's "
               "<metal_stdlib> has no " + refused.feature +
               " (docs/kernels.md lists what it covers)";
      }
    }
    if (after == '(') {
      for (const char* name : kNotMslFunctions) {
        if (std::strcmp(word.c_str(), name) == 0 && !DeclaresFunction(text, word)) {
          return word + " is not a function of the Metal Shading Language, so the Metal "
                 "compiler rejects this kernel on a Mac; the CPU path refuses it too. Define "
                 "it yourself in the kernel's header (docs/kernels.md lists MSL's math "
                 "functions)";
        }
      }
    }
    i = end;
  }
  return "";
}

std::string HostSource(const std::string& msl_source) {
  // `threadgroup` opening a statement (after ; { } or a line break, then spaces or tabs) and
  // declaring objects becomes the host's per-threadgroup storage. A hand-written scan, not
  // std::regex: the macOS build links only the parts of libc++ it names.
  static const std::string kWord = "threadgroup";
  std::string out;
  size_t copied = 0;
  for (size_t at = msl_source.find(kWord); at != std::string::npos;
       at = msl_source.find(kWord, at + kWord.size())) {
    const size_t after = at + kWord.size();
    if (after < msl_source.size() && IsWordChar(msl_source[after])) continue;
    size_t before = at;
    while (before > 0 && (msl_source[before - 1] == ' ' || msl_source[before - 1] == '\t')) {
      --before;
    }
    const bool opens_statement =
        before == 0 || std::strchr(";{}\n", msl_source[before - 1]) != nullptr;
    if (!opens_statement) continue;
    const size_t semicolon = msl_source.find(';', after);
    if (semicolon == std::string::npos ||
        !DeclaresThreadgroupObjects(msl_source.substr(after, semicolon - after))) {
      continue;
    }
    out.append(msl_source, copied, at - copied);
    out += "TFMO_THREADGROUP_STATIC";
    copied = after;
  }
  out.append(msl_source, copied, std::string::npos);
  return out;
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
