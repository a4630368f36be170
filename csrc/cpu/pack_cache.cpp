// The log-prob head's packed-W cache (pack_cache.h). Why a scope: outside fasttrain's own phases a
// caller may write W without bumping its version counter (through .data, say), and a stale packed
// copy would give wrong log-probs silently; inside a phase the trainer opens, W is the frozen head.
// An entry is W's storage held by a weak reference (while it is held, no other storage object can
// take that address, so a freed and reallocated W never matches), its offset, shape and version
// counter: every in-place write through W or a view of it (the optimizer's included) bumps the
// version and makes the entry stale. At most two entries (the policy's head, and a second one,
// e.g. the frozen base's where it is not tied).
#include "cpu/pack_cache.h"

#include <algorithm>
#include <mutex>
#include <vector>

namespace fasttrain {
namespace {

struct Entry {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  int64_t offset, rows, cols;
  uint32_t version;
  at::Tensor packed, packed_k;
};

std::mutex mu;
int64_t scopes = 0;
std::vector<Entry> entries;
constexpr size_t kMaxEntries = 2;

bool matches(const Entry& e, const at::Tensor& w) {
  return !e.storage.expired() && e.storage._unsafe_get_target() == w.storage().unsafeGetStorageImpl() &&
         e.offset == w.storage_offset() && e.rows == w.size(0) && e.cols == w.size(1) &&
         e.version == w._version();
}

}  // namespace

void logprob_pack_scope(bool open) {
  std::lock_guard<std::mutex> lock(mu);
  scopes = std::max<int64_t>(0, scopes + (open ? 1 : -1));
  if (scopes == 0) entries.clear();
}

int64_t logprob_pack_entries() {
  std::lock_guard<std::mutex> lock(mu);
  return static_cast<int64_t>(entries.size());
}

std::pair<at::Tensor, at::Tensor> logprob_pack_lookup(const at::Tensor& w) {
  std::lock_guard<std::mutex> lock(mu);
  if (scopes == 0 || w.dim() != 2) return {at::Tensor(), at::Tensor()};
  entries.erase(std::remove_if(entries.begin(), entries.end(), [](const Entry& e) { return e.storage.expired(); }),
                entries.end());
  for (const Entry& e : entries)
    if (matches(e, w)) return {e.packed, e.packed_k};
  return {at::Tensor(), at::Tensor()};
}

void logprob_pack_store(const at::Tensor& w, const at::Tensor& packed, const at::Tensor& packed_k) {
  std::lock_guard<std::mutex> lock(mu);
  if (scopes == 0 || w.dim() != 2 || !packed.defined()) return;
  for (Entry& e : entries)
    if (matches(e, w)) {
      e.packed = packed;
      if (packed_k.defined()) e.packed_k = packed_k;
      return;
    }
  if (entries.size() >= kMaxEntries) entries.erase(entries.begin());
  entries.push_back(Entry{c10::weak_intrusive_ptr<c10::StorageImpl>(w.storage().getWeakStorageImpl()),
                          w.storage_offset(), w.size(0), w.size(1), w._version(), packed, packed_k});
}

}  // namespace fasttrain
