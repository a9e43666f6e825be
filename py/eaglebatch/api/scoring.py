"""`Engine.score`'s pairs: checked, grouped by context into the choices rows of one
`task: score` job, and each pair's own result taken back out of those rows.

Invariant: every pair gets its own result. A choices row fails as a whole when one of its
choices fails (an empty or too long continuation), so a pair is never given a sibling's error:
an empty continuation is refused here, per pair, and the pairs of a row that failed are scored
again one per row, where an error can only be the pair's own. Messages name no column: the
job's columns are this module's, not the caller's.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from eaglebatch.errors import JobError, echo

EMPTY = "the continuation is empty"
COLUMNS = ["logprob", "num_tokens", "is_greedy", "error"]


def text_list(name: str, value) -> list:
    """`value` as a list of texts; JobError for a bare string (a sequence of characters, not
    of texts) or anything that is no sequence, as `generate` refuses its inputs."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise JobError(f"{name}: expected a list of strings, not {type(value).__name__}")
    return list(value)


def checked_pairs(contexts, continuations) -> list[tuple[str, str]]:
    """The (context, continuation) pairs of `score`, or JobError naming the bad argument."""
    ctx, cont = text_list("contexts", contexts), text_list("continuations", continuations)
    if len(ctx) != len(cont):
        raise JobError(f"score: {len(ctx)} contexts but {len(cont)} continuations")
    for i, pair in enumerate(zip(ctx, cont, strict=True)):
        if not all(isinstance(x, str) for x in pair):
            raise JobError(f"score: pair {i} is not two strings: {echo(pair)}")
    return list(zip(ctx, cont, strict=True))


def by_context(pairs: list[tuple[str, str]], indexes: list[int]) -> list[list[int]]:
    """The pairs `indexes` grouped by context, first appearance first."""
    groups: dict[str, list[int]] = {}
    for i in indexes:
        groups.setdefault(pairs[i][0], []).append(i)
    return list(groups.values())


def choices_table(pairs: list[tuple[str, str]], groups: list[list[int]]) -> pa.Table:
    """One row per group: its context (`prompt`) and its continuations (`choices`)."""
    return pa.table({
        "prompt": pa.array([pairs[g[0]][0] for g in groups], pa.string()),
        "choices": pa.array([[pairs[i][1] for i in g] for g in groups], pa.list_(pa.string())),
    })  # fmt: skip


class PairResults:
    """Each pair's logprob, num_tokens, is_greedy and error, filled in as rows come back."""

    def __init__(self, n: int) -> None:
        self.cols: dict[str, list] = {c: [None] * n for c in COLUMNS}

    def fail(self, i: int, error: str) -> None:
        self.cols["error"][i] = error

    def take(self, groups: list[list[int]], out: pa.Table) -> list[int]:
        """Fills in the pairs of the rows `out` (one per group, in order) that were scored, or
        failed alone; returns the pairs of rows that failed with several choices."""
        again: list[int] = []
        for group, row in zip(groups, out.select(COLUMNS).to_pylist(), strict=True):
            if row["error"] is not None and len(group) > 1:
                again.extend(group)
                continue
            for j, i in enumerate(group):
                self.cols["error"][i] = row["error"]
                if row["logprob"] is not None:
                    for c in ("logprob", "num_tokens", "is_greedy"):
                        self.cols[c][i] = row[c][j]
        return again

    def table(self) -> pa.Table:
        types = [pa.float64(), pa.int32(), pa.bool_(), pa.string()]
        return pa.table({c: pa.array(self.cols[c], t) for c, t in zip(COLUMNS, types,
                                                                       strict=True)})
