"""fasttrain's fused ops, importable by any trainer: `import fasttrain.ops`.

Each op is a schema in the `torch.ops.fasttrain` namespace with CPU and (when built) CUDA kernels,
a fake (meta) kernel for torch.compile, and, where it has a backward, a registered autograd formula
whose backward is itself an op. `fasttrain.ops.reference` holds every op in plain PyTorch (the
oracle of the tests and of `fasttrain selftest`); FASTTRAIN_KERNELS=reference, or
`use_kernels("reference")`, sends the op faces below to it (fasttrain.ops.kernels).
"""
from fasttrain._native import build_info, load as _load

_load()

from fasttrain.ops.nf4 import NF4State, nf4_dequantize, nf4_quantize, dynamic_map  # noqa: E402
from fasttrain.ops.logprob import *  # noqa: E402,F401,F403
from fasttrain.ops.policy_loss import *  # noqa: E402,F401,F403
from fasttrain.ops.nf4_linear import *  # noqa: E402,F401,F403
from fasttrain.ops.gated_delta import *  # noqa: E402,F401,F403
from fasttrain.ops.moe_experts import *  # noqa: E402,F401,F403
from fasttrain.ops.decode_attention import *  # noqa: E402,F401,F403
from fasttrain.ops.decode_fused import *  # noqa: E402,F401,F403
from fasttrain.ops.attention import *  # noqa: E402,F401,F403

from fasttrain.ops import reference  # noqa: E402  (plain-PyTorch versions of every op: the oracle)
from fasttrain.ops.kernels import set_kernels, use_kernels  # noqa: E402  (fused kernels or the reference)

__all__ = ["build_info", "NF4State", "nf4_quantize", "nf4_dequantize", "dynamic_map", "reference", "set_kernels",
           "use_kernels"]
for _m in ("logprob", "policy_loss", "nf4_linear", "gated_delta", "moe_experts", "decode_attention", "decode_fused",
           "attention"):
    __all__ += getattr(__import__(f"fasttrain.ops.{_m}", fromlist=["__all__"]), "__all__", [])
