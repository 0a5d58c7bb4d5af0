// decode_fp8: split-K decode attention over an fp8 KV pool, hand-written for tensor cores (sm_89 and newer).
//
// Why not Triton: its fp8 decode kernel is bound by its instruction stream, not by bytes (bench/gpu_notes.md,
// section 10: ~35 instructions per (key, KV head) row, 2.3 TB/s). Its dots need 16 query rows, so a GQA group of 2
// heads is padded 8x; V's fp8 bytes are loaded one by one because the P.V dot reduces over V's rows; every value is
// converted on its own path. Here one warp owns 16 keys at a time and, per mma.sync.m16n8k16 (fp16 in, fp32 sums),
//   * QK: S^T[16 keys x 8 heads] = K[16 keys x 16 dims] . Q^T: the keys fill the mma's 16 rows and the GQA group's
//     heads its 8 columns (up to 8 heads, padding 2 to 8 rather than to 16). The dims of a chunk of 16 are relabelled
//     so that each lane's four K values of a chunk are four consecutive bytes of its key row: a lane loads 32 bytes
//     of each of its two key rows (16-byte loads) and widens them two bytes per instruction;
//   * P.V: O^T[16 dims x 8 heads] += V^T[16 dims x 16 keys] . P^T. The output dims are relabelled so that a lane's A
//     operand over all 8 dim tiles is 16 consecutive bytes of each of its four key rows: four 16-byte loads, then a
//     byte permute pairs two keys' values of one dim and one conversion widens the pair to fp16x2. P^T reaches the
//     B operand from the QK accumulators by four shuffles (the transpose of their layout).
// (A first version put the heads in the rows, as the Triton kernel does: it padded 2 heads to 16, and moving the
// constant Q fragment and zeros into each mma's four consecutive A registers cost 95 of 514 loop instructions.)
// The keys of a 16-key tile are relabelled as well, so that the four scores a lane holds and the four V rows it loads
// are the same four consecutive positions of the sequence (one 16-byte page-table load).
//
// Contract (as the Triton split kernel's, whose merge kernel finishes a multi-split launch): grid (batch, KV head,
// split); split s of a sequence of n keys owns keys [s * chunk, min((s + 1) * chunk, n)) with chunk = n / splits
// rounded up to whole warp rounds. One split writes the output directly; else each split writes its normalised
// partial output (fp32) and log-sum-exp (natural log; -inf and zeros for a split past the end).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "common.cuh"
#include "convert.cuh"
#include "decode_fp8.h"

namespace stage4 {

// Warps per program: 4, or 8 where a launch has few programs (a small batch; the caller picks, below 2 programs per
// SM): then each program's sequence is read by twice the warps. Either way an
// SM holds 16 warps at 128 registers per thread.
constexpr int kSmWarps = 16;
constexpr int kTileKeys = 16;
constexpr int kDecodeHeadDim = 128;
constexpr int kMaxGroup = 8;  // query heads per KV head: rows 0..7 of the mma's 16
constexpr unsigned kFullMask = 0xffffffffu;

// four fp8 values (one 32-bit word) -> two fp16x2: bytes 0, 1 in `lo`, bytes 2, 3 in `hi` (one instruction each on
// sm_89+; splitting the word in PTX lets the second read the upper half in place instead of after a shift)
template <bool kE5M2>
__device__ __forceinline__ void fp8x4_to_half2x2(uint32_t x, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (kE5M2) {
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e5m2x2 %0, l; cvt.rn.f16x2.e5m2x2 %1, h; }"
        : "=r"(lo), "=r"(hi) : "r"(x));
  } else {
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e4m3x2 %0, l; cvt.rn.f16x2.e4m3x2 %1, h; }"
        : "=r"(lo), "=r"(hi) : "r"(x));
  }
