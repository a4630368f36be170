"""Data-parallel training: every value that spans ranks goes through this file.

Launch with torchrun (one process per GPU, or per CPU slot with gloo):

    torchrun --nproc-per-node N -m fasttrain run RECIPE
    torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m fasttrain run RECIPE

Each rank holds the whole base model and its own copy of the adapters (rank 0's, broadcast at
start). A step's prompts are cut into equal contiguous blocks, one per rank, and each rank samples
every answer of its prompts, so a GRPO group never crosses ranks; the trainer seeds each group's
sampler from (run seed, step, prompt position in the step), never from the rank. What spans the
batch is then reduced here, so N ranks train the same policy as one process (up to the order of
floating-point sums):

- the scores of every answer (gathered: GDPO's batch standardisation, the floor guard's share and
  the logged means are computed on the whole batch, by the same code as in one process);
- the top-rho entropy mask (the active tokens' entropies are gathered in the one-process order, so
  the kept set and its position tie-break are those of the whole batch);
- the loss's token normaliser, token counts, entropy and KL sums, and the per-pass loss statistics;
- the adapter gradients: one flat fp32 all-reduce (sum) per pass, before clipping and AdamW.
  The loss is already divided by the whole batch's normaliser, so the sum is the one-batch
  gradient. Not DDP: the update runs a data-dependent number of micro-batches per rank (a rank may
  have none with an active token), which DDP's per-backward bucket hooks do not allow without
  no_sync bookkeeping; one all-reduce after the last micro-batch is simpler and as cheap.

In one process (WORLD_SIZE unset or 1) every function here returns its input: the rest of the
trainer is rank-agnostic. Everything uses torch.distributed's own parts (init_process_group from
torchrun's environment, all_reduce, all_gather, all_gather_object, broadcast, barrier); there is
no launcher, rendezvous or collective of fasttrain's own. Rank 0 alone writes the run folder.
"""
from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = ["RankLost", "init_from_env", "finish", "world_size", "rank", "is_main", "shard_bounds",
           "check_prompts_per_step", "gather_list", "broadcast_object", "broadcast_parameters",
           "any_rank", "sum_values", "sum_gradients", "sum_stats", "top_entropy_mask", "barrier",
           "collective_seconds", "launch_local"]

# Seconds spent inside collectives since the last collective_seconds(reset=True); it includes
# the wait for the slowest rank.
_seconds = 0.0


def _on() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def init_from_env(timeout_s: float = 1800.0) -> bool:
    """Join the process group described by torchrun's environment (WORLD_SIZE, RANK, LOCAL_RANK,
    MASTER_ADDR/PORT). NCCL when CUDA is visible (each rank on cuda:LOCAL_RANK), gloo otherwise.
    `timeout_s` bounds how long a rank waits in a collective for a rank that died. Returns whether
    the run is distributed; a no-op without WORLD_SIZE > 1 or when the group exists already."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if dist.is_initialized():
        return True
    # NCCL: a rank whose collective fails or passes the timeout is torn down instead of hanging
    # (mode 3, torch's current default, made explicit; a value the user set wins).
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return True


def finish() -> None:
    """Leave the process group (after every rank got here)."""
    barrier()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def world_size() -> int:
    return dist.get_world_size() if _on() else 1


def rank() -> int:
    return dist.get_rank() if _on() else 0


def is_main() -> bool:
    return rank() == 0


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class RankLost(RuntimeError):
    """A collective failed: another rank died, raised, or did not answer within the timeout."""


class _timed:
    """Times a collective and turns the backend's failure into RankLost, which says what to do."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        self.t = time.perf_counter()

    def __exit__(self, kind, exc, tb):
        global _seconds
        _seconds += time.perf_counter() - self.t
        if exc is not None and isinstance(exc, RuntimeError) and not isinstance(exc, RankLost):
            raise RankLost(f"rank {dist.get_rank()} of {dist.get_world_size()}: {self.what} failed while "
                           f"waiting for the other ranks ({str(exc).strip()[:300]}). Another rank died, raised "
                           f"or hung past run.dist_timeout; torchrun's failure summary names it. The last "
                           f"checkpoint is complete: continue with `--resume RUN_DIR` on the same number "
                           f"of ranks.") from exc
        return False


def collective_seconds(reset: bool = False) -> float:
    global _seconds
    s = _seconds
    if reset:
        _seconds = 0.0
    return s


def barrier() -> None:
    if _on():
        with _timed("barrier"):
            dist.barrier()


# ---- splitting work ----------------------------------------------------------------------------
def shard_bounds(n: int) -> tuple[int, int]:
    """[start, stop) of this rank's contiguous block of n items (block sizes differ by at most one
    when n does not divide; the training step checks that it does)."""
    w, r = world_size(), rank()
    return r * n // w, (r + 1) * n // w


def check_prompts_per_step(prompts_per_step: int, world: int | None = None) -> None:
    """rollout.prompts_per_step must split into equal whole groups per rank."""
    from fasttrain.train.config import ConfigError
    w = world_size() if world is None else world
    if prompts_per_step % w:
        lo = [v for v in range(w, 8 * w + 1, w)][:6]
        sizes = [d for d in range(1, prompts_per_step + 1) if prompts_per_step % d == 0]
        raise ConfigError(
            f"rollout.prompts_per_step={prompts_per_step} does not divide by the {w} ranks (whole prompt "
            f"groups go to one rank): use a multiple of {w} ({', '.join(map(str, lo))}, ...), or run on "
            f"a number of ranks that divides {prompts_per_step} ({', '.join(map(str, sizes))})")


