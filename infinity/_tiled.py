"""Forward and backward of a tiled module, one tile at a time (see [Note: tiles] in `_units`).

Owns: the forwards that replace a tiled ``nn.Linear``'s or ``nn.Embedding``'s (on the module
object, not its class) and their autograd Functions. Touches: the `Scheduler` (to fetch,
prefetch and release a tile, and to hand it a tile's gradients), the tiles' memory (``full``).

Forward computes the output rows (Linear: the output features; Embedding: the looked-up rows)
of one tile at a time, the next tile's read in flight meanwhile, and releases each tile after
use (or keeps the last ones for backward, where the pool has room); only the input is saved for
backward. A Linear's backward goes over the tiles in the reverse order, fetching them again (but
those kept) only when the input needs a gradient (the weight's needs the input and
the output's gradient alone): a tile's weight gradient is complete as soon as that tile is
done, so it is handed on (written behind, or updated early by the overlapped optimizer)
before the next tile is read. The input gradient is summed over the tiles in fp32 and cast
once, so a bf16 run rounds it once, as the whole matmul does. Results match the untiled
module up to the order of floating-point sums. Where the parameters stay on a GPU, a Linear
computes with its whole weight instead ([Note: tiles computed whole]).
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from torch import nn
from torch.nn import functional as F


class _Tiles:
    """What a tiled module's Function needs: the scheduler (weakly: see `_weak_grad_hook`) and
    the tiles, in row order."""

    __slots__ = ("scheduler", "tiles", "rows")

    def __init__(self, scheduler, tiles):
        self.scheduler = weakref.ref(scheduler)
        self.tiles = tiles
        self.rows = tiles[0].records[0].full_shape[0]

    def live(self):
        s = self.scheduler()
        if s is None:
            raise RuntimeError("the engine of this tiled module was closed or dropped; its weights are gone")
        return s

    @contextlib.contextmanager
    def use(self, scheduler, k: int, step: int = 1, keep: bool = False):
        """Tile ``k`` ready to read, the read of the next one (``k + step``) started; released
        after (also when the work on it fails), or, with ``keep`` (a forward whose backward
        reads the tiles again), kept for backward where the pool has room ([Note: kept for
        backward] in `_schedule`)."""
        unit = self.tiles[k]
        scheduler.runtime.materialize(unit)
        if 0 <= k + step < len(self.tiles):
            scheduler.runtime.prefetch_unit(self.tiles[k + step])
        unit.active += 1
        try:
            yield unit
        finally:
            unit.active -= 1
            if not (keep and scheduler.prefetcher.keep_for_backward(unit)):
                scheduler.runtime.release(unit, after_forward=True)


def _anchor(*params) -> torch.Tensor:
    """What a tiled module's Function takes as its input in its parameters' place: an empty
    leaf that needs a gradient where one of ``params`` does, so that the output needs one
    (an embedding's ids need none), and that backward gives none (the tiles get theirs from
    the Function itself).

    [Note: no autograd edge to a tiled parameter]
    The parameters themselves are never the Function's inputs. Autograd makes a leaf's
    gradient edge once per graph, in the leaf's shape then: the placeholder's ``(0,)``, so a
    gathered read of the whole weight in the same forward (`_gather`) would have its gradient
    refused by autograd's shape check; and the edge runs the leaf's gradient hooks (the ones
    a gather left on it) for the gradient of None the Function gives."""
    needs = torch.is_grad_enabled() and any(p is not None and p.requires_grad for p in params)
    return torch.empty(0, device=params[0].device, requires_grad=needs)


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, anchor, tiles: _Tiles, need_w: bool, need_b: bool, has_bias: bool):
        scheduler = tiles.live()
        ctx.tiles, ctx.need_w, ctx.need_b = tiles, need_w, need_b
        ctx.anchor = _grad_node(anchor)
        ctx.whole = _computes_whole(scheduler, x)
        if ctx.whole:  # see [Note: tiles computed whole]
            w, b = _whole(scheduler, tiles, has_bias)
            out = F.linear(x, w, b)  # under autocast too
            ctx.compute_dtype = out.dtype
            ctx.save_for_backward(x)
            return out
        out = None
        # Backward reads the tiles again for the input's gradient, last tile first: the tiles
        # read last here are kept for it where the pool has room.
        keep = ctx.needs_input_grad[0]  # False without grad (forward runs with grad off)
        for k in range(len(tiles.tiles)):
            with tiles.use(scheduler, k, keep=keep) as unit:
                lo, hi = unit.rows
                b = unit.piece(1) if has_bias else None
                y = F.linear(x, unit.piece(0), b)  # under autocast too: the caller's autocast state holds here
                if out is None:
                    out = torch.empty(*x.shape[:-1], tiles.rows, dtype=y.dtype, device=y.device)
                out[..., lo:hi] = y
                del y
        ctx.compute_dtype = out.dtype
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        tiles: _Tiles = ctx.tiles
        scheduler = tiles.live()
        _refuse_create_graph(tiles)
        accumulates = _accumulates(ctx.anchor)  # this backward's: ctx is the next one's too (retain_graph)
        need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.need_w and accumulates, ctx.need_b and accumulates
        cdt = ctx.compute_dtype
        g = grad_out.to(cdt)
        xc = x.to(cdt).reshape(-1, x.shape[-1])
        if ctx.whole:
            return _whole_backward(scheduler, tiles, x, g, xc, need_x, need_w, need_b), None, None, None, None, None
        gx = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if need_x else None
        # The last tile first: forward read it last, and may have kept it ([Note: kept for
        # backward] in `_schedule`).
        for k in reversed(range(len(tiles.tiles))):
            unit = tiles.tiles[k]
            # The weights are read only for the input's gradient; the weight's and the bias's
            # need the input and the output's gradient alone.
            scheduler.prefetcher.take_kept(unit)
            with tiles.use(scheduler, k, step=-1) if need_x else contextlib.nullcontext(unit):
                lo, hi = unit.rows
                gk = g[..., lo:hi]
                if need_x:
                    gx.view(-1, gx.shape[-1]).add_(_fp32_product(gk.reshape(-1, hi - lo), unit.piece(0)))
                g2 = gk.reshape(-1, hi - lo)
                if need_w:
                    scheduler.runtime.tile_grad(unit, 0, g2.t() @ xc)
                if need_b:  # a bias trained under a frozen weight too
                    scheduler.runtime.tile_grad(unit, 1, g2.sum(0))
        return (gx.to(x.dtype) if need_x else None), None, None, None, None, None


def _refuse_create_graph(tiles: _Tiles) -> None:
    """A backward that builds its own graph (``create_graph=True``: a gradient penalty's
    ``torch.autograd.grad(out, x, create_graph=True)``, double backward) through a tiled
    module is refused: the tiles' gradients are computed here, outside autograd, so the
    penalty's second-order terms in the tiled weights would be dropped (1e-3 off plain PyTorch
    in a step, 4x the loss in 4 steps; an audit helper's repro)."""
    if torch.is_grad_enabled():  # autograd runs a backward with grad mode on only under create_graph
        name = tiles.tiles[0].path
        raise RuntimeError(
            f"a backward with create_graph=True (double backward, such as a gradient penalty) went through the "
            f"tiled module {name!r}, whose tiles compute their gradients outside autograd: their second-order "
            f"terms would be lost. Set memory.tile_size = None (or above {name!r}'s fp32 size) to keep it whole, "
            "or take the penalty's gradient with respect to a tensor the tiled module does not lie under"
        )


