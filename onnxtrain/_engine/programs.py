"""The translated graphs of a training model: initialization, inference, and what a step shares.

Each is translated once, when the front end is built (so unknown operators fail before
anything runs), and compiled once per input signature. State variables and hyperparameters
are arguments, never baked-in constants, so changing them never recompiles.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from onnxtrain._engine.compiled import Compiled, Job, ProgramLimit
from onnxtrain._engine.feeds import FeedChecker
from onnxtrain._engine.labels import with_label_check
from onnxtrain._engine.placement import DEFAULT_DEVICE, Placement, host_value
from onnxtrain._recipe.evaluation import loss_part, read as read_loss_specs
from onnxtrain.errors import BindingError, OnnxTrainError, without_jax_notes
from onnxtrain.proto import GraphProto, ModelProto, ValueInfoProto
from onnxtrain.proto.graphs import concatenated, light_graph, model_of
from onnxtrain.translate.graph import initializer_names
# _host_only: the one definition of the values XLA cannot take (strings, 6-bit floats).
from onnxtrain.translate.model import EagerSignatures, TranslatedModel, _host_only, static_input_names
from onnxtrain.translate.registry import model_opsets
from onnxtrain.translate.values import NeedsHostValues


def _translated(model: ModelProto, graph: GraphProto, variables: Sequence[str], where: str) -> TranslatedModel:
    """The graph translated with the state variables it reads as parameters (`graph` may hold
    them as placeholders without data: they are never decoded here)."""
    opsets = model_opsets(model.opset_import)
    present = set(initializer_names(graph))
    visible = [name for name in variables if name in present]
    shapes = sorted(static_input_names(graph, opsets) & set(visible))
    if shapes:
        raise BindingError(f"{where}: state variables {shapes} are used where an operator needs a "
                           "value known before running (a shape, axes, sizes); such inputs cannot "
                           "change during training, so they must not be bound")
    return TranslatedModel(model_of(model, graph), supplied=visible)


def checked_assignment(key: str, value: Any, current: jax.Array, where: str) -> jax.Array:
    """`value` as the new value of state variable `key`, which keeps its type and shape."""
    if isinstance(value, (list, dict)) or np.dtype(getattr(value, "dtype", object)).kind in "OUS":
        raise BindingError(
            f"{where}: the value bound to {key!r} is a string tensor, sequence or map; a state "
            f"variable is a numeric tensor, so bind a numeric output to it")
    value = jnp.asarray(value)
    if value.shape != current.shape or value.dtype != current.dtype:
        raise BindingError(
            f"{where}: {key!r} is {current.dtype}{list(current.shape)} but the value bound to it is "
            f"{value.dtype}{list(value.shape)}; a state variable keeps its type and shape")
    return value


class Program:
    """A translated graph, its constants and its feed check."""

    def __init__(self, model: ModelProto, graph: GraphProto, variables: Sequence[str], where: str,
                 placement: Placement = DEFAULT_DEVICE, feeds_where: str | None = None):
        self.where = where
        self.placement = placement
        self.translated = _translated(model, graph, variables, where)
        placement.annotate(self.translated.plan)
        self.variables = sorted(self.translated.supplied)
        self.constants = placement.replicate(self.translated.params)
        declared = set(self.translated.input_names)
        self.declared_inputs = [value for value in graph.input if value.name in declared]
        self.check_feeds = with_label_check(FeedChecker(self.declared_inputs, feeds_where or f"{where} step"), graph)

    def params(self, values: Mapping[str, Any], constants: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The graph's parameters: `constants` (a compiled function's argument; by default
        self.constants) and the state variables it reads."""
        return {**(self.constants if constants is None else constants),
                **{name: values[name] for name in self.variables}}

    def compilations(self) -> int:
        """Programs compiled so far."""
        return self.translated._jitted._cache_size()

    def kept(self) -> int:
        """Programs held now."""
        return self.translated._jitted._cache_size()


