"""The ai.onnx.preview.training optimizers (Adam, Adagrad, Momentum) written as standard ops.

expand_optimizers replaces each optimizer node of a node list by the element-wise formulas
of its op schema, as translate/ops/training.py runs them: scalar coefficients (the learning
rate, the step count T and what depends on it) are computed in double and cast to each
tensor's dtype; the per-tensor arithmetic runs in the tensor's dtype. Every node the
expansion writes is named `<optimizer node>/<tensor>/<what it computes>`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from onnxtrain._portable.emitter import Emitter, attr, label
from onnxtrain.errors import ExportError
from onnxtrain.proto import NodeProto, TensorProto
from onnxtrain.translate.registry import TRAINING_DOMAIN
from onnxtrain.translate.tensors import data_type_of

OPTIMIZER_DOMAINS = frozenset({TRAINING_DOMAIN, "ai.onnx.preview"})
# Per optimizer: how many blocks of n tensors follow R and T (X, G and the state slots).
_BLOCKS = {"Adam": 4, "Adagrad": 3, "Momentum": 3}


def is_optimizer(proto: NodeProto) -> bool:
    """Whether `proto` is an Adam, Adagrad or Momentum node of the training domain."""
    return proto.op_type in _BLOCKS and proto.domain in OPTIMIZER_DOMAINS


def expand_optimizers(nodes: Sequence[NodeProto], dtypes: Mapping[str, np.dtype | str],
                      opset: int) -> tuple[list[NodeProto], list[TensorProto]]:
    """Replace every Adam, Adagrad and Momentum node by standard ops writing the same outputs.

    Args:
        nodes: a topologically ordered node list (onnxtrain.proto NodeProtos).
        dtypes: the numpy dtype of every optimized tensor X (its gradient and state slots
            share it unless listed here under their own names).
        opset: the default domain's opset version the new nodes are written for.

    Returns:
        (the new node list, the scalar constants the new nodes read).

    Raises:
        ExportError: an optimizer node has a malformed input list, an unknown Momentum mode,
            or an X whose dtype is not known.

    Example:
        >>> nodes, constants = expand_optimizers(algorithm.node, {"W": np.float32}, 21)  # doctest: +SKIP
    """
    taken = {name for proto in nodes for name in [*proto.input, *proto.output]}
    examples = {name: np.zeros((), np.dtype(dtype)) for name, dtype in dtypes.items()}
    e = Emitter(examples, opset, taken)
    result: list[NodeProto] = []
    for proto in nodes:
        if not is_optimizer(proto):
            result.append(proto)
            continue
        _expand(e, proto)
        result.extend(e.take())
    return result, e.initializers


def _expand(e: Emitter, proto: NodeProto) -> None:
    """Write the nodes of one optimizer node into `e`."""
    per_tensor = _BLOCKS[proto.op_type]
    inputs, outputs = list(proto.input), list(proto.output)
    tensors = inputs[2:]
    if len(inputs) < 2 or not tensors or len(tensors) % per_tensor:
        raise ExportError(f"{label(proto)}: takes R, T and then {per_tensor} blocks of n tensors; got "
                          f"{len(tensors)} tensors after R and T. Fix the node's inputs")
    count = len(tensors) // per_tensor
    slots = per_tensor - 2
    if len(outputs) != count * (1 + slots):
        raise ExportError(f"{label(proto)}: {count} tensors need {count * (1 + slots)} outputs (new "
                          f"tensors then new state slots); got {len(outputs)}. Fix the node's outputs")
    base = proto.name or proto.op_type.lower()
    e.scope = base
    step = _double(e, inputs[1], "T")
    rate = _double(e, inputs[0], "R")
    # T > 0 gates Momentum's beta and Adam's bias correction.
    positive = e.add("Greater", [step, e.constant(np.zeros((), np.float64), "zero_double")], "T_positive")
    # Each writer is called with work=None to write the scalar terms shared by the tensors of
    # one dtype (it returns their names), then once per tensor with (inputs, outputs, shared).
    write = {"Adam": _adam, "Adagrad": _adagrad, "Momentum": _momentum}[proto.op_type]
    shared: dict[np.dtype, object] = {}
    for index in range(count):
        block = [tensors[b * count + index] for b in range(per_tensor)]
        new = [outputs[s * count + index] for s in range(1 + slots)]
        x = block[0]
        if x not in e.values:
            raise ExportError(f"{label(proto)}: the dtype of tensor {x!r} is unknown; list it in dtypes")
        for name in block[1:]:
            e.values.setdefault(name, e.values[x])
        # Scalar terms (rates, gates) are shared by every tensor of one dtype: written once.
        if e.dtype(x) not in shared:
            e.scope = base
            shared[e.dtype(x)] = write(e, proto, rate, step, positive, x, None)
        e.scope = f"{base}/{x}"
        write(e, proto, rate, step, positive, x, (block, new, shared[e.dtype(x)]))


def _double(e: Emitter, name: str, hint: str) -> str:
    """A scalar input as a double scalar (R and T may be shaped [1])."""
    cast = e.add("Cast", [name], f"{hint}_double", to=TensorProto.DOUBLE)
    return e.add("Reshape", [cast, e.ints([])], f"{hint}_scalar")


def _coefficient(e: Emitter, value: float, like: str) -> str:
    """A float64 value (from float32 attributes) as a constant of `like`'s dtype."""
    return e.scalar(float(np.float64(value)), like)


