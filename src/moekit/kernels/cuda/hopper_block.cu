// Block-scaled fp8 expert GEMMs for Hopper (sm_90a): DeepSeek-V3's recipe ("fp8_w8a8_block128":
// weights in 128 x 128 blocks, activations in 1 x 128 groups, each with an fp32 scale) over the
// rows of moekit's alignment, in CUDA with warp-specialized warpgroups.
//
// Why CUDA: every K block's product must be scaled before it joins the accumulator. Triton waits
// for each warpgroup product before that multiply-add, and Triton 3.6's Gluon could not keep one
// warpgroup's products in flight while another promotes (ptxas serialized them inside
// warp-specialized partitions; bench/NOTES-triton.md). Here the roles are plain branches:
//
//   warpgroup 0, one thread:  TMA loads of each K step's A rows [128 x 128] and weight block
//                             [128 x 128] into a ring of STAGES shared-memory stages;
//   warpgroups 1 and 2:       64 rows of the 128-row tile each: per K step four m64n128k32
//                             products into a fresh accumulator, wait, release the stage, then
//                             acc += product * a_scale[row] * w_scale (the promotion), so
//                             one warpgroup can promote while the other's products run.
//
// Template variants (the host picks them; bits identical): CLUSTER 2 pairs CTAs on the same row
// tile and neighbouring column tiles, each loading half of the A tile for both by TMA multicast;
// PIPE issues both products of a pair of K steps before promoting the first; GEMM1 may run a
// ring of 6 stages. The consumers' K loop is issue-bound (bench/NOTES-triton.md, "The block
// scheme's CUDA kernels were issue-bound"): each instruction counts, so the warpgroup's role is
// made warp-uniform for the compiler (descriptors in uniform registers), a pair's scales come in
// one load and the epilogue has no slow paths. Measured on an H200: the shipped single CTAs with
// K-step pairs 1.14x the Gluon kernels' calls at DeepSeek-V3 M = 16384, 1.32x at Mixtral M = 4096,
// in CUDA graphs and eagerly faster than the cuBLAS GEMM1 (bench/results/h200-hopper-block-ab-5.json).
//
// One program per SM walks (row tile, column tile) items in the Gluon kernels' order
// (gluon_block._item: row tiles grouped by GROUP_M for L2 reuse of the weight blocks; an item's
// expert from the alignment's padded expert ends). The ring runs across items, so the next
// item's loads are in flight during this item's epilogue.
//
// GEMM1 (MODE 1): an item is 64 activation columns; its weight block is 64 gate rows and 64 up
// rows of w13 (two TMA boxes), so a thread holds gate and up of the same (row, column) and the
// epilogue stores silu(gate) * up in x's dtype.
// GEMM2 (MODE 2): an item is 128 output columns; the epilogue multiplies each row by its routed
// weight and stores it at the row's assignment (padding rows and non-local assignments skipped).
//
// Host entry points (extern "C", called through ctypes by kernels/hopper_block.py): make the TMA
// descriptors (cuTensorMapEncodeTiled from the driver) and launch on the caller's stream.

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <stdint.h>

namespace {

constexpr int BM = 128;                    // rows of a tile (two consumer warpgroups of 64)
constexpr int BK = 128;                    // K of a step: one scale block
constexpr int TILE_BYTES = 128 * BK;       // an fp8 [128 x 128] operand tile: 16 KB
constexpr int STAGE_BYTES = 2 * TILE_BYTES;
constexpr int STAGES = 5;               // the ring's stages (GEMM1 may take 6: moekit_block_set_stages)
constexpr int THREADS = 384;
constexpr int CONSUMER_WARPS = 8;
constexpr int MAX_EXPERTS = 1024;

struct Args {
  const float* a_scale;      // [R, K / 128]
  int64_t stride_as;
  const float* w_scale;      // [E, N_w / 128, K / 128]
  int64_t stride_we, stride_wn;
  const int32_t* expert_end; // [E] padded ends of the experts' sorted rows
  int E;
  int N;                     // GEMM1: I (activation columns); GEMM2: H (output columns)
  int K;
  void* out;                 // GEMM1: act [R, I]; GEMM2: y [T * k, H]
  int64_t stride_out;
  const float* topk_w;       // GEMM2: [T * k] routed weights
  const int32_t* sorted_ids; // GEMM2: [R] assignment of each sorted row (>= TK on padding)
  int TK;
  int group_m;               // row tiles that take a column group in turn
};

// ---- PTX wrappers -------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  const uint32_t addr = smem_addr(bar);
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  } while (!done);
}

