"""fasttrain: RL post-training for language models with fused C++/CUDA hot paths."""

__version__ = "0.1.0"