def _regularized(e: Emitter, g: str, x: str, norm: float) -> str:
    """G + norm * X, or G itself when norm is 0 (no extra read of X)."""
    if not norm:
        return g
    return e.add("Add", [g, e.add("Mul", [_coefficient(e, norm, x), x], "norm_x")], "g_regularized")


def _float_attr(proto: NodeProto, name: str, default: float) -> float:
    """A float attribute as stored (float32) widened to float64, as onnxtrain's op reads it."""
    return float(np.float32(attr(proto, name, default)))


def _adam(e: Emitter, proto: NodeProto, rate: str, step: str, positive: str, x: str, work) -> object:
    """V = a*V + (1-a)*G', H = b*H + (1-b)*G'^2, X = (1-nc_post)*(X - R'*V/(sqrt(H)+eps))
    with G' = G + nc*X and R' = R*sqrt(1-b^T)/(1-a^T) when T > 0, else R."""
    alpha, beta = _float_attr(proto, "alpha", 0.9), _float_attr(proto, "beta", 0.999)
    if work is None:
        one = e.constant(np.ones((), np.float64), "one_double")
        safe = e.add("Where", [positive, step, one], "T_or_1")
        alpha_t = e.add("Pow", [e.constant(np.float64(alpha), "alpha_double"), safe], "alpha_pow_T")
        beta_t = e.add("Pow", [e.constant(np.float64(beta), "beta_double"), safe], "beta_pow_T")
        root = e.add("Sqrt", [e.add("Sub", [one, beta_t], "one_minus_beta_pow_T")], "sqrt_one_minus_beta_pow_T")
        corrected = e.add("Div", [e.add("Mul", [rate, root], "R_sqrt"),
                                  e.add("Sub", [one, alpha_t], "one_minus_alpha_pow_T")], "R_corrected")
        chosen = e.add("Where", [positive, corrected, rate], "R_bias_corrected")
        return e.add("Cast", [chosen], "R_bias_corrected_cast", to=_onnx_dtype(e, x))
    (x, g, v, h), (x_new, v_new, h_new), corrected_rate = work
    epsilon = _float_attr(proto, "epsilon", 1e-6)
    norm = _float_attr(proto, "norm_coefficient", 0.0)
    norm_post = _float_attr(proto, "norm_coefficient_post", 0.0)
    g = _regularized(e, g, x, norm)
    e.emit("Add", [e.add("Mul", [_coefficient(e, alpha, v), v], "alpha_v"),
                   e.add("Mul", [_coefficient(e, 1.0 - alpha, v), g], "one_minus_alpha_g")],
           [v_new], f"{e.scope}/v_new")
    squared = e.add("Mul", [e.add("Mul", [_coefficient(e, 1.0 - beta, h), g], "one_minus_beta_g"), g],
                    "one_minus_beta_g_squared")
    e.emit("Add", [e.add("Mul", [_coefficient(e, beta, h), h], "beta_h"), squared], [h_new], f"{e.scope}/h_new")
    root = e.add("Add", [e.add("Sqrt", [h_new], "sqrt_h"), _coefficient(e, epsilon, x)], "sqrt_h_eps")
    step_size = e.add("Div", [e.add("Mul", [corrected_rate, v_new], "rate_v"), root], "update")
    if norm_post:
        moved = e.add("Sub", [x, step_size], "x_moved")
        e.emit("Mul", [_coefficient(e, 1.0 - norm_post, x), moved], [x_new], f"{e.scope}/x_new")
    else:
        e.emit("Sub", [x, step_size], [x_new], f"{e.scope}/x_new")
    return None