def _accumulates(anchor_node) -> bool:
    """Whether this backward gives the tiled module's parameters their gradients: it does when
    it accumulates into leaves (``backward()``, or ``backward(inputs=...)`` naming them), and
    not under ``torch.autograd.grad(loss, x)`` or ``backward(inputs=[x])``, which ask for other
    tensors' gradients and leave the parameters' ``.grad`` alone, as plain PyTorch does: the
    tiles were handed weight gradients there, added to the next backward's (1.5e-3 off plain
    PyTorch after one such call; an audit helper's repro). The anchor ([Note: no autograd edge
    to a tiled parameter]) stands for the parameters: whether autograd runs its gradient's
    node this time. Under ``torch.autograd.grad`` with the anchor among the inputs (nothing
    outside this module holds it) autograd captures its gradient, never accumulates: none."""
    if anchor_node is None:
        return False
    try:
        return torch._C._will_engine_execute_node(anchor_node)
    except RuntimeError:  # a leaf's node under torch.autograd.grad: captured, not accumulated
        return False
    except AttributeError:  # a torch without the check: every backward accumulates
        return True


def _grad_node(anchor: torch.Tensor):
    """The node autograd accumulates ``anchor``'s gradient with (None: it needs none)."""
    if not anchor.requires_grad:
        return None
    try:
        from torch.autograd.graph import get_gradient_edge  # torch 2.2 and later
    except ImportError:
        with torch.enable_grad():  # (a Function's forward runs without grad)
            return anchor.view_as(anchor).grad_fn.next_functions[0][0]
    return get_gradient_edge(anchor).node