class InitializationProgram(Program):
    """training_info[i].initialization: no inputs; outputs assigned by initialization_binding."""

    def __init__(self, model: ModelProto, index: int):
        info = model.training_info[index]
        where = f"training_info[{index}].initialization"
        if len(info.initialization.input):
            raise BindingError(f"{where} declares inputs {[v.name for v in info.initialization.input]}; "
                               "an initialization graph takes none")
        super().__init__(model, info.initialization, (), where)
        self.bindings = [(entry.key, entry.value) for entry in info.initialization_binding]

    def run(self, values: Mapping[str, jax.Array], key: jax.Array) -> dict[str, jax.Array]:
        """New values for the bound variables (the caller commits them; the store gives a
        variable its own buffer where one output is bound to several)."""
        outputs = self.translated(self.params(values), {}, key)
        where = f"{self.where.rsplit('.', 1)[0]}.initialization_binding"
        with jax.enable_x64(True):
            return {k: checked_assignment(k, outputs[v], values[k], where) for k, v in self.bindings}


# Inference draws from its own stream of the state's key, so it never replays a step's numbers.
_INFERENCE_STREAM = 0x1F


def _inference_key(key: jax.Array) -> jax.Array:
    return jax.random.fold_in(key, _INFERENCE_STREAM)


class InferenceProgram(Program):
    """The main graph with the current state; reads the store, never writes it."""

    def __init__(self, model: ModelProto, variables: Sequence[str], placement: Placement = DEFAULT_DEVICE,
                 limit: ProgramLimit | None = None, graph: GraphProto | None = None,
                 where: str = "main graph", feeds_where: str = "inference (main graph)"):
        """limit: how many programs (one per feed signature) inference keeps. graph: what runs
        instead of the main graph (a subclass's graph that extends it)."""
        super().__init__(model, light_graph(model.graph if graph is None else graph, set(variables)), variables,
                         where, placement, feeds_where)
        self._compiled = Compiled(self._traced_from_state_key, feeds_where, limit or ProgramLimit(), 1,
                                  identity=self._identity())
        self._eager_signatures = EagerSignatures()

    def _identity(self) -> str | None:
        """Names the programs in the executable cache (the front end's key part names the model)."""
        return "inference"

    def _traced_from_state_key(self, params: dict[str, Any], feeds: dict[str, Any], key: jax.Array) -> dict[str, Any]:
        # The stream is folded in inside the program: done eagerly it costs more than a small
        # model's whole forward pass.
        return self._traced(params, feeds, _inference_key(key))

    def _traced(self, params: dict[str, Any], feeds: dict[str, Any], key: jax.Array) -> dict[str, Any]:
        return self.translated._traced(params, feeds, key)

    def _eager(self, params: dict[str, Any], feeds: dict[str, Any], key: jax.Array) -> dict[str, Any]:
        return self.translated(params, feeds, key)

    def run(self, values: Mapping[str, jax.Array], feeds: dict[str, Any], key: jax.Array) -> dict[str, Any]:
        """The graph's outputs: compiled once per feed signature (a bounded number of programs
        kept), op by op where the graph cannot be traced. Random ops draw from the inference
        stream of `key`, the state's key."""
        params = self.params(values)
        outputs = self._if_traceable(feeds, lambda: self._compiled(params, feeds, key))
        if outputs is not None:
            return outputs
        # Strings, and graphs that cannot be traced (the translated model says so, once): op by op.
        return self._eager(params, feeds, _inference_key(key))

    def prepare(self, values: Mapping[str, jax.Array], feeds: dict[str, Any], key: jax.Array
                ) -> list[Job]:
        """Get run()'s program for `feeds` ready without running it (see Compiled.prepare): the
        compiles left to run; none for a graph that runs op by op."""
        return self._if_traceable(feeds, lambda: self._compiled.prepare(self.params(values), feeds, key)) or []

    def _if_traceable(self, feeds: dict[str, Any], traced: Callable[[], Any]) -> Any:
        """traced() under x64, or None for feeds the graph cannot be traced for (remembered)."""
        if feeds in self._eager_signatures or _host_only(list(feeds.values())):
            return None
        with jax.enable_x64(True):
            try:
                return traced()
            except OnnxTrainError as error:
                raise without_jax_notes(error)
            except NeedsHostValues:
                self._eager_signatures.add(feeds)
                return None

    def compilations(self) -> int:
        return self._compiled.compilations() + super().compilations()

    def kept(self) -> int:
        return self._compiled.kept() + super().kept()


