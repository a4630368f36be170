"""fasttrain's CUDA path run on fake CUDA tensors (PyTorch's FakeTensorMode) on a machine without
a GPU: every tensor has a device, a dtype and a shape but no data, and every op runs its fake
implementation (fasttrain's ops register theirs in python/fasttrain/ops/).

Three things stand between a training step and such a run, and each is handled here:
  * data-dependent answers (a mask's count, `.item()`/`float()` of a loss or gradient norm, the
    groups of `torch.unique`, a boolean-mask index): fake tensors have no values to answer them.
    `Recorder` runs the same step for real on the CPU and keeps, in order, the answer of every op
    whose result depends on values (the ops PyTorch tags data_dependent_output or
    dynamic_output_shape, and index_put with a boolean mask); `Replay` gives those answers back,
    op by op, checking that the op is the one recorded. The step's own decisions are therefore
    the CPU run's of the same batch.
  * the autograd engine: with no GPU it refuses to start on CUDA tensors ("hasPrimaryContext
    expects a valid device index"), so `backward` here walks the graph itself, in a fixed order
    (each node once all its consumers ran; the engine's own dtype casts of incoming gradients;
    zeros for the missing gradients of Python-defined backwards, as the engine materialises
    them). It is used in both runs, so they record and replay in the same order.
  * the host: `Replay` notes every tensor an op leaves on the CPU, with the innermost frame of
    the code that asked for it; the tests fail on any outside a short named allowlist.

What it proves and what not: devices, dtypes, shapes and which implementation each op dispatches
to on CUDA (the host path); nothing about values, timing or memory (the CPU emulator and a GPU
run do those).
"""
from __future__ import annotations

import contextlib
import itertools
import os
import traceback
from collections import deque

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.abspath(__file__)
_INDEX_PUT = {torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
              torch.ops.aten._index_put_impl_.default}


def _bool_index(args) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or ()))


def data_dependent(func, args) -> bool:
    """Whether an op's result (its values as Python numbers, or its shape) depends on data: the ops
    PyTorch tags so, but indexing only with a boolean mask (integer indices fix the shape)."""
    if func in _INDEX_PUT or func is torch.ops.aten.index.Tensor:
        return _bool_index(args)
    tags = func.tags
    return torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags


def _meta(out):
    if isinstance(out, torch.Tensor):
        return ("tensor", tuple(out.shape), out.dtype)
    if isinstance(out, (tuple, list)):
        return ("seq", [_meta(o) for o in out])
    return ("value", out)


def _device_of(args) -> torch.device:
    for a in torch.utils._pytree.tree_leaves(args):
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")


def _make(meta, device):
    kind = meta[0]
    if kind == "tensor":
        return torch.empty(meta[1], dtype=meta[2], device=device)
    if kind == "seq":
        return tuple(_make(m, device) for m in meta[1])
    return meta[1]


