// The CUDA emulator's scheduler (runtime.h says what it models and checks): fibers, barriers, warp
// exchanges, shared memory and the launch checks.
#include "cuda_emu/runtime.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <exception>
#include <mutex>
#include <numeric>
#include <random>
#include <sstream>
#include <vector>

// AddressSanitizer keeps the bounds of the stack it runs on; a fiber switch moves the stack under it,
// so each switch is announced (otherwise an exception thrown on a fiber unwinds what ASan takes
// for the wrong stack and reports a false overflow), and a fiber stack is unpoisoned when a new
// fiber starts on it (frames left by the fiber before it, e.g. one a failed launch abandoned, are dead).
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define FT_EMU_ASAN 1
#endif

namespace cuda_emu {
namespace {

enum class State { kReady, kBarrier, kWarp, kDone };

struct Fiber {
  ucontext_t ctx;
  void* stack = nullptr;       // the lowest address of its stack (kStackBytes)
  void* fake_stack = nullptr;  // ASan's bookkeeping of the fiber while it is switched out
  Thread thread;
  int warp = 0, lane = 0;
  State state = State::kReady;
};

// One warp-wide exchange in flight: the lanes of `mask` write their slot, the last to arrive
// releases them, each then reads; `pending` holds the lanes that have not read yet.
struct WarpOp {
  unsigned mask = 0, arrived = 0, pending = 0;
  Site site;
  const char* what = "";
  alignas(16) unsigned char slot[32][16];
};

// Two exchanges alternate, so a lane may start the next one while others still read this one.
struct Warp {
  unsigned exists = 0;
  int open = -1;  // the op lanes are arriving at, or -1
  uint64_t generation = 0;
  WarpOp ops[2];
};

struct Block {
  BlockInfo info;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  int live = 0, at_barrier = 0;
  Site barrier_site;
  ucontext_t scheduler;
  void (*body)(void*) = nullptr;
  void* arg = nullptr;
  std::exception_ptr error;
  std::vector<void*> poisoned;  // static shared variables filled in this block
};

constexpr size_t kStackBytes = size_t(256) << 10;
constexpr size_t kSharedAlign = 256;

std::mutex g_launch_mutex;  // one grid at a time: the shared memory and the fibers are global
Schedule g_schedule;
Counters g_counters;
Block* g_block = nullptr;
Fiber* g_fiber = nullptr;
alignas(kSharedAlign) unsigned char g_dynamic[kMaxDynamicShared + kSharedAlign];
size_t g_dynamic_bytes = 0;

// Fiber stacks, kept between launches; each has a guard page below it, so an overflow faults.
struct Stack {
  unsigned char* base = nullptr;
  size_t bytes = 0;
};
std::vector<Stack>& stacks() {
  static std::vector<Stack> s;
  return s;
}
void* stack_for(size_t i) {
  std::vector<Stack>& s = stacks();
  while (s.size() <= i) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    void* p = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw Error("cuda_emu: cannot map a fiber stack");
    mprotect(p, page, PROT_NONE);
    s.push_back({static_cast<unsigned char*>(p) + page, kStackBytes});
  }
  return s[i].base;
}

std::string where() {
  std::ostringstream s;
  if (g_block != nullptr)
    s << " [block (" << g_block->info.idx.x << "," << g_block->info.idx.y << "," << g_block->info.idx.z << ")";
  if (g_fiber != nullptr)
    s << " thread (" << g_fiber->thread.idx.x << "," << g_fiber->thread.idx.y << "," << g_fiber->thread.idx.z << ")";
  if (g_block != nullptr) s << "]";
  return s.str();
}

#ifdef FT_EMU_ASAN
// The scheduler's stack (the launching thread's), learnt from ASan when a fiber first starts.
const void* g_scheduler_stack = nullptr;
size_t g_scheduler_stack_bytes = 0;
#endif

// Scheduler -> fiber f, until f switches back.
void enter(Fiber& f, Block& b) {
#ifdef FT_EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f.stack, kStackBytes);
  swapcontext(&b.scheduler, &f.ctx);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  swapcontext(&b.scheduler, &f.ctx);
#endif
}

// Fiber f -> the scheduler; `last`: f has ended and is never resumed.
void leave(Fiber& f, Block& b, bool last) {
#ifdef FT_EMU_ASAN
  __sanitizer_start_switch_fiber(last ? nullptr : &f.fake_stack, g_scheduler_stack, g_scheduler_stack_bytes);
  swapcontext(&f.ctx, &b.scheduler);
  __sanitizer_finish_switch_fiber(f.fake_stack, &g_scheduler_stack, &g_scheduler_stack_bytes);
#else
  (void)last;
  swapcontext(&f.ctx, &b.scheduler);
#endif
}

void to_scheduler() {
  ++g_counters.switches;
  leave(*g_fiber, *g_block, false);
}

void release_barrier_if_complete(Block& b) {
  if (b.at_barrier == 0 || b.at_barrier != b.live) return;
  for (Fiber& f : b.fibers)
    if (f.state == State::kBarrier) f.state = State::kReady;
  b.at_barrier = 0;
  ++g_counters.barriers;
}

// The open warp op that still waits for this lane, if any.
const WarpOp* waiting_for(const Block& b, const Fiber& f) {
  const Warp& w = b.warps[f.warp];
  if (w.open < 0) return nullptr;
  const WarpOp& op = w.ops[w.open];
  return (op.mask >> f.lane & 1u) && !(op.arrived >> f.lane & 1u) ? &op : nullptr;
}

void fiber_main() {
#ifdef FT_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &g_scheduler_stack, &g_scheduler_stack_bytes);
#endif
  Block& b = *g_block;
  try {
    b.body(b.arg);
    if (const WarpOp* op = waiting_for(b, *g_fiber))
      fail(std::string("a thread exits while its warp waits for it at ") + op->what + " (" + op->site.str() +
           "): a hang on the GPU");
  } catch (...) {
    if (!b.error) b.error = std::current_exception();
  }
  Fiber& f = *g_fiber;
  f.state = State::kDone;
  --b.live;
  release_barrier_if_complete(b);
  leave(f, b, true);  // never resumed
}

std::vector<uint32_t> order_of(uint32_t n, std::mt19937_64& rng) {
  std::vector<uint32_t> o(n);
  std::iota(o.begin(), o.end(), 0u);
  if (g_schedule.order == Order::kReverse) std::reverse(o.begin(), o.end());
  if (g_schedule.order == Order::kSeeded) std::shuffle(o.begin(), o.end(), rng);
  return o;
}

void check_launch(dim3 grid, dim3 block, size_t smem) {
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  std::ostringstream s;
  s << "grid (" << grid.x << "," << grid.y << "," << grid.z << ") block (" << block.x << "," << block.y << ","
    << block.z << ")";
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || threads == 0)
    fail("invalid configuration: an empty grid or block, " + s.str() + " (cudaErrorInvalidConfiguration)");
  if (threads > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64)
    fail("invalid configuration: more than 1024 threads per block (or a block side over its limit), " + s.str());
  if (grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535) fail("invalid configuration: grid too large, " + s.str());
  if (smem > kMaxDynamicShared)
    fail("too much dynamic shared memory: " + std::to_string(smem) + " bytes asked, " +
         std::to_string(kMaxDynamicShared) + " allowed without cudaFuncSetAttribute");
}

