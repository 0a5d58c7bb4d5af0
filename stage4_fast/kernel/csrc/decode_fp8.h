// The arguments of the fp8 decode-attention kernel (decode_fp8.cu), shared with its torch binding: plain C++.
#pragma once

#include <cstdint>

namespace stage4 {

// The one stage count the q/k prologue variant is built for: the engine's (DECODE_FP8_CUDA_STAGES in
// kernel/triton_attention.py); other counts are there for benchmarks and keep their build count down.
constexpr int kFusedStages = 2;

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

  // The q/k norm + RoPE prologue (decode_fp8.cu, "the prologue"): set `qkv` and the kernel reads this step's raw
  // projection instead of `q`: it normalises and rotates q itself, and the program that owns a sequence's newest key
  // also normalises, rotates and quantizes that key and value into the pool (the work of the q/k norm + RoPE
  // kernel with its fused store, kernel/triton_fused.py, one launch per layer less). Null `qkv`: q is given.
  const void* qkv = nullptr;     // [B, (Hq + 2 Hkv) * 128] in q's dtype: q heads, k heads, v heads
  int64_t stride_qkv = 0;        // elements
  int num_qo_heads = 0;
  int num_kv_heads = 0;
  const void* q_norm = nullptr;  // [128] per-head RMSNorm weights in q's dtype, or null for no norm (both or none)
  const void* k_norm = nullptr;
  float norm_eps = 0.f;
  const void* hidden = nullptr;  // [B, hidden_size]: each row's RMS factor scales q, k and v first (the deferred
  int64_t stride_hidden = 0;     // input norm, models/decoder.py), or null
  int hidden_size = 0;
  float hidden_eps = 0.f;
  const float* cos_sin = nullptr;  // [max_position, 128] fp32: cos of the 64 frequencies, then sin
  int64_t stride_cs = 0;
  const int32_t* positions = nullptr;  // [B]
  const int32_t* out_loc = nullptr;    // [B] the newest key's slot in the pool
  uint8_t* k_store = nullptr;          // the pool again, written (k_cache / v_cache are read)
  uint8_t* v_store = nullptr;
  float k_store_scale = 1.f;  // the pool's scales: stored value = x / scale
  float v_store_scale = 1.f;
};

}  // namespace stage4
