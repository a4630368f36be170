"""The answers of one micro-batch packed for the update's shared-prefix forward: the answer tokens
that matter, of all B rows, as one run of N tokens (row-major, each row's tokens in their order,
cumulative offsets per row), so that the token-wise work (norms, projections, the MLP, the log-prob
head) costs N rows instead of the padded layout's B·(T-1).

Which tokens: answer input j of row b (the token at column P + j, j < T - 1, which predicts answer
token j + 1) is packed when it is a real token (attention mask 1) and a later position of its row
is wanted (`select`, the completion mask): an input after its row's last wanted position changes
nothing wanted (every piece of the forward is causal), so the last real token of an answer, which
predicts a pad, is dropped too. Wanted position t of row b reads the hidden state of its prompt's
last column (t = 0) or of packed input t - 1 (`source`); when some wanted position's input is not a
real token, or when nothing would be dropped (N = B·(T-1)), `pack_answers` returns None and the
padded forward runs (the same work, or the only form that holds such a row).

The pieces that mix a row's tokens (attention; for the hybrid the causal conv and the delta rule)
run on length buckets: the rows with tokens, longest first, go into buckets in which every row has
at least 1/(1 + slack) of the longest row's tokens, and each bucket runs as a padded [n, M, ...]
batch of its own (`pad`): at most `slack` of a bucket's real tokens are padding, against
(T-1)/mean length in the padded layout. Positions past a row's end repeat the row's last token:
attention masks them as keys (`bucket_masks`), and the causal pieces never carry them into a real
position; their outputs are dropped by `unpad`, which gathers every real position of all buckets
back into packed order in one index. A bucket whose rows are consecutive in the packed order and
all of its width is a view, not a copy.

Host syncs: the row lengths, once per micro-batch (the buckets' shapes depend on them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["AnswerPacking", "Bucket", "pack_answers", "bucket_masks", "SLACK"]

# padding a bucket may add, as a share of its real tokens (1/8: at most 12.5 % more attention rows)
SLACK = 0.125


@dataclass(frozen=True)
class Bucket:
    """Rows run together by the pieces that mix a row's tokens, padded to the longest of them."""
    rows: Tensor            # [n] long: micro-batch rows, longest first
    lengths: Tensor         # [n] long: their packed token counts (>= 1)
    width: int              # M: the longest row's count
    index: Tensor | None    # [n, M] long: packed token of (row, column), a row's last past its end; None: a view
    start: int              # with index None: the packed position of the first row's first token


@dataclass(frozen=True)
class AnswerPacking:
    """Which answer inputs run (keep), where each sits in the packed run, and how to go back."""
    keep: Tensor                 # [B, A] bool: answer input j of row b is packed
    flat: Tensor                 # [N] long: index of each packed token in the flattened [B·A] layout
    offsets: Tensor              # [B + 1] long: row b's packed tokens are offsets[b] : offsets[b + 1]
    lengths: tuple[int, ...]     # [B]: packed tokens per row
    buckets: tuple[Bucket, ...]
    back: Tensor | None          # [N] long: each packed token's place in the cat of the flattened bucket
    #                              outputs (None: one view bucket that is the whole run)
    source: Tensor               # [n_sel] long: wanted position's hidden state in cat([prompt last [U], packed [N]])
    n: int                       # N

    def tokens(self, t: Tensor) -> Tensor:
        """The packed tokens [N, ...] of a padded-layout answer tensor t [B, A, ...]."""
        return t.flatten(0, 1)[self.flat]

    def pad(self, t: Tensor, bucket: Bucket) -> Tensor:
        """A packed tensor t [N, ...] as `bucket`'s padded batch [n, M, ...]."""
        n, M = bucket.rows.shape[0], bucket.width
        if bucket.index is None:
            return t[bucket.start:bucket.start + n * M].unflatten(0, (n, M))
        return t[bucket.index]

    def unpad(self, outs: list[Tensor]) -> Tensor:
        """The buckets' outputs [n, M, ...] (in the order of `buckets`) -> packed [N, ...]."""
        if self.back is None:
            return outs[0].flatten(0, 1)
        return torch.cat([o.flatten(0, 1) for o in outs])[self.back]


