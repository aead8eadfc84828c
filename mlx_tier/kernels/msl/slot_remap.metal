// slot_remap.metal -- kernel body for mx.fast.metal_kernel (signature generated
// by MLX from the names in mlx_tier/metal_kernels.py).
//
// Device-side slot remap of a tiered MoE layer: router expert ids -> slot ids
// through the layer's expert -> slot table, plus per-expert use counts.
//   slots[i]  = lut[inds[i]]            (uint32; 0xFFFFFFFF: expert not resident)
//   counts[e] = #{i : inds[i] == e}     (uint32; the profile / policy unit)
// Replaces: the host round trip of a fully resident layer. Today the remap
// (lut[indices]) is lazy but the router output is kept and counted later on
// the host (np.bincount); here both stay on the device, so a fully resident
// layer never syncs with the host and the counts are read once, when stats are
// asked for. Why it should help on Apple GPUs: no per-layer host sync or kept
// router arrays; a gather and a small histogram in one dispatch. Not measured
// on a Mac yet.
//
// Shapes: inds [N] uint32 (expert ids), lut [E] int32 (-1: not resident),
//   slots [N] uint32, counts [E] uint32. Grid (n, 1, 1) with n >= max(N, E),
//   any threadgroup: thread i remaps entry i and counts expert i (N is small
//   at decode: a scan of N ids per expert, no atomics, deterministic).

const uint i = thread_position_in_grid.x;
const uint N = uint(inds_shape[0]);
const uint E = uint(lut_shape[0]);
if (i < N) {
  const uint e = inds[i];
  slots[i] = e < E ? uint(lut[e]) : 0xFFFFFFFFu;
}
if (i < E) {
  uint c = 0;
  for (uint n = 0; n < N; n++) {
    c += inds[n] == i ? 1u : 0u;
  }
  counts[i] = c;
}