#else  // older GPUs have no fp8 conversion instruction: cuda_fp8.h's emulation (the engine uses Triton there)
  const auto kind = kE5M2 ? __NV_E5M2 : __NV_E4M3;
  const __half2_raw l = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x & 0xffffu), kind);
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x >> 16), kind);
  lo = static_cast<uint32_t>(l.x) | (static_cast<uint32_t>(l.y) << 16);
  hi = static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
#endif
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// D += A . B, m16n8k16, fp16 in, fp32 accumulate. Lane (g = lane / 4, t = lane % 4) holds a = A[g][2t, 2t + 1],
// A[g + 8][2t, 2t + 1], A[g][2t + 8, 2t + 9], A[g + 8][2t + 8, 2t + 9]; b = B[2t, 2t + 1][g], B[2t + 8, 2t + 9][g];
// d = D[g][2t, 2t + 1], D[g + 8][2t, 2t + 1].
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// The token slots whose rows a lane copies: positions 4q .. 4q + 3 of a tile, q = lane / 8 (one 16-byte table
// load). Positions at or past `end` read slot 0 (a valid row, masked later).
__device__ __forceinline__ int4 load_slots(const int32_t* table, int tile, int end, int lane) {
  const int pos = tile + 4 * (lane >> 3);
  if (tile + kTileKeys <= end) return __ldg(reinterpret_cast<const int4*>(table + pos));
  int4 s;  // the sequence's last, partial tile: read no table entry past it
  s.x = pos < end ? __ldg(table + pos) : 0;
  s.y = pos + 1 < end ? __ldg(table + pos + 1) : 0;
  s.z = pos + 2 < end ? __ldg(table + pos + 2) : 0;
  s.w = pos + 3 < end ? __ldg(table + pos + 3) : 0;
  return s;
}

// One lane's bytes of a tile: k[0..1] = 32 bytes (dims 32t ..) of the K row of label g, k[2..3] of label 8 + g;
// v[i] = 16 bytes (dims 16g ..) of the V row at position 4t + i.
struct TileRows {
  uint4 k[4];
  uint4 v[4];
};

// A row's address: base + slot x stride as one 32 x 32 -> 64-bit multiply-add (slots are non-negative int32,
// row strides below 4 GB), where a signed 64-bit product takes four instructions per row.
__device__ __forceinline__ const uint8_t* row_at(const uint8_t* base, int32_t slot, uint32_t stride) {
  return base + static_cast<uint64_t>(static_cast<uint32_t>(slot)) * stride;
}

// A warp's tile in shared memory: the 16 K rows (128 bytes each, by position), then the 16 V rows. The warp copies
// whole rows (8 lanes x 16 bytes a row, four rows an instruction: every DRAM sector used once), and each lane then
// reads the bytes its fragments need. The 16-byte chunks of a row are permuted (chunk c of K row r at c ^ (r & 1),
// of V row r at c ^ 2(r / 4 % 4)) so that both the copies and those reads touch each bank once per 8 lanes.
constexpr int kRowBytes = kDecodeHeadDim;
constexpr int kStageBytes = 2 * kTileKeys * kRowBytes;  // one warp's tile: 4 KB
constexpr int kVOffset = kTileKeys * kRowBytes;

__device__ __forceinline__ void copy_16_async(uint32_t smem, const uint8_t* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem), "l"(gmem) : "memory");
}

__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int kPending>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// Where this lane's copies and reads fall in a stage (byte offsets; see above).
struct StageOffsets {
  uint32_t copy_k_even, copy_k_odd, copy_v;  // rows 4q + i, chunk lane % 8: + i x 128
  uint32_t read_k0, read_k1, read_v;         // K label g chunks 2t, 2t + 1 (label 8 + g: + 256); V: + i x 128

