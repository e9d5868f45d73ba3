"""Prefill over a packed history: a chunk of Tq query tokens (a chunked prefill's later chunks, a chat's next turn)
attends to every token the layer held before it and, causally, to its own exact tokens.

The decode kernel reads such a chunk too, but dequantizes the whole history again for every tile of 64 query rows;
here the history is dequantized once per chunk, into a workspace of at most `PREFILL["workspace_bytes"]` (pieces
of the history in turn), and read by flash attention on tensor cores:

    out = merge_i (softmax(q K_i^T * scale) V_i, lse_i)     over the history's pieces i and the chunk itself

Each piece attends without a mask (every history token precedes every query token), with the query heads of a
kv-head folded into its rows (`(B, Hkv, G*Tq, D)`: GQA without repeating K/V); the chunk attends to itself causally;
the parts combine by their log-sum-exps. TurboQuant's packed tokens are dequantized in the codec's frame F (its
attention runs there with the query rotated in, `q F`, and its output rotated back, `o F^T`), its exact tokens in the
model's. KVQuant's history is dequantized by its reference codecs (`LayerReads.iter_kv_chunks`).

`hf_kvcache.attention.fused_attention` takes this path on CUDA for a chunk of more than `PREFILL["min_rows"]` query
rows (Tq times the query heads per kv-head) whose mask is plain causal, or causal with each batch row's first tokens
padded (`left_padding`: a left-padded batch prefilled in chunks); fewer rows (assisted decoding's few tokens) stay
with the decode kernel, which reads the packed bytes once. A padded row reads its history and its own chunk from its
first unpadded token on, by itself (flash attention takes no mask); its padded query rows attend to nothing and give
0, as the reference does.
"""

from __future__ import annotations

import os

import torch

from .kernels import backend
from .kernels.formats import reader_of
from .kernels.layout import StreamTensors
from .kernels.turbo_launch import _into_frame
from .kernels.workspace_launch import gather_codebook, gather_places

PREFILL = {
    # query rows (Tq x query heads per kv-head) above which a chunk reads its history from a workspace
    "min_rows": int(os.environ.get("HF_KVCACHE_PREFILL_MIN_ROWS", "32")),
    # the workspace's bytes (keys and values of one piece of the history, in the model dtype)
    "workspace_bytes": int(os.environ.get("HF_KVCACHE_PREFILL_WORKSPACE_MB", "1024")) << 20,
}
_MIN_PIECE = 1024  # tokens: pieces shorter than this leave flash attention short of work


