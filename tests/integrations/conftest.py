import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tiny_grpo.py, logprob_reference.py

# DEVELOPMENT ONLY, removed once fasttrain.ops.fused_logprob lands on main: give fasttrain.ops the stand-in.
import fasttrain.ops  # noqa: E402

if not hasattr(fasttrain.ops, "fused_logprob"):
    from logprob_reference import standin_fused_logprob

    fasttrain.ops.fused_logprob = standin_fused_logprob
