"""Tool-call formats, one module each, registered as model families are.

Every module of this package but the support ones (`base`, `common`, `rules`, `shapes`)
holds one format: its `SYNTAXES` (base.ToolSyntax: the grammar of a call, how calls
follow each other, the mlx-lm parsers that read it, how a call cut short is read back)
and, for the formats mlx-lm has no parser for, the parser itself with mlx-lm's contract
(``tool_call_start``, ``tool_call_end``, ``parse_tool_call(text, tools)``, returning
``{"name", "arguments"}`` or a list of them and raising on bad input): hermes, Qwen XML,
Gemma's tool_code. They are found here when the package is imported, so a new format is
one new module. `ChatMarkup` (text/markup.py) picks the formats a model uses when its
tokenizer is loaded.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable

from mlx_relay.text.tool_calls import hermes, qwen_xml, tool_code
from mlx_relay.text.tool_calls.base import ToolSyntax

__all__ = [
    "FALLBACK",
    "SYNTAXES",
    "ToolSyntax",
    "declared_syntax",
    "find",
    "index",
    "parse_tagged",
    "syntax",
]

_SUPPORT = ("base", "common", "rules", "shapes")  # modules of the package that hold no format


def index(syntaxes: Iterable[ToolSyntax]) -> dict[str, ToolSyntax]:
    """The syntaxes by name; ValueError if two modules claim one name."""
    by_name: dict[str, ToolSyntax] = {}
    for one in syntaxes:
        if one.name in by_name:
            raise ValueError(f"tool-call syntax {one.name!r} is declared twice")
        by_name[one.name] = one
    return by_name


def _collect() -> dict[str, ToolSyntax]:
    """Every format module's syntaxes, indexed."""
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in _SUPPORT)
    return index(
        one for name in names for one in importlib.import_module(f"{__name__}.{name}").SYNTAXES
    )


_BY_NAME = _collect()
SYNTAXES = tuple(_BY_NAME)  # every syntax a grammar is known for, by name


def syntax(name: str) -> ToolSyntax:
    """The syntax of this name; ValueError if no format declares it."""
    found = find(name)
    if found is None:
        raise ValueError(f"no grammar for tool-call syntax {name!r}")
    return found


def find(name: str | None) -> ToolSyntax | None:
    """The syntax of this name, None if there is none (or no name)."""
    return _BY_NAME.get(name) if name else None


def declared_syntax(parser_module: str, template: str) -> str | None:
    """The syntax that mlx-lm's parser of this module (its last dotted name) reads, for a
    model whose chat template is `template`; None where no format declares the parser
    (its calls are then parsed but not held to a grammar)."""
    found = [s for s in _BY_NAME.values() if parser_module in s.declared_by]
    marked = [s for s in found if s.template_mark and s.template_mark in template]
    usual = [s for s in found if not s.template_mark]
    chosen = (marked or usual or [None])[0]
    return chosen.name if chosen is not None else None


def parse_tagged(text: str, tools: list[dict] | None = None) -> list[dict]:
    """Inside ``<tool_call>`` what follows decides: ``{`` is hermes, ``<function=`` Qwen XML."""
    head = text.lstrip()
    if head.startswith("<function="):
        return qwen_xml.parse_tool_call(text, tools)
    if head.startswith(("{", "[")):
        return hermes.parse_tool_call(text, tools)
    raise ValueError("unknown <tool_call> format")


# (start marker, end marker, parser) of the formats recognised without mlx-lm's help.
FALLBACK = (
    (hermes.tool_call_start, hermes.tool_call_end, parse_tagged),
    (tool_code.tool_call_start, tool_code.tool_call_end, tool_code.parse_tool_call),
)
