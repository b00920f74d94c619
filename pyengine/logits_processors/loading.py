"""Custom logits processors given to an engine: classes, or their qualified names.

``logits_processors=[MyProcessor]`` (or ``["my_package.module.MyProcessor"]``, or
``"my_package.module:MyProcessor"``). An engine core in another process receives the
names and imports them there, so a class handed to a multi-process engine must be
importable by name (defined at the top level of a module on the core's path, not in
``__main__`` or inside a function).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, Union

from pyengine.errors import InvalidConfigError
from pyengine.logits_processors.interface import LogitsProcessor

ProcessorSpec = Union[str, type]


def check_processor_specs(specs: Any) -> tuple[ProcessorSpec, ...]:
    """``specs`` as a tuple; ``InvalidConfigError`` naming ``logits_processors`` when an
    entry is neither a qualified name nor a ``LogitsProcessor`` subclass."""
    if specs is None:
        return ()
    if isinstance(specs, (str, type)) or not isinstance(specs, Sequence):
        raise InvalidConfigError(f"logits_processors must be a list of classes or qualified names, got {specs!r}")
    for spec in specs:
        if isinstance(spec, str):
            if not spec.strip():
                raise InvalidConfigError("logits_processors holds an empty name")
        elif not (isinstance(spec, type) and issubclass(spec, LogitsProcessor)):
            raise InvalidConfigError(
                f"logits_processors entries must be LogitsProcessor subclasses (pyengine.LogitsProcessor) "
                f"or their qualified names, got {spec!r}"
            )
    return tuple(specs)


def qualified_name(spec: ProcessorSpec) -> str:
    """The name an engine core in another process imports ``spec`` by."""
    if isinstance(spec, str):
        return spec
    module, qualname = spec.__module__, spec.__qualname__
    if module == "__main__" or "<locals>" in qualname:
        raise InvalidConfigError(
            f"logits_processors: {module}.{qualname} cannot be imported by name in the engine core process "
            "(it is defined in __main__ or inside a function): define it at the top level of a module"
        )
    return f"{module}:{qualname}"


def resolve_processor(spec: ProcessorSpec) -> type:
    """The class ``spec`` names; ``InvalidConfigError`` naming it when it cannot be imported
    or is not a ``LogitsProcessor`` subclass."""
    if isinstance(spec, type):
        check_processor_specs([spec])
        return spec
    if ":" in spec:
        module_name, _, attribute = spec.partition(":")
    else:
        module_name, _, attribute = spec.rpartition(".")
    if not module_name or not attribute:
        raise InvalidConfigError(f"logits_processors: {spec!r} is not a qualified name ('package.module.Class')")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as error:
        raise InvalidConfigError(f"logits_processors: cannot import {spec!r}: {error}") from error
    if not (isinstance(target, type) and issubclass(target, LogitsProcessor)):
        raise InvalidConfigError(f"logits_processors: {spec!r} is not a LogitsProcessor subclass")
    return target


def validate_request(classes: Sequence[type], params: Any) -> None:
    """Each custom class's ``validate_params`` on a request's parameters; a ``ValueError``
    or ``TypeError`` it raises becomes an ``InvalidRequestError``."""
    from pyengine.errors import InvalidRequestError

    for cls in classes:
        try:
            cls.validate_params(params)
        except InvalidRequestError:
            raise
        except (ValueError, TypeError) as error:
            raise InvalidRequestError(f"{cls.__name__}: {error}") from error
