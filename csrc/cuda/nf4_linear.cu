// Placeholder: the nf4_linear CUDA kernels land with their issue.
