"""Recurrent layers: RNN, GRU and LSTM.

All three share one driver: the input projection X*W^T + Wb of every time step
is one matmul, and the recurrence runs as a jax.lax.scan per direction, so it
compiles once whatever the sequence length and stays differentiable. With
`sequence_lens`, steps past a sequence's end keep its state and output zeros,
and the reverse direction starts at each sequence's own last step; an empty
sequence ends in zero states (as in ONNX Runtime).

Activation names are matched case-insensitively; `activation_alpha` and
`activation_beta` are consumed in order by the activations that take them, as
ONNX Runtime does. `clip` bounds the gate pre-activations (the inputs of f and
g); as in ONNX Runtime, the LSTM cell state fed to h is not clipped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from onnxtrain.translate.registry import op

Activation = Callable[[jax.Array], jax.Array]


@dataclass(frozen=True)
class _ActivationKind:
    """An ONNX RNN activation: fn(x, alpha, beta) and the defaults of its parameters."""

    fn: Callable[[jax.Array, float, float], jax.Array]
    alpha: float | None = None
    beta: float | None = None


_ACTIVATIONS = {
    "relu": _ActivationKind(lambda x, a, b: jnp.maximum(x, 0)),
    "tanh": _ActivationKind(lambda x, a, b: jnp.tanh(x)),
    "sigmoid": _ActivationKind(lambda x, a, b: jax.nn.sigmoid(x)),
    "affine": _ActivationKind(lambda x, a, b: a * x + b, 1.0, 0.0),
    "leakyrelu": _ActivationKind(lambda x, a, b: jnp.where(x >= 0, x, a * x), 0.01),
    "thresholdedrelu": _ActivationKind(lambda x, a, b: jnp.where(x > a, x, 0), 1.0),
    "scaledtanh": _ActivationKind(lambda x, a, b: a * jnp.tanh(b * x), 1.0, 1.0),
    "hardsigmoid": _ActivationKind(lambda x, a, b: jnp.clip(a * x + b, 0, 1), 0.2, 0.5),
    "elu": _ActivationKind(lambda x, a, b: jnp.where(x >= 0, x, a * jnp.expm1(x)), 1.0),
    "softsign": _ActivationKind(lambda x, a, b: x / (1 + jnp.abs(x))),
    "softplus": _ActivationKind(lambda x, a, b: jax.nn.softplus(x)),
}


def _activations(node: Any, defaults: Sequence[str], directions: int) -> list[list[Activation]]:
    """The activation functions of each direction, with their alpha/beta bound."""
    names = node.attr("activations", list(defaults) * directions)
    if len(names) != len(defaults) * directions:
        raise node.error(f"activations must list {len(defaults)} function(s) per direction "
                         f"({len(defaults) * directions} in all), got {names}")
    alphas = list(node.attr("activation_alpha", []))
    betas = list(node.attr("activation_beta", []))
    functions = []
    for name in names:
        kind = _ACTIVATIONS.get(str(name).lower())
        if kind is None:
            raise node.error(f"unknown activation {name!r}; expected one of "
                             + ", ".join(sorted(_ACTIVATIONS)))
        alpha = alphas.pop(0) if kind.alpha is not None and alphas else kind.alpha
        beta = betas.pop(0) if kind.beta is not None and betas else kind.beta
        functions.append(_bind(kind.fn, alpha, beta))
    per = len(defaults)
    return [functions[d * per:(d + 1) * per] for d in range(directions)]


def _bind(fn: Callable[[jax.Array, float, float], jax.Array], alpha: float | None,
          beta: float | None) -> Activation:
    return lambda x: fn(x, alpha, beta).astype(x.dtype)


def _clipper(node: Any) -> Activation:
    """Bounds activation inputs to [-clip, clip] when the `clip` attribute is set."""
    if not node.has_attr("clip"):
        return lambda x: x
    bound = node.attr("clip")
    return lambda x: jnp.clip(x, -bound, bound)


@dataclass(frozen=True)
class _Layer:
    """The decoded common inputs of a recurrent node, in layout 0 ([seq, batch, ...])."""

    x: jax.Array
    w: jax.Array
    r: jax.Array
    bias: jax.Array | None
    lengths: jax.Array | None
    initial_h: jax.Array | None
    hidden_size: int
    reverse_flags: tuple[bool, ...]
    layout: int

    @property
    def directions(self) -> int:
        return len(self.reverse_flags)


_DIRECTIONS = {"forward": (False,), "reverse": (True,), "bidirectional": (False, True)}


def _layer(node: Any, x: Any, w: Any, r: Any, bias: Any, lengths: Any, initial_h: Any,
           gates: int) -> _Layer:
    direction = node.attr("direction", "forward")
    if direction not in _DIRECTIONS:
        raise node.error(f"direction must be forward, reverse or bidirectional, got {direction!r}")
    reverse_flags = _DIRECTIONS[direction]
    layout = node.attr("layout", 0)
    if layout not in (0, 1):
        raise node.error(f"layout must be 0 or 1, got {layout}")
    x = jnp.asarray(x)
    if x.ndim != 3:
        raise node.error(f"X must be 3-D, got shape {x.shape}")
    if layout == 1:
        x = jnp.swapaxes(x, 0, 1)
    w, r = jnp.asarray(w), jnp.asarray(r)
    hidden_size = node.attr("hidden_size", r.shape[-1])
    expected_w = (len(reverse_flags), gates * hidden_size, x.shape[2])
    expected_r = (len(reverse_flags), gates * hidden_size, hidden_size)
    if w.shape != expected_w or r.shape != expected_r:
        raise node.error(f"with direction {direction!r} and hidden_size {hidden_size}, W must have "
                         f"shape {expected_w} and R {expected_r}; got {w.shape} and {r.shape}")
    return _Layer(x, w, r, None if bias is None else jnp.asarray(bias),
                  None if lengths is None else jnp.asarray(lengths),
                  _state_in(initial_h, layout), hidden_size, reverse_flags, layout)


def _state_in(state: Any, layout: int) -> jax.Array | None:
    """initial_h / initial_c as [directions, batch, hidden]."""
    if state is None:
        return None
    state = jnp.asarray(state)
    return jnp.swapaxes(state, 0, 1) if layout == 1 else state


def _initial(layer: _Layer, state: jax.Array | None, direction: int) -> jax.Array:
    if state is None:
        return jnp.zeros((layer.x.shape[1], layer.hidden_size), layer.x.dtype)
    return state[direction].astype(layer.x.dtype)


def _biases(layer: _Layer, direction: int, gates: int) -> tuple[jax.Array, jax.Array]:
    """(Wb, Rb) of one direction; zeros when B is omitted."""
    width = gates * layer.hidden_size
    if layer.bias is None:
        zeros = jnp.zeros((width,), layer.x.dtype)
        return zeros, zeros
    return layer.bias[direction, :width], layer.bias[direction, width:]


def _input_projection(layer: _Layer, direction: int, gates: int) -> jax.Array:
    """X*W^T + Wb for every step at once: [seq, batch, gates*hidden]."""
    input_bias, _ = _biases(layer, direction, gates)
    return jnp.einsum("sbi,gi->sbg", layer.x, layer.w[direction]) + input_bias


def _reverse_within_lengths(values: jax.Array, lengths: jax.Array) -> jax.Array:
    """Reverse the first lengths[b] steps of each batch entry; later steps stay in place."""
    steps = jnp.arange(values.shape[0])[:, None]
    lengths = lengths[None, :].astype(steps.dtype)
    source = jnp.where(steps < lengths, lengths - 1 - steps, steps)
    return jnp.take_along_axis(values, source[:, :, None], axis=0)


def _scan(cell: Callable, carry: tuple[jax.Array, ...], inputs: jax.Array,
          lengths: jax.Array | None, reverse: bool) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Run `cell(carry, x_t) -> carry` over time; returns (all hidden states, final carry).

    carry[0] is the hidden state, the step output. Past a sequence's length the
    carry is held and the output is zero; an empty sequence ends in a zero state,
    as in ONNX Runtime.
    """
    if lengths is None:
        def step(state, x_t):
            state = cell(state, x_t)
            return state, state[0]

        final, outputs = jax.lax.scan(step, carry, inputs, reverse=reverse)
        return outputs, final

    lengths = jnp.clip(lengths.astype(jnp.int64), 0, inputs.shape[0])
    valid = jnp.arange(inputs.shape[0])[:, None] < lengths[None, :]
    if reverse:
        inputs = _reverse_within_lengths(inputs, lengths)

    def masked_step(state, step_inputs):
        x_t, valid_t = step_inputs
        keep = valid_t[:, None]
        updated = cell(state, x_t)
        state = tuple(jnp.where(keep, new, old) for new, old in zip(updated, state))
        return state, jnp.where(keep, state[0], jnp.zeros_like(state[0]))

    final, outputs = jax.lax.scan(masked_step, carry, (inputs, valid))
    if reverse:
        outputs = _reverse_within_lengths(outputs, lengths)
    nonempty = (lengths > 0)[:, None]
    return outputs, tuple(jnp.where(nonempty, state, jnp.zeros_like(state)) for state in final)


