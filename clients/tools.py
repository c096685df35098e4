"""Function tools for a session from plain Python functions (docs/protocol.md#tools).

`declare(fn)` is the session's declaration of `fn`: its name, its docstring's first paragraph
as the description, and a JSON Schema of its parameters from their type hints (str, int,
float, bool, lists, dicts, Literal choices; a parameter with a default, or `X | None`, is not
required). `Toolbox` holds the functions a session offers and runs a call: the arguments'
JSON in, the function's result out as the output text (a str as it is, anything else as
JSON; an exception as {"error": ...}, so the model hears what went wrong).

`load_tools(path)` reads a Python file's public functions (`rtmedia talk --tools tools.py`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

_SIMPLE = {str: "string", int: "integer", float: "number", bool: "boolean"}


class ToolError(ValueError):
    """A function that cannot be declared, or a tools file that cannot be read."""


def _schema(hint: Any, where: str) -> dict[str, Any]:
    origin, args = get_origin(hint), get_args(hint)
    if hint in _SIMPLE:
        return {"type": _SIMPLE[hint]}
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (list, tuple, set, frozenset) or hint in (list, tuple):
        items = [a for a in args if a is not Ellipsis]
        return {"type": "array", **({"items": _schema(items[0], where)} if items else {})}
    if origin is dict or hint is dict:
        return {"type": "object"}
    if _optional(hint) is not None:
        return _schema(_optional(hint), where)
    raise ToolError(f"{where}: cannot describe the type {hint!r} as JSON (use str, int, float, bool, list, dict or "
                    "Literal)")


def _optional(hint: Any) -> Any:
    """X for `X | None` / Optional[X], else None."""
    if get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in get_args(hint) if a is not type(None)]
        if len(rest) == 1 and len(get_args(hint)) == 2:
            return rest[0]
    return None


def declare(fn: Callable[..., Any]) -> dict[str, str]:
    """The session's declaration of `fn` (a `tools.functions` entry)."""
    name = fn.__name__
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # an unresolvable annotation
        raise ToolError(f"{name}: its type hints cannot be read: {exc}") from None
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolError(f"{name}: *{param.name} cannot be declared; name each parameter")
        if param.name not in hints:
            raise ToolError(f"{name}: parameter {param.name!r} has no type hint")
        properties[param.name] = _schema(hints[param.name], f"{name}({param.name})")
        if param.default is param.empty and _optional(hints[param.name]) is None:
            required.append(param.name)
    doc = inspect.getdoc(fn) or ""
    schema = {"type": "object", "properties": properties, "required": required}
    return {"name": name, "description": doc.split("\n\n")[0].replace("\n", " "), "parameters": json.dumps(schema)}


class Toolbox:
    """The functions a session offers, by name."""

    def __init__(self, functions: list[Callable[..., Any]]) -> None:
        self.functions = {fn.__name__: fn for fn in functions}
        self.declarations = [declare(fn) for fn in functions]

    async def run(self, name: str, arguments: str) -> str:
        """The output of a call: the function's result (run in a thread unless it is a
        coroutine function), as text."""
        fn = self.functions.get(name)
        if fn is None:
            return json.dumps({"error": f"no function {name!r}"})
        try:
            kwargs = json.loads(arguments or "{}")
            if not isinstance(kwargs, dict):
                raise TypeError("the arguments are not a JSON object")
            result = await fn(**kwargs) if inspect.iscoroutinefunction(fn) else \
                await asyncio.to_thread(fn, **kwargs)
        except Exception as exc:
            return json.dumps({"error": f"{type(exc).__name__}: {exc}"})
        return result if isinstance(result, str) else json.dumps(result, default=str)


def load_tools(path: str | Path) -> Toolbox:
    """The public functions defined in the Python file `path` (not those it imports)."""
    path = Path(path)
    if not path.is_file():
        raise ToolError(f"{path}: no such file")
    spec = importlib.util.spec_from_file_location(f"rtmedia_tools_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ToolError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and type hints look the module up
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ToolError(f"{path}: {type(exc).__name__}: {exc}") from None
    functions = [fn for name, fn in vars(module).items() if inspect.isfunction(fn) and not name.startswith("_")
                 and fn.__module__ == module.__name__]
    if not functions:
        raise ToolError(f"{path}: defines no public functions")
    return Toolbox(functions)