def _adagrad(e: Emitter, proto: NodeProto, rate: str, step: str, positive: str, x: str, work) -> object:
    """H = H + G'^2, X = X - R/(1+T*decay) * G'/(sqrt(H)+eps) with G' = G + nc*X."""
    if work is None:
        decay = e.constant(np.float64(_float_attr(proto, "decay_factor", 0.0)), "decay_double")
        one = e.constant(np.ones((), np.float64), "one_double")
        denominator = e.add("Add", [one, e.add("Mul", [step, decay], "T_decay")], "one_plus_T_decay")
        decayed = e.add("Div", [rate, denominator], "R_decayed")
        return e.add("Cast", [decayed], "R_decayed_cast", to=_onnx_dtype(e, x))
    (x, g, h), (x_new, h_new), decayed_rate = work
    g = _regularized(e, g, x, _float_attr(proto, "norm_coefficient", 0.0))
    e.emit("Add", [h, e.add("Mul", [g, g], "g_squared")], [h_new], f"{e.scope}/h_new")
    root = e.add("Add", [e.add("Sqrt", [h_new], "sqrt_h"), _coefficient(e, _float_attr(proto, "epsilon", 1e-6), x)],
                 "sqrt_h_eps")
    step_size = e.add("Div", [e.add("Mul", [decayed_rate, g], "rate_g"), root], "update")
    e.emit("Sub", [x, step_size], [x_new], f"{e.scope}/x_new")
    return None


def _momentum(e: Emitter, proto: NodeProto, rate: str, step: str, positive: str, x: str, work) -> object:
    """V = alpha*V + beta'*G' (beta' = 1 while T == 0) with G' = G + nc*X; X = X - R*V
    (standard) or X = X - R*(G' + alpha*V) (nesterov)."""
    alpha, beta = _float_attr(proto, "alpha", 0.0), _float_attr(proto, "beta", 0.0)
    mode = attr(proto, "mode", "standard")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode not in ("standard", "nesterov"):
        raise ExportError(f"{label(proto)}: mode must be 'standard' or 'nesterov', got {mode!r}; fix the attribute")
    if work is None:
        to = _onnx_dtype(e, x)
        scale = e.add("Where", [positive, e.constant(np.float64(beta), "beta_double"),
                                e.constant(np.ones((), np.float64), "one_double")], "beta_after_first_step")
        return (e.add("Cast", [rate], "R_cast", to=to), e.add("Cast", [scale], "beta_cast", to=to))
    (x, g, v), (x_new, v_new), (rate_x, scale) = work
    g = _regularized(e, g, x, _float_attr(proto, "norm_coefficient", 0.0))
    e.emit("Add", [e.add("Mul", [_coefficient(e, alpha, v), v], "alpha_v"), e.add("Mul", [scale, g], "beta_g")],
           [v_new], f"{e.scope}/v_new")
    direction = v_new
    if mode == "nesterov":
        direction = e.add("Add", [g, e.add("Mul", [_coefficient(e, alpha, x), v_new], "alpha_v_new")], "nesterov")
    e.emit("Sub", [x, e.add("Mul", [rate_x, direction], "update")], [x_new], f"{e.scope}/x_new")
    return None


def _onnx_dtype(e: Emitter, name: str) -> int:
    """The ONNX element type of tensor `name`."""
    return data_type_of(e.dtype(name))
