"""The IR's value types: tensors with (possibly symbolic) shapes, and the KV-state token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

Dim = Union[int, str]  # a concrete size or a symbolic name such as "T" (tokens in the step)


@dataclass(frozen=True)
class TensorType:
    dtype: str  # "f32", "i32", "i64"
    shape: tuple[Dim, ...]

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"


@dataclass(frozen=True)
class StateType:
    """The KV / compressor state after a side effect; carries no data of its own."""

    def __str__(self) -> str:
        return "state"


STATE = StateType()
Type = Union[TensorType, StateType]
