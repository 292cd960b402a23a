"""Dual chunk attention, ported from HKUNLP/ChunkLlama `chunkllama_attn_replace.py`
(`ChunkLlamaRotaryEmbedding`, `forward`, `merge_attn_outputs`, `do_flash_attn`).

What the port keeps, with c = chunk_size − local_window:
- three tables: queries within a chunk at `arange(c)`, queries against earlier chunks at
  `(arange(c) + c).clamp(max=chunk_size)`, keys at `arange(n) % c`; keys are rotated once, at
  their position id, and cached rotated; queries use `position_ids % c`;
- the tables' `mscale` (0.05·ln(seq_len / max_position_embeddings) + 1 on cos and sin alike, so on
  q and k both) once a call's sequence is longer than any before it and than
  `max_position_embeddings`; leave that None to never rescale;
- the prefill: the first chunk by causal attention; each later chunk as up to three attentions
  (intra: causal, over its own chunk; successive: queries at the clamped table, over the previous
  chunk; inter: all queries at row c − 1 of that table, over the chunks before), each returning its
  log-sum-exp as flash-attn does, merged by softmax weights of those log-sum-exps (theirs rounds
  the weights to bfloat16; float64 here);
- decoding (a call with a cache): one score matrix [inter | successive | intra] over the cache by
  the same three tables, transformers' (all-zero) mask, a softmax.
ChunkLlama has no log-n attention; with `logn`, Qwen's factor scales each query at its text index.
"""

from __future__ import annotations

import math

import torch

from tests.references.logn import logn_table
from tests.references.rotary import cos_sin, rotate

# Their constant: the key table covers this many positions past the longest sequence seen.
MAX_NEW_TOKENS = 512

Attended = tuple[torch.Tensor, torch.Tensor]
"""What `do_flash_attn` returns: the output [heads, q_len, d] and its log-sum-exp [heads, q_len]."""


class _ChunkRotary:
    """`ChunkLlamaRotaryEmbedding`: six tables, rebuilt for a longer sequence than any before."""

    def __init__(
        self,
        head_dim: int,
        base: float,
        chunk_size: int,
        local_window: int,
        max_position_embeddings: int | None,
    ) -> None:
        self.head_dim, self.base = head_dim, base
        self.chunk_size, self.chunk_len = chunk_size, chunk_size - local_window
        self.max_position_embeddings = max_position_embeddings
        self.max_seq_len = max_position_embeddings or 0
        self._build(self.max_seq_len)

    def _build(self, seq_len: int) -> None:
        scale = seq_len / self.max_position_embeddings if self.max_position_embeddings else 1.0
        mscale = 1.0 if scale <= 1 else 0.05 * math.log(scale) + 1.0
        q_t = torch.arange(self.chunk_len, dtype=torch.float64)
        qc_t = (torch.arange(self.chunk_len, dtype=torch.float64) + self.chunk_len).clamp(max=self.chunk_size)
        k_t = torch.arange(seq_len + MAX_NEW_TOKENS, dtype=torch.float64) % self.chunk_len
        self.tables = [
            part * mscale for t in (q_t, qc_t, k_t) for part in cos_sin(t, self.head_dim, self.base)
        ]

    def __call__(self, seq_len: int) -> list[torch.Tensor]:
        if seq_len > self.max_seq_len:
            self._build(seq_len)
            self.max_seq_len = seq_len
        return [part[:seq_len] for part in self.tables]


def dca_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    base: float,
    chunk_size: int,
    local_window: int,
    max_position_embeddings: int | None = None,
    logn: int | None = None,
    prefill: int | None = None,
) -> torch.Tensor:
    """Their `forward` over a text: one call for `prefill` tokens (all by default), then one per token."""
    length, head_dim = q.shape[1], q.shape[-1]
    prefill = length if prefill is None else prefill
    rotary = _ChunkRotary(head_dim, base, chunk_size, local_window, max_position_embeddings)
    chunk_len = chunk_size - local_window
    cached_keys = torch.empty(k.shape[0], 0, head_dim, dtype=k.dtype)
    outputs = []
    for begin, end in [(0, prefill), *((step, step + 1) for step in range(prefill, length))]:
        query_states = q[:, begin:end]
        if logn is not None:
            query_states = query_states * logn_table(logn)[begin:end][None, :, None]
        q_cos, q_sin, qc_cos, qc_sin, k_cos, k_sin = rotary(end)
        position_ids = torch.arange(begin, end)
        cached_keys = torch.cat(
            [cached_keys, rotate(k[:, begin:end], k_cos[position_ids], k_sin[position_ids])], dim=1
        )
        tables = (q_cos, q_sin, qc_cos, qc_sin)
        if begin == 0:
            outputs.append(
                _prefill(query_states, cached_keys, v[:, :end], position_ids % chunk_len, tables, chunk_len)
            )
        else:
            outputs.append(
                _decode(query_states, cached_keys, v[:, :end], position_ids % chunk_len, tables, chunk_len)
            )
    return torch.cat(outputs, dim=1)


