# DEVELOPMENT ONLY, removed once fasttrain.ops.fused_logprob lands on main: give fasttrain.ops the stand-in.
import fasttrain.ops

if not hasattr(fasttrain.ops, "fused_logprob"):
    from logprob_reference import standin_fused_logprob

    fasttrain.ops.fused_logprob = standin_fused_logprob