// A [rows x 128 bytes] box of a 2-D fp8 tensor (coordinates: byte column, row) into shared memory,
// completing on bar.
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, uint64_t* bar, int col, int row) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(col), "r"(row)
      : "memory");
}

// The same into the same shared-memory offsets of every CTA of the cluster in cta_mask (each
// CTA's barrier at bar's offset counts the bytes it receives).
__device__ __forceinline__ void tma_load_multicast(void* dst, const CUtensorMap* map, uint64_t* bar, int col, int row,
                                                   uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(col), "r"(row), "h"(cta_mask)
      : "memory");
}

// An arrival on the barrier at bar's offset in CTA `rank` of the cluster.
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, uint32_t rank) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(smem_addr(bar)),
      "r"(rank)
      : "memory");
}

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// Every thread of the cluster (that has not exited) arrives, then waits for the others.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Threads 128 * id .. 128 * id + 127 (one warpgroup) wait for each other.
__device__ __forceinline__ void warpgroup_sync(int id) {
  asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory");
}

// Shared-memory operand descriptors of K-major tiles with 128-byte rows in the 128-byte swizzle
// (what TMA writes with CU_TENSOR_MAP_SWIZZLE_128B): the low word holds the start address >> 4
// (14 bits) and the leading byte offset (1 at bit 16); the high word the stride between 8-row
// groups (1024 bytes >> 4) and the swizzle mode (bit 62). Adding n to the low word moves the
// start by 16 n bytes (addresses below 256 KB: no carry out of the field), so a kernel makes
// the low word of stage 0 once and adds the stage's and the K slice's offsets.
constexpr uint32_t DESC_HI = (1024 >> 4) | (1u << 30);

__device__ __forceinline__ uint32_t desc_lo(uint32_t addr) { return ((addr & 0x3FFFF) >> 4) | (1u << 16); }

__device__ __forceinline__ uint64_t make_desc(uint32_t lo) { return (static_cast<uint64_t>(DESC_HI) << 32) | lo; }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_one() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }

// D [64 x 128] (+)= A [64 x 32] . B [128 x 32]^T, fp8 e4m3 operands from shared memory (K-major,
// 128-byte swizzle), fp32 accumulators; accumulate: D += the product, else D = the product.
__device__ __forceinline__ void wgmma_m64n128k32(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// Keeps the compiler from moving reads or writes of v across this point (the asynchronous
// products write their accumulators between the issue and the wait).
__device__ __forceinline__ void fence_operands(float (&v)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(v[i])::"memory");
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

// silu(g) * u with the hardware's approximate 2^x and reciprocal (no slow paths for denormals or
// division: an epilogue runs while no product of its warpgroup is in flight).
__device__ __forceinline__ float silu_mul(float g, float u) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(-1.4426950408889634f * g));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
  return g * r * u;
}

__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
  return v;
}

// ---- the expert schedule ------------------------------------------------------------------------

struct Schedule {
  const int* tile_end;  // [E] row tiles up to and including expert e
  const int* row_base;  // [E] first sorted row of expert e minus (its first tile index) * BM
  const int* ends;      // [E] padded end row of expert e
  int num_m;            // row tiles
};

// Warp 0 builds the tables in shared memory (each lane a run of experts, then a scan of the runs).
__device__ void build_schedule(const Args& args, int* tile_end, int* row_base, int* ends) {
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  const int per = (args.E + 31) / 32;
  const int e0 = lane * per, e1 = min(args.E, e0 + per);
  int run = 0;
  for (int e = e0; e < e1; ++e) {
    const int end = args.expert_end[e];
    const int start = e > 0 ? args.expert_end[e - 1] : 0;
    ends[e] = end;
    run += (end - start + BM - 1) / BM;
    tile_end[e] = run;  // within the lane's run for now
  }
  int before = run;  // inclusive scan of the runs over the lanes
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, before, d);
    if (lane >= d) before += v;
  }
  before -= run;
  for (int e = e0; e < e1; ++e) {
    const int start = e > 0 ? args.expert_end[e - 1] : 0;
    const int tiles_e = (ends[e] - start + BM - 1) / BM;
    tile_end[e] += before;
    row_base[e] = start - (tile_end[e] - tiles_e) * BM;
  }
}

struct Item {
  int e, row0, rows, nt;
};

