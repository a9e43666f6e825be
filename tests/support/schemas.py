"""Sixty JSON schemas for structured-output tests, built from twelve shapes (flat objects,
nested objects, arrays with min/max items, enums, bounded numbers, string patterns,
`$ref`/`$defs`, `anyOf`, optional keys) over five vocabularies of key names; every string and
array is bounded so a small model's outputs end."""

from __future__ import annotations

NAMES = [
    ("name", "city", "age", "score", "tags"),
    ("title", "author", "year", "rating", "genres"),
    ("product", "brand", "stock", "price", "colors"),
    ("team", "coach", "wins", "ratio", "players"),
    ("topic", "source", "count", "weight", "keywords"),
]


def _text(n: int = 24) -> dict:
    return {"type": "string", "maxLength": n}


def _shapes(a: str, b: str, i: str, f: str, arr: str) -> list[dict]:
    obj = lambda props, req=None: {  # noqa: E731
        "type": "object", "properties": props, "required": list(props) if req is None else req,
        "additionalProperties": False,
    }  # fmt: skip
    return [
        obj({a: _text(), i: {"type": "integer", "minimum": 0, "maximum": 120}}),
        obj({a: _text(), f: {"type": "number", "minimum": 0, "maximum": 10}, "ok": {
            "type": "boolean"}}),
        obj({a: _text(), arr: {"type": "array", "items": _text(12), "minItems": 1,
                               "maxItems": 3}}),
        obj({a: {"enum": ["red", "green", "blue"]}, i: {"type": "integer", "minimum": -5,
                                                         "maximum": 5}}),
        obj({a: _text(), "details": obj({b: _text(), i: {"type": "integer", "minimum": 1,
                                                          "maximum": 9}})}),
        obj({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}, a: _text()}),
        {**obj({a: {"$ref": "#/$defs/part"}, b: {"$ref": "#/$defs/part"}}),
         "$defs": {"part": obj({"label": _text(10), i: {"type": "integer", "minimum": 0,
                                                        "maximum": 50}})}},
        obj({a: {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, _text(8)]},
             b: _text()}),
        obj({arr: {"type": "array", "items": obj({a: _text(10), i: {
            "type": "integer", "minimum": 0, "maximum": 9}}), "maxItems": 2}}),
        obj({a: _text(), b: _text(), i: {"type": "integer"}}, req=[a]),
        obj({f: {"type": "number", "exclusiveMinimum": 0, "maximum": 1}, "unit": {
            "enum": ["kg", "m", "s"]}, arr: {"type": "array", "items": {"type": "integer",
                                             "minimum": 0, "maximum": 9}, "maxItems": 4}}),
        obj({a: {"type": ["string", "null"], "maxLength": 16}, "level": {"enum": [1, 2, 3]},
             "nested": obj({"deep": obj({b: _text(8)})})}),
    ]


def schemas() -> list[dict]:
    """60 schemas: every shape over every vocabulary."""
    return [s for names in NAMES for s in _shapes(*names)]
