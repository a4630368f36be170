"""Bundled TOML recipes: the seed ladder and the CPU demo (`fasttrain run RECIPE`)."""