class EvaluationProgram(InferenceProgram):
    """The main graph, then the loss of its prediction: the loss and prediction the exported
    inference model gives (BatchNorm on running statistics, no Dropout), from the current state.

    The loss comes from loss nodes that follow the main graph (`loss_part`, see
    _recipe/evaluation.py), or from a JAX function of the prediction and the label feed.
    run() returns {loss_name: loss, prediction_name: prediction}: the names the training
    step returns them under.
    """

    def __init__(self, model: ModelProto, variables: Sequence[str], placement: Placement, limit: ProgramLimit,
                 prediction: str, label: str, loss_part: GraphProto | None = None,
                 loss_function: Callable[[Any, Any], Any] | None = None,
                 names: tuple[str, str] = ("loss", "prediction")):
        """prediction: the main-graph output the loss is of; label: the label feed; loss_part:
        the loss nodes (reading `prediction` and the label) or None with loss_function;
        names: the names run() returns the loss and the prediction under."""
        graph = (model.graph if loss_part is None
                 else concatenated(model.graph.name, (model.graph, loss_part), set(variables)))
        self.prediction, self.label = prediction, label
        self.names = names
        self._loss = None if loss_part is None else loss_part.output[0].name
        self._loss_function = loss_function
        super().__init__(model, variables, placement, limit, graph, "evaluation", "evaluation")
        if loss_function is not None:
            self.check_feeds = FeedChecker([*self.declared_inputs, ValueInfoProto(name=label)], "evaluation")

    def _identity(self) -> str | None:
        # A JAX loss function is Python, not model: nothing outside the trace names it.
        if self._loss_function is not None:
            return None
        return f"evaluation of {self.prediction!r} against {self.label!r} as {self.names}"

    def _graph_feeds(self, feeds: dict[str, Any]) -> dict[str, Any]:
        return feeds if self._loss_function is None else {n: v for n, v in feeds.items() if n != self.label}

    def _selected(self, outputs: Mapping[str, Any], feeds: Mapping[str, Any]) -> dict[str, Any]:
        prediction = outputs[self.prediction]
        loss = (outputs[self._loss] if self._loss_function is None
                else self._loss_function(prediction, feeds[self.label]))
        return {self.names[0]: loss, self.names[1]: prediction}

    def _traced(self, params: dict[str, Any], feeds: dict[str, Any], key: jax.Array) -> dict[str, Any]:
        return self._selected(self.translated._traced(params, self._graph_feeds(feeds), key), feeds)

    def _eager(self, params: dict[str, Any], feeds: dict[str, Any], key: jax.Array) -> dict[str, Any]:
        return self._selected(self.translated(params, self._graph_feeds(feeds), key), feeds)


def recorded_evaluation(model: ModelProto, index: int, variables: Sequence[str], placement: Placement,
                        limit: ProgramLimit) -> EvaluationProgram | None:
    """The evaluation of training_info[index] that the model's metadata describes (see
    _recipe/evaluation.py), or None where it describes none or its loss cannot be separated."""
    spec = read_loss_specs(model).get(index)
    if spec is None or index >= len(model.training_info):
        return None
    part = loss_part(model.training_info[index].algorithm, spec)
    if part is None or spec.prediction not in {value.name for value in model.graph.output}:
        return None
    return EvaluationProgram(model, variables, placement, limit, spec.prediction, spec.label, part,
                             names=(spec.loss, spec.output))


def host_copy(values: Mapping[str, jax.Array]) -> dict[str, np.ndarray]:
    """Values as numpy arrays (for writing them out), gathered from every device."""
    return {name: host_value(value) for name, value in values.items()}
