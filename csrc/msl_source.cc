// See msl_source.h. A hand-written scanner, not std::regex: the macOS build links only the
// parts of libc++ it names.
#include "csrc/msl_source.h"

#include <algorithm>
#include <cctype>
#include <cstring>

namespace tf_metal_ops {
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

// Functions of the C and C++ libraries that the Metal Shading Language does not have. The
// emulator's host compiler would take them from <cmath>, <cstdio>, <cstdlib> and <cstring>, and
// the kernel would then pass every test off the Mac and fail to compile on it, so they are
// refused where called, unless the source declares a function of that name itself (MLX, for
// one, writes its own erf: mlx/backend/metal/kernels/erf.h). Each list has its own advice.
//
// Math that MSL lacks (its math functions are those docs/kernels.md lists, from the MSL
// specification's tables).
const char* const kNotMslMath[] = {
    "erf", "erff", "erfc", "erfcf", "log1p", "log1pf", "expm1", "expm1f", "cbrt", "cbrtf", "hypot",
    "hypotf", "lgamma", "lgammaf", "tgamma", "tgammaf", "logb", "logbf", "scalbn", "scalbnf",
    "scalbln", "scalblnf", "nearbyint", "nearbyintf", "lrint", "lrintf", "llrint", "llrintf",
    "lround", "lroundf", "llround", "llroundf", "remainder", "remainderf", "remquo", "remquof",
    "nexttoward", "nexttowardf", "fpclassify", "isgreater", "isgreaterequal", "isless",
    "islessequal", "islessgreater",
};
// C's float forms of math MSL has, common in kernels ported from CUDA: MSL spells each without
// the f (exp, not expf), overloaded for float and half. The Metal compiler's own words for one:
// "use of undeclared identifier 'sqrtf'; did you mean 'sqrt'?"
// (https://github.com/dmlc/nnvm/issues/177).
const char* const kFloatSuffixedMath[] = {
    "expf",   "exp2f",  "logf",   "log2f",  "log10f", "powf",   "sqrtf",  "sinf",   "cosf",
    "tanf",   "asinf",  "acosf",  "atanf",  "atan2f", "sinhf",  "coshf",  "tanhf",  "asinhf",
    "acoshf", "atanhf", "fabsf",  "floorf", "ceilf",  "truncf", "roundf", "rintf",  "fmodf",
    "fmaxf",  "fminf",  "fmaf",   "frexpf", "ldexpf", "modff",  "copysignf", "ilogbf",
};
// The C library's input and output, memory and process functions: a Metal kernel has none of
// them (no printf: Metal 3.2's shader logging is os_log, in <metal_logging>).
const char* const kCLibrary[] = {
    "printf",  "fprintf", "sprintf", "snprintf", "vprintf", "puts",    "putchar", "fputs",
    "fopen",   "fclose",  "fread",   "fwrite",   "scanf",   "malloc",  "calloc",  "realloc",
    "free",    "aligned_alloc", "abort", "exit", "atexit",  "system",  "getenv",  "qsort",
    "bsearch", "rand",    "srand",   "atoi",     "atol",    "atof",    "strtol",  "strtoul",
    "strtof",  "strtod",  "memcpy",  "memmove",  "memset",  "memcmp",  "memchr",  "strlen",
    "strcmp",  "strncmp", "strcpy",  "strncpy",  "strcat",  "strchr",  "strstr",  "time",
    "clock",
};
struct NotMslFunctions {
  const char* const* names;
  size_t count;
  const char* what;  // after "<name> is ": what the function is
  const char* advice;
};
template <size_t N>
constexpr NotMslFunctions ListOf(const char* const (&names)[N], const char* what,
                                 const char* advice) {
  return {names, N, what, advice};
}
const NotMslFunctions kNotMslFunctionLists[] = {
    ListOf(kNotMslMath, "not a function of the Metal Shading Language",
           "Define it yourself in the kernel's header (docs/kernels.md lists MSL's math "
           "functions)"),
    ListOf(kFloatSuffixedMath, "C's float form of a math function, which the Metal Shading "
           "Language spells without the f",
           "Call it without the f; MSL's math functions take float and half alike"),
    ListOf(kCLibrary, "a C library function",
           "A Metal kernel has no C library: no console (Metal 3.2's shader logging, os_log in "
           "<metal_logging>, is not on the CPU path) and no dynamic memory"),
};

// C++ that MSL does not take (the MSL specification, section 1.5.4 "Restrictions", and section
// 2.1 for the types). Keywords, so every use of the word is such a use, except where noted in
// CppFeatureAt.
struct CppFeature {
  const char* word;
  const char* feature;
  const char* section;
};
const CppFeature kCppFeatures[] = {
    {"new", "the new operator", "1.5.4"},
    {"delete", "the delete operator", "1.5.4"},
    {"throw", "exception handling", "1.5.4"},
    {"try", "exception handling", "1.5.4"},
    {"catch", "exception handling", "1.5.4"},
    {"dynamic_cast", "dynamic_cast", "1.5.4"},
    {"typeid", "type identification", "1.5.4"},
    {"goto", "the goto statement", "1.5.4"},
    {"register", "the register storage attribute", "1.5.4"},
    {"thread_local", "the thread_local storage attribute", "1.5.4"},
    {"virtual", "virtual functions", "1.5.4"},
    {"double", "the double type: use float", "2.1"},
};

// Metal standard library headers (MSL specification, chapter 6): those whose functions the
// emulator has, each a part of its <metal_stdlib> (csrc/emulator/include/ forwards each to it),
// and those of features it does not have.
const char* const kCoveredHeaders[] = {
    "metal_stdlib",   "metal_common",  "metal_integer",   "metal_relational", "metal_math",
    "metal_geometric", "metal_compute", "metal_simdgroup", "metal_atomic",
};
struct UncoveredHeader {
  const char* name;
  const char* feature;
};
const UncoveredHeader kUncoveredHeaders[] = {
    {"metal_matrix", "matrix types"},
    {"metal_simdgroup_matrix", "simdgroup_matrix"},
    {"metal_graphics", "graphics functions"},
    {"metal_interpolate", "interpolation"},
    {"metal_texture", "textures"},
    {"metal_pack", "pack and unpack functions"},
    {"metal_command_buffer", "indirect command buffers"},
    {"metal_raytracing", "ray tracing"},
    {"metal_curves", "ray tracing (curves)"},
    {"metal_logging", "shader logging"},
    {"simd/simd.h", "host-shared vector types (simd_float4, ...)"},
};

constexpr const char* kMacRejects =
    ", so the Metal compiler rejects this kernel on a Mac; the CPU path refuses it too";

// The refusal of MSL the emulator does not have: `what` (a word, a header) of `feature`.
std::string NotInEmulator(const std::string& what, const std::string& feature) {
  return what + " (" + feature +
         ") is not supported by the CPU path of metal_kernel: the MSL emulator's <metal_stdlib> "
         "has no " + feature + " (docs/kernels.md lists what it covers)";
}

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

// The word starting at text[at] ("" if none does).
std::string WordAt(const std::string& text, size_t at) {
  size_t end = at;
  while (end < text.size() && IsWordChar(text[end])) ++end;
  return text.substr(at, end - at);
}

// Empty, or why the `#include` directives of `msl_source` (`text`: the same with comments and
// literals blanked) are refused: a header that is not the Metal standard library's, or one of
// its headers whose feature the emulator does not have.
std::string IncludeRefusal(const std::string& msl_source, const std::string& text) {
  for (size_t line = 0; line < text.size();) {
    size_t i = line;
    const size_t line_end = std::min(text.find('\n', line), text.size());
    line = line_end + 1;
    while (i < line_end && IsSpaceChar(text[i])) ++i;
    if (i >= line_end || text[i] != '#') continue;
    ++i;
    while (i < line_end && IsSpaceChar(text[i])) ++i;
    if (!StartsAt(text, i, "include") || (i + 7 < text.size() && IsWordChar(text[i + 7]))) {
      continue;
    }
    i += 7;
    while (i < line_end && IsSpaceChar(msl_source[i])) ++i;  // not text's: a blanked literal
    // `<name>` stands in `text`; a quoted name only in the source (a literal, blanked in text).
    const char close = msl_source[i] == '<' ? '>' : '"';
    const size_t name_end = msl_source.find(close, i + 1);
    if (i >= line_end || (msl_source[i] != '<' && msl_source[i] != '"') ||
        name_end == std::string::npos || name_end > line_end) {
      continue;  // a macro or a malformed name: the compiler says what is wrong with it
    }
    const std::string name = msl_source.substr(i + 1, name_end - i - 1);
    const std::string spelled = msl_source.substr(i, name_end + 1 - i);
    bool covered = false;
    for (const char* header : kCoveredHeaders) {
      covered = covered || std::strcmp(name.c_str(), header) == 0;
    }
    if (covered) continue;
    for (const UncoveredHeader& header : kUncoveredHeaders) {
      if (std::strcmp(name.c_str(), header.name) == 0) {
        return NotInEmulator(spelled, header.feature);
      }
    }
    return "#include " + spelled +
           ": a Metal kernel includes only the headers of the Metal standard library "
           "(<metal_stdlib> and those of its parts, the MSL specification's chapter 6), never "
           "the C or C++ library's or a file's" + kMacRejects;
  }
  return "";
}

// Empty, or why the word `word` at text[at, end) is a use of C++ that MSL does not take:
// kCppFeatures (`= delete`, a deleted function, is C++ MSL keeps), `long long` and
// `long double`, the `std` namespace, and a derived class (`struct A : B`).
std::string CppFeatureAt(const std::string& text, const std::string& word, size_t at,
                         size_t next) {
  const char* const kNotMsl = " is not part of the Metal Shading Language (its specification, ";
  for (const CppFeature& feature : kCppFeatures) {
    if (std::strcmp(word.c_str(), feature.word) != 0) continue;
    size_t before = at;
    while (before > 0 && IsSpaceChar(text[before - 1])) --before;
    if (std::strcmp(feature.word, "delete") == 0 && before > 0 && text[before - 1] == '=') {
      return "";
    }
    return word + " (" + feature.feature + ")" + kNotMsl + "section " + feature.section + ")" +
           kMacRejects;
  }
  const std::string next_word = WordAt(text, next);
  if (std::strcmp(word.c_str(), "long") == 0 &&
      (std::strcmp(next_word.c_str(), "long") == 0 ||
       std::strcmp(next_word.c_str(), "double") == 0)) {
    return "long " + next_word + kNotMsl + "section 2.1: it has no long long, unsigned long "
           "long or long double; long is 64 bits)" + kMacRejects;
  }
  if (std::strcmp(word.c_str(), "std") == 0 &&
      (StartsAt(text, next, "::") ||
       std::strcmp(WordBefore(text, at).c_str(), "namespace") == 0)) {
    return std::string("std (the C++ standard library)") + kNotMsl +
           "section 1.5.4: Metal has its own standard library, in namespace metal)" + kMacRejects;
  }
  if ((std::strcmp(word.c_str(), "struct") == 0 || std::strcmp(word.c_str(), "class") == 0) &&
      std::strcmp(WordBefore(text, at).c_str(), "enum") != 0 && !next_word.empty()) {
    size_t colon = next + next_word.size();
    while (colon < text.size() && IsSpaceChar(text[colon])) ++colon;
    if (std::strcmp(WordAt(text, colon).c_str(), "final") == 0) {
      colon += 5;
      while (colon < text.size() && IsSpaceChar(text[colon])) ++colon;
    }
    if (colon < text.size() && text[colon] == ':' && !StartsAt(text, colon, "::")) {
      return word + " " + next_word + " : ... (a derived class)" + kNotMsl +
             "section 1.5.4)" + kMacRejects;
    }
  }
  return "";
}

}  // namespace

std::string UnsupportedFeature(const std::string& msl_source) {
  const std::string text = WithoutCommentsAndLiterals(msl_source);
  if (std::string e = IncludeRefusal(msl_source, text); !e.empty()) return e;
  size_t i = 0;
  while (i < text.size()) {
    if (!IsWordChar(text[i]) || (i > 0 && IsWordChar(text[i - 1]))) {
      ++i;
      continue;
    }
    const std::string word = WordAt(text, i);
    const size_t end = i + word.size();
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
      if (used) return NotInEmulator(word, refused.feature);
    }
    if (std::string e = CppFeatureAt(text, word, i, next); !e.empty()) return e;
    if (after == '(') {
      for (const NotMslFunctions& list : kNotMslFunctionLists) {
        for (size_t k = 0; k < list.count; ++k) {
          if (std::strcmp(word.c_str(), list.names[k]) == 0 && !DeclaresFunction(text, word)) {
            return word + " is " + list.what + kMacRejects + ". " + list.advice;
          }
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

}  // namespace tf_metal_ops
