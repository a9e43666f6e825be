"""`GgufFix`: how one parameter of a family is read from a GGUF file whose converter stored it
otherwise than the checkpoint (a family's `gguf_fixup`, family.py; applied by
gguf_checkpoint.py): the file's tensor, the rows and columns of it that make the parameter, in
the parameter's order, an elementwise inverse of the converter's value transform, and the
parameter's shape where the converter squeezed it.

Invariants: `rows[i]` is the file's row of the parameter's row i (a permutation of the file's
rows, or a selection of `file_rows` of them); `cols[j]` likewise for columns (only for a
dequantized weight: GGUF quantizes whole rows, so a column order cannot be applied to blocks);
`value` is applied to the dequantized float32 values and no norm offset besides.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class GgufFix:
    tensor: str  # the file's tensor name
    rows: np.ndarray | None = None
    file_rows: int | None = None  # the file's rows `rows` index (checked against the file's)
    cols: np.ndarray | None = None
    value: Callable[[np.ndarray], np.ndarray] | None = None
    shape: tuple[int, ...] | None = None  # the parameter's, where it differs from the file's

    def param_shape(self, file_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The parameter's shape given the file's (PyTorch order), or the file's own where its
        rows are not the `file_rows` the rows index (the shape check then names it)."""
        if self.rows is not None:
            if self.file_rows is not None and file_shape[0] != self.file_rows:
                return file_shape
            file_shape = (len(self.rows), *file_shape[1:])
        return self.shape if self.shape is not None else file_shape

    def apply(self, w: np.ndarray) -> np.ndarray:
        """The dequantized file tensor `w` (PyTorch order) as the parameter's values."""
        if self.rows is not None:
            w = w[self.rows]
        if self.cols is not None:
            w = w[:, self.cols]
        if self.value is not None:
            w = self.value(w)
        return w if self.shape is None else w.reshape(self.shape)
