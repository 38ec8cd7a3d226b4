"""A synthetic task whose answers need sequential lookups: chains of assignments.

A sample holds several independent chains. A chain of k hops is a root statement ``vA = 7 ;``
and k - 1 copies ``vB = vA ;``, ``vC = vB ;`` ..., so the value of its last variable takes k
lookups. The statements of all chains are shuffled together (a statement cannot be resolved when
it is read: its source may come later), variables are distinct within a sample, and one query
per chain follows (one per variable with ``queries="all"``), in random order: ``? vC = 7 ;``.
The answer token (``7``) is predicted from the ``=`` before it. Pure Python: `sample` makes
samples, `score_positions` parses a token list (as read back from shards) to recover each
query's answer and k, so evaluation needs no side metadata.
`data_pipeline/chains_write.py` writes the task as shards (`grt data chains`).

Symbols are written without spaces (``v3=7;v5=v3;?v5=7;``): the tokenizer has one piece per
symbol, and since a variable or value is always followed by ``=`` or ``;``, the text splits into
symbols in one way only.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

SEP = "<|endoftext|>"  # the tokenizer's control symbol: starts every sample
EQ, END, ASK, PAD = "=", ";", "?", "."
_PUNCT = (EQ, END, ASK, PAD)
QUERIES = ("last", "all")
ORDERS = ("shuffled", "by-name")


@dataclass(frozen=True)
class ChainTask:
    """The task's settings: ``num_vars`` variables v0.., ``num_values`` values 0.., chains of
    ``min_hops``..``max_hops`` lookups (k drawn uniformly per chain), ``chains_per_sample``
    chains a sample; ``queries``: ``last`` asks each chain's last variable (k lookups), ``all``
    asks every variable of each chain (1..k lookups: more answers a sample);
    ``queries_per_sample``: ask only this many of those, drawn at random (0: all). With several
    queries a sample, a later one can be answered by elimination (the root value not answered
    yet) rather than by lookups; one query a sample, the other chains distractors, leaves none.
    ``order``: ``shuffled`` (the statements in random order) or ``by-name``: every variable
    defined, the unused ones as distractor roots, in name order (v0 first): a statement's place
    is then its variable's, so a lookup reads a fixed position, while a chain's statements still
    name variables defined after them. ``compact``: a key just before its value, as associative
    recall writes it: ``vA 7 ;`` and ``vB vA ;``, queries ``? vB 7 ;`` (the answer predicted from
    the query's variable); values are then the letters A.. so that the text still splits one way."""

    num_vars: int = 32
    num_values: int = 10
    min_hops: int = 1
    max_hops: int = 4
    chains_per_sample: int = 4
    seed: int = 0
    queries: str = "last"
    queries_per_sample: int = 0
    order: str = "shuffled"
    compact: bool = False

    def check(self, max_hops: str = "max_hops") -> None:
        """Refuse settings no sample can be made with (a ValueError naming the setting, the
        validation split's maximum as ``max_hops`` says)."""
        checks = (
            (self.num_values >= 2, f"num_values must be >= 2, got {self.num_values}"),
            (self.min_hops >= 1, f"min_hops must be >= 1, got {self.min_hops}"),
            (self.max_hops >= self.min_hops, f"{max_hops} ({self.max_hops}) must be >= min_hops ({self.min_hops})"),
            (self.chains_per_sample >= 1, f"chains_per_sample must be >= 1, got {self.chains_per_sample}"),
            (self.queries in QUERIES, f"queries must be one of {', '.join(QUERIES)}, got {self.queries!r}"),
            (self.queries_per_sample >= 0, f"queries_per_sample must be >= 0, got {self.queries_per_sample}"),
            (self.order in ORDERS, f"order must be one of {', '.join(ORDERS)}, got {self.order!r}"),
            (not self.compact or self.num_values <= 26, f"compact: num_values must be <= 26, got {self.num_values}"),
            (
                self.num_vars >= self.chains_per_sample * self.max_hops,
                f"num_vars ({self.num_vars}) must be >= chains_per_sample x {max_hops} "
                f"({self.chains_per_sample} x {self.max_hops}): variables are distinct within a sample",
            ),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def max_length(self) -> int:
        """Tokens of the longest sample: the separator, 4 per statement, 5 per query (3 and 4 compact)."""
        asked = self.chains_per_sample * (self.max_hops if self.queries == "all" else 1)
        if self.queries_per_sample:
            asked = min(asked, self.queries_per_sample)
        defined = self.num_vars if self.order == "by-name" else self.chains_per_sample * self.max_hops
        return 1 + (4 - self.compact) * defined + (5 - self.compact) * asked


def variables(task: ChainTask) -> list[str]:
    return [f"v{i}" for i in range(task.num_vars)]


def values(task: ChainTask) -> list[str]:
    return [chr(65 + i) if task.compact else str(i) for i in range(task.num_values)]


def value_index(symbol: str) -> int:
    """A value symbol's index in `values` ("7": 7; compact "H": 7)."""
    return int(symbol) if symbol.isdigit() else ord(symbol) - 65


def symbols(task: ChainTask) -> list[str]:
    """Every token of the task: the separator, the variables, the values, ``= ; ? .`` (``.`` pads)."""
    return [SEP, *variables(task), *values(task), *_PUNCT]


@dataclass(frozen=True)
class ChainSample:
    tokens: list[str]  # starts with SEP, unpadded
    answers: list[tuple[int, int]]  # (position of a query's answer token, its chain's k)


def sample(task: ChainTask, rng: random.Random) -> ChainSample:
    """One sample of `task` (see the module's docstring) drawn with ``rng``."""
    vals = values(task)

    def statement(name: str, source: str) -> list[str]:
        return [name, source, END] if task.compact else [name, EQ, source, END]

    hops = [rng.randint(task.min_hops, task.max_hops) for _ in range(task.chains_per_sample)]
    names = [f"v{i}" for i in rng.sample(range(task.num_vars), sum(hops))]
    statements: list[list[str]] = []
    queries: list[tuple[list[str], int]] = []
    start = 0
    for k in hops:
        chain = names[start : start + k]
        start += k
        value = vals[rng.randrange(task.num_values)]
        statements.append(statement(chain[0], value))
        statements += [statement(chain[j], chain[j - 1]) for j in range(1, k)]
        asked = range(1, k + 1) if task.queries == "all" else [k]
        queries += [([ASK, *statement(chain[j - 1], value)], j) for j in asked]
    if task.order == "by-name":
        unused = set(range(task.num_vars)) - {int(n[1:]) for n in names}
        statements += [statement(f"v{i}", vals[rng.randrange(task.num_values)]) for i in unused]
        statements.sort(key=lambda st: int(st[0][1:]))
    else:
        rng.shuffle(statements)
    rng.shuffle(queries)
    if task.queries_per_sample:
        queries = queries[: task.queries_per_sample]
    tokens = [SEP] + [t for s in statements for t in s]
    answers = []
    for query, k in queries:
        answers.append((len(tokens) + len(query) - 2, k))
        tokens += query
    return ChainSample(tokens, answers)


def padded(tokens: list[str], length: int) -> list[str]:
    """``tokens`` filled with PAD to ``length`` (a sample too long for it is a ValueError)."""
    if len(tokens) > length:
        raise ValueError(f"a sample of {len(tokens)} tokens does not fit in {length}")
    return tokens + [PAD] * (length - len(tokens))


def score_positions(tokens: Sequence[str]) -> list[tuple[int, int, int]]:
    """(position, answer, k) of every complete query in ``tokens``: the answer's position, the
    index of its value in the task's values (the symbol ``"7"`` is 7) and the lookups its chain
    needs, found by following the statements before it (since the last SEP). A query whose
    answer is not its chain's value, or whose chain does not end in a value, is a ValueError:
    the tokens are not this task's."""
    out: list[tuple[int, int, int]] = []
    defs: dict[str, str] = {}
    i, n = 0, len(tokens)
    while i < n:
        t = tokens[i]
        if t == SEP:
            defs = {}
            i += 1
        elif t == ASK and i + 4 < n and tokens[i + 2] == EQ and tokens[i + 4] == END:
            value, k = _resolve(defs, tokens[i + 1], i)
            if tokens[i + 3] != value:
                raise ValueError(f"the query at token {i} answers {tokens[i + 3]!r}, but its chain holds {value!r}")
            out.append((i + 3, value_index(value), k))
            i += 5
        elif t == ASK and i + 3 < n and tokens[i + 3] == END and tokens[i + 2] not in _PUNCT:  # compact
            value, k = _resolve(defs, tokens[i + 1], i)
            if tokens[i + 2] != value:
                raise ValueError(f"the query at token {i} answers {tokens[i + 2]!r}, but its chain holds {value!r}")
            out.append((i + 2, value_index(value), k))
            i += 4
        elif i + 3 < n and tokens[i + 1] == EQ and tokens[i + 3] == END and t not in _PUNCT:
            defs[t] = tokens[i + 2]
            i += 4
        elif i + 2 < n and tokens[i + 2] == END and t not in _PUNCT and tokens[i + 1] not in _PUNCT:  # compact
            defs[t] = tokens[i + 1]
            i += 3
        else:
            i += 1  # padding, or a statement cut off by the end of the sequence
    return out


def _resolve(defs: dict[str, str], name: str, at: int) -> tuple[str, int]:
    """(value, lookups) of variable ``name`` under ``defs``."""
    k, seen = 1, {name}
    while True:
        if name not in defs:
            raise ValueError(f"the query at token {at} asks {name!r}, which no statement before it defines")
        name = defs[name]
        if not name.startswith("v"):
            return name, k
        if name in seen:
            raise ValueError(f"the query at token {at} asks a variable whose chain loops")
        seen.add(name)
        k += 1
