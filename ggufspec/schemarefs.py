"""A schema's $refs resolved where a schema can hold one (schemafollow.BoundedConverter.resolve_refs).

llama-cpp-python's SchemaConverter.resolve_refs walks every object in the schema and takes any with a
"$ref" key for a reference, data too: a const or enum value {"$ref": "x"} was refused ("Unsupported
ref x"), one {"$ref": "#/$defs"} rewritten to "stdin#/$defs" in the literal the answer must equal, a
default or examples value of that shape (an annotation) refused the whole schema, and a property named
$ref was taken for one ("unhashable type: 'dict'"). Here only the schemas are walked (the keywords
that hold them: `ONE_SCHEMA`, `SCHEMA_LISTS`, `SCHEMA_MAPS`), data stays as it is and is followed
literally; and what each $ref points at is walked too, wherever it lies.
"""
from __future__ import annotations

from collections.abc import Iterator

# where a schema holds schemas: one, a list of them, or a map of names to them (anything else is data)
ONE_SCHEMA = frozenset({"items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                        "additionalItems", "unevaluatedItems", "unevaluatedProperties"})
SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems", "items"})
SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties", "dependentSchemas"})
REMOTE = "Fetching remote schemas is not allowed (use --allow-fetch for force)"  # the converter's words


def subschemas(schema: dict) -> Iterator:
    """The schemas directly inside `schema` (their values: a schema that is no object is left to check_shapes)."""
    for key, value in schema.items():
        if key in SCHEMA_LISTS and isinstance(value, list):
            yield from value
        elif key in ONE_SCHEMA and isinstance(value, dict):
            yield value
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            yield from value.values()


def resolve_refs(converter, schema: dict, url: str) -> dict:
    """What SchemaConverter.resolve_refs does (each local $ref rewritten as `url#/...`, what it points
    at kept in converter._refs for visit), at the schemas only: `schema`, rewritten in place."""
    walked: set[int] = set()

    def walk(node) -> None:
        if not isinstance(node, dict) or id(node) in walked:
            return
        walked.add(id(node))
        if "$ref" in node:
            walk(pointed_at(converter, schema, url, node))
        for sub in subschemas(node):
            walk(sub)

    walk(schema)
    return schema


def pointed_at(converter, root: dict, url: str, node: dict):
    """What `node`'s $ref points at in `root`, recorded as the converter's resolve_refs records it,
    with its errors (tools.schema_problem turns them into one line)."""
    ref = node["$ref"]
    if not isinstance(ref, str):
        raise ValueError(f"a $ref must be a text, got {ref!r}")
    if ref in converter._refs:
        return converter._refs[ref]
    if ref.startswith("https://"):
        raise AssertionError(REMOTE)
    if not ref.startswith("#/"):
        raise ValueError(f"Unsupported ref {ref}")
    full, target = f"{url}{ref}", root
    for key in ref[2:].split("/"):
        if not isinstance(target, dict) or key not in target:
            raise AssertionError(f"Error resolving ref {full}: {key} not in {target}")
        target = target[key]
    node["$ref"] = full
    converter._refs[full] = target
    return target