// The q-th item of this program: the CTAs of a cluster take the same row tile and CLUSTER
// neighbouring column tiles (one each, by rank); clusters walk (row tile, column group) pairs in
// gluon_block._item's order (GROUP_M row tiles take a column group in turn).
template <int CLUSTER>
__device__ __forceinline__ Item item_at(int q, int num_n, const Schedule& s, int E, int rank, int group_m) {
  const int units = gridDim.x / CLUSTER;
  const int t = blockIdx.x / CLUSTER + q * units;
  const int num_g = num_n / CLUSTER;
  const int per_group = group_m * num_g;
  const int first_m = (t / per_group) * group_m;
  const int group_rows = max(min(s.num_m - first_m, group_m), 1);
  const int m = first_m + (t % per_group) % group_rows;
  Item it;
  it.nt = ((t % per_group) / group_rows) * CLUSTER + rank;
  int lo = 0, hi = E - 1;  // the first expert whose tiles end past m
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (s.tile_end[mid] > m) hi = mid; else lo = mid + 1;
  }
  it.e = lo;
  it.row0 = s.row_base[lo] + m * BM;
  it.rows = min(s.ends[lo] - it.row0, BM);
  return it;
}

// ---- the kernel ---------------------------------------------------------------------------------

// Output columns of an item and the staging row pitch (elements; 16 bytes of padding so that the
// accumulator fragments' rows fall in different banks).
template <int MODE>
struct Out {
  static constexpr int COLS = MODE == 1 ? 64 : 128;
  static constexpr int PITCH = COLS + 8;
};

// A thread's scale rows of an item: its two rows' activation scales and the weight scales of its
// columns (GEMM1: the gate and the up block), each indexed by the K step.
struct Scales {
  const float *a_lo, *a_hi, *w_a, *w_b;
};

template <int MODE>
__device__ __forceinline__ Scales first_scales(const Args& args, const Item& it, int r_lo) {
  Scales s;
  s.a_lo = args.a_scale + (int64_t)(it.row0 + r_lo) * args.stride_as;
  s.a_hi = s.a_lo + 8 * args.stride_as;
  const float* ws = args.w_scale + (int64_t)it.e * args.stride_we;
  s.w_a = ws + (int64_t)(MODE == 1 ? (it.nt * 64) / 128 : it.nt) * args.stride_wn;
  s.w_b = ws + (int64_t)((args.N + it.nt * 64) / 128) * args.stride_wn;
  return s;
}

template <int S>
__device__ __forceinline__ void advance(int& stage, uint32_t& phase) {
  if (++stage == S) {
    stage = 0;
    phase ^= 1;
  }
}

// One K step's products of this warpgroup's 64 rows into p (asynchronous, one commit group):
// a_desc / w_desc are the low descriptor words of the stage's A rows and weight block.
__device__ __forceinline__ void issue_step(float (&p)[64], uint32_t a_desc, uint32_t w_desc) {
  fence_operands(p);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)  // 32 bytes of K a product
    wgmma_m64n128k32(p, make_desc(a_desc + 2 * ks), make_desc(w_desc + 2 * ks), ks);
  wgmma_commit();
}

// A stage's products are done: one arrival a warp on its empty barrier, in every CTA of the cluster.
template <int CLUSTER>
__device__ __forceinline__ void release_stage(uint64_t* empty, int lane) {
  if (CLUSTER > 1) {
    if (lane < CLUSTER) mbar_arrive_cluster(empty, lane);  // one lane a CTA
  } else if (lane == 0) {
    mbar_arrive(empty);
  }
}

// acc += p * (row scale x weight scale); GEMM1's up half (chunks 8..15) takes the up block's scale.
template <int MODE>
__device__ __forceinline__ void promote(float (&acc)[64], const float (&p)[64], float sa_lo, float sa_hi, float sw_a,
                                        float sw_b) {
  const float s_lo_a = sa_lo * sw_a, s_hi_a = sa_hi * sw_a;
  const float s_lo_b = sa_lo * sw_b, s_hi_b = sa_hi * sw_b;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const bool second = MODE == 1 && j >= 8;
    const float s_lo = second ? s_lo_b : s_lo_a, s_hi = second ? s_hi_b : s_hi_a;
    acc[4 * j + 0] += p[4 * j + 0] * s_lo;
    acc[4 * j + 1] += p[4 * j + 1] * s_lo;
    acc[4 * j + 2] += p[4 * j + 2] * s_hi;
    acc[4 * j + 3] += p[4 * j + 3] * s_hi;
  }
}

// What the consumer warpgroups share: the stages, the epilogue's staging rows and destination
// rows, and the program's item count.
template <typename OutT>
struct Consumer {
  uint8_t* tiles;
  OutT* staging;
  uint64_t *full, *empty;
  int* dst_rows_all;
  int num_n, KT, my_items;
  uint32_t rank;
};

__device__ __forceinline__ float2 scaled(float2 v, float f) { return make_float2(v.x * f, v.y * f); }

// Two K steps' scales, loaded together (8-byte aligned pairs: the host checks).
__device__ __forceinline__ float2 load2(const float* p) { return __ldg(reinterpret_cast<const float2*>(p)); }

