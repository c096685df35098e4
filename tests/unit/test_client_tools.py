"""Tool declarations from Python functions and running a call (rtmedia.clients.tools), as
`rtmedia talk --tools` uses them."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from rtmedia.clients.tools import Toolbox, ToolError, declare, load_tools


def get_weather(city: str, unit: Literal["c", "f"] = "c", days: int | None = None) -> dict:
    """The weather in a city.

    More words that are not the description."""
    return {"city": city, "unit": unit, "days": days}


async def slow_sum(values: list[float]) -> float:
    return sum(values)


def test_a_function_is_declared_from_its_docstring_and_type_hints():
    declaration = declare(get_weather)
    assert declaration["name"] == "get_weather" and declaration["description"] == "The weather in a city."
    assert json.loads(declaration["parameters"]) == {
        "type": "object", "required": ["city"],
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}, "days": {"type": "integer"}}}
    assert json.loads(declare(slow_sum)["parameters"])["properties"] == {
        "values": {"type": "array", "items": {"type": "number"}}}


def test_what_cannot_be_declared_is_named():
    def untyped(x):
        return x

    def variadic(*args: int):
        return args

    def odd(x: complex):
        return x

    with pytest.raises(ToolError, match="'x' has no type hint"):
        declare(untyped)
    with pytest.raises(ToolError, match=r"\*args"):
        declare(variadic)
    with pytest.raises(ToolError, match="complex"):
        declare(odd)


async def test_a_call_runs_and_its_result_is_the_output():
    box = Toolbox([get_weather, slow_sum])
    assert json.loads(await box.run("get_weather", '{"city": "Paris"}')) == {"city": "Paris", "unit": "c",
                                                                            "days": None}
    assert await box.run("slow_sum", '{"values": [1, 2.5]}') == "3.5"
    assert "no function 'nope'" in json.loads(await box.run("nope", "{}"))["error"]
    assert "TypeError" in json.loads(await box.run("get_weather", '{"town": "x"}'))["error"]
    assert "error" in json.loads(await box.run("get_weather", "[1]"))


def test_a_tools_file_gives_its_own_public_functions(tmp_path):
    path = tmp_path / "tools.py"
    path.write_text("from json import dumps\n\ndef _helper() -> None: ...\n\n"
                    "def add(a: int, b: int) -> int:\n    'Adds two numbers.'\n    return a + b\n")
    box = load_tools(path)
    assert list(box.functions) == ["add"] and box.declarations[0]["description"] == "Adds two numbers."
    (tmp_path / "broken.py").write_text("def f(:\n")
    with pytest.raises(ToolError, match="SyntaxError"):
        load_tools(tmp_path / "broken.py")
    (tmp_path / "empty.py").write_text("X = 1\n")
    with pytest.raises(ToolError, match="no public functions"):
        load_tools(tmp_path / "empty.py")
    with pytest.raises(ToolError, match="no such file"):
        load_tools(tmp_path / "missing.py")