def _computes_whole(scheduler, x: torch.Tensor) -> bool:
    """[Note: tiles computed whole]
    Tiles bound the buffers that hold a unit: on the host, its parameters fetched, its
    gradient landing, its optimizer states. On a GPU whose parameters stay on it (the params
    tier on the device: ZeRO-Offload's device,device,cpu), the tiles' weights are all there,
    and computing tile by tile only costs the GPU: an fp32 sum of the input's gradient over the
    tiles, copies of each tile's output rows, smaller matmuls (the 953M Llama's MLP projections
    and output layer are tiles: its GPU time was 2.2 s a step at 16x4096 against the resident
    side's 1.46 s on an H200, aten::mm alone 1.24 s of it). So there the weight is put
    together for each pass (a copy of the tiles' rows: 1.4 GB of bf16 weights for that model,
    estimated at about 1 ms at the H200's bandwidth, not timed) and the products are the
    untiled Linear's: one for the output, one
    for the input's gradient, one for the weight's, whose rows each tile is handed. With the
    parameters fetched from nvme or host memory, the tiles stay the unit of the reads, which
    run ahead of the compute one tile at a time."""
    return scheduler.runtime.always_ready and _on_gpu(x)


def _whole(scheduler, tiles: _Tiles, has_bias: bool):
    """The tiled Linear's weight and bias, whole (copies of the tiles' rows)."""
    units = tiles.tiles
    for unit in units:
        scheduler.runtime.materialize(unit)  # bound already: the parameters stay on the device
    w = torch.cat([u.piece(0) for u in units])
    b = torch.cat([u.piece(1) for u in units]) if has_bias else None
    return w, b


def _whole_backward(scheduler, tiles: _Tiles, x, g, xc, need_x: bool, need_w: bool, need_b: bool):
    """The untiled Linear's gradients ([Note: tiles computed whole]): each tile is handed its
    rows of the weight's and the bias's, the last tile first (as the tiles' backward does);
    returns the input's."""
    gx = None
    if need_x:
        w, _ = _whole(scheduler, tiles, False)
        gx = (g @ w.to(g.dtype)).to(x.dtype)
    g2 = g.reshape(-1, g.shape[-1])
    gw = g2.t() @ xc if need_w else None
    gb = g2.sum(0) if need_b else None
    for unit in reversed(tiles.tiles):
        lo, hi = unit.rows
        if need_w:
            scheduler.runtime.tile_grad(unit, 0, gw[lo:hi])
        if need_b:  # a bias trained under a frozen weight too
            scheduler.runtime.tile_grad(unit, 1, gb[lo:hi])
    return gx


