"""One list of plan and event fields: the native classes' ``FIELDS``. The stub, the
contract document and the Python plan classes must name exactly those fields."""

from __future__ import annotations

import ast
import dataclasses
import re
import typing
from pathlib import Path

from pyengine._sched import OutputEvent, StepPlan
from pyengine.executor import plan as py_plan

ROOT = Path(__file__).resolve().parent.parent
# Counts the plan derives from its arrays; documented in prose, not as table rows.
DERIVED = {"num_seqs", "num_tokens", "num_samples"}


def stub_properties(class_name: str) -> list[str]:
    tree = ast.parse((ROOT / "pyengine" / "_sched.pyi").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    return [n.name for n in cls.body if isinstance(n, ast.FunctionDef)
            and any(isinstance(d, ast.Name) and d.id == "property" for d in n.decorator_list)]


def contract_table(heading: str) -> list[str]:
    """Field names in the first column of the table under ``heading`` in docs/contract.md."""
    text = (ROOT / "docs" / "contract.md").read_text()
    section = text.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    names: list[str] = []
    for line in section.splitlines():
        if line.startswith("| `"):
            names += re.findall(r"`([a-z_]+)`", line.split("|")[1])
    return names


def test_plan_fields_are_listed_once_and_agree():
    fields = list(StepPlan.FIELDS)
    assert stub_properties("StepPlan") == fields
    assert contract_table("StepPlan") == [f for f in fields if f not in DERIVED]
    dataclass_fields = [f.name for f in dataclasses.fields(py_plan.HandBuiltPlan)]
    assert dataclass_fields == [f for f in fields if f not in DERIVED]
    assert list(typing.get_type_hints(py_plan.StepPlanLike)) == dataclass_fields


def test_event_fields_are_listed_once_and_agree():
    fields = list(OutputEvent.FIELDS)
    assert stub_properties("OutputEvent") == fields
    assert contract_table("OutputEvent") == fields