// What an item's K loop needs first (GEMM2: loaded during the item before's epilogue): GEMM2's
// assignments and routed weights of this thread's two rows (GEMM1: none, weight 1), and the first
// K steps' scales (a pair of steps with PIPE, else one in .x).
struct Lead {
  int a_row[2];
  float w_row[2];
  float2 a_lo, a_hi, w_a, w_b;
};

template <int MODE, bool PIPE>
__device__ __forceinline__ Lead lead_of(const Args& args, const Item& it, const Scales& sc, int r_lo) {
  Lead l;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l.a_row[h] = args.TK;
    l.w_row[h] = MODE == 1 ? 1.0f : 0.0f;
    if (MODE == 2) {
      const int r = r_lo + 8 * h;
      l.a_row[h] = r < it.rows ? args.sorted_ids[it.row0 + r] : args.TK;
      if (l.a_row[h] < args.TK) l.w_row[h] = args.topk_w[l.a_row[h]];
    }
  }
  const float2 zero = make_float2(0.0f, 0.0f);
  if (PIPE) {
    l.a_lo = load2(sc.a_lo);
    l.a_hi = load2(sc.a_hi);
    l.w_a = load2(sc.w_a);
    l.w_b = MODE == 1 ? load2(sc.w_b) : zero;
  } else {
    l.a_lo = make_float2(sc.a_lo[0], 0.0f);
    l.a_hi = make_float2(sc.a_hi[0], 0.0f);
    l.w_a = make_float2(sc.w_a[0], 0.0f);
    l.w_b = MODE == 1 ? make_float2(sc.w_b[0], 0.0f) : zero;
  }
  return l;
}