class Recorder(TorchDispatchMode):
    """Runs every op; keeps (op, result's metadata or value) of the data-dependent ones, in order."""

    def __init__(self):
        super().__init__()
        self.answers: list[tuple[str, object]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if data_dependent(func, args):
            self.answers.append((str(func), _meta(out)))
        return out


def _caller() -> str:
    """The innermost frame outside torch's own machinery (torch.optim and torch.nn.utils count as
    callers) and outside this file, as 'path:function' relative to its package."""
    for fr in reversed(traceback.extract_stack()[:-2]):
        f = os.path.abspath(fr.filename)
        if f == _HERE:
            continue
        if f.startswith(_TORCH_DIR) and not any(s in f for s in (os.sep + "optim" + os.sep,
                                                                 os.sep + "nn" + os.sep + "utils" + os.sep)):
            continue
        for root in ("fasttrain", "torch", "transformers", "tests"):
            key = os.sep + root + os.sep
            if key in f:
                return root + "/" + f.rsplit(key, 1)[1].replace(os.sep, "/") + ":" + fr.name
        return f"{fr.filename}:{fr.name}"
    return "?"


_host_watch = [True]


@contextlib.contextmanager
def host_unwatched():
    """Tensors made on the host inside the block are not noted: a policy built on the CPU before it
    moves to the device, as a checkpoint is read on the host (a no-op in the CPU run)."""
    _host_watch.append(False)
    try:
        yield
    finally:
        _host_watch.pop()


class Replay(TorchDispatchMode):
    """Above a FakeTensorMode: data-dependent ops get the recorded answers (the op must be the one
    recorded); every other op runs fake. Notes each op (custom ops by name), and each tensor an op
    puts on the CPU with its caller."""

    def __init__(self, answers):
        super().__init__()
        self.answers = deque(answers)
        self.host: list[tuple[str, str, tuple]] = []     # (caller, op, shape) of tensors made on the CPU
        self.ops: list[tuple[str, tuple]] = []           # fasttrain's and the stand-ins' ops with their args
        self.asked: list[tuple[str, str]] = []           # (op, caller) of each data-dependent question

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "fasttrain":
            self.ops.append((str(func), args))
        if data_dependent(func, args):
            if not self.answers:
                raise AssertionError(f"the fake run asked {func} more data-dependent questions than the CPU run")
            name, meta = self.answers.popleft()
            self.asked.append((str(func), _caller()))
            if name != str(func):
                raise AssertionError(f"the fake run diverged from the CPU run at question {len(self.asked)}: it "
                                     f"asks {func} where the CPU run asked {name}; the last asked: "
                                     f"{self.asked[-6:]}")
            if func in (torch.ops.aten.index_put_.default, torch.ops.aten._index_put_impl_.default):
                return args[0]
            out = _make(meta, _device_of(args))
        else:
            out = func(*args, **kwargs)
        if _host_watch[-1]:
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    self.host.append((_caller(), str(func), tuple(t.shape)))
                    break
        return out


# ---- backward without the autograd engine ------------------------------------------------------
_FUNCTION_APPLY = torch.autograd.Function.__dict__["apply"]
_TENSOR_ARGS: dict = {}      # a Python-defined backward's node -> which forward arguments were tensors


@classmethod
def _recording_apply(cls, *args, **kwargs):
    """autograd.Function.apply, noting which arguments were tensors: a Python backward returns one
    gradient per forward argument, its node's edges are the tensor arguments only (the engine
    keeps that map in C++, out of reach)."""
    out = _FUNCTION_APPLY.__get__(None, cls)(*args, **kwargs)
    if kwargs:
        import inspect
        bound = inspect.signature(cls.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        args = bound.args
    mask = [isinstance(a, torch.Tensor) for a in args]
    for t in torch.utils._pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None and _python_node(t.grad_fn):
            _TENSOR_ARGS[t.grad_fn] = mask
    return out


def _python_node(node) -> bool:
    return not callable(node) and hasattr(node, "apply")


def _fit(g, md):
    """The engine's validate_outputs: a gradient broadcast wider than its input is summed back to
    the input's shape, and cast to its dtype."""
    if g is None or md.is_nested_tensor:
        return g
    if tuple(g.shape) != tuple(md.shape):
        g = g.sum_to_size(md.shape)
    return g.to(md.dtype) if g.dtype != md.dtype else g


def backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, grad_variables=None,
             inputs=None):
    """torch.autograd.backward's effect (gradients accumulated into the leaves' .grad), by walking
    the graph from `tensors` in a fixed order."""
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    if grad_tensors is None:
        grad_tensors = [None] * len(tensors)
    elif isinstance(grad_tensors, torch.Tensor):
        grad_tensors = [grad_tensors]
    pending: dict = {}
    roots = []
    for t, g in zip(tensors, grad_tensors):
        if t.grad_fn is None:
            continue
        g = torch.ones_like(t) if g is None else g
        pending.setdefault(t.grad_fn, {})[t.output_nr] = g
        roots.append(t.grad_fn)
    deps: dict = {}
    seen, stack = set(roots), list(roots)
    while stack:
        n = stack.pop()
        for nxt, _ in n.next_functions:
            if nxt is None:
                continue
            deps[nxt] = deps.get(nxt, 0) + 1
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    ready = deque(r for r in dict.fromkeys(roots) if deps.get(r, 0) == 0)
    # non-reentrant checkpointing recomputes a segment once per graph task (its id keys the
    # recomputed tensors); outside the engine there is no task, and every unpack would recompute
    task = next(_TASK_IDS)
    task_id, torch._C._current_graph_task_id = torch._C._current_graph_task_id, lambda: task
    try:
        _walk(ready, pending, deps)
    finally:
        torch._C._current_graph_task_id = task_id


_TASK_IDS = itertools.count(1 << 40)


def _walk(ready, pending, deps) -> None:
    with torch.no_grad():
        while ready:
            n = ready.popleft()
            got = pending.pop(n, {})
            md = n._input_metadata
            grads = [_fit(got.get(i), md[i]) for i in range(len(md))]
            if _python_node(n):
                grads = [torch.zeros(md[i].shape, dtype=md[i].dtype, device=md[i].device) if g is None else g
                         for i, g in enumerate(grads)]
                outs = n.apply(*grads)
                outs = outs if isinstance(outs, tuple) else (outs,)
                mask = _TENSOR_ARGS.get(n)
                if mask is None or len(mask) != len(outs):
                    raise AssertionError(f"{n.name()}: which forward arguments were tensors is not known")
                outs = tuple(o for o, is_tensor in zip(outs, mask) if is_tensor)
            else:
                outs = n(*grads)
            outs = outs if isinstance(outs, tuple) else (outs,)
            for (nxt, nr), g in zip(n.next_functions, outs):
                if nxt is None:
                    continue
                if g is not None:
                    buf = pending.setdefault(nxt, {})
                    buf[nr] = g if nr not in buf else buf[nr] + g
                deps[nxt] -= 1
                if deps[nxt] == 0:
                    ready.append(nxt)


def _tolist(t: torch.Tensor):
    """Tensor.tolist by item(): a real CPU tensor's tolist reads its memory without an op (the
    recorder would not see it) while a fake one's asks one question per element."""
    return t.item() if t.dim() == 0 else [_tolist(x) for x in t.unbind(0)]


@contextlib.contextmanager
def own_backward():
    """Inside the block (both runs use it, so they ask the same questions in the same order):
    Tensor.backward and torch.autograd.backward go through `backward` above, and Tensor.tolist
    reads through item()."""
    saved, tolist = torch.autograd.backward, torch.Tensor.tolist
    torch.autograd.backward = backward
    torch.autograd.Function.apply = _recording_apply
    torch.Tensor.tolist = _tolist
    try:
        yield
    finally:
        torch.autograd.backward = saved
        torch.autograd.Function.apply = _FUNCTION_APPLY
        torch.Tensor.tolist = tolist
        _TENSOR_ARGS.clear()


@contextlib.contextmanager
def _module_moves(mode: FakeTensorMode):
    """nn.Module.to swaps a fake parameter with its moved copy (torch.utils.swap_tensors), which
    refuses tensors with weak references; the mode's conversion memo holds one to every fake
    tensor. It is dropped before each swap (it only serves conversions of real tensors, which this
    run never makes)."""
    swap = torch.utils.swap_tensors

    def swap_after_forgetting(t1, t2):
        mode.fake_tensor_converter.meta_converter.tensor_memo.clear()
        return swap(t1, t2)
    torch.utils.swap_tensors = swap_after_forgetting
    try:
        yield
    finally:
        torch.utils.swap_tensors = swap


@contextlib.contextmanager
def fake_cuda(answers):
    """FakeTensorMode with a Replay of `answers` above it; yields the Replay."""
    with FakeTensorMode(allow_non_fake_inputs=False) as mode, _module_moves(mode), Replay(answers) as replay, \
            own_backward():
        yield replay