  __device__ __forceinline__ StageOffsets(int lane) {
    const int c = lane & 7, q = lane >> 3, g = lane >> 2, t = lane & 3;
    copy_k_even = 4 * q * kRowBytes + 16 * c;
    copy_k_odd = 4 * q * kRowBytes + 16 * (c ^ 1);
    copy_v = kVOffset + 4 * q * kRowBytes + 16 * (c ^ (2 * q));
    const int k_row = 4 * (g >> 1) + (g & 1);  // the position of key label g
    read_k0 = k_row * kRowBytes + 16 * ((2 * t) ^ (g & 1));
    read_k1 = k_row * kRowBytes + 16 * ((2 * t + 1) ^ (g & 1));
    read_v = kVOffset + 4 * t * kRowBytes + 16 * (g ^ (2 * t));
  }
};

// Starts the copies of one tile's rows (this lane's four slots `s`, chunk lane % 8) into the stage at `stage`.
__device__ __forceinline__ void copy_rows_async(const int4& s, uint32_t stage, const StageOffsets& o,
                                                const uint8_t* k_base, const uint8_t* v_base, uint32_t stride_kt,
                                                uint32_t stride_vt) {
  const int32_t slot[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    copy_16_async(stage + (i & 1 ? o.copy_k_odd : o.copy_k_even) + i * kRowBytes, row_at(k_base, slot[i], stride_kt));
    copy_16_async(stage + o.copy_v + i * kRowBytes, row_at(v_base, slot[i], stride_vt));
  }
}

__device__ __forceinline__ uint4 load_shared_16(uint32_t addr) {
  uint4 r;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(addr));
  return r;
}

__device__ __forceinline__ void load_k_rows(uint32_t stage, const StageOffsets& o, TileRows& r) {
  r.k[0] = load_shared_16(stage + o.read_k0);
  r.k[1] = load_shared_16(stage + o.read_k1);
  r.k[2] = load_shared_16(stage + o.read_k0 + 2 * kRowBytes);
  r.k[3] = load_shared_16(stage + o.read_k1 + 2 * kRowBytes);
}

__device__ __forceinline__ void load_v_rows(uint32_t stage, const StageOffsets& o, TileRows& r) {
#pragma unroll
  for (int i = 0; i < 4; ++i) r.v[i] = load_shared_16(stage + o.read_v + i * kRowBytes);
}

// Folds one 16-key tile (this lane's rows) into the warp's online softmax: running max `m_run` and sum `l_run` of
// heads 2t, 2t + 1 and the unnormalised output `acc` (O^T tiles, see the kernel).
template <bool kE5M2>
__device__ __forceinline__ void attend_tile(uint32_t stage, const StageOffsets& o, const uint32_t (&q_frag)[16], int tile, int end, int g,
                                            int t, float scale_log2, float (&acc)[8][4], float (&m_run)[2],
                                            float (&l_run)[2]) {
    TileRows rows;
    load_k_rows(stage, o, rows);
    // S^T = K . Q^T over 8 chunks of 16 dims: s = keys g (s[0..1]) and 8 + g (s[2..3]) x heads 2t, 2t + 1
    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      uint32_t k_frag[4];
      fp8x4_to_half2x2<kE5M2>(word_of(rows.k[c / 4], c % 4), k_frag[0], k_frag[2]);
      fp8x4_to_half2x2<kE5M2>(word_of(rows.k[2 + c / 4], c % 4), k_frag[1], k_frag[3]);
      mma_16816(s, k_frag, q_frag[2 * c], q_frag[2 * c + 1]);
    }
    load_v_rows(stage, o, rows);
    if (tile + kTileKeys > end) {  // the last, partial tile: keys past the end score -inf and their V rows are 0
      const int k_pos = tile + 4 * (g >> 1) + (g & 1);
      if (k_pos >= end) s[0] = s[1] = -INFINITY;
      if (k_pos + 2 >= end) s[2] = s[3] = -INFINITY;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (tile + 4 * t + i >= end) rows.v[i] = make_uint4(0u, 0u, 0u, 0u);
      }
    }

    // online softmax per head over the tile's 16 keys, which lie across the 8 row groups (lane bits 2..4)
    float tile_max[2] = {fmaxf(s[0], s[2]), fmaxf(s[1], s[3])};