// The consumer warpgroup CW (rows 64 CW .. 64 CW + 63 of each tile): every item of the program,
// its K steps from the ring, the promotion, then the epilogue.
template <int MODE, typename OutT, int CLUSTER, bool PIPE, int S, int CW>
__device__ __forceinline__ void consume(const Args& args, const Schedule& sched, const Consumer<OutT>& c) {
  const int tw = threadIdx.x % 128;  // thread in the warpgroup
  const int warp = tw / 32, lane = tw % 32;
  const int r_wg = warp * 16 + lane / 4;  // this thread's rows in its warpgroup's 64: r_wg, r_wg + 8
  const int r_lo = CW * 64 + r_wg;        // and in the tile
  const int c_in = 2 * (lane % 4);        // its first column in each 8-column chunk
  const uint32_t stage_base = smem_addr(c.staging + CW * 64 * Out<MODE>::PITCH);  // this warpgroup's staging rows
  int* dst_rows = c.dst_rows_all + CW * 64;  // this warpgroup's rows' destinations (-1: not stored)
  // low descriptor words of stage 0: this warpgroup's 64 A rows and the weight block
  const uint32_t a_desc0 = desc_lo(smem_addr(c.tiles) + CW * 64 * 128);
  const uint32_t w_desc0 = desc_lo(smem_addr(c.tiles) + TILE_BYTES);
  constexpr uint32_t STAGE_DESC = STAGE_BYTES >> 4;
  const int KT = c.KT;

  float acc[64], part[64], part2[64];  // part2: PIPE only
  int stage = 0;
  uint32_t phase = 0;
  Item it = item_at<CLUSTER>(0, c.num_n, sched, args.E, c.rank, args.group_m);
  Scales sc = first_scales<MODE>(args, it, r_lo);
  // GEMM2 loads an item's lead during the item before's epilogue (its routed weights are two
  // dependent loads); GEMM1's long K loops hide its scales' loads, and its registers are tight
  Lead next;
  if (MODE == 2) next = lead_of<MODE, PIPE>(args, it, sc, r_lo);
  for (int q = 0; q < c.my_items; ++q) {
    const Lead cur = MODE == 2 ? next : lead_of<MODE, PIPE>(args, it, sc, r_lo);
    const float* w_row = cur.w_row;
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    if (PIPE) {
      // K steps in pairs, both products issued before the first is promoted, so one promotion a
      // pair runs under the tensor cores' work. (A product left in flight across the loop's back
      // edge makes ptxas serialize every product: C7514.) A pair's scales come in one 8-byte load
      // a row and block, the next pair's while this pair's products run.
      // (GEMM2: each row's routed weight joins its row scales, not the epilogue)
      float2 sa_lo = scaled(cur.a_lo, w_row[0]), sa_hi = scaled(cur.a_hi, w_row[1]), sw_a = cur.w_a, sw_b = cur.w_b;
      for (int kk = 0; kk < KT; kk += 2) {
        const int st0 = stage;
        mbar_wait(&c.full[stage], phase);
        issue_step(part, a_desc0 + stage * STAGE_DESC, w_desc0 + stage * STAGE_DESC);
        advance<S>(stage, phase);
        const int st1 = stage;
        mbar_wait(&c.full[stage], phase);
        issue_step(part2, a_desc0 + stage * STAGE_DESC, w_desc0 + stage * STAGE_DESC);
        advance<S>(stage, phase);
        const int kn = kk + 2 < KT ? kk + 2 : kk;  // the next pair's scales
        const float2 na_lo = scaled(load2(sc.a_lo + kn), w_row[0]), na_hi = scaled(load2(sc.a_hi + kn), w_row[1]);
        const float2 nw_a = load2(sc.w_a + kn);
        const float2 nw_b = MODE == 1 ? load2(sc.w_b + kn) : make_float2(0.0f, 0.0f);
        wgmma_wait_one();  // step kk done
        fence_operands(part);
        release_stage<CLUSTER>(&c.empty[st0], lane);
        promote<MODE>(acc, part, sa_lo.x, sa_hi.x, sw_a.x, sw_b.x);
        wgmma_wait_all();  // step kk + 1 done
        fence_operands(part2);
        release_stage<CLUSTER>(&c.empty[st1], lane);
        promote<MODE>(acc, part2, sa_lo.y, sa_hi.y, sw_a.y, sw_b.y);
        sa_lo = na_lo;
        sa_hi = na_hi;
        sw_a = nw_a;
        sw_b = nw_b;
      }
    } else {
      float sa_lo = cur.a_lo.x * w_row[0], sa_hi = cur.a_hi.x * w_row[1], sw_a = cur.w_a.x, sw_b = cur.w_b.x;
      for (int kk = 0; kk < KT; ++kk) {
        mbar_wait(&c.full[stage], phase);
        issue_step(part, a_desc0 + stage * STAGE_DESC, w_desc0 + stage * STAGE_DESC);
        // the next step's scales load while the products run
        const int kn = kk + 1 < KT ? kk + 1 : kk;
        const float nsa_lo = sc.a_lo[kn] * w_row[0], nsa_hi = sc.a_hi[kn] * w_row[1], nsw_a = sc.w_a[kn];
        const float nsw_b = MODE == 1 ? sc.w_b[kn] : 0.0f;
        wgmma_wait_all();
        fence_operands(part);
        release_stage<CLUSTER>(&c.empty[stage], lane);
        advance<S>(stage, phase);
        promote<MODE>(acc, part, sa_lo, sa_hi, sw_a, sw_b);
        sa_lo = nsa_lo;
        sa_hi = nsa_hi;
        sw_a = nsw_a;
        sw_b = nsw_b;
      }
    }
    // what the next item needs before its K loop loads during this item's epilogue
    const Item done = it;
    const int* a_row = cur.a_row;
    if (q + 1 < c.my_items) {
      it = item_at<CLUSTER>(q + 1, c.num_n, sched, args.E, c.rank, args.group_m);
      sc = first_scales<MODE>(args, it, r_lo);
      if (MODE == 2) next = lead_of<MODE, PIPE>(args, it, sc, r_lo);
    }
    // Epilogue: the warpgroup's 64 rows into shared memory, then 16-byte stores of whole row pieces.
    constexpr int PITCH = Out<MODE>::PITCH, CHUNKS = Out<MODE>::COLS / 8;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r_wg + 8 * h;
      const uint32_t row = stage_base + (r * PITCH + c_in) * sizeof(OutT);
      if (MODE == 1) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float g0 = acc[4 * j + 2 * h], g1 = acc[4 * j + 2 * h + 1];
          const float u0 = acc[4 * (j + 8) + 2 * h], u1 = acc[4 * (j + 8) + 2 * h + 1];
          st_shared_b32(row + 16 * j, pack2<OutT>(silu_mul(g0, u0), silu_mul(g1, u1)));
        }
      } else {
#pragma unroll
        for (int j = 0; j < 16; ++j)
          st_shared_b32(row + 16 * j, pack2<OutT>(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]));
      }
      if (lane % 4 == 0) {
        const int rt = CW * 64 + r;
        dst_rows[r] = MODE == 1 ? (rt < done.rows ? done.row0 + rt : -1) : (a_row[h] < args.TK ? a_row[h] : -1);
      }
    }
    warpgroup_sync(1 + CW);
    OutT* out = static_cast<OutT*>(args.out) + done.nt * Out<MODE>::COLS;
