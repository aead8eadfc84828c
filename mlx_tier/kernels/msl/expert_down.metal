// expert_down.metal -- kernel body for mx.fast.metal_kernel (signature generated
// by MLX from the names in mlx_tier/metal_kernels.py).
//
// Decode-time second half of a tiered expert block: for each (token, choice)
// pair, gather the expert's down projection from the slot slab by slot id,
// dequantise affine BITS-bit weights (2,3,4,5,6,8; group size GS) and compute
//   COMBINE = 0:  y[p, o] = h[p] . Wd[slot(p), o]                    [T, K, D]
//   COMBINE = 1:  y[t, o] = sum_j scores[t, j] * (h[t*K+j] . Wd[...])   [T, D]
// Replaces: mx.gather_qmm for down_proj and, with COMBINE, the MoE block's
// (y * scores[..., None]).sum(-2): the [T, K, D] intermediate is never written.
// Why it should help on Apple GPUs: one dispatch, no intermediate round trip in
// a bandwidth-bound decode step (published MLX kernel kits: +2-12% for fused
// MoE decode). Not measured on a Mac yet.
//
// Shapes: h [T*K, H] float32, slots [T, K] uint32 (>= S: not resident, adds 0),
//   scores [T, K] float32 (read only with COMBINE), down_w [S, D, H*BITS/32]
//   uint32, down_s/down_b [S, D, H/GS] (type ST), y [T, K, D] or [T, D] (type T).
// Grid (32*D, T*K or T, 1); threadgroup (32*n, 1, 1): one simdgroup per output
// feature; packing and the scale/bias sum as in expert_gate_up.metal.

const uint lane = thread_index_in_simdgroup;
const uint row = thread_position_in_grid.x / 32;
const uint out_row = thread_position_in_grid.y;
const int H = h_shape[1];
const int K = slots_shape[1];
const int S = down_w_shape[0];
const int D = down_w_shape[1];
const int row_bytes = H * BITS / 8;
const int n_groups = H / GS;
const ulong mask = (ulong(1) << BITS) - ulong(1);
const uint first = COMBINE ? out_row * uint(K) : out_row;
const uint count = COMBINE ? uint(K) : 1u;
float total = 0.0f;
for (uint p = first; p < first + count; p++) {
  const uint slot = slots[p];
  if (slot >= uint(S)) {
    continue;
  }
  const size_t wrow = size_t(slot) * D + row;
  const device uint8_t* w = (const device uint8_t*)down_w + wrow * row_bytes;
  float acc = 0.0f;
  for (int i = int(lane) * 8; i < H; i += 32 * 8) {
    const int g = i / GS;
    ulong pk = 0;
    for (int b = 0; b < BITS; b++) {
      pk |= ulong(w[(i / 8) * BITS + b]) << (8 * b);
    }
    float hsum = 0.0f;
    float qh = 0.0f;
    for (int m = 0; m < 8; m++) {
      const float hv = h[size_t(p) * H + i + m];
      hsum += hv;
      qh += float((pk >> (m * BITS)) & mask) * hv;
    }
    acc += float(down_s[wrow * n_groups + g]) * qh + float(down_b[wrow * n_groups + g]) * hsum;
  }
  acc = simd_sum(acc);
  total += COMBINE ? float(scores[p]) * acc : acc;
}
if (lane == 0) {
  y[size_t(out_row) * D + row] = T(total);
}
