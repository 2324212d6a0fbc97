// The AMX tile unit as the kernels use it: permission to use its state, one configuration (every
// tile 16 rows of 64 bytes), and a 2 x 2 blocked product step. Include only where __AMX_TILE__
// and __AMX_BF16__ are set.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace speedkv {

// Linux hands a process the tile registers' state only when asked (arch_prctl); oneDNN asks
// too, so this is usually already granted. Without it the tile instructions fault, so a kernel
// must not use them then.
inline bool amx_granted() {
  static const bool granted = [] {
    constexpr int kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr int kTileData = 18;               // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return granted;
}

// Every tile 16 rows of 64 bytes. Each product step is blocked 2 x 2: tiles 0-3 hold the
// float32 sums of two blocks of 16 rows by two blocks of 16 columns, tiles 4-5 the two left
// operands, 6-7 the two right ones, so each operand loaded feeds two products and the four
// products of a step do not wait on each other.
struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Per thread: tile state is a thread's own.
inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

// sums (tiles 0-3) += left (4: rows 0-15, 5: rows 16-31) x right (6: columns 0-15, 7: 16-31).
// Left tiles are 16 rows of 32 bfloat16 values (`left_stride` bytes apart, the second tile
// `left_half` bytes on); right tiles 16 rows of 16 pairs, the layout the product takes.
inline void product_2x2(const void* left, int64_t left_stride, int64_t left_half,
                        const void* right, int64_t right_stride, int64_t right_half) {
  const auto* l = static_cast<const char*>(left);
  const auto* r = static_cast<const char*>(right);
  _tile_loadd(4, l, left_stride);
  _tile_loadd(6, r, right_stride);
  _tile_dpbf16ps(0, 4, 6);
  _tile_loadd(7, r + right_half, right_stride);
  _tile_dpbf16ps(1, 4, 7);
  _tile_loadd(5, l + left_half, left_stride);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

// Tiles 0-3 to or from a 32 x 32 float32 block at `p` (row stride in bytes).
inline void store_sums_2x2(float* p, int64_t stride) {
  float* lower = p + 16 * (stride / sizeof(float));
  _tile_stored(0, p, stride);
  _tile_stored(1, p + 16, stride);
  _tile_stored(2, lower, stride);
  _tile_stored(3, lower + 16, stride);
}

inline void load_sums_2x2(const float* p, int64_t stride) {
  const float* lower = p + 16 * (stride / sizeof(float));
  _tile_loadd(0, p, stride);
  _tile_loadd(1, p + 16, stride);
  _tile_loadd(2, lower, stride);
  _tile_loadd(3, lower + 16, stride);
}

inline void zero_sums_2x2() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

}  // namespace speedkv