#pragma unroll 4
    for (int idx = tw; idx < 64 * CHUNKS; idx += 128) {
      const int r = idx / CHUNKS, ch = idx % CHUNKS;
      const int dst = dst_rows[r];
      if (dst < 0) continue;  // padding, or an assignment of another rank's expert
      const uint4 v = ld_shared_v4(stage_base + (r * PITCH + 8 * ch) * sizeof(OutT));
      *reinterpret_cast<uint4*>(out + (int64_t)dst * args.stride_out + 8 * ch) = v;
    }
    warpgroup_sync(1 + CW);  // the staging rows are free again
  }
}

template <int MODE>
__host__ __device__ constexpr size_t staging_bytes() { return 2 * 64 * Out<MODE>::PITCH * 2; }  // two warpgroups' 64 rows, 16-bit values
template <int MODE, int S>
__host__ __device__ constexpr size_t smem_bytes() {
  return 1024 + S * STAGE_BYTES + staging_bytes<MODE>() + 2 * S * sizeof(uint64_t) + (3 * MAX_EXPERTS + 128) * sizeof(int);
}
static_assert(smem_bytes<1, 6>() <= 227 * 1024 && smem_bytes<2, STAGES>() <= 227 * 1024, "shared memory per block");

template <int MODE, typename OutT, int CLUSTER, bool PIPE, int S>
__global__ void __launch_bounds__(THREADS, 1)
    block_fp8_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap w_map,
                     const Args args) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // 1024-byte alignment for the swizzled tiles
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* tiles = smem;  // S x (A tile, weight tile)
  OutT* staging = reinterpret_cast<OutT*>(smem + S * STAGE_BYTES);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + S * STAGE_BYTES + staging_bytes<MODE>());
  uint64_t* empty = full + S;
  int* tile_end = reinterpret_cast<int*>(empty + S);
  int* row_base = tile_end + MAX_EXPERTS;
  int* ends = row_base + MAX_EXPERTS;
  int* dst_rows_all = ends + MAX_EXPERTS;  // [128] the epilogue's destination rows

  // the warpgroup, known to the compiler as the same across a warp (so that the roles' code and
  // the product descriptors stay in uniform registers)
  const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
  const uint32_t rank = CLUSTER > 1 ? cluster_rank() : 0;
  if (threadIdx.x == 0) {
    for (int i = 0; i < S; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], CONSUMER_WARPS * CLUSTER);  // a stage is refilled in every CTA of the cluster
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  build_schedule(args, tile_end, row_base, ends);
  if (CLUSTER > 1) cluster_sync(); else __syncthreads();

  const Schedule sched{tile_end, row_base, ends, args.E > 0 ? tile_end[args.E - 1] : 0};
  const int num_n = args.N / Out<MODE>::COLS;
  const int KT = args.K / BK;
  const int units = gridDim.x / CLUSTER, unit = blockIdx.x / CLUSTER;
  const int items = sched.num_m * (num_n / CLUSTER);
  const int my_items = items > unit ? (items - unit + units - 1) / units : 0;

  if (wg == 0) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
    if (threadIdx.x == 0) {
      int stage = 0;
      uint32_t phase = 0;
      for (int q = 0; q < my_items; ++q) {
        const Item it = item_at<CLUSTER>(q, num_n, sched, args.E, rank, args.group_m);
        const int w_row = MODE == 1 ? it.e * 2 * args.N + it.nt * 64 : it.e * args.N + it.nt * 128;
        for (int kk = 0; kk < KT; ++kk) {
          mbar_wait(&empty[stage], phase ^ 1);
          uint8_t* a_tile = tiles + stage * STAGE_BYTES;
          uint8_t* w_tile = a_tile + TILE_BYTES;
          mbar_expect_tx(&full[stage], STAGE_BYTES);
          if (CLUSTER > 1)  // this CTA's share of the A rows, to every CTA of the cluster
            tma_load_multicast(a_tile + rank * (TILE_BYTES / CLUSTER), &a_map, &full[stage], kk * BK,
                               it.row0 + rank * (BM / CLUSTER), (1u << CLUSTER) - 1);
          else
            tma_load(a_tile, &a_map, &full[stage], kk * BK, it.row0);
          tma_load(w_tile, &w_map, &full[stage], kk * BK, w_row);
          if (MODE == 1)  // the up rows below the gate rows
            tma_load(w_tile + TILE_BYTES / 2, &w_map, &full[stage], kk * BK, w_row + args.N);
          advance<S>(stage, phase);
        }
      }
    }
    if (CLUSTER > 1) cluster_sync();  // the peers' arrivals on this CTA's barriers are done
    return;
  }

  // consumers: warpgroup 1 takes the tile's first 64 rows, warpgroup 2 the rest (a template
  // argument each, so that their descriptors stay in uniform registers)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;");
  const Consumer<OutT> c{tiles, staging, full, empty, dst_rows_all, num_n, KT, my_items, rank};
  if (wg == 1)
    consume<MODE, OutT, CLUSTER, PIPE, S, 0>(args, sched, c);
  else
    consume<MODE, OutT, CLUSTER, PIPE, S, 1>(args, sched, c);
  if (CLUSTER > 1) cluster_sync();  // no arrival on a peer's barriers after it exits
}

