// What every kernel with AMX variants shares (packed_gemm.cc, paged_decode.cc): whether the
// compiler has the tile intrinsics, the target attribute of a function that uses them, the
// process's permission to use the tile registers, and a tile configuration. build.py hashes
// this header with each source.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

// AMX intrinsics came with GCC 11 and Clang 12: an older compiler (or -DJAXBATCH_NO_AMX, as a
// test builds it) builds everything else, and the AMX handlers then refuse (JaxbatchAmxBuilt
// says which; availability.built_with_amx asks).
#if defined(__has_include) && !defined(JAXBATCH_NO_AMX)
#if __has_include(<amxtileintrin.h>) || __has_include(<amxintrin.h>)
#define JAXBATCH_HAVE_AMX 1
#endif
#endif
#ifndef JAXBATCH_HAVE_AMX
#define JAXBATCH_HAVE_AMX 0
#endif

#define JAXBATCH_AMX __attribute__((target("amx-tile,amx-bf16,amx-int8")))

namespace jaxbatch_amx {

// Linux hands a process the tile registers' state only once asked (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA): false where it refuses (no AMX, an old kernel).
inline bool Permitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return permitted;
}

// `ldtilecfg`'s operand: palette 1, each tile's bytes per row and rows.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  bool operator==(const TileConfig& o) const { return std::memcmp(this, &o, sizeof o) == 0; }
};

}  // namespace jaxbatch_amx

// Each library with AMX variants defines this with this macro (availability.built_with_amx
// looks it up by name).
#define JAXBATCH_DEFINE_AMX_BUILT                                                       \
  extern "C" __attribute__((visibility("default"))) int JaxbatchAmxBuilt() {            \
    return JAXBATCH_HAVE_AMX;                                                           \
  }
