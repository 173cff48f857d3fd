"""GraphStep: a model's own training step (main graph ⊕ training_info[i].algorithm) as a pure
function (state, key, constants, feeds) -> (key, updates, outputs, kept).

Every output is computed from the pre-step state; `updates` holds the update_binding values,
which the caller assigns together. Graphs that draw random numbers split the key.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from onnxtrain._engine.placement import DEFAULT_DEVICE, Placement
from onnxtrain._engine.programs import Program, checked_assignment
from onnxtrain._engine.update_tail import update_tail
from onnxtrain._recipe.evaluation import read as read_loss_specs
from onnxtrain.proto import ModelProto
from onnxtrain.proto.graphs import combined_graph
from onnxtrain.translate.graph import any_node, draws_random
from onnxtrain.translate.node import NodeSpec
from onnxtrain.translate.registry import DEFAULT_DOMAIN, normalize_domain
from onnxtrain.translate.values import to_host

# Ops XLA:CPU runs several times slower inside a while loop than outside one.
_LOOP_AVERSE_OPS = frozenset({"Conv", "ConvTranspose", "ConvInteger", "QLinearConv", "DeformConv",
                              "CausalConvWithState"})


def _loop_averse(spec: NodeSpec) -> bool:
    return normalize_domain(spec.proto.domain) == DEFAULT_DOMAIN and spec.proto.op_type in _LOOP_AVERSE_OPS


class GraphStep(Program):
    """The step of training_info[index], with the state variables `variables` as parameters."""

    def __init__(self, model: ModelProto, index: int, variables: Sequence[str],
                 placement: Placement = DEFAULT_DEVICE, recompute: str | None = None):
        """recompute: "blocks" to recompute the activations of Gradient nodes' forward passes
        per segment of nodes (see translate.recompute), None to keep them."""
        info = model.training_info[index]
        super().__init__(model, combined_graph(model, index, set(variables)), variables,
                         f"training_info[{index}]", placement)
        self.translated.recompute = recompute
        self.bindings = [(entry.key, entry.value) for entry in info.update_binding]
        bound_outputs = {value for _, value in self.bindings}
        self.bound = tuple(key for key, _ in self.bindings)
        spec = read_loss_specs(model).get(index)
        # The step's prediction (make_training_model's unbound output for metrics) is returned
        # only by the copy with_prediction() makes: a language model's logits are large.
        self.prediction = spec.output if spec is not None else None
        self.returned = [o.name for o in info.algorithm.output
                         if o.name not in bound_outputs and o.name != self.prediction]
        plan = self.translated.plan
        self.random = draws_random(plan)
        self.loop_averse = any_node(plan, _loop_averse)
        self.tail = update_tail(plan, bound_outputs)
        given = {*plan.inputs, *plan.constants, *self.translated.params, *self.variables}
        # What the tail reads that only the graph computes (the gradients, typically).
        self.tail_inputs = [name for name in self.tail.reads if name not in given]

    @property
    def identity(self) -> str:
        """Names this step's programs in the executable cache: the model and the trainer's
        options are the front end's part of the key, so the algorithm and what it returns."""
        return f"{self.where} returning {self.returned}"

    def with_prediction(self) -> GraphStep | None:
        """This step returning its prediction too (sharing the translation), or None when the
        model names none."""
        if self.prediction is None:
            return None
        measuring = copy.copy(self)
        measuring.returned = [*self.returned, self.prediction]
        return measuring

    def _updates(self, state: Mapping[str, Any], outputs: Mapping[str, Any]) -> dict[str, Any]:
        where = f"{self.where}.update_binding"
        return {k: checked_assignment(k, outputs[v], state[k], where) for k, v in self.bindings}

    def __call__(self, state: Mapping[str, Any], key: jax.Array | None, constants: Mapping[str, Any],
                 feeds: Mapping[str, Any], kept: Sequence[str] = ()) -> tuple:
        """(key, the bound variables' new values, the returned outputs, the values of the `kept`
        intermediate names); `key` is None for graphs without random ops."""
        key, subkey = jax.random.split(key) if self.random else (key, None)
        outputs, values = self.translated.apply_keeping(self.params(state, constants), feeds, subkey, kept)
        return key, self._updates(state, outputs), {name: outputs[name] for name in self.returned}, values

    def tail_update(self, state: Mapping[str, Any], constants: Mapping[str, Any], feeds: Mapping[str, Any],
                    kept: Mapping[str, Any]) -> dict[str, Any]:
        """The bound variables' new values, only the update tail recomputed from `kept`."""
        values = self.translated.apply_nodes(self.tail.nodes, self.params(state, constants), feeds, kept)
        return self._updates(state, values)

    def eager(self, state: Mapping[str, Any], key: jax.Array, feeds: Mapping[str, Any]) -> tuple:
        """(key, updates, outputs) of one step run op by op on the host."""
        key, subkey = jax.random.split(key) if self.random else (key, None)
        params = {name: to_host(value) for name, value in self.params(state).items()}
        host_feeds = {name: to_host(value) for name, value in feeds.items()}
        outputs = self.translated.apply(params, host_feeds, subkey, eager=True)
        updates = {name: jnp.asarray(value) for name, value in self._updates(dict(state), outputs).items()}
        return key, updates, {name: outputs[name] for name in self.returned}
