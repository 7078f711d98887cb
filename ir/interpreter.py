"""Run an IR function node by node with the numpy reference ops (``reference_ops``).

The interpreter is the oracle of every backend: it binds weights by their IR names, keeps
the KV store it is given, and optionally calls a hook after each node (tests use it to
inspect top-k selections).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from dsv4c.errors import UsageError
from dsv4c.ir import reference_ops, reference_v41
from dsv4c.ir.core import Function, Node, Program
from dsv4c.ir.types import TensorType

Hook = Callable[[Node, list[Any], Any], None]


class Interpreter:
    def __init__(self, program: Program, weights: Mapping[str, np.ndarray], store: reference_ops.KVStore,
                 hook: Hook | None = None):
        self.program, self.weights, self.store, self.hook = program, weights, store, hook
        cfg = program.config
        self._inv_freq = {"main": cfg.main_rope.inv_freq(cfg.rope_dim),
                          "compress": cfg.compress_rope.inv_freq(cfg.rope_dim)}

    def inv_freq(self, table: str) -> np.ndarray:
        return self._inv_freq[table]

    def run(self, fn_name: str, **inputs: np.ndarray) -> list[np.ndarray]:
        fn: Function = self.program.functions[fn_name]
        env: dict[int, Any] = {}
        for v in fn.inputs:
            if v.name not in inputs:
                raise UsageError(f"@{fn_name} needs input %{v.name}")
            arr = np.asarray(inputs[v.name])
            want = np.int32 if v.type.dtype == "i32" else np.float32
            env[id(v)] = arr.astype(want, copy=False)
        for node in fn.nodes:
            args = [env[id(v)] if v.kind != "weight" else self._weight(v) for v in node.inputs]
            run = reference_v41.run_v41 if node.op in reference_v41.V41_OPS else reference_ops.run_node
            result = run(node.op, args, node.attrs, self)
            if self.hook is not None:
                self.hook(node, args, result)
            if len(node.outputs) == 1:
                env[id(node.outputs[0])] = result
            else:
                for o, r in zip(node.outputs, result):
                    env[id(o)] = r
        return [env[id(v)] for v in fn.outputs]

    def _weight(self, v) -> np.ndarray:
        try:
            w = self.weights[v.name]
        except KeyError:
            raise UsageError(f"weight @{v.name} is not bound") from None
        assert isinstance(v.type, TensorType)
        if tuple(w.shape) != tuple(v.type.shape):
            raise UsageError(f"weight @{v.name} has shape {tuple(w.shape)}, the program expects {v.type.shape}")
        return w