def use_workspace(query: torch.Tensor, hkv: int) -> bool:
    """Whether a chunk of `query (B, Hq, Tq, D)` over `hkv` kv-heads reads its history through a workspace."""
    _, hq, tq, _ = query.shape
    return (tq > 1 and tq * (hq // hkv) > PREFILL["min_rows"]
            and query.dtype in (torch.float16, torch.bfloat16, torch.float32))


def left_padding(mask: torch.Tensor, tq: int, held: int) -> list[int] | None:
    """Each batch row's padded tokens `p_b` when boolean `mask (B or 1, 1, Tq, S >= held)` (True = attend) is
    bottom-right causal over the `held` tokens with every row's first `p_b` of them masked and nothing else (a
    left-padded batch's mask, its fully padded query rows attending nothing), else None. One host read; the
    comparison runs over `_CHECK_ROWS` query rows at a time (the mask of a 2048-token chunk over 32k tokens at batch
    16 is 1 GiB)."""
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != tq or held < tq or mask.shape[-1] < held:
        return None
    last = mask[:, 0, -1, :held]  # the chunk's last token attends to every unpadded token
    pads = torch.where(last.any(-1), last.to(torch.uint8).argmax(-1), held)
    col = torch.arange(held, device=mask.device)
    ok = ~mask[..., held:].any()
    for r0 in range(0, tq, _CHECK_ROWS):
        t = torch.arange(r0, min(r0 + _CHECK_ROWS, tq), device=mask.device)
        expected = (col >= pads[:, None, None, None]) & (col <= (held - tq + t)[:, None])
        ok &= (mask[:, :, r0 : r0 + _CHECK_ROWS, :held] == expected).all()
    found = torch.cat([pads, ok.view(1).long()]).tolist()
    return found[:-1] if found[-1] else None


_CHECK_ROWS = 256


def prefill_attention(query: torch.Tensor, layer, keys: StreamTensors, values: StreamTensors, k_new: torch.Tensor,
                      v_new: torch.Tensor, scaling: float, pads: list[int] | None = None) -> torch.Tensor:
    """`query (B, Hq, Tq, D)` (keys' frame: `layer.reads.rotate_query` applied) over the history `layer` held before this
    chunk (`keys`/`values`: its kernel views) and the chunk's own exact `k_new`/`v_new (B, Hkv, Tq, D)`, causal ->
    `(B, Tq, Hq, D)` in the query dtype. `pads`: each batch row's first tokens that nothing attends to (as
    `left_padding` finds them; a mask of one row stands for every row), else none."""
    b, hq, tq, d = query.shape
    if pads is not None and len(pads) != b:
        pads = pads * b
    if pads is not None and not any(pads):
        pads = None
    hkv = k_new.shape[1]
    g = hq // hkv
    static = layer.reads.static_layout()
    held = layer.held_tokens
    stop = held - tq  # history tokens
    folded = query.reshape(b, hkv, g * tq, d)  # rows (g, t) of each kv-head: a view when the query is contiguous
    parts = []
    history = reader_of(keys.fmt).history
    if history == "codebook":
        n_body = _codebook_body(held, stop, static)
        frame_q = _into_frame(query, keys.fmt.frame(query.device), hkv).to(query.dtype).reshape(b, hkv, g * tq, d)
        vframe = values.fmt.frame(query.device)
        n_sink = min(held, static.sink_tokens)
        for start, n, wk, wv in _pieces(query, hkv, n_body):
            gather_codebook(keys, values, k_new, static, wk, wv, start, n, exact=False)
            o, lse = _attend_from(frame_q, wk, wv, False, scaling, _starts(pads, n_sink + start))
            parts.append((_out_of_frame(o, vframe), lse))
        n_exact = stop - n_body
        if n_exact:
            wk, wv = _workspace(query, hkv, n_exact)
            gather_codebook(keys, values, k_new, static, wk, wv, 0, n_exact, exact=True)
            # the sinks (positions 0 .. n_sink), then the residual (from n_sink + n_body): a row's unpadded tokens
            # are a suffix of them either way
            starts = None if pads is None else [p if p < n_sink else n_sink + max(p - n_sink - n_body, 0)
                                                for p in pads]
            parts.append(_attend_from(folded, wk, wv, False, scaling, starts))
    elif history == "reference":
        pos = 0
        for k, v in layer.reads.iter_kv_chunks(k_new, v_new, chunk_tokens=_piece_tokens(query, hkv)):
            if pos >= stop:
                break
            parts.append(_attend_from(folded, k.contiguous(), v.contiguous(), False, scaling, _starts(pads, pos)))
            pos += k.shape[2]
    else:
        for start, n, wk, wv in _pieces(query, hkv, stop):
            gather_places(keys, values, k_new, static, wk, wv, start, n)
            parts.append(_attend_from(folded, wk, wv, False, scaling, _starts(pads, start)))
    parts = [(o.reshape(b, hq, tq, d), lse.reshape(b, hq, tq)) for o, lse in parts]
    parts.append(_attend_from(query, k_new, v_new, True, scaling, _starts(pads, stop)))  # the chunk itself, causal
    return _merge(parts, query.dtype).transpose(1, 2)


# ------------------------------------------------------------------ the workspace


def _piece_tokens(query: torch.Tensor, hkv: int) -> int:
    per_token = 2 * query.shape[0] * hkv * query.shape[-1] * query.element_size()
    return max(_MIN_PIECE, PREFILL["workspace_bytes"] // per_token // 64 * 64)


def _workspace(query: torch.Tensor, hkv: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (query.shape[0], hkv, n, query.shape[-1])
    return (torch.empty(shape, device=query.device, dtype=query.dtype),
            torch.empty(shape, device=query.device, dtype=query.dtype))


def _pieces(query: torch.Tensor, hkv: int, n_tokens: int):
    """`(start, n, wk, wv)` for consecutive pieces of `n_tokens` history tokens: one workspace, reused, whose first n
    rows each piece fills."""
    if n_tokens <= 0:
        return
    piece = min(_piece_tokens(query, hkv), n_tokens)
    wk, wv = _workspace(query, hkv, piece)
    for start in range(0, n_tokens, piece):
        n = min(piece, n_tokens - start)
        yield start, n, wk[:, :, :n], wv[:, :, :n]


def _codebook_body(held: int, stop: int, static) -> int:
    """The packed body tokens among the first `stop` of the `held` tokens (sinks first): the host's twin of
    `turbo._turbo_attn`'s STATIC counts (`tiles.static_places`)."""
    n_sink = min(held, static.sink_tokens)
    after = held - n_sink
    ring = static.key_ring
    if ring == 0:
        packed = after
    elif static.key_window:
        packed = max(after - ring, 0)
    else:
        packed = after // ring * ring
    return max(min(packed, stop - n_sink), 0)


def _out_of_frame(o: torch.Tensor, frame) -> torch.Tensor:
    """`o (B, Hkv, rows, D)` in the values' frame -> `o F^T` in the model dtype: `z = o R^T`, then channel `order_j`
    takes z_j."""
    rot, order = frame
    z = o.float() @ rot.T
    if order is not None:
        z = torch.empty_like(z).scatter_(3, order.long()[:, :, None, :].expand_as(z), z)
    return z.to(o.dtype)


# ------------------------------------------------------------------ attention with its log-sum-exp


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`softmax(q k^T * scale) v` -> `(out (B, Hq, T, D) in q's dtype, lse (B, Hq, T) float32)`, natural log;
    `causal`: T equals k's length and row t sees keys up to t. Hq may be a multiple of k's heads (GQA)."""
    g = q.shape[1] // k.shape[1]
    if q.is_cuda and not backend.interpreting():
        if g > 1:
            # only the chunk itself comes here with its query heads unfolded (a causal part cannot fold them): its K/V
            # are the chunk's own tokens, a small copy beside the workspace
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        if q.dtype in (torch.float16, torch.bfloat16):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
            return out, lse
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                           scale=scale)[:2]
        return out, lse[..., : q.shape[2]]
    # CPU (the reference, and the interpreter's tests): plain float32 arithmetic
    s = torch.einsum("bhgtd,bhsd->bhgts", q.float().unflatten(1, (k.shape[1], g)), k.float()) * scale
    if causal:
        t = q.shape[2]
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("bhgts,bhsd->bhgtd", torch.exp(s - lse[..., None]), v.float())
    return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2)


def _starts(pads: list[int] | None, first: int) -> list[int] | None:
    """Where each row's unpadded tokens begin in a part whose first token is at position `first`."""
    return None if pads is None else [max(p - first, 0) for p in pads]


def _attend_from(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                 starts: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`_attend`, batch row i reading the keys from `starts[i]` on (causal: its query rows too, those before it
    attending to nothing: out 0, lse -inf); consecutive rows that start at 0 go together."""
    if starts is None or not any(starts):
        return _attend(q, k, v, causal, scale)
    b, hq, tq, _ = q.shape
    n = k.shape[2]
    out = q.new_zeros(b, hq, tq, v.shape[-1])
    lse = torch.full((b, hq, tq), float("-inf"), device=q.device)
    i = 0
    while i < b:
        start = starts[i]
        if start == 0:  # a run of rows that read every key: one call
            j = i
            while j < b and starts[j] == 0:
                j += 1
            out[i:j], lse[i:j] = _attend(q[i:j], k[i:j], v[i:j], causal, scale)
            i = j
            continue
        if start < n:
            rows = slice(start, None) if causal else slice(None)
            o, lse_i = _attend(q[i : i + 1, :, rows], k[i : i + 1, :, start:], v[i : i + 1, :, start:], causal, scale)
            out[i, :, rows], lse[i, :, rows] = o[0], lse_i[0]
        i += 1
    return out, lse


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """Attention over the union of the parts' keys from each part's `(out (B, Hq, T, D), lse (B, Hq, T))`; a row
    that no part attends (every lse -inf: a padded query row) gives 0."""
    if len(parts) == 1:
        return parts[0][0].to(dtype)
    lse = torch.stack([p[1] for p in parts])
    w = torch.softmax(lse, 0).nan_to_num_(0.0)  # each part's share of the total weight
    out = parts[0][0].float() * w[0, ..., None]
    for i, (o, _) in enumerate(parts[1:], 1):
        out.addcmul_(o.float(), w[i, ..., None])
    return out.to(dtype)
