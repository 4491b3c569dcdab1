// See kernel_source.h.
#include "csrc/metal/kernel_source.h"

#include <climits>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

namespace tf_metal_ops {
namespace metal {
namespace {

// Joins with exactly one '/'.
std::string JoinPath(const std::string& directory, const std::string& name) {
  if (directory.empty()) return name;
  if (directory.back() == '/') return directory + name;
  return directory + "/" + name;
}

bool IsReadableFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  return file.good();
}

bool ReadFile(const std::string& path, std::string* contents) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return false;
  std::ostringstream buffer;
  buffer << file.rdbuf();
  if (file.bad()) return false;
  *contents = buffer.str();
  return true;
}

// The identity of a file for the include-once rule: two spellings of one path ("kernels/./a.h",
// "kernels/../kernels/a.h") must count as one file.
std::string CanonicalPath(const std::string& path) {
  char resolved[PATH_MAX];
  if (::realpath(path.c_str(), resolved) != nullptr) return resolved;
  return path;
}

// The name inside `#include "name"`, or "" when `line` is anything else. Whitespace is allowed
// where the preprocessor allows it ("  #  include \"x.h\"  // comment").
std::string QuotedIncludeName(const std::string& line) {
  size_t i = line.find_first_not_of(" \t");
  if (i == std::string::npos || line[i] != '#') return "";
  i = line.find_first_not_of(" \t", i + 1);
  static const std::string kInclude = "include";
  if (i == std::string::npos || line.compare(i, kInclude.size(), kInclude) != 0) return "";
  i = line.find_first_not_of(" \t", i + kInclude.size());
  if (i == std::string::npos || line[i] != '"') return "";
  const size_t end = line.find('"', i + 1);
  if (end == std::string::npos || end == i + 1) return "";
  return line.substr(i + 1, end - i - 1);
}

// A path as a string literal for #line.
std::string Quoted(const std::string& path) {
  std::string out = "\"";
  for (char c : path) {
    if (c == '\\' || c == '"') out += '\\';
    out += c;
  }
  return out + "\"";
}

bool Inline(const std::string& path, std::set<std::string>* inlined, int depth, std::string* out,
            std::string* error) {
  // Far deeper than any real include chain; only a bug in the once-rule could get here.
  if (depth > 32) {
    *error = "includes nested more than 32 deep at " + path;
    return false;
  }
  std::string contents;
  if (!ReadFile(path, &contents)) {
    *error = "cannot read " + path;
    return false;
  }
  inlined->insert(CanonicalPath(path));
  const std::string directory = DirectoryOf(path);

  std::istringstream lines(contents);
  std::string line;
  int line_number = 0;
  while (std::getline(lines, line)) {
    ++line_number;
    const std::string name = QuotedIncludeName(line);
    const std::string included = name.empty() ? "" : JoinPath(directory, name);
    if (name.empty() || !IsReadableFile(included)) {
      *out += line;
      *out += '\n';
      continue;
    }
    if (inlined->count(CanonicalPath(included)) != 0) {
      // Replaced by a comment of one line, so the line numbers below stay right.
      *out += "// tf_metal_ops: already inlined: " + name + "\n";
      continue;
    }
    *out += "#line 1 " + Quoted(included) + "\n";
    if (!Inline(included, inlined, depth + 1, out, error)) return false;
    if (!out->empty() && out->back() != '\n') *out += '\n';
    *out += "#line " + std::to_string(line_number + 1) + " " + Quoted(path) + "\n";
  }
  return true;
}

}  // namespace

std::string DirectoryOf(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

KernelFiles FindKernelFiles(const std::string& native_library_dir) {
  KernelFiles files;
  const std::string metallib = JoinPath(native_library_dir, kPrecompiledLibraryName);
  files.searched.push_back(metallib);
  if (IsReadableFile(metallib)) files.metallib = metallib;

  const std::string source_dirs[] = {
      JoinPath(native_library_dir, kKernelSourceDirName),                     // installed package
      JoinPath(JoinPath(native_library_dir, ".."), kKernelSourceDirName),     // in-place build
  };
  for (const std::string& dir : source_dirs) {
    const std::string source = JoinPath(dir, kKernelSourceName);
    files.searched.push_back(source);
    if (IsReadableFile(source)) {
      files.source = source;
      break;
    }
  }
  return files;
}

bool AssembleKernelSource(const std::string& path, std::string* source, std::string* error) {
  std::set<std::string> inlined;
  std::string out = "#line 1 " + Quoted(path) + "\n";
  if (!Inline(path, &inlined, 0, &out, error)) return false;
  *source = std::move(out);
  return true;
}

}  // namespace metal
}  // namespace tf_metal_ops
