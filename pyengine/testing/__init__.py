"""Helpers for tests and benchmarks only: tiny checkpoints, hand-built step plans, a
contiguous-cache reference forward and synthetic model runners.

``checkpoints`` writes tiny random Hugging Face checkpoints of every supported
architecture; ``hand_plan`` builds valid :class:`~pyengine.executor.plan.HandBuiltPlan` objects
without the Rust scheduler. This package may import from the product, never the reverse
(``tests/test_package_layout.py``): what the product itself runs on (the built-in default
model, the fake executor behind ``pyengine simulate``) lives in the package proper.
"""
