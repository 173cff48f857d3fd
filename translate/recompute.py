"""What a differentiated forward pass keeps for its backward pass, and what it recomputes.

Both memory tools rest on `recomputed(function, args)`: function(*args) whose backward
pass keeps only `args` and recomputes the function from them once the cotangent of its
result exists. jax.checkpoint recomputes too, but on XLA:CPU its optimization barriers are
expanded before common subexpressions merge, so the recomputation merges back into the
forward pass or runs early, holding more than keeping the values would; `recomputed` makes
the recomputation depend on the cotangent instead.

- Quantized weights (an integer initializer read by DequantizeLinear, or MatMulNBits's
  packed weight) are dequantized inside the program where each layer uses them: the
  consumer of a dequantized weight runs as `recomputed` of (its operands, the integers),
  so the backward pass dequantizes each layer again when it reaches it, and no step ever
  holds the float model (see graph.run_node and ops/microsoft_quantize).
- Activation recomputation (recompute="blocks" on Trainer and finetune): the nodes of a
  differentiated forward pass are cut into about sqrt(n) consecutive segments, each run as
  `recomputed` (see `run_segments`): the backward pass keeps only the values that cross
  segment boundaries and recomputes one segment's activations at a time. The results are
  those of the plain step; only the peak memory and the time change.

Example:
    >>> onnxtrain.finetune(model, "cross_entropy", recompute="blocks")
"""

from __future__ import annotations

import math
from collections import ChainMap
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from onnxtrain.errors import InputError

# The values the `recompute` option of Trainer and finetune takes.
RECOMPUTE_MODES = ("blocks",)


def recompute_mode(recompute: bool | str | None) -> str | None:
    """The recompute option normalized: None (off) or "blocks".

    Raises:
        InputError: a value other than None, False, True or "blocks".
    """
    if recompute is None or recompute is False:
        return None
    if recompute is True:
        return "blocks"
    if isinstance(recompute, str) and recompute in RECOMPUTE_MODES:
        return recompute
    raise InputError(f"recompute={recompute!r}: pass True or \"blocks\" (recompute activations per block "
                     f"of nodes in the backward pass), or None/False")


def _differentiable(value: Any) -> bool:
    return hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.inexact)


def _tied(values: Any, anchor: Any) -> Any:
    """`values` with every numeric leaf made to depend on `anchor`: plus floor(tanh(|a|) / 2)
    for a the sum of one element of each float leaf of anchor, which is 0 unless a is NaN
    (then the values are NaN or meaningless, as a step computed from a NaN already is). XLA's
    simplifier folds a * 0 and a == a, but knows no range of tanh, so the computation is
    neither merged with an identical one nor run before `anchor` exists."""
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(anchor) if _differentiable(leaf) and leaf.size]
    if not leaves:
        return values
    # No gradient flows through the tie: it only orders the computation.
    # One element of every leaf: some leaves may be constants (zero cotangents), not all.
    element = jax.lax.stop_gradient(sum(jnp.ravel(leaf)[0].astype(jnp.float32) for leaf in leaves))
    zero = jnp.floor(jnp.tanh(jnp.abs(element)) * 0.5)

    def tie(value: Any) -> Any:
        if _differentiable(value):
            return value + zero.astype(value.dtype)
        if hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.integer) and value.size:
            # Integers too (the stored weights): else their conversion to floats, the same in
            # both passes, would be merged and kept from the forward pass to the backward pass.
            return value + zero.astype(value.dtype)
        return value

    return jax.tree_util.tree_map(tie, values)


def recomputed(function: Callable[..., Any], *args: Any, after_first: bool = False) -> Any:
    """function(*args), differentiable in its float args, whose backward pass keeps only
    `args` and recomputes `function` from them once the cotangent of its result exists.

    XLA:CPU expands optimization barriers before it merges common subexpressions, and
    schedules a computation of arguments alone wherever it likes: so the recomputation is
    made to depend on the cotangent (see _tied), else it would be merged with the forward
    computation, or run early, and hold what it should free.

    Args:
        function: a pure function of `args` (pytrees of arrays in, a pytree of arrays out);
            every traced value it reads must be among `args`.
        args: its arguments; integer ones get no cotangent.
        after_first: also in the forward pass, compute nothing before args[0] exists (a
            quantized weight is dequantized when the activation it multiplies is ready,
            not all at the start).

    Returns:
        function(*args).
    """

    def tied_forward(*values: Any) -> Any:
        if after_first:
            values = (values[0], *_tied(values[1:], values[0]))
        return function(*values)

    @jax.custom_vjp
    def call(*values: Any) -> Any:
        return tied_forward(*values)

    def forward(*values: Any) -> tuple[Any, tuple]:
        return tied_forward(*values), values

    def backward(saved: tuple, cotangent: Any) -> tuple:
        _, pullback = jax.vjp(tied_forward, *_tied(saved, cotangent))
        return pullback(cotangent)

    call.defvjp(forward, backward)
    return call(*args)


def segments(count: int) -> list[range]:
    """`count` node positions cut into about sqrt(count) consecutive runs of equal length."""
    if count <= 0:
        return []
    length = max(1, math.isqrt(count - 1) + 1)
    return [range(start, min(start + length, count)) for start in range(0, count, length)]


def run_segments(numbers: Sequence[int], scope: ChainMap, reads: Callable[[int], set[str]],
                 writes: Callable[[int], list[str]], prepare: Callable[[list[int], Callable[[], Any]], bool],
                 run: Callable[[int, ChainMap], None], is_host: Callable[[Any], bool]) -> None:
    """Run the nodes at `numbers` (in order) in about sqrt(n) segments, each `recomputed`
    in the backward pass, binding every output in scope.maps[0].

    A segment takes the traced values it reads as arguments (host constants stay constants,
    so shape arithmetic still folds while tracing) and returns the traced values it writes;
    the host values it computes are bound from the trace. Random nodes draw their keys
    before the segment starts (`prepare`), so the recomputation draws the same numbers and
    no key made inside the segment leaks out of it; a segment `prepare` refuses runs
    plainly.

    Args:
        numbers: plan positions of the nodes to run.
        scope: the walk's scope; outputs land in scope.maps[0].
        reads, writes: a node's read names and written names.
        prepare: (the segment's positions, a thunk tracing the segment for shapes only) ->
            whether the segment can run recomputed, its random nodes' keys drawn ahead.
        run: runs one node in a scope.
        is_host: whether a value is a host constant.
    """
    for part in segments(len(numbers)):
        members = [numbers[i] for i in part]
        written = {name for number in members for name in writes(number)}
        outside = sorted({name for number in members for name in reads(number)} - written)
        traced = [name for name in outside if name in scope and not is_host(scope[name])]
        host_values: dict[str, Any] = {}

        def segment(values: list[Any], members: list[int] = members, traced: list[str] = traced,
                    host_values: dict[str, Any] = host_values) -> dict[str, Any]:
            local: dict[str, Any] = {}
            inner = ChainMap(local, dict(zip(traced, values)), scope)
            for number in members:
                run(number, inner)
            host_values.update((name, value) for name, value in local.items() if is_host(value))
            return {name: value for name, value in local.items() if name not in host_values}

        values = [scope[name] for name in traced]
        shapes = [jax.ShapeDtypeStruct(jnp.shape(value), jnp.result_type(value)) for value in values]
        if not prepare(members, lambda segment=segment, shapes=shapes: jax.eval_shape(segment, shapes)):
            for number in members:
                run(number, scope)
            continue
        outputs = recomputed(segment, values)
        scope.maps[0].update(outputs)
        scope.maps[0].update(host_values)
