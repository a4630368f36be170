"""`python -m fasttrain.selftest [--device cpu|cuda] [--quick] [--json PATH] [--op OP ...]`: the same
Typer command as `fasttrain selftest`."""
import sys

from fasttrain.selftest.command import main

sys.exit(main())
