// Autograd of fasttrain::policy_loss in C++, for every backend: registered once under the Autograd
// dispatch key (bottom of csrc/cpu/policy_loss.cpp, the file every build compiles), it wraps the
// CPU or CUDA kernel that the redispatch picks.
// Why C++: the Python formula (torch.library.register_autograd) cost ~70 us forward and ~100 us
// backward per call on this machine, more than the kernel itself at 15k tokens; this Node costs
// a few us. The math is the same as before: backward = policy_loss_backward(grad_loss, coef,
// rowscale, logp.dtype); only logp gets a gradient (old_logp, advantages, mask, ref_logp and the
// normalizer are data, as if detached: they are handed to the Function outside its Variables).
// Both ops are called through the dispatcher, so torch.compile / AOTAutograd trace them with their
// fake kernels (python/fasttrain/ops/policy_loss.py) the way they trace any ATen op's C++ Node.
// Not supported: double backward, and torch.func transforms (C++ autograd Functions refuse them).
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>

#include <optional>
#include <tuple>

namespace fasttrain {

using PolicyLossOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using PolicyLossSig = PolicyLossOut(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, int64_t,
                                    double, double, double, double, double, double, int64_t);

// Every argument but logp: not a Variable input of the Function (no gradient, no graph edge).
struct PolicyLossData {
  const at::Tensor& old_logp;
  const at::Tensor& advantages;
  const at::Tensor& mask;
  const std::optional<at::Tensor>& ref_logp;
  const std::optional<at::Tensor>& token_normalizer;
  int64_t loss_type;
  double beta, eps_low, eps_high, cispo_cap, zeta, token_normalizer_value;
  int64_t kl_type;
};

class PolicyLossFunction : public torch::autograd::Function<PolicyLossFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logp,
                                                const PolicyLossData& d) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("fasttrain::policy_loss", "")
                               .typed<PolicyLossSig>();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [loss, stats, coef, rowscale] =
        op.call(logp, d.old_logp, d.advantages, d.mask, d.ref_logp, d.token_normalizer, d.loss_type, d.beta,
                d.eps_low, d.eps_high, d.cispo_cap, d.zeta, d.token_normalizer_value, d.kl_type);
    ctx->mark_non_differentiable({stats, coef, rowscale});
    ctx->save_for_backward({coef, rowscale});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logp.scalar_type());
    return {loss, stats, coef, rowscale};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("fasttrain::policy_loss_backward", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                 at::ScalarType)>();
    at::Tensor grad_logp;
    if (ctx->needs_input_grad(0)) {
      const auto saved = ctx->get_saved_variables();
      const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
      grad_logp = op.call(grads[0], saved[0], saved[1], dtype);
    }
    return {grad_logp, at::Tensor()};  // one per forward argument; the data gets none
  }
};

// The Autograd-key kernel: same signature as the op.
inline PolicyLossOut policy_loss_autograd(const at::Tensor& logp, const at::Tensor& old_logp,
                                          const at::Tensor& advantages, const at::Tensor& mask,
                                          const std::optional<at::Tensor>& ref_logp,
                                          const std::optional<at::Tensor>& token_normalizer, int64_t loss_type,
                                          double beta, double eps_low, double eps_high, double cispo_cap,
                                          double zeta, double token_normalizer_value, int64_t kl_type) {
  const PolicyLossData d{old_logp, advantages, mask, ref_logp, token_normalizer, loss_type, beta,
                         eps_low, eps_high, cispo_cap, zeta, token_normalizer_value, kl_type};
  auto out = PolicyLossFunction::apply(logp, d);
  return {std::move(out[0]), std::move(out[1]), std::move(out[2]), std::move(out[3])};
}

}  // namespace fasttrain
