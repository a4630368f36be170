// Placeholder: the fused_logprob CUDA kernels land with their issue.
