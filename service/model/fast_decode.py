"""The fast backends' decode pass (`service.model.backend`: compiled, cuda_graphs, c).

The compiled step has one entry per window bucket (a power of two of positions, from
`MIN_WINDOW` to the decoder's `max_window`) and, within a bucket, one for a lone row and one for
any larger batch (the batch size is a dynamic dimension; 1 is special-cased by the compiler
anyway). Compiling them all is paid once per model at start-up (`warm_up`). The step is the
model's own layers (`decode_one_token`, over `attention.PagedStep`), as gpt-fast compiles its
model's forward: there is no second copy of the layer math to keep in step. Everything else
takes the eager path: a window past `max_window` (long contexts, where attention's memory reads
dominate and the compiler gains little), and schemes whose attention is not a bias on the scores
(`spec.TORCH_STEP_SUPPORT`).

Under the `c` backend (a CPU in float32), every step, a lone row's too, runs instead in C,
`service.model.kernels.batch_pass`, which interprets the block (`spec.BlockSpec`), after the
same `pass_prelude` (embedding, each row's tables, the scheme's bias): its attention reads each
row's own keys, where the torch
attention reads every row's whole window bucket; its products read weights packed once for them,
where the BLAS call repacks them every time; and one call replaces the compiled graph's guards,
wrappers and per-op dispatches. Nothing is compiled then.

The positional tables a batch reads are gathered into stacks once and reused while the rows, their
tables and the window stay the same; a step then only indexes them through `table_index`.

On a GPU the step is captured as CUDA graphs (`service.model.cuda_graphs`), one per window bucket
and batch bucket (powers of two up to `max_batch`), all at start-up: a batch replays its bucket's
graph, padded with rows that only touch the scratch block.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from pe_runtime import RopeScaling
from service.model.attention import PagedStep
from service.model.attention_rules import AttentionRule
from service.model.backend import Backend
from service.model.cuda_graphs import GraphedPass
from service.model.kernels import batch_pass
from service.model.kernels.huge_pages import HugePageArena
from service.model.kernels.packed_linear import Panels, pack_int4, pack_int8, pack_weight
from service.model.paged_cache import PagedKVCache, PagedRows
from service.model.positional import PassInputs, PassTables, PositionalInputs, StepPositions, step_positions
from service.model.quantized import Int4Linear, Int8Linear
from service.model.spec import C_SUPPORT, TORCH_STEP_SUPPORT, BlockSpec
from service.model.streaming_rows import StreamingSlots, decodes_in_c, streaming_slots
from service.model.transformer import Block, Transformer

logger = logging.getLogger("service.model.fast_decode")

MIN_WINDOW = 64
DEFAULT_MAX_WINDOW = 512
DEFAULT_MAX_BATCH = 64
# Tokens x keys of a biased scheme's prompt chunk past which it runs eager (`FastDecoder.prefills`).
C_PREFILL_MAX_READS = 1 << 20

StepFunction = Callable[..., Tensor]


def decode_one_token(
    model: Transformer,
    inputs: PassInputs,
    key_pages: list[Tensor],
    value_pages: list[Tensor],
    slot_positions: Tensor,
) -> Tensor:
    """gpt-fast's `decode_one_token`: the model's own layers (`Transformer.run_blocks`) for one new
    token per row, attending over the pool's blocks (`PagedStep`); logits float32 [B, V]. Writes
    each row's new key and value into its block at its position. Nothing branches on data, and
    shapes depend only on the batch size and the window (a power of two of blocks), so
    `torch.compile` traces it once per window bucket and replays it for every step of that shape."""
    hidden, step = pass_prelude(model, inputs, slot_positions)
    rope = (step.rope[0][:, None, None], step.rope[1][:, None, None]) if step.rope is not None else None
    positions = PositionalInputs(absolute=None, rope=rope, attn_mask=None, causal=False)  # rope [B, 1, 1, R]
    cache = PagedStep(key_pages, value_pages, inputs.window_blocks, inputs.positions, step.bias)
    hidden = model.run_blocks(hidden[:, None], positions, cache)[:, 0]  # [B, D]
    logits: Tensor = model.lm_head(model.norm(hidden))
    return logits.float()


def pass_prelude(
    model: Transformer, inputs: PassInputs, slot_positions: Tensor
) -> tuple[Tensor, StepPositions]:
    """The rows' embedded tokens [B, D] (absolute positions added) and positional inputs, read at
    the positions the pool records (`slot_positions`): the same for the torch step and the C pass."""
    t5 = model.positions.t5_table
    step = step_positions(inputs, slot_positions, t5.weight if t5 is not None else None)
    hidden = model.embed(inputs.tokens)
    if step.absolute is not None:
        hidden = hidden + step.absolute.to(hidden.dtype)
    return hidden, step


@functools.cache
def compiled_step() -> StepFunction:
    """`decode_one_token` under `torch.compile`, one per process.

    Automatic dynamic shapes are off so that a new window bucket compiles a static entry instead
    of turning the window into a symbol (symbolic windows made a lone row's step 3x slower); the
    batch dimension is marked dynamic explicitly. The entry limit covers every bucket of a few
    schemes and dtypes.

    Inductor's `decompose_mm_pass` turns a lone row's matrix products (one row times a weight:
    memory-bound) into multiply-and-sum loops it fuses with their neighbours; on CPU it applies
    only where the batch is statically 1, so the batched entries keep their GEMM kernels. On two
    cores it made a zoo model's single-row engine step 15-30% faster (3 alternating runs each).

    The generated code's checks of sizes and strides are off: they run in every step (about 60
    calls in a batch's), and what they check is fixed when the entry is compiled (the guards match
    the inputs' sizes and strides; the kernels' outputs are contiguous, as their fake ones say).
    """
    torch._dynamo.config.automatic_dynamic_shapes = False
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    options: dict[str, Any] = {
        "post_grad_fusion_options": {"decompose_mm_pass": {}},
        "size_asserts": False,
    }
    return torch.compile(decode_one_token, fullgraph=True, options=options)


def window_bucket(positions: int) -> int:
    """The smallest window bucket (a power of two, at least `MIN_WINDOW`) holding `positions`."""
    return max(MIN_WINDOW, 1 << (positions - 1).bit_length())


class FastDecoder:
    """The decode pass of one model over its block pool, on a fast backend (`backend`)."""

    def __init__(
        self,
        model: Transformer,
        pool: PagedKVCache,
        backend: Backend,
        *,
        max_window: int = DEFAULT_MAX_WINDOW,
        max_batch: int = DEFAULT_MAX_BATCH,
        inductor: bool = True,
    ) -> None:
        """`backend` is `choose_backend`'s (or a test's) pick among the fast ones. A lone row's C
        step took 0.20 ms against 0.39 ms for its compiled torch step (a /tmp probe, both paths
        alternating in one process, 5 repeats).

        `inductor=False` runs the torch step uncompiled (the reference the tests use). Under
        `cuda_graphs` the step replays graphs of batches of up to `max_batch` rows (the engine's
        batch size); on a CPU it runs the graphs' buffers and padding uncaptured (tests again)."""
        if backend is Backend.EAGER:
            raise ValueError("the eager backend is the model's own forward pass, not a FastDecoder")
        self.model = model
        self.pool = pool
        self.backend = backend
        self.max_window = max_window
        self.max_batch = max_batch
        # The C step reads its own panels; the torch step the model itself. Both share the prelude.
        self.c_pass = c_batch_pass(model, pool) if backend is Backend.C else None
        if self.c_pass is None and (refused := TORCH_STEP_SUPPORT.refuses(BlockSpec.of(model.config))):
            raise ValueError(refused)
        self.compile_seconds = 0.0
        self._step = compiled_step() if inductor else decode_one_token
        self.graphs = (
            GraphedPass(self._torch_step, max_batch, capture=pool.keys[0].device.type == "cuda")
            if backend is Backend.CUDA_GRAPHS
            else None
        )
        self._tables: tuple[Hashable, PassTables] | None = None
        for pages in pool.keys + pool.values:
            torch._dynamo.mark_dynamic(pages, 1)  # pools of any size share the compiled entries
        torch._dynamo.mark_dynamic(pool.key_positions, 0)

    def window_for(self, lengths: Sequence[int]) -> int:
        """The bucket whose window holds every row's keys after this step."""
        return window_bucket(max(lengths) + 1)

    def covers(self, lengths: Sequence[int]) -> bool:
        """Whether rows of these cached lengths decode here: their window is within the buckets."""
        return self.window_for(lengths) <= self.max_window

    def windows(self) -> list[int]:
        sizes, window = [], MIN_WINDOW
        while window <= self.max_window:
            sizes.append(window)
            window *= 2
        return sizes

    def warm_up(self) -> float:
        """Compile every bucket now, for one row and for several (nothing where steps run in C),
        and capture every graph; returns the seconds it took.

        The dummy steps write only the pool's scratch block, which no row ever reads.
        """
        started = time.perf_counter()
        scaling = self.model.positions.default_scaling
        batches: Sequence[int] = (1, 2)
        if self.c_pass is not None:
            batches = ()
        elif self.graphs is not None:
            batches = self.graphs.buckets[::-1]  # the largest first: the others reuse its memory
        for window in self.windows():
            for batch in batches:
                blocks = torch.zeros(
                    batch, window // self.pool.block_size, dtype=torch.long, device=self._device
                )
                scalings, lengths = [scaling] * batch, [1] * batch
                keys = self._table_keys(scalings, lengths)
                self._run(blocks, [0] * batch, [0] * batch, scalings, lengths, keys, window)
        self.compile_seconds += time.perf_counter() - started
        logger.info(
            "compiled the decode pass for %s (%s windows) in %.1f s",
            self.model.config.pe,
            len(self.windows()),
            self.compile_seconds,
        )
        return self.compile_seconds

    def decodes_under(self, rule: AttentionRule | None) -> bool:
        """Whether a row under `rule` decodes here: in C, a streaming row too (`streaming_rows`)."""
        return rule is None or (self.c_pass is not None and decodes_in_c(rule, self.model.config))

    def decode(
        self,
        rows: PagedRows,
        tokens: Sequence[int],
        scalings: Sequence[RopeScaling],
        rules: Sequence[AttentionRule | None] = (),
    ) -> Tensor:
        """Logits float32 [B, V] for one token per row, each under its rule (`decodes_under`);
        advances the rows once it succeeded."""
        return self._step_rows(rows, tokens, scalings, [length + 1 for length in rows.lengths], rules)

    def _step_rows(
        self,
        rows: PagedRows,
        tokens: Sequence[int],
        scalings: Sequence[RopeScaling],
        table_lengths: Sequence[int],
        rules: Sequence[AttentionRule | None] = (),
    ) -> Tensor:
        """One token per row, read with the tables for `table_lengths`: logits float32 [B, V]. A
        streaming row's slots and text indices part once it gave back blocks (`text_offsets`):
        its tables are read at its text index, its pool at its slot."""
        lengths = rows.lengths
        window = self.window_for(lengths)
        blocks = rows.window_blocks(window // self.pool.block_size)
        keys = self._table_keys(scalings, table_lengths)
        streaming = (
            streaming_slots(rows, rules, scalings, table_lengths, self.model.config) if rules else None
        )
        texts = [length + offset for length, offset in zip(lengths, rows.text_offsets, strict=True)]
        rows.place(1)
        logits = self._run(blocks, tokens, texts, scalings, table_lengths, keys, window, lengths, streaming)
        rows.advance(torch.tensor(list(tokens))[:, None], keys)
        return logits

    def prefills(self, lengths: Sequence[int], counts: Sequence[int]) -> bool:
        """Whether a prompt chunk of `counts` tokens per row, after `lengths` cached, runs in C.

        Without a bias on the scores, a chunk's attention reads each key block once per tile of
        its rows (`chunk_attention.h`), and every chunk in the window runs in C: SmolLM2 read a
        3,298-token prompt in 6.7 s against 9.3 s with chunks deep in the prompt eager (BLAS
        products, a blocked attention). A biased scheme (ALiBi, T5) attends row by row, whose
        cost grows with tokens x keys: past `C_PREFILL_MAX_READS` of them the eager pass is faster.
        """
        if self.c_pass is None or min(counts) < 1 or self._chunk_window(lengths, counts) > self.max_window:
            return False
        if self.c_pass.tiles_chunks and not self.model.config.has_score_bias:
            return True
        reads = sum(count * (length + count) for length, count in zip(lengths, counts, strict=True))
        return reads <= C_PREFILL_MAX_READS

    def _chunk_window(self, lengths: Sequence[int], counts: Sequence[int]) -> int:
        """The bucket whose window holds every row's keys after its chunk."""
        return self.window_for([length + count - 1 for length, count in zip(lengths, counts, strict=True)])

    def prefill(
        self,
        rows: PagedRows,
        chunks: Sequence[Sequence[int]],
        counts: Sequence[int],
        scalings: Sequence[RopeScaling],
        table_lengths: Sequence[int],
    ) -> Tensor:
        """Logits float32 [B, V] at each row's last real chunk token; advances the rows (`prefills`).

        Every real token of the chunk runs as a row of the C step, at its own position, with its
        sequence's blocks and table. The kernel writes every row's key and value first, then each
        row attends over the positions up to its own, so a token sees the ones before it in its
        chunk, as in the eager pass. Its products then run on weights packed for them, and one
        call replaces the eager pass's few hundred ops: 50 ms against 70-79 ms for 32 rows of 32
        tokens of a zoo model (a /tmp probe, 3 alternating runs). The C pass stops before the
        output layer, and only each row's last token goes through it (in torch): with a
        vocabulary of 49,152 (SmolLM2) the head over every token of a 1,536-token chunk was a
        fifth of its products and 300 MB of logits. Those tokens go through the pass's own packed
        output layer (`BatchPass.output_layer`).

        A chunk of one token per row (a cached prompt's last token) is a decode step read with
        the prompt's tables, and runs as one: its output layer packed in C, its tables cached
        (16 such rows of SmolLM2 took 54 ms the chunk's way, against a 30 ms step).
        """
        if all(count == 1 for count in counts):
            return self._step_rows(rows, [chunk[0] for chunk in chunks], scalings, table_lengths)
        last = torch.tensor(list(itertools.accumulate(counts)), device=self._device) - 1
        assert self.c_pass is not None  # `prefills` said so
        with torch.inference_mode():
            hidden = self._chunk_residuals(rows, chunks, counts, scalings, table_lengths)
            logits = self.c_pass.output_layer(self.model.norm(hidden[last]))
        self._advance_chunk(rows, chunks, counts, scalings, table_lengths)
        return logits

    def prefill_hidden(
        self,
        rows: PagedRows,
        chunks: Sequence[Sequence[int]],
        counts: Sequence[int],
        scalings: Sequence[RopeScaling],
        table_lengths: Sequence[int],
    ) -> Tensor:
        """The final residual [T, D] of every real chunk token (row by row, before the model's last
        norm), from the C pass as `prefill` runs it; advances the rows (`prefills` first).

        For scoring, which needs every position's log-probabilities, not only the last one's: the
        caller projects the rows to the vocabulary in slices it chooses.
        """
        with torch.inference_mode():
            hidden = self._chunk_residuals(rows, chunks, counts, scalings, table_lengths)
        self._advance_chunk(rows, chunks, counts, scalings, table_lengths)
        return hidden

    def _chunk_residuals(
        self,
        rows: PagedRows,
        chunks: Sequence[Sequence[int]],
        counts: Sequence[int],
        scalings: Sequence[RopeScaling],
        table_lengths: Sequence[int],
    ) -> Tensor:
        """The C pass over every real chunk token as a row: the residual [T, D] after every layer.
        Writes the tokens' keys and values, but leaves the rows' lengths to `_advance_chunk`."""
        device = self._device
        lengths = rows.lengths
        window = self._chunk_window(lengths, counts)
        repeats = torch.tensor(list(counts), device=device)
        dtype = self.model.embed_tokens.weight.dtype
        tables = self.model.positions.pass_tables(scalings, table_lengths, window, device=device, dtype=dtype)
        index = tables.table_index.repeat_interleave(repeats) if tables.table_index is not None else None
        inputs = PassInputs(
            torch.tensor(
                [token for chunk, count in zip(chunks, counts, strict=True) for token in chunk[:count]],
                dtype=torch.long,
                device=device,
            ),
            torch.tensor(
                [length + t for length, count in zip(lengths, counts, strict=True) for t in range(count)],
                dtype=torch.long,
                device=device,
            ),
            rows.window_blocks(window // self.pool.block_size).repeat_interleave(repeats, dim=0),
            index,
            *tables[1:],
        )
        rows.place(max(counts))
        return self._run_in_c(inputs, logits=False, runs=counts)

    def _advance_chunk(
        self,
        rows: PagedRows,
        chunks: Sequence[Sequence[int]],
        counts: Sequence[int],
        scalings: Sequence[RopeScaling],
        table_lengths: Sequence[int],
    ) -> None:
        """Record a chunk that ran: each row's first `counts` tokens, under its table."""
        keys = self._table_keys(scalings, table_lengths)
        rows.advance(torch.tensor([list(chunk) for chunk in chunks]), keys, counts)

    def _table_keys(self, scalings: Sequence[RopeScaling], table_lengths: Sequence[int]) -> list[Hashable]:
        """Each row's table key, worked out once a step: the stacks and the rows both need it."""
        table_key = self.model.positions.table_key
        return [table_key(scaling, length) for scaling, length in zip(scalings, table_lengths, strict=True)]

    @property
    def _device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def _run(
        self,
        window_blocks: Tensor,
        tokens: Sequence[int],
        positions: Sequence[int],
        scalings: Sequence[RopeScaling],
        table_lengths: Sequence[int],
        table_keys: Sequence[Hashable],
        window: int,
        slots: Sequence[int] | None = None,
        streaming: StreamingSlots | None = None,
    ) -> Tensor:
        """One token per row at text index `positions` (its tables' index), written at its slot
        (`slots`; where None, the same): logits float32 [B, V]. Only the C pass reads a row whose
        slot is not its text index, or `streaming`."""
        slots = positions if slots is None else slots
        table_window = self.window_for(positions) if slots != positions else window
        tables = self._step_tables(scalings, table_lengths, table_keys, table_window)
        assert self.c_pass is not None or (streaming is None and slots == positions), "C reads streaming rows"
        with torch.inference_mode():
            if self.graphs is not None:
                return self.graphs(list(tokens), list(positions), window_blocks, tables)
            inputs = PassInputs(
                torch.tensor(list(tokens), dtype=torch.long, device=self._device),
                torch.tensor(list(positions), dtype=torch.long, device=self._device),
                window_blocks,
                *tables,
            )
            if self.c_pass is not None:
                return self._run_in_c(inputs, slots=torch.tensor(list(slots)), streaming=streaming)
            return self._torch_step(inputs)

    def _run_in_c(
        self,
        inputs: PassInputs,
        *,
        logits: bool = True,
        runs: Sequence[int] = (),
        slots: Tensor | None = None,
        streaming: StreamingSlots | None = None,
    ) -> Tensor:
        """The step in C, after the torch step's own prelude (embedding, tables, bias): logits
        [B, V], or with `logits=False` the final residual [B, D] before the model's last norm.
        `runs`: a prompt chunk's rows per sequence (`BatchPass`). `slots`: where each row's entry
        goes, where that is not its text index (`inputs.positions`); `streaming`: its rows'
        masked slots and sinks."""
        assert self.c_pass is not None
        hidden, step = pass_prelude(self.model, inputs, self.pool.key_positions)
        blocks = inputs.window_blocks
        positions = inputs.positions if slots is None else slots
        masked, sinks = streaming if streaming is not None else (None, None)
        return self.c_pass(
            hidden,
            step.rope,
            step.bias,
            blocks,
            positions,
            logits=logits,
            runs=runs,
            masked=masked,
            sinks=sinks,
        )

    def _torch_step(self, inputs: PassInputs) -> Tensor:
        """The torch step, compiled or not. Batch size and table count vary without recompiling
        (1 is special-cased by the compiler): batches share one compiled entry per window."""
        if inputs.tokens.shape[0] > 1:
            for tensor in (inputs.tokens, inputs.positions, inputs.window_blocks, inputs.table_index):
                if tensor is not None:
                    torch._dynamo.mark_dynamic(tensor, 0)
        for stack in (inputs.rope_cos, inputs.rope_sin, inputs.absolute):
            if stack is not None:
                torch._dynamo.mark_dynamic(stack, 0)
        logits: Tensor = self._step(
            self.model, inputs, self.pool.keys, self.pool.values, self.pool.key_positions
        )
        return logits

    def _step_tables(
        self,
        scalings: Sequence[RopeScaling],
        table_lengths: Sequence[int],
        table_keys: Sequence[Hashable],
        window: int,
    ) -> PassTables:
        """The stacked tables for these rows, rebuilt only when a row's table or the window changed."""
        positions = self.model.positions
        learned = positions.learned_table is not None
        key = (
            tuple(scalings),
            tuple(table_keys),
            window,
            max(table_lengths) if learned else None,  # learned tables are checked against positions
        )
        if self._tables is None or self._tables[0] != key:
            dtype = self.model.embed_tokens.weight.dtype
            tables = positions.pass_tables(scalings, table_lengths, window, device=self._device, dtype=dtype)
            self._tables = (key, tables._replace(**_two_or_more(tables)))
        return self._tables[1]


@torch.no_grad()
def c_batch_pass(model: Transformer, pool: PagedKVCache) -> batch_pass.BatchPass:
    """The C step over the model's weights, packed in panels (copies, made once, in memory backed
    by 2 MiB pages where the system has them: `HugePageArena`): float32 layers as float panels,
    `Int8Linear` and `Int4Linear` layers as their codes and scales, unwidened. Norms and biases
    are passed as they are; a tensor the block does not have is None (`BatchPass` checks the two
    agree)."""
    refused = C_SUPPORT.refuses(BlockSpec.of(model.config))
    if refused is not None:
        raise ValueError(refused)
    arena = HugePageArena()

    def placed(projections: Sequence[torch.nn.Module | None]) -> Panels:
        panels = _packed(projections)
        scales = arena.place(panels.scales) if panels.scales is not None else None
        return panels._replace(values=arena.place(panels.values), scales=scales)

    layers = []
    for block in model.layers:
        assert isinstance(block, Block)
        attention, mlp = block.attn, block.mlp
        projections = [attention.q_proj, attention.k_proj, attention.v_proj]
        ups = [mlp.gate_proj, mlp.up_proj] if mlp.gate_proj is not None else [mlp.up_proj]
        layers.append(
            batch_pass.CLayer(
                attn_norm=norm_weight(block.attn_norm),
                attn_norm_bias=norm_bias(block.attn_norm),
                qkv=placed(projections),
                qkv_bias=fused_bias(projections),
                q_norm=norm_weight(attention.q_norm) if attention.q_norm is not None else None,
                k_norm=norm_weight(attention.k_norm) if attention.k_norm is not None else None,
                o_proj=placed([attention.o_proj]),
                o_bias=_bias(attention.o_proj),
                mlp_norm=norm_weight(block.mlp_norm) if block.mlp_norm is not None else None,
                mlp_norm_bias=norm_bias(block.mlp_norm) if block.mlp_norm is not None else None,
                up=placed(ups),
                up_bias=fused_bias(ups),
                down=placed([mlp.down_proj]),
                down_bias=_bias(mlp.down_proj),
            )
        )
    head = batch_pass.CHead(
        norm=norm_weight(model.norm),
        norm_bias=norm_bias(model.norm),
        lm_head=placed([model.lm_head]),
        lm_head_bias=_bias(model.lm_head),
    )
    return batch_pass.BatchPass(model.config, layers, head, pool.keys, pool.values)


def norm_weight(norm: torch.nn.Module) -> Tensor:
    weight = norm.weight
    assert isinstance(weight, Tensor)
    return weight


def fused_bias(projections: Sequence[torch.nn.Module]) -> Tensor | None:
    """The biases of projections whose outputs are stacked into one product (q, k, v): all or none."""
    biases = [projection.bias for projection in projections]
    if not all(isinstance(bias, Tensor) for bias in biases):
        return None
    return torch.cat(cast(list[Tensor], biases))


def norm_bias(norm: torch.nn.Module) -> Tensor | None:
    """A LayerNorm's bias; None for RMSNorm and a LayerNorm without one."""
    bias = getattr(norm, "bias", None)
    return bias if isinstance(bias, Tensor) else None


def _bias(projection: torch.nn.Module) -> Tensor | None:
    bias = getattr(projection, "bias", None)
    return bias if isinstance(bias, Tensor) else None


def _packed(projections: Sequence[torch.nn.Module | None]) -> Panels:
    """One product's panels from the layers whose outputs it stacks (q, k, v; gate, up): their
    codes when all are packed alike, else float32 panels of the weights they stand for (a file
    may keep one projection at a finer format than its neighbours), over activations rounded as
    the packed layers round them."""
    int8 = [projection for projection in projections if isinstance(projection, Int8Linear)]
    int4 = [projection for projection in projections if isinstance(projection, Int4Linear)]
    if len(int8) == len(projections):
        return pack_int8(torch.cat([p.codes for p in int8]), torch.cat([p.scales for p in int8]))
    if len(int4) == len(projections):
        return pack_int4(
            torch.cat([p.codes() for p in int4]),
            torch.cat([p.scales for p in int4]),
            torch.cat([p.minimums for p in int4]),
        )
    rounded = bool(int8 or int4)
    return pack_weight(torch.cat([_float_weight(projection) for projection in projections]), rounded=rounded)


def _float_weight(projection: torch.nn.Module | None) -> Tensor:
    if isinstance(projection, Int8Linear | Int4Linear):
        return projection.dequantized()
    if isinstance(projection, torch.nn.Linear):
        return projection.weight
    raise ValueError(f"the C step reads linear layers, not {type(projection).__name__}")


def _two_or_more(tables: PassTables) -> dict[str, Tensor]:
    """Stacks of a single table, repeated once: a one-table batch then runs the same compiled
    entry as a mixed one (the table count is dynamic from 2), instead of an entry of its own."""
    stacks = {"rope_cos": tables.rope_cos, "rope_sin": tables.rope_sin, "absolute": tables.absolute}
    return {
        name: torch.cat([stack, stack])
        for name, stack in stacks.items()
        if stack is not None and len(stack) == 1
    }