// ---- host side ----------------------------------------------------------------------------------

typedef CUresult (*EncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiled encode_tiled() {
  static EncodeTiled fn = nullptr;
  if (!fn) {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!lib) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib) fn = reinterpret_cast<EncodeTiled>(dlsym(lib, "cuTensorMapEncodeTiled"));
  }
  return fn;
}

// rows x cols bytes, row stride in bytes; boxes of box_rows x 128 bytes, 128-byte swizzle.
int make_map(CUtensorMap* map, const void* ptr, int64_t rows, int64_t cols, int64_t stride, int box_rows) {
  EncodeTiled fn = encode_tiled();
  if (!fn) return -1;
  cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
  cuuint64_t strides[1] = {(cuuint64_t)stride};
  cuuint32_t box[2] = {128, (cuuint32_t)box_rows};
  cuuint32_t elem[2] = {1, 1};
  CUresult r = fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(ptr), dims, strides, box, elem,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? 0 : 1000 + (int)r;
}

constexpr int MAX_DEVICES = 64;
int group_m_setting = 8;  // row tiles a column group (moekit_block_set_group_m)
int stages_setting = 5;   // GEMM1's stages on single CTAs with K steps in pairs (moekit_block_set_stages)
int last_grid[3];  // by MODE: the grid of the last launch (benchmarks record it)

// A launch of `grid` CTAs of the kernel's shape in clusters of `cluster` (attr: its storage).
cudaLaunchConfig_t launch_config(int grid, int cluster, size_t smem, cudaStream_t stream, cudaLaunchAttribute* attr) {
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = cluster;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(THREADS);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

template <int MODE, typename OutT, int CLUSTER, bool PIPE, int S = STAGES>
int launch_cluster(const void* a, int64_t R, int64_t stride_a, const void* w, int64_t w_rows, int64_t stride_w,
                   const Args& args, int programs, int device, cudaStream_t stream) {
  CUtensorMap a_map, w_map;
  int err = make_map(&a_map, a, R, args.K, stride_a, BM / CLUSTER);
  if (err) return err;
  err = make_map(&w_map, w, w_rows, args.K, stride_w, MODE == 1 ? 64 : 128);
  if (err) return err;
  auto kernel = block_fp8_kernel<MODE, OutT, CLUSTER, PIPE, S>;
  constexpr size_t smem = smem_bytes<MODE, S>();
  static int resident[MAX_DEVICES];  // CTAs that fit at once (whole clusters), by device
  if (!resident[device]) {
    cudaError_t c = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (c != cudaSuccess) return 2000 + (int)c;
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    int fit = sms;
    if (CLUSTER > 1) {
      cudaLaunchAttribute attr;
      const cudaLaunchConfig_t cfg = launch_config(sms / CLUSTER * CLUSTER, CLUSTER, smem, nullptr, &attr);
      int clusters = 0;
      c = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg);
      if (c != cudaSuccess || clusters < 1) return 2000 + (int)c;
      fit = clusters * CLUSTER;
    }
    resident[device] = fit;
  }
  int grid = programs > 0 && programs < resident[device] ? programs : resident[device];
  grid = grid / CLUSTER * CLUSTER;
  last_grid[MODE] = grid;
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = launch_config(grid, CLUSTER, smem, stream, &attr);
  cudaError_t c = cudaLaunchKernelEx(&cfg, kernel, a_map, w_map, args);
  return c == cudaSuccess ? 0 : 3000 + (int)c;
}

