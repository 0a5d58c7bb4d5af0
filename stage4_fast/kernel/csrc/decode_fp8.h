// The arguments of the fp8 decode-attention kernel (decode_fp8.cu), shared with its torch binding: plain C++.
#pragma once

#include <cstdint>

namespace stage4 {

struct DecodeFp8Args {
  const void* q;
  const uint8_t* k_cache;
  const uint8_t* v_cache;
  const int32_t* page_table;
  const int32_t* table_idx;
  const int32_t* seq_lens;
  float* mid_o;
  float* mid_lse;
  void* out;
  int64_t stride_qb, stride_qh;  // elements
  int64_t stride_kt, stride_kh, stride_vt, stride_vh;  // bytes (= elements)
  int64_t stride_pt;
  int64_t stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh;
  float scale_log2;  // softmax scale x K scale x log2(e): scores in base 2
  float v_scale;
  int num_splits;
  int group;
  int stages;       // tiles per warp in shared memory (2, 3 or 4): stages - 1 in flight while one computes
  int heads_first;  // grid order: a sequence's KV heads side by side (1) or one KV head's sequences (0)
  int warps;        // warps per program: 4 or 8
  int pdl;          // launch with programmatic dependent launch (sm_90+; kernel/pdl.py)
};

}  // namespace stage4