void run_block(Block& b, const std::vector<uint32_t>& thread_order, std::mt19937_64& rng) {
  const size_t n = b.fibers.size();
  for (size_t t = 0; t < n; ++t) {
    Fiber& f = b.fibers[t];
    const dim3 bd = b.info.block;
    f.thread.idx = dim3(t % bd.x, (t / bd.x) % bd.y, t / (size_t(bd.x) * bd.y));
    f.warp = static_cast<int>(t / 32);
    f.lane = static_cast<int>(t % 32);
    f.state = State::kReady;
    b.warps[f.warp].exists |= 1u << f.lane;
    f.stack = stack_for(t);
#ifdef FT_EMU_ASAN
    ASAN_UNPOISON_MEMORY_REGION(f.stack, kStackBytes);
#endif
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
  }
  std::memset(g_dynamic, 0xFF, g_dynamic_bytes + kSharedAlign);
  std::vector<uint32_t> order = thread_order;
  b.live = static_cast<int>(n);
  while (b.live > 0) {
    if (g_schedule.order == Order::kSeeded) std::shuffle(order.begin(), order.end(), rng);
    bool ran = false;
    for (uint32_t t : order) {
      Fiber& f = b.fibers[t];
      if (f.state != State::kReady) continue;
      g_fiber = &f;
      ++g_counters.switches;
      enter(f, b);
      g_fiber = nullptr;
      ran = true;
      if (b.error) std::rethrow_exception(b.error);
    }
    if (!ran) {
      int bar = 0, warp = 0;
      for (const Fiber& f : b.fibers) {
        bar += f.state == State::kBarrier;
        warp += f.state == State::kWarp;
      }
      fail("deadlock: " + std::to_string(b.live) + " live threads, " + std::to_string(bar) + " at __syncthreads (" +
           b.barrier_site.str() + "), " + std::to_string(warp) + " at a warp intrinsic");
    }
  }
}

}  // namespace

