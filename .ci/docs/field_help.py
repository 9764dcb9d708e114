"""Griffe extension (.ci/mkdocs.yml): a dataclass field declared as `field(..., metadata={"help": ...})`, as
`TrainingArguments` and varsmooth's arguments and method configs declare theirs for `HfArgumentParser`, gets that help
text as its docstring, so the API reference shows what `--help` shows, and its default as its value (not the whole
`field(...)` call, which repeats the help).

The help text is often built (f-strings, calls), so it is read from the imported class's `dataclasses.fields`; only
classes with such a field are imported.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
from typing import Any

import griffe


def _declares_help(node: ast.AST) -> bool:
    if not isinstance(node, ast.AnnAssign) or not isinstance(node.value, ast.Call):
        return False
    for keyword in node.value.keywords:
        if keyword.arg == "metadata" and isinstance(keyword.value, ast.Dict):
            return any(isinstance(key, ast.Constant) and key.value == "help" for key in keyword.value.keys)
    return False


class FieldHelp(griffe.Extension):
    """Sets the docstring of a dataclass field without one to the field's `help` metadata, its value to the default."""

    def on_attribute_instance(self, *, node: ast.AST | griffe.ObjectNode, attr: griffe.Attribute, agent: Any,
                              **kwargs: Any) -> None:
        if attr.docstring is not None or not _declares_help(node) or not attr.parent.is_class:
            return
        cls = getattr(importlib.import_module(attr.parent.module.path), attr.parent.name)
        help_text = {f.name: f.metadata.get("help") for f in dataclasses.fields(cls)}.get(attr.name)
        if help_text:
            attr.docstring = griffe.Docstring(help_text, parent=attr)
        defaults = {keyword.arg: keyword.value for keyword in node.value.keywords}
        if "default" in defaults:
            attr.value = ast.unparse(defaults["default"])
        elif "default_factory" in defaults:
            attr.value = f"{ast.unparse(defaults['default_factory'])}()"