#pragma unroll
    for (int mask = 4; mask < kWarpSize; mask *= 2) {
      tile_max[0] = fmaxf(tile_max[0], __shfl_xor_sync(kFullMask, tile_max[0], mask));
      tile_max[1] = fmaxf(tile_max[1], __shfl_xor_sync(kFullMask, tile_max[1], mask));
    }
    const float m_new[2] = {fmaxf(m_run[0], tile_max[0]), fmaxf(m_run[1], tile_max[1])};
    if (__any_sync(kFullMask, m_new[0] > m_run[0] || m_new[1] > m_run[1])) {  // rare after the first few tiles
      const float alpha[2] = {fast_exp2((m_run[0] - m_new[0]) * scale_log2),
                              fast_exp2((m_run[1] - m_new[1]) * scale_log2)};
      l_run[0] *= alpha[0];
      l_run[1] *= alpha[1];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        acc[j][0] *= alpha[0];
        acc[j][2] *= alpha[0];
        acc[j][1] *= alpha[1];
        acc[j][3] *= alpha[1];
      }
      m_run[0] = m_new[0];
      m_run[1] = m_new[1];
    }
    const float m_scaled[2] = {m_run[0] * scale_log2, m_run[1] * scale_log2};
    float p[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = fast_exp2(fmaf(s[i], scale_log2, -m_scaled[i & 1]));
    l_run[0] += p[0] + p[2];
    l_run[1] += p[1] + p[3];

    // P^T as the B operand of P.V: lane (g, t) needs head g at key labels 2t, 2t + 1 (b0) and 8 + 2t, 9 + 2t (b1),
    // which lanes (2t, g / 2) and (2t + 1, g / 2) hold as heads (g & ~1, g | 1) of labels 2t (+ 8) and 2t + 1 (+ 8)
    const uint32_t p_key = pack_half2(p[0], p[1]);       // label g: heads 2t, 2t + 1
    const uint32_t p_key8 = pack_half2(p[2], p[3]);      // label 8 + g
    const int src0 = 4 * (2 * t) + (g >> 1), src1 = src0 + 4;
    const uint32_t x0 = __shfl_sync(kFullMask, p_key, src0), x1 = __shfl_sync(kFullMask, p_key, src1);
    const uint32_t y0 = __shfl_sync(kFullMask, p_key8, src0), y1 = __shfl_sync(kFullMask, p_key8, src1);
    const uint32_t pick = (g & 1) ? 0x7632u : 0x5410u;  // the upper or lower head of each pair
    const uint32_t p_b0 = __byte_perm(x0, x1, pick), p_b1 = __byte_perm(y0, y1, pick);

    // O^T += V^T . P^T: tile j = dims 16g + 2j (rows g) and 16g + 2j + 1 (rows 8 + g); a byte permute pairs the V rows
    // at positions 4t, 4t + 1 (labels 2t, 2t + 1) and 4t + 2, 4t + 3 (labels 8 + 2t, 9 + 2t) dim by dim
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint32_t r0 = word_of(rows.v[0], w), r1 = word_of(rows.v[1], w);
      const uint32_t r2 = word_of(rows.v[2], w), r3 = word_of(rows.v[3], w);
      uint32_t v_frag[2][4];  // tiles 2w (dims 4w, 4w + 1 of the lane's 16) and 2w + 1 (4w + 2, 4w + 3)
      fp8x4_to_half2x2<kE5M2>(__byte_perm(r0, r1, 0x5140), v_frag[0][0], v_frag[0][1]);
      fp8x4_to_half2x2<kE5M2>(__byte_perm(r2, r3, 0x5140), v_frag[0][2], v_frag[0][3]);
      fp8x4_to_half2x2<kE5M2>(__byte_perm(r0, r1, 0x7362), v_frag[1][0], v_frag[1][1]);
      fp8x4_to_half2x2<kE5M2>(__byte_perm(r2, r3, 0x7362), v_frag[1][2], v_frag[1][3]);
      mma_16816(acc[2 * w], v_frag[0], p_b0, p_b1);
      mma_16816(acc[2 * w + 1], v_frag[1], p_b0, p_b1);
    }
}

