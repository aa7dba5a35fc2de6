"""The JSON Schemas the structured-output tests ask for: hand-written ones covering the
keywords clients use, and generated ones (seeded) that nest them. Every string is bounded
(maxLength, an enum or a pattern) and every array has maxItems, so any output the grammar
allows ends within the tests' max_tokens: constrained decoding guarantees a valid prefix,
and termination is the schema's business."""

from __future__ import annotations

import random

NAME = {"type": "string", "maxLength": 12}

HAND_WRITTEN: list[tuple[str, dict]] = [
    ("person", {"type": "object", "properties": {
        "name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False}),
    ("address", {"type": "object", "properties": {
        "street": {"type": "string", "maxLength": 20}, "city": NAME,
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["street", "city", "zip"], "additionalProperties": False}),
    ("colour", {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
                "required": ["colour"], "additionalProperties": False}),
    ("price", {"type": "object", "properties": {
        "item": NAME, "price": {"type": "number", "minimum": 0, "maximum": 1000},
        "in_stock": {"type": "boolean"}},
        "required": ["item", "price", "in_stock"], "additionalProperties": False}),
    ("date", {"type": "object", "properties": {
        "event": NAME, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
        "required": ["event", "date"], "additionalProperties": False}),
    ("tags", {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False}),
    ("order", {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "lines": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
        "required": ["id", "lines"], "additionalProperties": False}),
    ("nullable", {"type": "object", "properties": {
        "nickname": {"type": ["string", "null"], "maxLength": 8}, "score": {"type": ["integer", "null"],
                                                                         "minimum": 0, "maximum": 10}},
        "required": ["nickname", "score"], "additionalProperties": False}),
    ("const", {"type": "object", "properties": {"version": {"const": 2}, "kind": {"const": "report"}},
               "required": ["version", "kind"], "additionalProperties": False}),
    ("any_of", {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"enum": ["none", "many"]}]}},
        "required": ["value"], "additionalProperties": False}),
    ("refs", {"type": "object", "$defs": {"point": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                         "y": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}},
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"], "additionalProperties": False}),
    ("optional", {"type": "object", "properties": {
        "title": NAME, "subtitle": NAME, "pages": {"type": "integer", "minimum": 1, "maximum": 999}},
        "required": ["title"], "additionalProperties": False}),
    ("matrix", {"type": "object", "properties": {"rows": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 3, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
        "required": ["rows"], "additionalProperties": False}),
    ("exclusive", {"type": "object", "properties": {
        "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        "count": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}},
        "required": ["ratio", "count"], "additionalProperties": False}),
    ("phone", {"type": "object", "properties": {
        "phone": {"type": "string", "pattern": "^\\+[0-9]{2} [0-9]{3} [0-9]{4}$"}, "owner": NAME},
        "required": ["phone", "owner"], "additionalProperties": False}),
    ("weekday", {"type": "object", "properties": {
        "day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
        "hours": {"type": "integer", "minimum": 0, "maximum": 24}},
        "required": ["day", "hours"], "additionalProperties": False}),
    ("deep", {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {
        "type": "object", "properties": {"c": {"type": "boolean"}}, "required": ["c"],
        "additionalProperties": False}}, "required": ["b"], "additionalProperties": False}},
        "required": ["a"], "additionalProperties": False}),
    ("one_of", {"type": "object", "properties": {"shape": {"oneOf": [
        {"type": "object", "properties": {"circle": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["circle"], "additionalProperties": False},
        {"type": "object", "properties": {"square": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["square"], "additionalProperties": False}]}},
        "required": ["shape"], "additionalProperties": False}),
    ("lengths", {"type": "object", "properties": {
        "code": {"type": "string", "minLength": 3, "maxLength": 3},
        "items": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}},
        "required": ["code", "items"], "additionalProperties": False}),
    ("hex", {"type": "object", "properties": {
        "colour": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}, "alpha": {"type": "number",
                                                                            "minimum": 0, "maximum": 1}},
        "required": ["colour", "alpha"], "additionalProperties": False}),
]

LEAVES = [
    {"type": "integer", "minimum": 0, "maximum": 100},
    {"type": "integer", "minimum": -50, "maximum": 50},
    {"type": "number", "minimum": 0, "maximum": 10},
    {"type": "boolean"},
    {"type": "string", "maxLength": 10},
    {"type": "string", "pattern": "^[a-z]{2,6}$"},
    {"enum": ["low", "medium", "high"]},
    {"enum": [1, 2, 3]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 2},
    {"type": ["boolean", "null"]},
]
KEYS = ["id", "name", "kind", "level", "count", "flag", "value", "label", "size", "mode", "note", "rank"]


def generated(num_schemas: int, seed: int = 16) -> list[tuple[str, dict]]:
    """`num_schemas` objects of 1-4 properties, leaves or (at depth 1) nested objects,
    some properties optional."""
    rng = random.Random(seed)

    def obj(depth: int) -> dict:
        keys = rng.sample(KEYS, rng.randint(1, 4 if depth == 0 else 2))
        properties = {key: obj(depth + 1) if depth == 0 and rng.random() < 0.25 else dict(rng.choice(LEAVES))
                      for key in keys}
        required = [key for key in keys if rng.random() < 0.8] or keys[:1]
        return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}

    return [(f"generated_{i}", obj(0)) for i in range(num_schemas)]


SCHEMAS = HAND_WRITTEN + generated(30)