# ---- collectives -------------------------------------------------------------------------------
def gather_list(local: Sequence[Any]) -> list[Any]:
    """Every rank's list, concatenated in rank order (the one-process order when ranks hold
    contiguous blocks). Items are pickled between ranks (torch's all_gather_object)."""
    if not _on():
        return list(local)
    out: list[Any] = [None] * dist.get_world_size()
    with _timed("gathering a list (all_gather_object)"):
        dist.all_gather_object(out, list(local))
    return [x for part in out for x in part]


def any_rank(flag: bool) -> bool:
    """Whether `flag` is true on some rank (every rank gets the same answer)."""
    if not _on():
        return bool(flag)
    v = torch.tensor([1.0 if flag else 0.0], device=_device())
    with _timed("all_reduce of the stop flag"):
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
    return bool(v.item() > 0)


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if not _on():
        return obj
    box = [obj]
    with _timed("broadcast_object_list"):
        dist.broadcast_object_list(box, src=0)
    return box[0]


@torch.no_grad()
def broadcast_parameters(params: Sequence[torch.Tensor]) -> None:
    """Copy rank 0's values into every rank's tensors (identical adapters whatever each rank's
    initialisation did)."""
    if not _on() or not params:
        return
    dev = _device()
    flat = torch.cat([p.detach().reshape(-1).to(dev, torch.float32) for p in params])
    with _timed("broadcasting the adapters"):
        dist.broadcast(flat, src=0)
    _unflatten_into(flat, params)


def _unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    off = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[off:off + n].view_as(t).to(t.device, t.dtype))
        off += n


def sum_values(values: Sequence[float] | torch.Tensor) -> list[float]:
    """Element-wise sums over ranks, in float64 (counts and sums of the whole batch)."""
    v = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    if not _on():
        return v.tolist()
    v = v.to(_device())
    with _timed("all_reduce of batch sums"):
        dist.all_reduce(v, op=dist.ReduceOp.SUM)
    return v.cpu().tolist()


@torch.no_grad()
def sum_gradients(params: Sequence[torch.nn.Parameter]) -> None:
    """Sum the adapter gradients over ranks with one flat fp32 all-reduce. A parameter that has
    no gradient on any rank keeps grad None (AdamW then skips it, as in one process); one with a
    gradient somewhere gets the sum (a rank without one contributes zeros)."""
    if not _on() or not params:
        return
    dev = _device()
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=dev)
    parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dev, torch.float32)
             for p in params]
    flat = torch.cat(parts + [has])
    with _timed("all_reduce of the adapter gradients"):
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    n = flat.numel() - len(params)
    has = flat[n:] > 0
    off = 0
    for p, h in zip(params, has.tolist()):
        k = p.numel()
        if h:
            g = flat[off:off + k].view_as(p).to(p.device, p.dtype)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
        off += k


def sum_stats(total: float, stats: dict[str, float]) -> tuple[float, dict[str, float]]:
    """The pass loss and the token-weighted statistics, summed over ranks (a rank whose
    micro-batches had no active token has no keys: its share is zero)."""
    if not _on():
        return total, stats
    parts = [None] * dist.get_world_size()
    with _timed("gathering the loss statistics"):
        dist.all_gather_object(parts, (float(total), dict(stats)))
    out_total, out = 0.0, {}
    for t, s in parts:
        out_total += t
        for k, v in s.items():
            out[k] = out.get(k, 0.0) + v
    return out_total, out


def top_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, rho: float) -> torch.Tensor:
    """Bool [B, T]: this rank's part of the whole batch's top-rho entropy mask (fasttrain.rl.masks).

    The active tokens' entropies are gathered in row-major order, rank after rank; with whole
    groups in contiguous rank blocks that is the one-process order, so the kept count
    ceil(rho * n), the threshold and the earlier-position tie-break are the whole batch's."""
    from fasttrain.rl.masks import top_entropy_mask as local_mask

    if not _on():
        return local_mask(entropy, mask, rho=rho).bool() & mask.bool()
    active = mask.bool()
    mine = entropy.detach().float()[active]
    dev = _device()
    w = dist.get_world_size()
    with _timed("gathering the answer-token entropies"):
        counts = [torch.zeros(1, dtype=torch.long, device=dev) for _ in range(w)]
        dist.all_gather(counts, torch.tensor([mine.numel()], dtype=torch.long, device=dev))
        counts_l = [int(c.item()) for c in counts]
        top = max(counts_l)
        buf = torch.zeros(top, dtype=torch.float32, device=dev)
        buf[:mine.numel()] = mine.to(dev)
        bufs = [torch.empty(top, dtype=torch.float32, device=dev) for _ in range(w)]
        dist.all_gather(bufs, buf)
    whole = torch.cat([b[:c] for b, c in zip(bufs, counts_l)]).to(entropy.device)
    keep_all = local_mask(whole[None], torch.ones_like(whole[None], dtype=torch.bool), rho=rho)[0]
    start = sum(counts_l[:dist.get_rank()])
    keep_mine = keep_all[start:start + mine.numel()]
    out = torch.zeros_like(active)
    out[active] = keep_mine
    return out


# ---- `fasttrain run --nproc N` -----------------------------------------------------------------
def launch_local(nproc: int, argv: Sequence[str]) -> int:
    """Start `torchrun --standalone --nproc-per-node nproc -m fasttrain ARGV` on this machine (the
    rendezvous on a free local port) and return its exit status. torchrun starts, watches and
    stops the ranks, and its summary names a rank that failed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "fasttrain", *argv]
    return subprocess.call(cmd)