template <typename QT, bool kE5M2, bool kDirect, int kStages, int kDecodeWarps>
__global__ void __launch_bounds__(kDecodeWarps * kWarpSize, kSmWarps / kDecodeWarps)
    decode_fp8_kernel(const DecodeFp8Args a) {
  constexpr int kDecodeThreads = kDecodeWarps * kWarpSize;
  constexpr int kRoundKeys = kTileKeys * kDecodeWarps;  // the keys one round of all warps covers
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int g = lane >> 2;  // the mma's row group: key labels g and 8 + g, query head g, V dims 16g ..
  const int t = lane & 3;   // the thread in the group: K dims 32t .., query heads 2t and 2t + 1, V positions 4t ..
  // heads first: the programs of one sequence's KV heads start together and read the same token rows (128 bytes
  // each of a row's 1 KB) at about the same time
  const int b = a.heads_first ? blockIdx.y : blockIdx.x;
  const int kv_head = a.heads_first ? blockIdx.x : blockIdx.y;
  const int split = blockIdx.z;

  const int seq_len = a.seq_lens[b];
  const int per_split = (seq_len + a.num_splits - 1) / a.num_splits;
  const int chunk = (per_split + kRoundKeys - 1) / kRoundKeys * kRoundKeys;
  const int start = split * chunk;
  const int end = min(start + chunk, seq_len);
  const int32_t* table = a.page_table + static_cast<int64_t>(a.table_idx[b]) * a.stride_pt;

  const uint8_t* k_base = a.k_cache + kv_head * a.stride_kh + 16 * (lane & 7);  // this lane's chunk of each row
  const uint8_t* v_base = a.v_cache + kv_head * a.stride_vh + 16 * (lane & 7);
  const uint32_t stride_kt = static_cast<uint32_t>(a.stride_kt), stride_vt = static_cast<uint32_t>(a.stride_vt);
  float acc[8][4];  // O^T tile j: dims 16g + 2j (acc[j][0..1]) and 16g + 2j + 1 (acc[j][2..3]), heads 2t, 2t + 1
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};  // running max of heads 2t, 2t + 1 (raw scores)
  float l_run[2] = {0.f, 0.f};              // this lane's share of their running sums

  // Each warp takes every kDecodeWarps-th tile of the split and keeps kStages - 1 of its next tiles in flight, copied
  // into shared memory while it computes; the page-table entries of a tile are read two rounds before its copies
  // start, so that no copy waits on its address.
  extern __shared__ __align__(16) uint8_t smem[];
  const uint32_t warp_stages = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + warp * kStages * kStageBytes;
  const StageOffsets offsets(lane);
  int tile = start + warp * kTileKeys;
  int next_copy = tile;  // the next tile whose rows to copy
  uint32_t q_frag[16];
  {
    // The lengths, the page table and the first tiles' slots come from the host's copies, which came before the
    // previous kernel; q and the newest K/V row are that kernel's output: the wait sits between the two. The first
    // tiles that hold only older keys (written in earlier steps) are copied before the wait as well, so that their
    // DRAM latency overlaps the previous kernel's tail; the others, and every tile of a sequence whose newest key
    // they hold, after it.
    int4 first[kStages - 1];
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) {
      if (next_copy + i * kRoundKeys < end) first[i] = load_slots(table, next_copy + i * kRoundKeys, end, lane);
    }
    const int newest = seq_len - 1;  // the position whose K/V the previous kernel wrote
    int copied_early = 0;
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) {
      if (copied_early == i && next_copy < end && next_copy + kTileKeys <= newest) {
        copy_rows_async(first[i], warp_stages + i * kStageBytes, offsets, k_base, v_base, stride_kt, stride_vt);
        commit_copies();
        next_copy += kRoundKeys;
        ++copied_early;
      }
    }
    pdl_wait_then_release();
    // Q^T as the B operand of QK chunk c (head g): q_frag[2c] = dims 32t + 4c + {0, 1}, q_frag[2c + 1] = + {2, 3}.
    // Heads past the group are zero columns: their scores are 0 and their outputs are never read.
    const QT* q_row = static_cast<const QT*>(a.q) + b * a.stride_qb + (kv_head * a.group + g) * a.stride_qh + 32 * t;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      q_frag[i] = g < a.group ? pack_half2(to_float(q_row[2 * i]), to_float(q_row[2 * i + 1])) : 0u;
    }
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) {
      if (i < copied_early) continue;
      if (next_copy < end) {
        copy_rows_async(first[i], warp_stages + i * kStageBytes, offsets, k_base, v_base, stride_kt, stride_vt);
      }
      commit_copies();
      next_copy += kRoundKeys;
    }
  }
  int4 ahead[2];  // the slots of tiles next_copy and next_copy + one round
  if (next_copy < end) ahead[0] = load_slots(table, next_copy, end, lane);
  if (next_copy + kRoundKeys < end) ahead[1] = load_slots(table, next_copy + kRoundKeys, end, lane);
  int stage = 0;
  for (; tile < end; tile += kRoundKeys) {
    wait_copies<kStages - 2>();  // this lane's copies of this tile (each round commits one group, empty past the end)
    __syncwarp();                // ... and the other lanes' (and every lane is done reading the stage refilled next)
    const int refill = stage == 0 ? kStages - 1 : stage - 1;  // the stage the previous round read
    if (next_copy < end) {
      copy_rows_async(ahead[0], warp_stages + refill * kStageBytes, offsets, k_base, v_base, stride_kt, stride_vt);
    }
    commit_copies();
    next_copy += kRoundKeys;
    ahead[0] = ahead[1];
    if (next_copy + kRoundKeys < end) ahead[1] = load_slots(table, next_copy + kRoundKeys, end, lane);
    attend_tile<kE5M2>(warp_stages + stage * kStageBytes, offsets, q_frag, tile, end, g, t, a.scale_log2, acc, m_run,
                       l_run);
    stage = stage + 1 == kStages ? 0 : stage + 1;
  }
  wait_copies<0>();

  // merge the warps: each leaves its per-head max, sum and unnormalised output
  __shared__ float warp_max[kDecodeWarps][kMaxGroup];
  __shared__ float warp_sum[kDecodeWarps][kMaxGroup];
  auto& warp_out = *reinterpret_cast<float (*)[kDecodeWarps][kMaxGroup][kDecodeHeadDim]>(smem);  // over the stages
  __syncthreads();  // every warp is done reading its stages