def _prefill(
    query_states: torch.Tensor,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    position_ids: torch.Tensor,
    tables: tuple[torch.Tensor, ...],
    chunk_len: int,
) -> torch.Tensor:
    q_cos, q_sin, qc_cos, qc_sin = tables
    kv_seq_len = key_states.shape[1]
    first = position_ids[:chunk_len]
    q_states_intra = rotate(query_states[:, :chunk_len], q_cos[first], q_sin[first])
    k_states_prev, v_states_prev = key_states[:, :chunk_len], value_states[:, :chunk_len]
    flash_results: list[list[Attended]] = [
        [_attend(q_states_intra, k_states_prev, v_states_prev, causal=True)]
    ]
    remain_len = kv_seq_len - chunk_len
    while remain_len > 0:
        per_chunk = []
        begin = kv_seq_len - remain_len
        curr_chunk_len = min(chunk_len, remain_len)
        end = begin + curr_chunk_len
        rows = position_ids[begin:end]
        q_states_intra = rotate(query_states[:, begin:end], q_cos[rows], q_sin[rows])
        k_states_intra, v_states_intra = key_states[:, begin:end], value_states[:, begin:end]
        per_chunk.append(_attend(q_states_intra, k_states_intra, v_states_intra, causal=True))
        q_states_succ = rotate(query_states[:, begin:end], qc_cos[rows], qc_sin[rows])
        per_chunk.append(_attend(q_states_succ, k_states_prev, v_states_prev, causal=False))
        if begin - k_states_prev.shape[1] > 0:
            prev_len = k_states_prev.shape[1]
            inter = position_ids[chunk_len - 1].repeat(curr_chunk_len)
            q_states_inter = rotate(query_states[:, begin:end], qc_cos[inter], qc_sin[inter])
            per_chunk.append(
                _attend(
                    q_states_inter,
                    key_states[:, : begin - prev_len],
                    value_states[:, : begin - prev_len],
                    causal=False,
                )
            )
        flash_results.append(per_chunk)
        k_states_prev, v_states_prev = k_states_intra, v_states_intra
        remain_len -= chunk_len
    return _merge(flash_results)


def _decode(
    query_states: torch.Tensor,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    position_ids: torch.Tensor,
    tables: tuple[torch.Tensor, ...],
    chunk_len: int,
) -> torch.Tensor:
    q_cos, q_sin, qc_cos, qc_sin = tables
    kv_seq_len, head_dim = key_states.shape[1], query_states.shape[-1]
    chunk_num_curr = (kv_seq_len - 1) // chunk_len
    q_states_intra = rotate(query_states, q_cos[position_ids], q_sin[position_ids])
    k_states_intra = key_states[:, chunk_len * chunk_num_curr : kv_seq_len]
    attn_scores = [q_states_intra @ k_states_intra.transpose(-1, -2) / math.sqrt(head_dim)]
    if chunk_num_curr >= 1:
        q_states_succ = rotate(query_states, qc_cos[position_ids], qc_sin[position_ids])
        k_states_succ = key_states[:, chunk_len * (chunk_num_curr - 1) : chunk_len * chunk_num_curr]
        attn_scores = [q_states_succ @ k_states_succ.transpose(-1, -2) / math.sqrt(head_dim), *attn_scores]
    if chunk_num_curr >= 2:
        inter = torch.tensor([chunk_len - 1])
        q_states_inter = rotate(query_states, qc_cos[inter], qc_sin[inter])
        k_states_inter = key_states[:, : chunk_len * (chunk_num_curr - 1)]
        attn_scores = [q_states_inter @ k_states_inter.transpose(-1, -2) / math.sqrt(head_dim), *attn_scores]
    return torch.softmax(torch.cat(attn_scores, dim=-1), dim=-1) @ value_states


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, causal: bool) -> Attended:
    """`do_flash_attn`: softmax(q·k/√d) v and the log-sum-exp; causal only for equal lengths here."""
    scores = query @ key.transpose(-1, -2) / math.sqrt(query.shape[-1])
    if causal:
        blocked = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(blocked, -math.inf)
    return torch.softmax(scores, dim=-1) @ value, torch.logsumexp(scores, dim=-1)


def _merge(flash_results: list[list[Attended]]) -> torch.Tensor:
    """`merge_attn_outputs`: each chunk's parts weighted by the softmax of their log-sum-exps."""
    attn_outputs_all = [flash_results[0][0][0]]
    for flash_per_chunk in flash_results[1:]:
        attn_outputs = torch.stack([output for output, _ in flash_per_chunk])
        logits = torch.stack([lse for _, lse in flash_per_chunk])
        lse_s = torch.exp(logits - logits.max(dim=0).values)
        lse_s = lse_s / lse_s.sum(dim=0)
        attn_outputs_all.append((attn_outputs * lse_s[..., None]).sum(dim=0))
    return torch.cat(attn_outputs_all, dim=1)