@dataclass(frozen=True)
class _Cell:
    """One direction's recurrence: `count` gates projected from X, step(carry, x_proj)."""

    count: int
    step: Callable[[tuple[jax.Array, ...], jax.Array], tuple[jax.Array, ...]]


def _run(layer: _Layer, make_cell: Callable[[int], _Cell],
         initial_states: Sequence[jax.Array | None]) -> tuple[jax.Array, list[jax.Array]]:
    """Scan every direction; Y as [seq, directions, batch, hidden] and the final states."""
    outputs, finals = [], []
    for direction, reverse in enumerate(layer.reverse_flags):
        cell = make_cell(direction)
        carry = tuple(_initial(layer, state, direction) for state in initial_states)
        projected = _input_projection(layer, direction, cell.count)
        y, final = _scan(cell.step, carry, projected, layer.lengths, reverse)
        outputs.append(y)
        finals.append(final)
    y = jnp.stack(outputs, axis=1)
    states = [jnp.stack([final[index] for final in finals]) for index in range(len(initial_states))]
    return y, states


def _outputs(layer: _Layer, y: jax.Array, states: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """Y and the final states in the node's layout and X's dtype."""
    dtype = layer.x.dtype
    if layer.layout == 1:
        y = jnp.transpose(y, (2, 0, 1, 3))
        states = [jnp.swapaxes(state, 0, 1) for state in states]
    return (y.astype(dtype),) + tuple(state.astype(dtype) for state in states)


@op("RNN", since=1)
def rnn(node: Any, x: Any, w: Any, r: Any, b: Any = None, sequence_lens: Any = None,
        initial_h: Any = None) -> tuple[jax.Array, ...]:
    """Simple RNN: H_t = f(X_t*W^T + H_{t-1}*R^T + Wb + Rb); outputs Y and Y_h."""
    layer = _layer(node, x, w, r, b, sequence_lens, initial_h, gates=1)
    activations = _activations(node, ("Tanh",), layer.directions)
    clip = _clipper(node)

    def make_cell(direction: int) -> _Cell:
        (f,) = activations[direction]
        recurrence = layer.r[direction].T
        _, recurrent_bias = _biases(layer, direction, 1)

        def step(carry, projected):
            (h,) = carry
            return (f(clip(projected + h @ recurrence + recurrent_bias)),)

        return _Cell(1, step)

    y, states = _run(layer, make_cell, [layer.initial_h])
    return _outputs(layer, y, states)


@op("GRU", since=1)
def gru(node: Any, x: Any, w: Any, r: Any, b: Any = None, sequence_lens: Any = None,
        initial_h: Any = None) -> tuple[jax.Array, ...]:
    """GRU with gates z, r, h; linear_before_reset applies R_h before the reset gate."""
    layer = _layer(node, x, w, r, b, sequence_lens, initial_h, gates=3)
    activations = _activations(node, ("Sigmoid", "Tanh"), layer.directions)
    clip = _clipper(node)
    linear_before_reset = bool(node.attr("linear_before_reset", 0))
    size = layer.hidden_size

    def make_cell(direction: int) -> _Cell:
        f, g = activations[direction]
        recurrence = layer.r[direction]
        update_reset = recurrence[:2 * size].T
        hidden = recurrence[2 * size:].T
        _, recurrent_bias = _biases(layer, direction, 3)
        update_reset_bias, hidden_bias = recurrent_bias[:2 * size], recurrent_bias[2 * size:]

        def step(carry, projected):
            (h,) = carry
            gates = projected[:, :2 * size] + h @ update_reset + update_reset_bias
            z = f(clip(gates[:, :size]))
            reset = f(clip(gates[:, size:]))
            if linear_before_reset:
                recurrent = reset * (h @ hidden + hidden_bias)
            else:
                recurrent = (reset * h) @ hidden + hidden_bias
            candidate = g(clip(projected[:, 2 * size:] + recurrent))
            return ((1 - z) * candidate + z * h,)

        return _Cell(3, step)

    y, states = _run(layer, make_cell, [layer.initial_h])
    return _outputs(layer, y, states)


@op("LSTM", since=1)
def lstm(node: Any, x: Any, w: Any, r: Any, b: Any = None, sequence_lens: Any = None,
         initial_h: Any = None, initial_c: Any = None, p: Any = None) -> tuple[jax.Array, ...]:
    """LSTM with gates i, o, f, c, optional peepholes P[iof] and input_forget (f = 1 - i)."""
    layer = _layer(node, x, w, r, b, sequence_lens, initial_h, gates=4)
    activations = _activations(node, ("Sigmoid", "Tanh", "Tanh"), layer.directions)
    clip = _clipper(node)
    input_forget = bool(node.attr("input_forget", 0))
    size = layer.hidden_size
    peepholes = None if p is None else jnp.asarray(p).astype(layer.x.dtype)
    if peepholes is not None and peepholes.shape != (layer.directions, 3 * size):
        raise node.error(f"P must have shape {(layer.directions, 3 * size)}, got {peepholes.shape}")

    def make_cell(direction: int) -> _Cell:
        f, g, h_act = activations[direction]
        recurrence = layer.r[direction].T
        _, recurrent_bias = _biases(layer, direction, 4)
        zeros = jnp.zeros((size,), layer.x.dtype)
        p_i, p_o, p_f = ((zeros,) * 3 if peepholes is None
                         else jnp.split(peepholes[direction], 3))

        def step(carry, projected):
            h, c = carry
            gates = projected + h @ recurrence + recurrent_bias
            i_in, o_in, f_in, c_in = jnp.split(gates, 4, axis=-1)
            i = f(clip(i_in + p_i * c))
            forget = 1 - i if input_forget else f(clip(f_in + p_f * c))
            c_new = forget * c + i * g(clip(c_in))
            o = f(clip(o_in + p_o * c_new))
            return o * h_act(c_new), c_new

        return _Cell(4, step)

    initial_c = _state_in(initial_c, layer.layout)
    y, states = _run(layer, make_cell, [layer.initial_h, initial_c])
    return _outputs(layer, y, states)