#pragma unroll
  for (int mask = 4; mask < kWarpSize; mask *= 2) {
    l_run[0] += __shfl_xor_sync(kFullMask, l_run[0], mask);
    l_run[1] += __shfl_xor_sync(kFullMask, l_run[1], mask);
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int h = 2 * t + e;
    if (h < a.group) {
      if (g == 0) {
        warp_max[warp][h] = m_run[e];
        warp_sum[warp][h] = l_run[e];
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        warp_out[warp][h][16 * g + 2 * j] = acc[j][e];
        warp_out[warp][h][16 * g + 2 * j + 1] = acc[j][2 + e];
      }
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < a.group * kDecodeHeadDim; idx += kDecodeThreads) {
    const int h = idx / kDecodeHeadDim;
    const int d = idx % kDecodeHeadDim;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) m = fmaxf(m, warp_max[w][h]);
    float sum = 0.f, o = 0.f;
    if (m != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kDecodeWarps; ++w) {
        const float weight = fast_exp2((warp_max[w][h] - m) * a.scale_log2);  // 0 for a warp without keys
        sum += warp_sum[w][h] * weight;
        o += warp_out[w][h][d] * weight;
      }
    }
    const int head = kv_head * a.group + h;
    if constexpr (kDirect) {
      static_cast<QT*>(a.out)[b * a.stride_ob + head * a.stride_oh + d] = from_float<QT>(o / sum * a.v_scale);
    } else {
      const bool has_keys = sum > 0.f;  // a split past the end of a short sequence holds nothing
      a.mid_o[b * a.stride_mob + head * a.stride_moh + split * a.stride_mos + d] =
          has_keys ? o / sum * a.v_scale : 0.f;
      if (d == 0) {
        a.mid_lse[b * a.stride_mlb + head * a.stride_mlh + split] =
            has_keys ? (m * a.scale_log2 + __log2f(sum)) * 0.69314718055994531f : -INFINITY;
      }
    }
  }
}