std::string Site::str() const {
  if (file == nullptr) return "?";
  const char* base = std::strrchr(file, '/');
  return std::string(base != nullptr ? base + 1 : file) + ":" + std::to_string(line) + ":" + std::to_string(column);
}

const Thread& this_thread() { return g_fiber->thread; }
const BlockInfo& this_block() { return g_block->info; }
void set_schedule(Schedule s) { g_schedule = s; }
namespace {
int g_grid_cap = kDefaultGridCap;
}
int grid_cap() { return g_grid_cap; }
void set_grid_cap(int blocks) {
  if (blocks < 1 || blocks > kDefaultGridCap) fail("set_grid_cap: the cap must be in [1, 8 x 65535]");
  g_grid_cap = blocks;
}
Schedule schedule() { return g_schedule; }
Counters counters() { return g_counters; }
void reset_counters() { g_counters = Counters{}; }
int lane_id() { return g_fiber->lane; }

void fail(const std::string& what) { throw Error("cuda_emu: " + what + where()); }

void poison_shared(void* p, size_t bytes) {
  std::vector<void*>& done = g_block->poisoned;
  if (std::find(done.begin(), done.end(), p) != done.end()) return;
  std::memset(p, 0xFF, bytes);
  done.push_back(p);
}

unsigned char* dynamic_shared(size_t align) {
  if (align == 0 || (align & (align - 1)) != 0 || align > kSharedAlign)
    fail("dynamic shared memory declared with alignment " + std::to_string(align));
  return g_dynamic + (align < kSharedAlign ? align : 0);
}

void syncthreads(Site site) {
  Block& b = *g_block;
  if (const WarpOp* op = waiting_for(b, *g_fiber))
    fail("__syncthreads (" + site.str() + ") while this thread's warp waits for it at " + op->what + " (" +
         op->site.str() + ")");
  if (b.at_barrier == 0) b.barrier_site = site;
  else if (!(site == b.barrier_site))
    fail("threads of one block wait at different __syncthreads: " + b.barrier_site.str() + " and " + site.str());
  g_fiber->state = State::kBarrier;
  ++b.at_barrier;
  release_barrier_if_complete(b);
  if (g_fiber->state == State::kBarrier) to_scheduler();
}

