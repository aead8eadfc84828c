// metal_shim.h -- compile mx.fast.metal_kernel bodies (mlx_tier/kernels/msl/*.metal)
// unchanged with g++, and run their grid on the CPU.
//
// Metal's address spaces are defined away; `threadgroup` becomes `static`, one
// copy shared by the threads of the emulated threadgroup (threadgroups run one
// after another, so a body must not keep threadgroup data across groups --
// Metal gives no such guarantee either). Each thread of a threadgroup is a
// fiber (ucontext); fibers run round-robin and yield only at a barrier or a
// simdgroup operation, so threads run in lockstep between synchronisation
// points as on the GPU. simd_* reductions exchange values through a per-lane
// slot between two simdgroup barriers. SIMD width 32 (Apple GPUs).
#pragma once
#include <sys/types.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <vector>

#define device
#define constant
#define thread
#define threadgroup static

typedef unsigned char uchar;
typedef _Float16 half;  // IEEE binary16 like Metal's half (GCC >= 12 on x86-64); no bfloat16 here
struct uint3 {
  uint x, y, z;
};

namespace metal {
using std::abs;
using std::exp;
using std::fabs;
using std::log;
using std::max;
using std::min;
using std::sqrt;
using std::tanh;
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
namespace precise {
using std::exp;
}
namespace fast {
using std::exp;
}
}  // namespace metal
using namespace metal;  // MLX's generated source has `using namespace metal`

namespace shim {
constexpr uint kSimdWidth = 32;

struct Position {  // the attribute values of one thread
  uint3 thread_position_in_grid, threadgroup_position_in_grid, thread_position_in_threadgroup;
  uint3 threads_per_threadgroup, threads_per_grid, threadgroups_per_grid;
  uint thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup;
  uint threads_per_simdgroup, simdgroups_per_threadgroup;
};

struct Barrier {  // generation barrier over the live threads of a group
  int gen = 0, arrived = 0, live = 0;
};

struct Group {  // one threadgroup being emulated
  ucontext_t main;
  std::vector<ucontext_t> ctx;
  std::vector<std::vector<char>> stacks;
  std::vector<char> done;
  std::vector<Barrier> simd;
  Barrier all;
  std::vector<double> lanes;  // one exchange slot per thread (exact for float/int32)
  std::vector<Position> pos;
  const std::function<void(const Position&)>* body = nullptr;
  int current = 0;
};

inline Group* g = nullptr;

inline void yield() { swapcontext(&g->ctx[g->current], &g->main); }

inline void sync(Barrier& b) {
  const int gen = b.gen;
  b.arrived++;
  while (b.gen == gen) {
    if (b.arrived >= b.live) {
      b.arrived = 0;
      b.gen++;
      break;
    }
    yield();
  }
}

inline void trampoline() {
  const int me = g->current;
  (*g->body)(g->pos[me]);
  g->done[me] = 1;
  g->simd[me / kSimdWidth].live--;
  g->all.live--;
}  // returns to g->main through uc_link

// Runs `body` for every thread of a grid of `grid` threads in groups of `tg`
// (both must divide evenly, as the host code in mlx_tier/metal_kernels.py does).
inline void launch(const uint* grid, const uint* tg, const std::function<void(const Position&)>& body) {
  for (int a = 0; a < 3; a++)
    if (tg[a] == 0 || grid[a] % tg[a] != 0) throw std::invalid_argument("grid not a multiple of threadgroup");
  const uint n = tg[0] * tg[1] * tg[2];
  const uint3 groups{grid[0] / tg[0], grid[1] / tg[1], grid[2] / tg[2]};
  Group grp;
  g = &grp;
  grp.ctx.resize(n);
  grp.stacks.assign(n, std::vector<char>(64 * 1024));
  grp.lanes.resize(n);
  grp.pos.resize(n);
  grp.body = &body;
  for (uint gz = 0; gz < groups.z; gz++)
    for (uint gy = 0; gy < groups.y; gy++)
      for (uint gx = 0; gx < groups.x; gx++) {
        grp.done.assign(n, 0);
        grp.simd.assign((n + kSimdWidth - 1) / kSimdWidth, Barrier{});
        grp.all = Barrier{0, 0, int(n)};
        for (uint t = 0; t < n; t++) {
          Position& p = grp.pos[t];
          const uint3 local{t % tg[0], (t / tg[0]) % tg[1], t / (tg[0] * tg[1])};
          p.thread_position_in_threadgroup = local;
          p.threadgroup_position_in_grid = {gx, gy, gz};
          p.thread_position_in_grid = {gx * tg[0] + local.x, gy * tg[1] + local.y, gz * tg[2] + local.z};
          p.threads_per_threadgroup = {tg[0], tg[1], tg[2]};
          p.threads_per_grid = {grid[0], grid[1], grid[2]};
          p.threadgroups_per_grid = groups;
          p.thread_index_in_threadgroup = t;
          p.thread_index_in_simdgroup = t % kSimdWidth;
          p.simdgroup_index_in_threadgroup = t / kSimdWidth;
          p.threads_per_simdgroup = kSimdWidth;
          p.simdgroups_per_threadgroup = (n + kSimdWidth - 1) / kSimdWidth;
          grp.simd[t / kSimdWidth].live++;
          getcontext(&grp.ctx[t]);
          grp.ctx[t].uc_stack.ss_sp = grp.stacks[t].data();
          grp.ctx[t].uc_stack.ss_size = grp.stacks[t].size();
          grp.ctx[t].uc_link = &grp.main;
          makecontext(&grp.ctx[t], trampoline, 0);
        }
        for (uint left = n; left > 0;) {  // round-robin until every thread returned
          left = 0;
          for (uint t = 0; t < n; t++) {
            if (grp.done[t]) continue;
            grp.current = int(t);
            swapcontext(&grp.main, &grp.ctx[t]);
            left += grp.done[t] ? 0 : 1;
          }
        }
      }
  g = nullptr;
}

template <typename V, typename Op>
V simd_reduce(V v, Op op) {
  const int me = g->current;
  const int base = me - me % int(kSimdWidth);
  Barrier& b = g->simd[me / kSimdWidth];
  g->lanes[me] = double(v);
  sync(b);  // every live lane has written
  bool first = true;
  V acc{};
  for (int l = base; l < base + int(kSimdWidth) && l < int(g->done.size()); l++) {
    if (g->done[l]) continue;
    const V lv = V(g->lanes[l]);
    acc = first ? lv : op(acc, lv);
    first = false;
  }
  sync(b);  // every live lane has read
  return acc;
}
}  // namespace shim

template <typename V>
V simd_sum(V v) {
  return shim::simd_reduce(v, [](V a, V b) { return a + b; });
}
template <typename V>
V simd_max(V v) {
  return shim::simd_reduce(v, [](V a, V b) { return a > b ? a : b; });
}
template <typename V>
V simd_min(V v) {
  return shim::simd_reduce(v, [](V a, V b) { return a < b ? a : b; });
}
inline void threadgroup_barrier(mem_flags) { shim::sync(shim::g->all); }
inline void simdgroup_barrier(mem_flags) { shim::sync(shim::g->simd[shim::g->current / shim::kSimdWidth]); }