def _fp32_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in fp32, for a sum over tiles rounded once.

    [Note: the input gradient's matmul on a GPU]
    bf16 or fp16 factors on a GPU are multiplied on its tensor cores with an fp32 result
    (``torch.mm``'s ``out_dtype``): their products are exact in fp32 and summed in fp32, as in
    the fp32 matmul of the upcast factors, which the tensor cores do not run (TF32 is off by
    default). That fp32 matmul, in every tiled Linear's backward (the MLP's three projections
    of each block of the 953M Llama, and its output layer), was an estimated 0.8 s (from its
    FLOPs at fp32 speed) of the 1.26 s backward at 16x2048 in device,device,cpu on an H200,
    where aten::mm took 1.13 s of GPU time and the resident step 0.55 s in all; there the tiles are now computed whole ([Note:
    tiles computed whole]), and this is the product of tiles fetched from nvme or host memory.
    Weights of another dtype (fp32 under autocast) are cast to the gradient's,
    as autocast cast them for forward's matmul. Elsewhere (the host, or fp32) the upcast
    matmul."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and _mm_out_dtype():
        return torch.mm(a, b.to(a.dtype), out_dtype=torch.float32)
    return a.float() @ b.float()


@functools.cache
def _mm_out_dtype() -> bool:
    """Whether this torch multiplies bf16 into fp32 on a GPU (``torch.mm(..., out_dtype=)``)."""
    try:
        x = torch.ones(16, 16, dtype=torch.bfloat16, device="cuda")
        return torch.mm(x, x, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


class _EmbeddingFn(torch.autograd.Function):
    """[Note: a tiled embedding without host synchronisation]
    Boolean-mask indexing (``out[ids in tile]``) sizes its result on the host, so on a GPU each
    waits for the GPU to get there: 37 stream synchronisations a step of the 953M Llama in bf16
    (its embedding is 8 tiles), 0.46 s of the host waiting on an H200, and the range check's
    ``int(ids.min())`` two more. So on a GPU forward picks each tile's rows with ``torch.where``
    (every row is looked up in one tile exactly, so the result is the same bytes), the ids
    are checked by a device-side assertion, as ``nn.Embedding`` checks them there, and backward
    makes the whole gradient with ``nn.Embedding``'s own kernel (``embedding_dense_backward``,
    which sums in fp32 on a GPU) and hands each tile its rows (a view: the
    vocabulary's gradient lives on the device until the tiles' have gone, as an untiled
    embedding's does). On the host, where nothing waits and the tiles bound host memory, the
    boolean masks stay (each output row written once, not once a tile), backward runs the
    same kernel over each tile's ids apart, and an id out of range is an IndexError before
    anything runs."""

    @staticmethod
    def forward(ctx, ids, anchor, tiles: _Tiles, padding_idx, dtype: torch.dtype, device: torch.device):
        scheduler = tiles.live()
        _check_ids(ids, tiles.rows)
        cols = tiles.tiles[0].records[0].full_shape[1]
        gpu = _on_gpu(ids)
        out = (torch.zeros if gpu else torch.empty)(*ids.shape, cols, dtype=dtype, device=device)
        for k in range(len(tiles.tiles)):
            with tiles.use(scheduler, k) as unit:
                lo, hi = unit.rows
                if gpu:  # no boolean indexing: each tile's rows picked by torch.where
                    local = ids - lo
                    inside = ((local >= 0) & (local < hi - lo)).unsqueeze(-1)
                    out = torch.where(inside, F.embedding(local.clamp(0, hi - lo - 1), unit.piece(0)), out)
                else:  # the host: only the ids in the tile are touched
                    sel = (ids >= lo) & (ids < hi)
                    out[sel] = unit.piece(0)[ids[sel] - lo]
        ctx.tiles, ctx.padding_idx = tiles, padding_idx
        ctx.save_for_backward(ids)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        tiles: _Tiles = ctx.tiles
        _refuse_create_graph(tiles)
        scheduler = tiles.live()
        if _on_gpu(grad_out):  # the weights themselves are not read: no fetch
            # nn.Embedding's own gradient kernel: on a GPU it sums in fp32 and rounds once (an
            # index_add_ into a bf16 gradient would round at every add of a frequent id); the
            # padding row gets none.
            pad = -1 if ctx.padding_idx is None else ctx.padding_idx
            gw = torch.ops.aten.embedding_dense_backward(grad_out, ids, tiles.rows, pad, False)
            for unit in tiles.tiles:
                lo, hi = unit.rows
                scheduler.runtime.tile_grad(unit, 0, gw[lo:hi])
            return None, None, None, None, None, None
        for unit in tiles.tiles:
            lo, hi = unit.rows
            sel = (ids >= lo) & (ids < hi)
            pad = ctx.padding_idx - lo if ctx.padding_idx is not None and lo <= ctx.padding_idx < hi else -1
            # nn.Embedding's kernel over the tile's ids, in their order: each row's sum is the
            # untiled one's, rounded as it rounds (an index_add_ into a bf16 gradient rounded
            # otherwise: bf16 weights 1e-3 off the untiled ones in 3 steps, test_tiles).
            gw = torch.ops.aten.embedding_dense_backward(grad_out[sel], ids[sel] - lo, hi - lo, pad, False)
            scheduler.runtime.tile_grad(unit, 0, gw)
        return None, None, None, None, None, None


def _on_gpu(t: torch.Tensor) -> bool:
    """Whether the tiled modules computing on ``t`` take the GPU's ways ([Note: a tiled
    embedding without host synchronisation], [Note: tiles computed whole]); the tests take them
    on the host too."""
    return t.is_cuda


def _check_ids(ids: torch.Tensor, rows: int) -> None:
    if _on_gpu(ids):  # no host wait: an id out of range stops the GPU's work, as nn.Embedding's does
        inside = ((ids >= 0) & (ids < rows)).all()
        try:
            torch._assert_async(inside, "index out of range in self")
        except TypeError:  # a torch whose assertion takes no message
            torch._assert_async(inside)
    elif ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
        raise IndexError(f"index out of range in self: ids span [{int(ids.min())}, {int(ids.max())}], "
                         f"the embedding has {rows} rows")  # fmt: skip


def _linear_forward(module: nn.Linear, tiles: _Tiles, x):
    w, b = module.weight, module.bias  # see [Note: no autograd edge to a tiled parameter]
    return _LinearFn.apply(x, _anchor(w, b), tiles, w.requires_grad, b is not None and b.requires_grad, b is not None)


def _embedding_forward(module: nn.Embedding, tiles: _Tiles, ids):
    w = module.weight  # see [Note: no autograd edge to a tiled parameter]
    return _EmbeddingFn.apply(ids, _anchor(w), tiles, module.padding_idx, w.dtype, w.device)


def ahead(module: nn.Module, tiles, backward: bool) -> list:
    """The tiles the scheduler prefetches before ``module`` runs: the one it reads first (the
    Function reads the rest one ahead): the first in forward, the last in a Linear's backward;
    none before an embedding's backward, which reads no weights."""
    if backward:
        return [] if type(module) is nn.Embedding else tiles[-1:]
    return tiles[:1]


def install(module: nn.Module, scheduler, tiles) -> None:
    """Replace ``module``'s forward (on the object) by its tiled one."""
    state = _Tiles(scheduler, tiles)
    fn = _linear_forward if type(module) is nn.Linear else _embedding_forward
    module.forward = functools.partial(fn, module, state)
    for p in module.parameters(recurse=False):
        p._infinity_tiled = True  # a hook on it is refused: `_placeholder.refuse_tiled_hook`


def remove(module: nn.Module) -> None:
    """Give ``module`` back its class's forward."""
    module.__dict__.pop("forward", None)
    for p in module.parameters(recurse=False):
        p.__dict__.pop("_infinity_tiled", None)