template <int MODE, typename OutT>
int launch(const void* a, int64_t R, int64_t stride_a, const void* w, int64_t w_rows, int64_t stride_w,
           const Args& args, int programs, int cluster, int pipelined, int device, cudaStream_t stream) {
  if (args.E > MAX_EXPERTS || args.E < 1) return -2;
  if (device < 0 || device >= MAX_DEVICES || cudaSetDevice(device) != cudaSuccess) return -3;
  const int num_n = args.N / Out<MODE>::COLS;
  const bool pairs = cluster == 2 && num_n % 2 == 0;
  // K steps in pairs need an even count and 8-byte aligned pairs of scales
  const bool even = (args.K / BK) % 2 == 0 && args.stride_as % 2 == 0 && args.stride_we % 2 == 0 &&
                    args.stride_wn % 2 == 0 && reinterpret_cast<uintptr_t>(args.a_scale) % 8 == 0 &&
                    reinterpret_cast<uintptr_t>(args.w_scale) % 8 == 0;
  if (pipelined && even) {
    if (pairs)
      return launch_cluster<MODE, OutT, 2, true>(a, R, stride_a, w, w_rows, stride_w, args, programs, device, stream);
    if constexpr (MODE == 1) {  // GEMM1's staging rows leave room for a sixth stage
      if (stages_setting == 6)
        return launch_cluster<MODE, OutT, 1, true, 6>(a, R, stride_a, w, w_rows, stride_w, args, programs, device, stream);
    }
    return launch_cluster<MODE, OutT, 1, true>(a, R, stride_a, w, w_rows, stride_w, args, programs, device, stream);
  }
  return pairs ? launch_cluster<MODE, OutT, 2, false>(a, R, stride_a, w, w_rows, stride_w, args, programs, device, stream)
               : launch_cluster<MODE, OutT, 1, false>(a, R, stride_a, w, w_rows, stride_w, args, programs, device, stream);
}

}  // namespace

extern "C" {

// The grid (CTAs) of the last launch of GEMM1 (mode 1) or GEMM2 (mode 2).
int moekit_block_last_grid(int mode) { return mode == 1 || mode == 2 ? last_grid[mode] : 0; }

// Row tiles that take a column group in turn, for the launches after this call (default 8).
void moekit_block_set_group_m(int group_m) { group_m_setting = group_m > 0 ? group_m : 8; }

// GEMM1's ring on single CTAs with K steps in pairs: 5 or 6 stages (default 5).
void moekit_block_set_stages(int stages) { stages_setting = stages == 6 ? 6 : 5; }

// act [R, I] = silu(gate) * up of the sorted fp8 rows a1s [R, H] (scales [R, H / 128]) through
// w13 [E, 2I, H] fp8 (scales [E, 2I / 128, H / 128]); out_dtype 0 bf16, 1 fp16. cluster: 2 pairs
// CTAs that share each A tile's loads (multicast), where the column tiles pair up; else 1.
// pipelined: 1 keeps the next K step's products in flight while a step is promoted (K steps in
// pairs: K a multiple of 256).
int moekit_block_gemm1(const void* a1s, int64_t R, int64_t H, int64_t stride_a, const float* a1s_s, int64_t stride_as,
                       const void* w13, const float* w13_s, int64_t stride_we, int64_t stride_wn,
                       const int32_t* expert_end, int E, int64_t I, void* act, int64_t stride_act, int out_dtype,
                       int programs, int cluster, int pipelined, int device, void* stream) {
  Args args{a1s_s, stride_as, w13_s, stride_we, stride_wn, expert_end, E, (int)I, (int)H, act, stride_act,
            nullptr, nullptr, 0, group_m_setting};
  auto s = static_cast<cudaStream_t>(stream);
  return out_dtype == 0
             ? launch<1, __nv_bfloat16>(a1s, R, stride_a, w13, E * 2 * I, H, args, programs, cluster, pipelined, device, s)
             : launch<1, __half>(a1s, R, stride_a, w13, E * 2 * I, H, args, programs, cluster, pipelined, device, s);
}

// (Strides in elements; the weights are contiguous.)
// y [TK, H] at each sorted row's assignment = routed weight * (a2 [R, I] fp8 (scales [R, I / 128])
// through w2 [E, H, I] fp8 (scales [E, H / 128, I / 128])).
int moekit_block_gemm2(const void* a2, int64_t R, int64_t I, int64_t stride_a, const float* a2_s, int64_t stride_as,
                       const void* w2, const float* w2_s, int64_t stride_we, int64_t stride_wn,
                       const int32_t* expert_end, int E, int64_t H, void* y, int64_t stride_y, const float* topk_w,
                       const int32_t* sorted_ids, int TK, int out_dtype, int programs, int cluster, int pipelined,
                       int device, void* stream) {
  Args args{a2_s, stride_as, w2_s, stride_we, stride_wn, expert_end, E, (int)H, (int)I, y, stride_y, topk_w,
            sorted_ids, TK, group_m_setting};
  auto s = static_cast<cudaStream_t>(stream);
  return out_dtype == 0 ? launch<2, __nv_bfloat16>(a2, R, stride_a, w2, E * H, I, args, programs, cluster, pipelined, device, s)
                        : launch<2, __half>(a2, R, stride_a, w2, E * H, I, args, programs, cluster, pipelined, device, s);
}

}  // extern "C"