def pack_answers(attention_mask: Tensor, select: Tensor, P: int, inverse: Tensor, U: int,
                 contiguous: bool = False, slack: float = SLACK) -> AnswerPacking | None:
    """The packing of the answer inputs of `attention_mask` [B, P+T] (columns P .. P+T-2) for the
    wanted positions `select` [B, T] (bool), with `inverse` [B] each row's distinct prompt of U.
    None when packing drops nothing or cannot hold a wanted position (see the module doc);
    `contiguous`: also None when a row's packed tokens are not its first columns (a real token after
    a pad: the hybrid's conv and delta rule run over the padded layout's zeroed positions, packing
    would skip them)."""
    B, T = select.shape
    A = T - 1
    device = attention_mask.device
    if A <= 0:
        return None
    sel = select.bool()
    real = attention_mask[:, P:P + A].bool()                             # [B, A]
    if bool((sel[:, 1:] & ~real).any()):        # a wanted position whose input is a pad
        return None
    cols = torch.arange(A, device=device)
    last = torch.where(sel, torch.arange(T, device=device), -1).amax(1)   # last wanted position per row, -1: none
    keep = real & (cols[None] < last[:, None])                            # inputs j < last feed a wanted position
    counts = keep.sum(1)
    lengths = tuple(int(c) for c in counts.tolist())
    N = sum(lengths)
    if N == B * A:
        return None
    if contiguous and not bool((keep == (cols[None] < counts[:, None])).all()):
        return None
    flat = keep.flatten().nonzero().squeeze(1)                            # [N]
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    position = torch.full((B * A,), -1, dtype=torch.long, device=device).index_copy_(
        0, flat, torch.arange(N, device=device)).view(B, A)               # packed index of (b, j), -1: not packed
    sb, st = sel.nonzero().unbind(1)
    source = torch.where(st == 0, inverse[sb], U + position[sb, (st - 1).clamp_min(0)])

    starts = [0]
    for c in lengths:
        starts.append(starts[-1] + c)
    order = sorted((b for b in range(B) if lengths[b] > 0), key=lambda b: -lengths[b])   # stable: ties by row
    buckets, places, at = [], [], 0
    i = 0
    while i < len(order):
        M = lengths[order[i]]
        j = i + 1
        while j < len(order) and lengths[order[j]] * (1 + slack) >= M:
            j += 1
        rows = order[i:j]
        n = len(rows)
        rows_t = torch.tensor(rows, dtype=torch.long, device=device)
        lens_t = counts[rows_t]
        consecutive = rows == list(range(rows[0], rows[0] + n)) and all(lengths[r] == M for r in rows)
        column = torch.arange(M, device=device)
        if consecutive:
            index = None
        else:
            index = offsets[rows_t][:, None] + torch.minimum(column[None], lens_t[:, None] - 1)
        buckets.append(Bucket(rows_t, lens_t, M, index, starts[rows[0]]))
        # where each real (row, column) of this bucket lands in the cat of the flattened outputs
        real_b = column[None] < lens_t[:, None]                           # [n, M]
        padded_at = at + torch.arange(n * M, device=device).view(n, M)
        packed_at = offsets[rows_t][:, None] + column[None]
        places.append((packed_at[real_b], padded_at[real_b]))
        at += n * M
        i = j
    whole = len(buckets) == 1 and buckets[0].index is None and at == N
    back = None
    if not whole and N > 0:
        packed_at = torch.cat([p for p, _ in places])
        padded_at = torch.cat([q for _, q in places])
        back = torch.empty(N, dtype=torch.long, device=device).index_copy_(0, packed_at, padded_at)
    return AnswerPacking(keep, flat, offsets, lengths, tuple(buckets), back, source, N)


def bucket_masks(packing: AnswerPacking, prompt_valid: Tensor, G: int = 1) -> list[Tensor]:
    """Per bucket, the attention mask (True = may attend) of its rows' answer queries over their
    prompt's P keys (`prompt_valid` [B, P], each row's prompt columns) then the row's own packed
    answers, causal and cut at the row's end: [n, 1, G·M, P+M], each query row repeated G times
    (the G query heads of a KV head run as G·M query rows of it; G = 1: the heads as they are).
    A query past its row's end sees its prompt's real tokens (no all-masked row); its output is dropped."""
    out = []
    for b in packing.buckets:
        n, M = b.rows.shape[0], b.width
        device = b.rows.device
        column = torch.arange(M, device=device)
        keys_p = prompt_valid[b.rows].bool()[:, None, :].expand(n, M, prompt_valid.shape[1])
        causal = torch.ones(M, M, dtype=torch.bool, device=device).tril_()
        keys_a = causal[None] & (column[None, None, :] < b.lengths[:, None, None])
        mask = torch.cat([keys_p, keys_a], dim=2)                         # [n, M, P+M]
        if G > 1:
            mask = mask.unsqueeze(1).expand(n, G, M, mask.shape[2]).reshape(n, G * M, mask.shape[2])
        out.append(mask[:, None])
    return out
