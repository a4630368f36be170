"""The `fasttrain` command line (Typer)."""
from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=False, help="fasttrain: fast RL post-training for LMs.")
console = Console()

DISPATCH_KEYS = ("CPU", "CUDA", "Autograd", "Meta")


def registered_ops() -> list[tuple[str, list[str]]]:
    """Every fasttrain:: op and the dispatch keys that have a kernel for it."""
    import torch

    import fasttrain.ops  # noqa: F401  (registers schemas, fakes and autograd)

    names = sorted({n for n in torch._C._dispatch_get_all_op_names() if n.startswith("fasttrain::")})
    out = []
    for name in names:
        keys = [k for k in DISPATCH_KEYS if torch._C._dispatch_has_kernel_for_dispatch_key(name, k)]
        out.append((name, keys))
    return out


@app.command()
def info() -> None:
    """Version, torch, compiled backends and CUDA archs, and every registered fasttrain op."""
    import torch

    import fasttrain
    from fasttrain.ops import build_info

    bi = build_info()
    console.print(f"fasttrain {fasttrain.__version__}  (extension {bi['version']}, built against torch {bi['torch_version']})")
    console.print(f"torch {torch.__version__}  CUDA runtime {torch.version.cuda or 'none'}  "
                  f"GPU available: {torch.cuda.is_available()}")
    console.print(f"compiled backends: {', '.join(bi['backends'])}  CUDA archs: {bi['cuda_archs'] or '-'}")
    table = Table(title="registered ops (torch.ops.fasttrain)")
    table.add_column("op")
    for k in DISPATCH_KEYS:
        table.add_column(k, justify="center")
    for name, keys in registered_ops():
        table.add_row(name, *["yes" if k in keys else "-" for k in DISPATCH_KEYS])
    console.print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
