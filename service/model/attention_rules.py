"""Attention rules (`pe_attention`): where a query and a key sit, and which keys a query sees.

`pe_scaling` maps a position to RoPE angles; an attention rule chooses the positions themselves, per
(query, key) pair, so one query may be rotated at different positions against different keys
(Self-Extend's neighbour and grouped halves, ReRoPE's clamp, DCA's three chunk relations), and may
not see every earlier key (StreamingLLM's sinks and window). The SPEC's table is the contract; this
module states it once, as data:

- a frozen, validated dataclass per `type`, built from the request's dict (`parse_attention`) or
  from the lab's `TYPE:key=value,...` string (`parse_attention_spec`, also the model-alias form),
  echoed by `to_dict()` in responses, cards and metrics labels;
- one pure torch function per type: for query text indices i [Tq] and key text indices j [Tk], the
  position q is rotated at, the position k is rotated at (both [Tq, Tk] float64, because Leaky
  ReRoPE's are fractional) and whether j is seen ([Tq, Tk] bool, causality included);
- `logn_scale`: Qwen's log-n factor for each query, which any type may add.

Nothing here knows the model, the cache or the backends: they read these positions (the pool's
recorded key positions, the pass's query positions) and the tests hold the functions against
float64 ports of each method's published attention code (`tests/references/`).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final, NamedTuple

import torch

from pe_runtime import PEConfigError
from pe_runtime.scaling import MAX_FACTOR, MAX_POSITIONS


class Branch(NamedTuple):
    """One way a rule rotates a query against a key, as a backend computes it: the query at
    `query_position` [Tq], the key at `key_position` [Tk] (float64), for the pairs `selected`
    [Tq, Tk]. A rule is a few branches whose selections partition its seen pairs; each branch is
    one score product, which is why Self-Extend or ReRoPE cost two and DCA three.

    Within a branch the positions of a query and of a key are functions of that token alone, so
    queries and keys can be rotated once per branch. For every seen pair, a branch's position
    difference equals the `Placement`'s (RoPE and ALiBi read only that difference); the absolute
    positions may differ (StreamingLLM's recent keys: the slot arithmetic cancels).
    """

    query_position: torch.Tensor
    key_position: torch.Tensor
    selected: torch.Tensor


class Placement(NamedTuple):
    """Where each (query, key) pair is rotated, and whether the query sees the key; all [Tq, Tk].

    The positions of a pair that is not seen are whatever the formula gives (a streaming key that
    left the window has a negative slot): read them only where `seen` holds.
    """

    query_position: torch.Tensor
    key_position: torch.Tensor
    seen: torch.Tensor


@dataclass(frozen=True, kw_only=True)
class AttentionRule(ABC):
    """A resolved rule: its fields are validated and canonical (integers as int, `leak` as float) on
    construction, whichever way it was built, and every error names the field as the user wrote it,
    because the HTTP layer reports that name (as `pe_attention.<field>`) verbatim."""

    type: ClassVar[str]
    # Qwen's log-n attention: the training length L past which queries are sharpened.
    logn: int | None = None

    def __post_init__(self) -> None:
        if self.logn is not None:
            # ln L must be positive: L = 1 would divide by zero, L < 1 would flip every score.
            self._canonical("logn", _count("logn", self.logn, minimum=2))

    def _canonical(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)

    @abstractmethod
    def place(self, query_index: torch.Tensor, key_index: torch.Tensor) -> Placement:
        """The SPEC's positions and seen mask for text indices i [Tq] against j [Tk]."""

    @abstractmethod
    def branches(self, query_index: torch.Tensor, key_index: torch.Tensor) -> tuple[Branch, ...]:
        """The rule as score products (`Branch`) for text indices i [Tq] against j [Tk]."""

    @property
    def moves_pairs(self) -> bool:
        """Whether a query and a key meet other than causally at their text indices (every type but
        `standard`, whose `logn` only scales queries): such a row attends by its rule's branches."""
        return self.type != StandardAttention.type

    @property
    def standard_below(self) -> int:
        """The first query text index at which the rule may differ from `standard`: a query below it
        sees every earlier key where it sits, unscaled (each type's own bound, and log-n's L, whose
        factor is 1 while i + 1 <= L). A pass whose queries all sit below it is a plain pass, and
        runs as one (`rule_for_pass`)."""
        own = self._standard_below()
        return own if self.logn is None else min(own, self.logn)

    @abstractmethod
    def _standard_below(self) -> int:
        """`standard_below` without log-n."""

    def query_scale(self, query_index: torch.Tensor) -> torch.Tensor:
        """The factor each query is multiplied by ([Tq] float64; ones without `logn`)."""
        return logn_scale(query_index, self.logn)

    def to_dict(self) -> dict[str, Any]:
        """The resolved rule, JSON-ready: `type`, the type's fields, and `logn` when set."""
        resolved: dict[str, Any] = {"type": self.type}
        resolved.update((item.name, getattr(self, item.name)) for item in dataclasses.fields(self))
        del resolved["logn"]
        if self.logn is not None:
            resolved["logn"] = self.logn
        return resolved


@dataclass(frozen=True, kw_only=True)
class StandardAttention(AttentionRule):
    """q at i, k at j: the model as trained (the default)."""

    type: ClassVar[str] = "standard"

    def _standard_below(self) -> int:
        return sys.maxsize

    def place(self, query_index: torch.Tensor, key_index: torch.Tensor) -> Placement:
        return standard_positions(query_index, key_index)

    def branches(self, query_index: torch.Tensor, key_index: torch.Tensor) -> tuple[Branch, ...]:
        i, j, distance = _pairs(query_index, key_index)
        return (_branch(i, j, distance >= 0),)


@dataclass(frozen=True, kw_only=True)
class SelfExtendAttention(AttentionRule):
    """Self-Extend (LongLM): exact positions for the `window` nearest keys, floor-divided by
    `group_size` beyond, with the query shifted so the two regions meet."""

    type: ClassVar[str] = "self_extend"
    group_size: int
    window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        self._canonical("group_size", _count("group_size", self.group_size, minimum=1))
        self._canonical("window", _count("window", self.window, minimum=1))

    def _standard_below(self) -> int:
        return self.window  # every key of a query below the window is a neighbour

    def place(self, query_index: torch.Tensor, key_index: torch.Tensor) -> Placement:
        return self_extend_positions(query_index, key_index, group_size=self.group_size, window=self.window)

    def branches(self, query_index: torch.Tensor, key_index: torch.Tensor) -> tuple[Branch, ...]:
        i, j, distance = _pairs(query_index, key_index)
        shift = self.window - self.window // self.group_size
        return (
            _branch(i, j, (distance >= 0) & (distance < self.window)),
            _branch(i // self.group_size + shift, j // self.group_size, distance >= self.window),
        )


@dataclass(frozen=True, kw_only=True)
class ReRoPEAttention(AttentionRule):
    """ReRoPE: exact positions within `window`, every farther key read at distance `window`."""

    type: ClassVar[str] = "rerope"
    window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        self._canonical("window", _count("window", self.window, minimum=1))

    def _standard_below(self) -> int:
        return self.window  # no key of a query below the window is far

    def place(self, query_index: torch.Tensor, key_index: torch.Tensor) -> Placement:
        return rerope_positions(query_index, key_index, window=self.window)

    def branches(self, query_index: torch.Tensor, key_index: torch.Tensor) -> tuple[Branch, ...]:
        i, j, distance = _pairs(query_index, key_index)
        far = distance >= self.window
        return (
            _branch(i, j, (distance >= 0) & ~far),
            _branch(torch.full_like(i, self.window), torch.zeros_like(j), far),
        )


@dataclass(frozen=True, kw_only=True)
class LeakyReRoPEAttention(AttentionRule):
    """Leaky ReRoPE: beyond `window`, distances grow `leak` times slower instead of staying put."""

    type: ClassVar[str] = "leaky_rerope"
    window: int
    leak: float

    def __post_init__(self) -> None:
        super().__post_init__()
        self._canonical("window", _count("window", self.window, minimum=1))
        leak = _number("leak", self.leak, limit=MAX_FACTOR)
        if leak < 1.0:
            raise PEConfigError(f"leak must be >= 1, got {self.leak!r}", field="leak")
        self._canonical("leak", leak)

    def _standard_below(self) -> int:
        return self.window

    def place(self, query_index: torch.Tensor, key_index: torch.Tensor) -> Placement:
        return leaky_rerope_positions(query_index, key_index, window=self.window, leak=self.leak)

    def branches(self, query_index: torch.Tensor, key_index: torch.Tensor) -> tuple[Branch, ...]:
        i, j, distance = _pairs(query_index, key_index)
        far = distance >= self.window
        return (
            _branch(i, j, (distance >= 0) & ~far),
            _branch((i.double() + self.window * (self.leak - 1.0)) / self.leak, j.double() / self.leak, far),
        )


@dataclass(frozen=True, kw_only=True)
class DCAAttention(AttentionRule):
    """Dual chunk attention (ChunkLlama): positions within chunks of stride `chunk_size −
    local_window`, queries placed per chunk relation (same, neighbouring, farther)."""

    type: ClassVar[str] = "dca"
    chunk_size: int
    local_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        self._canonical("chunk_size", _count("chunk_size", self.chunk_size, minimum=1))
        self._canonical("local_window", _count("local_window", self.local_window, minimum=0))
        if self.local_window >= self.chunk_size:
            # The stride chunk_size − local_window must stay positive.
            raise PEConfigError(
                f"local_window must be below chunk_size ({self.chunk_size}), got {self.local_window}",
                field="local_window",
            )

    def _standard_below(self) -> int:
        # The first chunk is at its text indices, and the second against it until the query's clamp
        # at chunk_size; a third chunk reads the first at the fixed inter-chunk position.
        return min(self.chunk_size + 1, 2 * (self.chunk_size - self.local_window))

    def place(self, query_index: torch.Tensor, key_index: torch.Tensor) -> Placement:
        return dca_positions(
            query_index, key_index, chunk_size=self.chunk_size, local_window=self.local_window
        )

    def branches(self, query_index: torch.Tensor, key_index: torch.Tensor) -> tuple[Branch, ...]:
        i, j, distance = _pairs(query_index, key_index)
        stride = self.chunk_size - self.local_window
        chunks_apart = i // stride - j // stride
        within, key = i % stride, j % stride
        inter = torch.full_like(i, min(2 * stride - 1, self.chunk_size))
        return (
            _branch(within, key, (distance >= 0) & (chunks_apart == 0)),
            _branch(torch.clamp(within + stride, max=self.chunk_size), key, chunks_apart == 1),
            _branch(inter, key, chunks_apart >= 2),
        )


@dataclass(frozen=True, kw_only=True)
class StreamingAttention(AttentionRule):
    """StreamingLLM: the first `sink_tokens` keys and the last `window`, positions as cache slots."""

    type: ClassVar[str] = "streaming"
    sink_tokens: int
    window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        self._canonical("sink_tokens", _count("sink_tokens", self.sink_tokens, minimum=0))
        self._canonical("window", _count("window", self.window, minimum=1))

    def _standard_below(self) -> int:
        # Below S + W + 1 keys nothing has left the window, and the query sits at its text index.
        return self.sink_tokens + self.window + 1

    def place(self, query_index: torch.Tensor, key_index: torch.Tensor) -> Placement:
        return streaming_positions(query_index, key_index, sink_tokens=self.sink_tokens, window=self.window)

    def branches(self, query_index: torch.Tensor, key_index: torch.Tensor) -> tuple[Branch, ...]:
        # A recent key's slot distance is its text distance; a sink sits at its slot j while the
        # query sits at most at slot S + W.
        i, j, distance = _pairs(query_index, key_index)
        recent = (distance >= 0) & (distance <= self.window)
        sink = (j < self.sink_tokens) & (distance > self.window)
        return (
            _branch(i, j, recent),
            _branch(torch.clamp(i, max=self.sink_tokens + self.window), j, sink),
        )


_RULES: Final[Mapping[str, type[AttentionRule]]] = {
    rule.type: rule
    for rule in (
        StandardAttention,
        SelfExtendAttention,
        ReRoPEAttention,
        LeakyReRoPEAttention,
        DCAAttention,
        StreamingAttention,
    )
}
ATTENTION_TYPES: Final = tuple(_RULES)


def rule_for_pass(rule: AttentionRule | None, end: int) -> AttentionRule | None:
    """The rule a pass whose queries all sit before text index `end` runs: None (a plain pass, on
    the fast paths) when the rule places every one of them as `standard` does
    (`AttentionRule.standard_below`), else the rule."""
    return None if rule is None or end <= rule.standard_below else rule


def attention_label(rule: AttentionRule | None) -> str:
    """A rule's metrics label: its type, `+logn` when it sets `logn` (None is `standard`)."""
    if rule is None:
        return StandardAttention.type
    return rule.type + ("+logn" if rule.logn is not None else "")


def parse_attention(value: Mapping[str, Any]) -> AttentionRule:
    """Build the rule from the SPEC's dict form, e.g. `{"type": "dca", "chunk_size": 6144,
    "local_window": 512, "logn": 8192}`; `type` defaults to `standard`, a `None` field counts as
    absent, and a field the type does not read is an error (a typo should not silently run)."""
    params = {key: item for key, item in value.items() if item is not None}
    kind = params.pop("type", StandardAttention.type)
    rule = _RULES.get(kind) if isinstance(kind, str) else None
    if rule is None:
        raise PEConfigError(f"type must be one of {', '.join(ATTENTION_TYPES)}, got {kind!r}", field="type")
    fields = dataclasses.fields(rule)
    known = {item.name for item in fields}
    for key in params:
        if key not in known:
            raise PEConfigError(f"{key} does not apply to {kind!r} attention", field=str(key))
    for item in fields:
        if item.default is dataclasses.MISSING and item.name not in params:
            raise PEConfigError(f"{item.name} is required for {kind!r} attention", field=item.name)
    return rule(**params)


def parse_attention_spec(spec: str) -> AttentionRule:
    """Build the rule from the lab's and the model alias's `TYPE:key=value,...` form, e.g.
    `self_extend:group_size=4,window=1024` or plain `standard`; values are numbers."""
    kind, _, assignments = spec.strip().partition(":")
    params: dict[str, Any] = {"type": kind.strip()}
    for assignment in filter(None, (part.strip() for part in assignments.split(","))):
        key, equals, text = (part.strip() for part in assignment.partition("="))
        if not equals or not key or not text:
            raise PEConfigError(f"expected key=value, got {assignment!r}", field=key or assignment)
        if key in params:
            raise PEConfigError(f"{key} is given twice", field=key)
        params[key] = _parsed_number(key, text)
    return parse_attention(params)


def standard_positions(query_index: torch.Tensor, key_index: torch.Tensor) -> Placement:
    """q at i, k at j, j seen iff j ≤ i."""
    i, j, distance = _pairs(query_index, key_index)
    return _placement(i, j, distance >= 0)


def self_extend_positions(
    query_index: torch.Tensor, key_index: torch.Tensor, *, group_size: int, window: int
) -> Placement:
    """d < W: q at i, k at j; d ≥ W: q at ⌊i/G⌋ + W − ⌊W/G⌋, k at ⌊j/G⌋.

    The shift uses ⌊W/G⌋ (LongLM's fix of its `W − W/G`), so a grouped key at d = W sits where the
    neighbour rule would have put it when G divides W, and grouped positions stay integers.
    """
    i, j, distance = _pairs(query_index, key_index)
    near = distance < window
    query = torch.where(near, i, i // group_size + (window - window // group_size))
    key = torch.where(near, j, j // group_size)
    return _placement(query, key, distance >= 0)


def rerope_positions(query_index: torch.Tensor, key_index: torch.Tensor, *, window: int) -> Placement:
    """d < w: q at i, k at j; d ≥ w: q at w, k at 0 (every far key at distance exactly w)."""
    i, j, distance = _pairs(query_index, key_index)
    near = distance < window
    query = torch.where(near, i, window)
    key = torch.where(near, j, 0)
    return _placement(query, key, distance >= 0)


def leaky_rerope_positions(
    query_index: torch.Tensor, key_index: torch.Tensor, *, window: int, leak: float
) -> Placement:
    """d < w: q at i, k at j; d ≥ w: q at (i + w(k − 1))/k, k at j/k, so the distance past the
    window grows 1/k per token and is continuous at d = w. Positions are fractional."""
    i, j, distance = _pairs(query_index, key_index)
    near = distance < window
    query = torch.where(near, i.double(), (i.double() + window * (leak - 1.0)) / leak)
    key = torch.where(near, j.double(), j.double() / leak)
    return _placement(query, key, distance >= 0)


def dca_positions(
    query_index: torch.Tensor, key_index: torch.Tensor, *, chunk_size: int, local_window: int
) -> Placement:
    """With stride c = s − l: k at j mod c; q at i mod c in the key's chunk, at min(i mod c + c, s)
    in the next chunk, at min(2c − 1, s) farther (ChunkLlama's intra, successive and inter parts)."""
    i, j, distance = _pairs(query_index, key_index)
    stride = chunk_size - local_window
    chunks_apart = i // stride - j // stride
    within = i % stride
    successive = torch.clamp(within + stride, max=chunk_size)
    inter = min(2 * stride - 1, chunk_size)
    query = torch.where(chunks_apart == 0, within, torch.where(chunks_apart == 1, successive, inter))
    return _placement(query, j % stride, distance >= 0)


def streaming_positions(
    query_index: torch.Tensor, key_index: torch.Tensor, *, sink_tokens: int, window: int
) -> Placement:
    """j seen iff j ≤ i and (j < S or d ≤ W): the window counts the W keys before the query, so a
    query sees at most S + W + 1 keys. Positions are cache slots: q at min(i, S + W), a sink key at
    j, a recent key at min(i, S + W) − d (its slot once the cache is trimmed after every token)."""
    i, j, distance = _pairs(query_index, key_index)
    query = torch.clamp(i, max=sink_tokens + window)
    sink = j < sink_tokens
    key = torch.where(sink, j, query - distance)
    seen = (distance >= 0) & (sink | (distance <= window))
    return _placement(query, key, seen)


def logn_scale(query_index: torch.Tensor, logn: int | None) -> torch.Tensor:
    """max(1, ln(i + 1) / ln L) per query text index i ([Tq] float64); ones when `logn` is None."""
    index = _indices("query_index", query_index).double()
    if logn is None:
        return torch.ones_like(index)
    return torch.clamp(torch.log1p(index) / math.log(logn), min=1.0)


def _pairs(
    query_index: torch.Tensor, key_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """i as a column [Tq, 1], j as a row [1, Tk] (int64) and d = i − j [Tq, Tk]."""
    i = _indices("query_index", query_index)[:, None]
    j = _indices("key_index", key_index)[None, :]
    return i, j, i - j


def _indices(name: str, index: torch.Tensor) -> torch.Tensor:
    if index.dim() != 1 or index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
        raise ValueError(
            f"{name} must be a 1-D integer tensor, got {index.dtype} of shape {tuple(index.shape)}"
        )
    return index.to(torch.int64)


def _branch(query: torch.Tensor, key: torch.Tensor, selected: torch.Tensor) -> Branch:
    """A branch from a query column [Tq, 1] and a key row [1, Tk] (float64, flattened)."""
    return Branch(query.to(torch.float64)[:, 0], key.to(torch.float64)[0], selected)


def _placement(query: torch.Tensor, key: torch.Tensor, seen: torch.Tensor) -> Placement:
    """Both positions as float64 over the full [Tq, Tk] grid (a rule may leave one side 1-D)."""
    shape = seen.shape
    return Placement(
        query.to(torch.float64).expand(shape).contiguous(),
        key.to(torch.float64).expand(shape).contiguous(),
        seen,
    )


def _number(name: str, value: object, *, limit: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PEConfigError(f"{name} must be a number, got {value!r}", field=name)
    # The bound first: an integer past a float's range (JSON may carry one) cannot be made finite.
    if abs(value) > limit or not math.isfinite(value):
        raise PEConfigError(f"{name} must be a finite number of at most {limit:g}, got {value!r}", field=name)
    return float(value)


def _count(name: str, value: object, *, minimum: int) -> int:
    """An integer field (a whole float such as 4.0 counts, as JSON may write it) in [minimum, 2²²]."""
    number = _number(name, value, limit=MAX_POSITIONS)
    if not number.is_integer():
        raise PEConfigError(f"{name} must be an integer, got {value!r}", field=name)
    if number < minimum:
        raise PEConfigError(f"{name} must be >= {minimum}, got {value!r}", field=name)
    return int(number)


def _parsed_number(key: str, text: str) -> int | float:
    """A spec value: an integer, else a float; the dataclass then checks its range."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise PEConfigError(f"{key} must be a number, got {text!r}", field=key) from None
