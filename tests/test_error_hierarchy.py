"""Every exception class the engine raises on purpose is an ``EngineError``, so callers
can catch the package's errors with one class. The server's HTTP-level exceptions (turned
into responses inside the server, never raised to a caller) and test helpers are the
only others."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import numpy as np
import pytest

import pyengine
from pyengine import EngineError, KernelError, _kernels

# Raised and caught inside the HTTP server (an error response, a client that left), or
# only by test helpers.
NOT_ENGINE_ERRORS = {
    "pyengine.server.errors.APIError",
    "pyengine.server.engine_requests.ClientDisconnected",
    "pyengine.server.limits.LimitRefusal",
    "pyengine.testing.hand_plan.HandPlanError",
}


def package_exception_classes():
    for info in pkgutil.walk_packages(pyengine.__path__, "pyengine."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == info.name:
                yield f"{cls.__module__}.{cls.__qualname__}", cls


def test_every_package_exception_is_an_engine_error():
    found = dict(package_exception_classes())
    assert "pyengine.errors.KVCacheTooSmallError" in found and "pyengine.models.errors.WeightMismatchError" in found
    outside = sorted(name for name, cls in found.items() if not issubclass(cls, EngineError))
    assert outside == sorted(NOT_ENGINE_ERRORS)


def test_native_kernel_errors_are_engine_errors():
    x = np.zeros(12, np.float32)
    with pytest.raises(KernelError, match="whole rows"):
        _kernels.rms_norm(np.zeros(12, np.float32), x, np.ones(8, np.float32), 1e-6)


def test_native_modules_are_attributes_of_the_package():
    import pyengine._kernels
    import pyengine._sched

    assert pyengine._kernels.rms_norm is _kernels.rms_norm
    assert pyengine._sched.PLACEHOLDER_TOKEN == -1
