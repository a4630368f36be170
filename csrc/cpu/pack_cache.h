// Packed copies of the log-prob head's W kept across fused_logprob calls, inside a scope the caller
// opens (fasttrain.ops.logprob_pack_cache). Compiled once, outside the CPU variants, so that the
// scope and the entries are one state whichever variant runs.
#pragma once
#include <ATen/ATen.h>

#include <utility>

namespace fasttrain {

// Open (true) or close (false) a scope; scopes nest, and closing the last drops every entry.
void logprob_pack_scope(bool open);

// The cached (packed, packed_k) for W where a scope is open and an entry matches W's storage,
// offset, shape and version counter; undefined tensors otherwise (packed_k undefined if never stored).
std::pair<at::Tensor, at::Tensor> logprob_pack_lookup(const at::Tensor& w);

// How many entries are held now (tests).
int64_t logprob_pack_entries();

// Keep W's packed copies while a scope is open (a no-op outside one).
void logprob_pack_store(const at::Tensor& w, const at::Tensor& packed, const at::Tensor& packed_k);

}  // namespace fasttrain
