// ___isPlatformVersionAtLeast for the link check of tests/cross/macos_arm64_build.sh only.
//
// clang compiles `if (@available(macOS 14.0, *))` into a call to this function, which lives in
// compiler-rt's builtins (libclang_rt.osx.a) that a Mac's clang links into every binary by
// itself. Debian's clang ships no Darwin builtins, so the cross-link would otherwise leave the
// symbol unresolved. The real build never uses this file.
//
// It does what compiler-rt documents for it on macOS 10.15 and later (lib/builtins/
// os_version_check.c, https://github.com/llvm/llvm-project): ask dyld through
// _availability_version_check, with the version packed as 0xMMMMmmpp. Written that way, the link
// also checks that the libSystem function it depends on exists.
#include <stdbool.h>
#include <stdint.h>

typedef struct {
  uint32_t platform;
  uint32_t version;
} dyld_build_version_t;

extern bool _availability_version_check(uint32_t count, dyld_build_version_t versions[]);

// Hidden, as in compiler-rt's static library: each binary carries its own copy.
__attribute__((visibility("hidden"))) int32_t __isPlatformVersionAtLeast(
    uint32_t platform, uint32_t major, uint32_t minor, uint32_t subminor) {
  dyld_build_version_t version = {
      platform, (major << 16) | ((minor & 0xffu) << 8) | (subminor & 0xffu)};
  return _availability_version_check(1, &version);
}
