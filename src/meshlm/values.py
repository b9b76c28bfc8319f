"""Config values from flags and YAML, checked against their kind and named in plain words.

A config field is of one kind: ``int``, ``float``, ``bool``, ``list`` (of text), ``ints`` (a list of
integers) or ``str`` (:func:`kind_of`).
:func:`flag_type` is the argparse ``type`` of a flag of that kind and :func:`coerce` converts a
YAML value to it. Either refuses a value of another kind (a YAML ``true`` for an integer, a list
for a path) with a message that says what was expected in words — "an integer", "a number",
"true or false" — never a Python type name.
"""

from __future__ import annotations

import argparse

WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "list": "a list",
         "ints": "integers", "str": "text"}


def kind_of(f) -> str:
    """The kind of the dataclass field ``f`` (its annotation, e.g. ``Optional[int]`` → "int",
    ``Optional[list[int]]`` → "ints")."""
    typ = f.type if isinstance(f.type, str) else str(f.type)
    if "list[int]" in typ:
        return "ints"
    return next((kind for kind in ("bool", "int", "float", "list") if kind in typ), "str")


def parse_bool(value) -> bool:
    """true/false, yes/no, on/off, 1/0 (any case) or a YAML bool; ValueError otherwise."""
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(value)


def _to_int(value) -> int:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, (int, str)):
        return int(value)
    raise ValueError(value)


def _to_float(value) -> float:
    if isinstance(value, (int, float, str)):
        return float(value)
    raise ValueError(value)


def coerce(kind: str, value):
    """A YAML value as ``kind``; ValueError when it is of another kind (bools count as no number)."""
    if kind == "bool":
        return parse_bool(value)
    if kind in ("list", "ints"):
        items = value if isinstance(value, list) else [value] if isinstance(value, (int, float)) \
            else str(value).split() if isinstance(value, str) else None
        if items is None or any(isinstance(v, (bool, list, dict)) or v is None for v in items):
            raise ValueError(value)
        return [_to_int(v) for v in items] if kind == "ints" else [str(v) for v in items]
    if isinstance(value, (bool, list, dict)):
        raise ValueError(value)
    return _to_int(value) if kind == "int" else _to_float(value) if kind == "float" else str(value)


def expected(kind: str, value) -> str:
    """What a value of ``kind`` must be, in words, with the integer meant when ``value`` spells one
    another way (``1e3`` → "an integer (write 1000)")."""
    words = WORDS[kind]
    if kind == "int" and isinstance(value, (str, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except ValueError:
            return words
        if number.is_integer():
            return f"{words} (write {int(number)})"
    if kind == "str" and isinstance(value, (list, tuple)) and value and \
            all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
        return f"{words} (write the flag's text: '{','.join(map(str, value))}')"  # YAML `split: [98, 2, 0]`
    return words


def flag_type(kind: str):
    """The argparse ``type`` of a flag of ``kind`` (of each value, for ``ints``): its error names
    the kind in words."""
    kind = "int" if kind == "ints" else kind
    convert = {"int": int, "float": float, "bool": parse_bool}.get(kind, str)

    def parse(text: str):
        try:
            return convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {expected(kind, text)}") from None
    parse.__name__ = WORDS[kind]
    return parse
