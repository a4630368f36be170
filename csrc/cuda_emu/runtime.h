// The CUDA emulator: runs the project's __global__ functions (csrc/cuda/kernels/*.cuh) on a CPU,
// unchanged, for tests on machines without a GPU.
//
// What it is: one fiber (ucontext) per CUDA thread on one OS thread; the threads of a block run one
// at a time, each until it blocks at a barrier or a warp intrinsic, blocks one after another. It
// models threadIdx/blockIdx/blockDim/gridDim, __syncthreads, the *_sync warp intrinsics over 32-lane
// warps with their masks, static and dynamic shared memory (both filled with 0xFF, a NaN for floats,
// at every block start, so a read before a write shows), atomics, and the launch limits of the
// hardware. It checks what the hardware leaves undefined or hangs on: a lane outside the mask, lanes
// of one warp at different intrinsics or with different masks, threads of one block at different
// __syncthreads (compared by source location), a thread that exits while its warp waits for it,
// deadlock, an empty or oversized launch, more dynamic shared memory than a kernel gets without
// opting in. Schedules: threads and blocks in order, in reverse, or shuffled from a seed (anew at
// every round of the scheduler), so a result that depends on an order no barrier fixes differs
// between two schedules.
// Why by hand: no maintained CPU emulator of CUDA C++ exists that runs kernels unchanged with the
// checks above (GPU simulators model the hardware, not the language; compute-sanitizer needs a GPU).
// What it is not: a GPU. No timing, no memory-model races between two sync points (each thread runs
// alone until it blocks), no inline PTX, tensor cores or cuBLAS (a launch sequence's GEMMs go
// through fasttrain::cuda::Device, served with at::mm here), host libm instead of the GPU's
// expf/logf, and no FMA contraction (nvcc contracts a*b + c, the emulator build does not): compare
// floating point with derived tolerances, integers exactly. A fiber switch costs ~0.3 us (swapcontext
// saves the signal mask), so keep test launches small.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <source_location>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Shared memory is declared through FT_SHARED / FT_DYNAMIC_SHARED (csrc/cuda/common.cuh), which the
// emulator fills with 0xFF in every block; a bare __shared__ would escape that, so it does not compile.
#define __shared__ static_assert(false, "declare shared memory with FT_SHARED or FT_DYNAMIC_SHARED (cuda/common.cuh)");
#define FASTTRAIN_CUDA_EMU 1

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
using uint3 = dim3;
struct CUstream_st;
using cudaStream_t = CUstream_st*;
constexpr int warpSize = 32;

namespace cuda_emu {

// A launch or a kernel did something the hardware would refuse, hang on or leave undefined.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class Order : int { kForward = 0, kReverse = 1, kSeeded = 2 };

struct Schedule {
  Order order = Order::kForward;
  uint64_t seed = 1;
};

struct Counters {
  uint64_t launches = 0, blocks = 0, switches = 0, barriers = 0, warp_ops = 0;
};

// Where a barrier or warp intrinsic was called from (its arguments' default is the caller's site).
struct Site {
  const char* file = nullptr;
  uint32_t line = 0, column = 0;
  static Site of(const std::source_location& l) { return {l.file_name(), l.line(), l.column()}; }
  bool operator==(const Site& o) const {
    return line == o.line && column == o.column && (file == o.file || std::strcmp(file, o.file) == 0);
  }
  std::string str() const;
};

struct Thread {
  dim3 idx;
};
struct BlockInfo {
  dim3 grid, block, idx;
};

// The running thread and block (valid inside a kernel only).
const Thread& this_thread();
const BlockInfo& this_block();

void set_schedule(Schedule s);
Schedule schedule();
// The most blocks fasttrain::cuda::grid_for gives a grid-stride kernel (8 x 65,535, as in the CUDA
// build, unless a test sets it lower so that every grid-stride loop runs more than once at a small
// shape). Emulator only: the CUDA build's cap is a constant.
constexpr int kDefaultGridCap = 65535 * 8;
int grid_cap();
void set_grid_cap(int blocks);
Counters counters();
void reset_counters();
// The most dynamic shared memory a launch may ask for (48 KiB: what a kernel gets without
// cudaFuncSetAttribute on every GPU since sm_70).
constexpr size_t kMaxDynamicShared = 48u << 10;

[[noreturn]] void fail(const std::string& what);

// Runs body once per thread of every block of the grid. smem: dynamic shared memory in bytes.
void run_grid(dim3 grid, dim3 block, size_t smem, void (*body)(void*), void* arg);

// Fills a static shared variable with 0xFF when the first thread of the running block reaches its
// declaration (FT_SHARED).
void poison_shared(void* p, size_t bytes);

// The dynamic shared memory of the running block, aligned to `align` bytes and to no more (so a
// kernel that declares less alignment than it uses is seen by the alignment sanitizer).
unsigned char* dynamic_shared(size_t align);

void syncthreads(Site site);
void syncwarp(unsigned mask, Site site);
// The warp-wide exchange behind the shuffles and votes: every lane of `mask` puts `bytes` of its
// value, then reads lane `src_lane`'s (votes pass src_lane = -1 and read all lanes through `all`).
void exchange(unsigned mask, Site site, const char* what, const void* mine, size_t bytes, int src_lane, void* out,
              unsigned* all_nonzero);
int lane_id();

template <typename... P, typename... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "a kernel launched with the wrong number of arguments");
  // Arguments are copied once, converted to the parameter types, as a CUDA launch copies them.
  struct Call {
    void (*kernel)(P...);
    std::tuple<std::decay_t<P>...> params;
  } call{kernel, std::tuple<std::decay_t<P>...>(static_cast<std::decay_t<P>>(std::forward<A>(args))...)};
  run_grid(grid, block, smem, [](void* p) {
    auto* c = static_cast<Call*>(p);
    std::apply(c->kernel, c->params);
  }, &call);
}

}  // namespace cuda_emu