void exchange(unsigned mask, Site site, const char* what, const void* mine, size_t bytes, int src_lane, void* out,
              unsigned* all_nonzero) {
  Block& b = *g_block;
  Fiber& f = *g_fiber;
  Warp& w = b.warps[f.warp];
  const unsigned bit = 1u << f.lane;
  if (!(mask & bit)) fail(std::string(what) + ": the calling lane is not in the mask");
  if (mask & ~w.exists) fail(std::string(what) + ": the mask names lanes this block does not have");
  for (int l = 0; l < 32; ++l)
    if ((mask >> l & 1u) && b.fibers[f.warp * 32 + l].state == State::kDone)
      fail(std::string(what) + " (" + site.str() + "): the mask names lane " + std::to_string(l) + ", which has exited");
  // Join the open op, or open the next one once every lane has read the one before it on that side.
  while (w.open < 0 && w.ops[w.generation & 1].pending != 0) {
    f.state = State::kReady;
    to_scheduler();
  }
  if (w.open < 0) {
    WarpOp& op = w.ops[w.generation & 1];
    op.mask = mask;
    op.arrived = 0;
    op.site = site;
    op.what = what;
    w.open = static_cast<int>(w.generation & 1);
    ++w.generation;
  }
  const int k = w.open;
  WarpOp& op = w.ops[k];
  if (!(op.site == site))
    fail(std::string("lanes of one warp wait at different warp intrinsics: ") + op.what + " (" + op.site.str() +
         ") and " + what + " (" + site.str() + ")");
  if (op.mask != mask) fail(std::string(what) + " (" + site.str() + "): lanes of one warp pass different masks");
  std::memcpy(op.slot[f.lane], mine, bytes);
  op.arrived |= bit;
  f.state = State::kWarp;
  if (op.arrived == op.mask) {
    for (int l = 0; l < 32; ++l)
      if (op.mask >> l & 1u) b.fibers[f.warp * 32 + l].state = State::kReady;
    op.pending = op.mask;
    w.open = -1;
    ++g_counters.warp_ops;
  } else {
    to_scheduler();
  }
  if (all_nonzero != nullptr) {
    unsigned r = 0;
    for (int l = 0; l < 32; ++l) {
      int p = 0;
      std::memcpy(&p, op.slot[l], sizeof p);
      if ((mask >> l & 1u) && p != 0) r |= 1u << l;
    }
    *all_nonzero = r;
  } else {
    if (!(mask >> src_lane & 1u))
      fail(std::string(what) + " (" + site.str() + "): reads lane " + std::to_string(src_lane) +
           ", which is not in the mask (undefined on the GPU)");
    std::memcpy(out, op.slot[src_lane], bytes);
  }
  op.pending &= ~bit;
}

void syncwarp(unsigned mask, Site site) {
  const int none = 0;
  unsigned all = 0;
  exchange(mask, site, "__syncwarp", &none, sizeof none, -1, nullptr, &all);
}

void run_grid(dim3 grid, dim3 block, size_t smem, void (*body)(void*), void* arg) {
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  check_launch(grid, block, smem);
  ++g_counters.launches;
  g_dynamic_bytes = smem;
  std::mt19937_64 rng(g_schedule.seed * 0x9E3779B97F4A7C15ull + g_counters.launches);
  const uint64_t nblocks = uint64_t(grid.x) * grid.y * grid.z;
  const uint32_t nthreads = block.x * block.y * block.z;
  // Blocks in the schedule's order (a seeded shuffle over at most 2^20 blocks; larger grids are
  // walked in order or in reverse, which is what a test launch ever needs).
  std::vector<uint64_t> blocks;
  if (g_schedule.order == Order::kSeeded && nblocks <= (uint64_t(1) << 20)) {
    blocks.resize(nblocks);
    std::iota(blocks.begin(), blocks.end(), uint64_t(0));
    std::shuffle(blocks.begin(), blocks.end(), rng);
  }
  const std::vector<uint32_t> thread_order = order_of(nthreads, rng);
  for (uint64_t i = 0; i < nblocks; ++i) {
    const uint64_t bl = !blocks.empty() ? blocks[i] : g_schedule.order == Order::kReverse ? nblocks - 1 - i : i;
    Block b;
    b.info.grid = grid;
    b.info.block = block;
    b.info.idx = dim3(bl % grid.x, (bl / grid.x) % grid.y, bl / (uint64_t(grid.x) * grid.y));
    b.fibers.resize(nthreads);
    b.warps.resize((nthreads + 31) / 32);
    b.body = body;
    b.arg = arg;
    g_block = &b;
    try {
      run_block(b, thread_order, rng);
    } catch (...) {
      g_block = nullptr;
      g_fiber = nullptr;
      throw;
    }
    g_block = nullptr;
    ++g_counters.blocks;
  }
}

}  // namespace cuda_emu
