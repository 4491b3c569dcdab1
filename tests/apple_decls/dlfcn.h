// The part of macOS's <dlfcn.h> used by csrc/metal/*.mm, for the Linux syntax check only (see
// README.md). Found first on the include path, so the check sees the macOS declaration rather than
// glibc's (which happens to agree).
// https://developer.apple.com/library/archive/documentation/System/Conceptual/ManPages_iPhoneOS/man3/dladdr.3.html
//   "int dladdr(const void* addr, Dl_info* info); ... const char* dli_fname  The pathname of the
//   shared object containing the address ... If an image containing addr cannot be found,
//   dladdr() returns 0. On success, a non-zero value is returned."
#ifndef TF_METAL_OPS_APPLE_DECLS_DLFCN_H_
#define TF_METAL_OPS_APPLE_DECLS_DLFCN_H_

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dl_info {
  const char *dli_fname; /* pathname of the shared object */
  void *dli_fbase;       /* base address of the shared object */
  const char *dli_sname; /* name of the nearest symbol */
  void *dli_saddr;       /* address of the nearest symbol */
} Dl_info;

int dladdr(const void *addr, Dl_info *info);

#ifdef __cplusplus
}
#endif

#endif  // TF_METAL_OPS_APPLE_DECLS_DLFCN_H_