#define threadIdx (::cuda_emu::this_thread().idx)
#define blockIdx (::cuda_emu::this_block().idx)
#define blockDim (::cuda_emu::this_block().block)
#define gridDim (::cuda_emu::this_block().grid)

inline void __syncthreads(std::source_location l = std::source_location::current()) {
  cuda_emu::syncthreads(cuda_emu::Site::of(l));
}
inline void __syncwarp(unsigned mask = 0xffffffffu, std::source_location l = std::source_location::current()) {
  cuda_emu::syncwarp(mask, cuda_emu::Site::of(l));
}

namespace cuda_emu {
// Source lane of each shuffle within segments of `width` lanes (CUDA's rules: a lane whose source
// falls outside its segment keeps its own value).
inline int shfl_src(int lane, int src, int width) { return (lane & ~(width - 1)) + (src & (width - 1)); }
inline int shfl_xor_src(int lane, int m, int width) {
  const int in = (lane & (width - 1)) ^ m;
  return in < width ? (lane & ~(width - 1)) + in : lane;
}
inline int shfl_down_src(int lane, int d, int width) { return (lane & (width - 1)) + d < width ? lane + d : lane; }
inline int shfl_up_src(int lane, int d, int width) { return (lane & (width - 1)) - d >= 0 ? lane - d : lane; }

template <typename T>
T shuffle(unsigned mask, T v, int src, int width, Site site, const char* what) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 16, "a shuffle of a type wider than 16 bytes");
  if (width <= 0 || width > 32 || (width & (width - 1)) != 0) fail(std::string(what) + ": width must be 1, 2, ..., 32");
  T out;
  exchange(mask, site, what, &v, sizeof(T), src, &out, nullptr);
  return out;
}
}  // namespace cuda_emu

template <typename T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32, std::source_location l = std::source_location::current()) {
  return cuda_emu::shuffle(mask, v, cuda_emu::shfl_src(cuda_emu::lane_id(), src, width), width,
                           cuda_emu::Site::of(l), "__shfl_sync");
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int m, int width = 32,
                  std::source_location l = std::source_location::current()) {
  return cuda_emu::shuffle(mask, v, cuda_emu::shfl_xor_src(cuda_emu::lane_id(), m, width), width,
                           cuda_emu::Site::of(l), "__shfl_xor_sync");
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32,
                   std::source_location l = std::source_location::current()) {
  return cuda_emu::shuffle(mask, v, cuda_emu::shfl_down_src(cuda_emu::lane_id(), (int)d, width), width,
                           cuda_emu::Site::of(l), "__shfl_down_sync");
}
template <typename T>
T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32,
                 std::source_location l = std::source_location::current()) {
  return cuda_emu::shuffle(mask, v, cuda_emu::shfl_up_src(cuda_emu::lane_id(), (int)d, width), width,
                           cuda_emu::Site::of(l), "__shfl_up_sync");
}
inline unsigned __ballot_sync(unsigned mask, int pred, std::source_location l = std::source_location::current()) {
  unsigned all = 0;
  const int p = pred != 0;
  cuda_emu::exchange(mask, cuda_emu::Site::of(l), "__ballot_sync", &p, sizeof p, -1, nullptr, &all);
  return all;
}
inline int __any_sync(unsigned mask, int p, std::source_location l = std::source_location::current()) {
  return __ballot_sync(mask, p, l) != 0;
}
inline int __all_sync(unsigned mask, int p, std::source_location l = std::source_location::current()) {
  return __ballot_sync(mask, p, l) == mask;
}
inline void __threadfence() {}
inline void __threadfence_block() {}

// Atomics: one thread runs at a time, so a plain read-modify-write is atomic here. Only the
// overloads CUDA has are given, so a kernel that needs one the GPU lacks fails to compile here too.
inline float atomicAdd(float* p, float v) { const float o = *p; *p = o + v; return o; }
inline double atomicAdd(double* p, double v) { const double o = *p; *p = o + v; return o; }
inline int atomicAdd(int* p, int v) { const int o = *p; *p = o + v; return o; }
inline unsigned atomicAdd(unsigned* p, unsigned v) { const unsigned o = *p; *p = o + v; return o; }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  const unsigned long long o = *p; *p = o + v; return o;
}
inline int atomicMin(int* p, int v) { const int o = *p; *p = v < o ? v : o; return o; }
inline unsigned atomicMin(unsigned* p, unsigned v) { const unsigned o = *p; *p = v < o ? v : o; return o; }
inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) {
  const unsigned long long o = *p; *p = v < o ? v : o; return o;
}
inline long long atomicMin(long long* p, long long v) { const long long o = *p; *p = v < o ? v : o; return o; }
inline int atomicMax(int* p, int v) { const int o = *p; *p = v > o ? v : o; return o; }
inline unsigned atomicMax(unsigned* p, unsigned v) { const unsigned o = *p; *p = v > o ? v : o; return o; }

// Device min/max as CUDA's headers overload them (the usual arithmetic conversions; fminf/fmaxf
// semantics for floating point: a NaN operand yields the other one).
template <typename A, typename B, typename = std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>>
inline std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  if constexpr (std::is_floating_point_v<C>) return std::fmin(static_cast<C>(a), static_cast<C>(b));
  else return static_cast<C>(b) < static_cast<C>(a) ? static_cast<C>(b) : static_cast<C>(a);
}
template <typename A, typename B, typename = std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>>
inline std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  if constexpr (std::is_floating_point_v<C>) return std::fmax(static_cast<C>(a), static_cast<C>(b));
  else return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(b) : static_cast<C>(a);
}
