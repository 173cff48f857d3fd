"""Op handlers keyed by (domain, op_type, since_version).

A model declares one opset version per domain; the handler used for a node is
the newest one whose since_version is <= that version. So a handler written
for Softmax-13 serves opsets 13..N until a Softmax-M handler is added, and an
opset bump in ONNX costs nothing unless the op's semantics changed.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

DEFAULT_DOMAIN = ""
ML_DOMAIN = "ai.onnx.ml"
TRAINING_DOMAIN = "ai.onnx.preview.training"
# Ops written in a domain other than their own by a known exporter: pytorch-pfn-extras
# (ppe.onnx.grad) emits Gradient in ai.onnx.preview, and its upstream fix is unmerged.
_DOMAIN_ALIASES = {("ai.onnx.preview", "Gradient"): TRAINING_DOMAIN}


# Domains read at this version when a model does not import them: ONNX Runtime's contrib domain
# has one version, which ONNX Runtime assumes, and its transformer optimizer's in-memory models
# leave the import out.
_IMPLIED_OPSETS = {"com.microsoft": 1}


def normalize_domain(domain: str) -> str:
    """'' and 'ai.onnx' name the same default domain."""
    return DEFAULT_DOMAIN if domain in ("", "ai.onnx") else domain


def model_opsets(opset_import: Iterable) -> dict[str, int]:
    """Domain (normalized) -> version, from a model's or function's opset_import entries, with
    the versions implied for domains it does not import (ONNX Runtime's contrib domain)."""
    return {**_IMPLIED_OPSETS, **{normalize_domain(o.domain): o.version for o in opset_import}}


@dataclass(frozen=True)
class OpHandler:
    """One implementation of an operator, valid from `since_version` on.

    static_inputs: input positions whose values must be host constants
    (shapes, axes, sizes); the translator keeps initializers feeding them out
    of the traced parameters and reports a clear error otherwise.
    random: the op draws from the PRNG key, so it is never folded on the host.
    group: fn(spec, index) -> the graph.NodeGroup of earlier nodes to evaluate together for
    this node, or None (the Gradient op's forward pass; see translate.gradient).
    """

    domain: str
    op_type: str
    since_version: int
    fn: Callable
    static_inputs: tuple[int, ...] = ()
    random: bool = False
    differentiable: bool = True
    group: Callable | None = None


_HANDLERS: dict[tuple[str, str], list[OpHandler]] = {}


def op(
    op_type: str,
    since: int = 1,
    domain: str = DEFAULT_DOMAIN,
    *,
    static_inputs: Iterable[int] = (),
    random: bool = False,
    differentiable: bool = True,
    group: Callable | None = None,
) -> Callable[[Callable], Callable]:
    """Register the decorated function as the handler of op_type from opset `since` on.

    The function is called as fn(node, *inputs) and returns one value or a
    tuple/list of values (one per output); see translate.node.NodeContext.
    Stacking decorators registers one function under several ops or versions.
    """

    def register(fn: Callable) -> Callable:
        handler = OpHandler(normalize_domain(domain), op_type, since, fn,
                            tuple(static_inputs), random, differentiable, group)
        versions = _HANDLERS.setdefault((handler.domain, op_type), [])
        if any(h.since_version == since for h in versions):
            raise ValueError(f"{domain or 'ai.onnx'}::{op_type} since {since} registered twice")
        versions.append(handler)
        versions.sort(key=lambda h: h.since_version)
        return fn

    return register


def resolve(domain: str, op_type: str, opset_version: int) -> OpHandler | None:
    """The newest handler with since_version <= opset_version, or None.

    An op in an aliased domain (Gradient in ai.onnx.preview) resolves to its own domain's
    handler, at the version the model imports for the domain it wrote."""
    domain = normalize_domain(domain)
    if (domain, op_type) in _DOMAIN_ALIASES and (domain, op_type) not in _HANDLERS:
        domain = _DOMAIN_ALIASES[domain, op_type]
        _log_alias(op_type, domain)
    versions = _HANDLERS.get((domain, op_type), [])
    usable = [h for h in versions if h.since_version <= opset_version]
    return usable[-1] if usable else None


@functools.cache
def _log_alias(op_type: str, domain: str) -> None:
    logging.getLogger("onnxtrain").info("reading %s of domain ai.onnx.preview (as pytorch-pfn-extras writes it) "
                                        "as %s::%s", op_type, domain, op_type)


def registered() -> dict[tuple[str, str], list[int]]:
    """(domain, op_type) -> the since_versions implemented; for coverage reports."""
    return {key: [h.since_version for h in versions] for key, versions in _HANDLERS.items()}

