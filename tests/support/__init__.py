"""The tests' shared helpers, one package: tiny worlds, float64 oracles, derived tolerances, fixtures.

Importable as `support` because pyproject.toml's [tool.pytest.ini_options] puts tests/ on pytest's
`pythonpath`; nothing here is shipped in the wheel, and no test imports another test module.
"""