template <typename QT, bool kE5M2, bool kDirect, int kStages, int kWarps>
void launch_warps(const DecodeFp8Args& a, dim3 grid, cudaStream_t stream) {
  constexpr int smem_bytes = kStages * kWarps * kStageBytes;
  static const cudaError_t configured = cudaFuncSetAttribute(  // above the 48 KB a launch gets unasked
      decode_fp8_kernel<QT, kE5M2, kDirect, kStages, kWarps>, cudaFuncAttributeMaxDynamicSharedMemorySize,
      smem_bytes);
  (void)configured;
  cudaLaunchAttribute dependent{};
  dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(kWarps * kWarpSize);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &dependent;
  config.numAttrs = a.pdl ? 1 : 0;
  cudaLaunchKernelEx(&config, decode_fp8_kernel<QT, kE5M2, kDirect, kStages, kWarps>, a);
}

template <typename QT, bool kE5M2, bool kDirect, int kStages>
void launch_stages(const DecodeFp8Args& a, dim3 grid, cudaStream_t stream) {
  a.warps == 8 ? launch_warps<QT, kE5M2, kDirect, kStages, 8>(a, grid, stream)
               : launch_warps<QT, kE5M2, kDirect, kStages, 4>(a, grid, stream);
}

template <typename QT, bool kE5M2, bool kDirect>
void launch_direct(const DecodeFp8Args& a, dim3 grid, cudaStream_t stream) {
  switch (a.stages) {
    case 2: return launch_stages<QT, kE5M2, kDirect, 2>(a, grid, stream);
    case 3: return launch_stages<QT, kE5M2, kDirect, 3>(a, grid, stream);
    default: return launch_stages<QT, kE5M2, kDirect, 4>(a, grid, stream);
  }
}

template <typename QT, bool kE5M2>
void launch_decode_fp8(const DecodeFp8Args& a, int batch, int num_kv_heads, bool direct, cudaStream_t stream) {
  const dim3 grid = a.heads_first ? dim3(num_kv_heads, batch, a.num_splits) : dim3(batch, num_kv_heads, a.num_splits);
  direct ? launch_direct<QT, kE5M2, true>(a, grid, stream) : launch_direct<QT, kE5M2, false>(a, grid, stream);
}

}  // namespace stage4

// q_dtype: 1 float16, 2 bfloat16; e5m2: 0 = e4m3 pool, 1 = e5m2 pool. The caller checked head_dim == 128,
// group <= 8, a page-table row stride of a multiple of 4 and 16-byte aligned K/V rows.
int stage4_decode_fp8(const stage4::DecodeFp8Args& args, int q_dtype, int e5m2, int batch, int num_kv_heads,
                      int direct, cudaStream_t stream) {
  if (batch == 0) return 0;
  const bool d = direct != 0;
  if (q_dtype == 1) {
    e5m2 ? stage4::launch_decode_fp8<__half, true>(args, batch, num_kv_heads, d, stream)
         : stage4::launch_decode_fp8<__half, false>(args, batch, num_kv_heads, d, stream);
  } else {
    e5m2 ? stage4::launch_decode_fp8<__nv_bfloat16, true>(args, batch, num_kv_heads, d, stream)
         : stage4::launch_decode_fp8<__nv_bfloat16, false>(args, batch, num_kv_heads, d, stream);
  }
  return static_cast<int>(cudaGetLastError());
}
