"""What llama-cpp-python's JSON-schema converter follows, and refusing what it would drop (`tools.schema_grammar`).

The converter (llama_cpp.llama_grammar.SchemaConverter.visit) picks one branch by the first of these
it finds: $ref; anyOf/oneOf; a list of types; const; enum; an object's properties (or
additionalProperties); an object's allOf; an array's items (or prefixItems); a string's pattern;
format uuid, date, time or date-time; a string's minLength/maxLength; else the bare type. Each
branch follows its own keywords and drops every other constraint without a word: minimum, maximum,
exclusiveMinimum/Maximum (an integer's and a number's are followed here:
`BoundedConverter`) and multipleOf; uniqueItems, contains, minProperties, patternProperties,
propertyNames, not, if/then/else, dependent* and unevaluated*; anything beside $ref or anyOf. An
answer that breaks the schema it was asked to follow is worse than an error, so those are refused.

Not refused: annotations (title, description, default, examples, $schema, $id, $comment...), keywords
JSON Schema does not define, and `format` beyond the four the grammar writes (email, uri, int32...):
JSON Schema makes a format an annotation unless a validator opts in, and pydantic writes them for
EmailStr or HttpUrl. Three shapes the converter mishandles are rewritten first (`normalized`): a list
of types becomes an anyOf of one schema per type, a type beside enum or const is dropped (the values
say it all), and a schema of annotations alone is {} (any value; the converter refuses pydantic's
{"title": ...} for Any). So {"type": ["string", "null"], "maxLength": 3} is followed, bound and all.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import llama_cpp.llama_grammar
from llama_cpp.llama_grammar import RESERVED_NAMES, BuiltinRule, SchemaConverter

from .errors import ToolError
from .gbnftrie import TrieWriter
from .schemaints import INT_BOUNDS, int_range_rule, integer_range, number_bound, number_range, number_range_rule
from .schemapatterns import anchored, class_escapes, length_in_pattern
from .schemarefs import ONE_SCHEMA, SCHEMA_LISTS, SCHEMA_MAPS, resolve_refs

ANY_TYPE = None
# JSON Schema's constraints, and the types of the values they constrain (a string one says nothing of a number)
CONSTRAINTS = {
    **dict.fromkeys(("type", "enum", "const", "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref",
                     "$dynamicRef", "$recursiveRef"), ANY_TYPE),
    **dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
                    ("number", "integer")),
    **dict.fromkeys(("minLength", "maxLength", "pattern"), ("string",)),
    **dict.fromkeys(("items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems", "contains",
                     "minContains", "maxContains", "unevaluatedItems"), ("array",)),
    **dict.fromkeys(("properties", "required", "additionalProperties", "patternProperties", "propertyNames",
                     "minProperties", "maxProperties", "dependentRequired", "dependentSchemas", "dependencies",
                     "unevaluatedProperties"), ("object",)),
}
JSON_TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
STRING_FORMATS = ("date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5")
OBJECT_PART = frozenset({"type", "properties", "required", "additionalProperties"})


@dataclass(frozen=True)
class Branch:
    followed: frozenset                     # the keywords the converter's branch follows
    parts: tuple = ()                       # (subschema, its place) the branch converts
    beside: str = ""                        # what made the branch drop the rest ("next to $ref")


def check_followed(schema, root: dict, where: str = "#", seen: set | None = None) -> None:
    """ToolError for the first constraint in `schema` (at the JSON pointer `where`) that the converter
    would drop, or for an enum or anyOf that nothing can follow; $refs followed (once each)."""
    seen = set() if seen is None else seen
    if not isinstance(schema, dict):
        raise ToolError(f"the JSON schema at {where} must be an object, got {json.dumps(schema)[:40]}")
    check_keyword_values(schema, root, where)
    branch = converter_branch(schema, root, where)
    kind = schema.get("type")
    for keyword in schema:
        if keyword not in branch.followed and constrains(keyword, kind):
            numbers = " (a number's bounds are followed where they are numbers below 2**63 in size)" if (
                kind == "number" and keyword in INT_BOUNDS and not branch.beside) else ""
            raise ToolError(f"the JSON schema's {keyword!r} at {where} cannot be enforced{branch.beside}: "
                            f"the grammar would ignore it, so an answer could break it{numbers}")
    for part, place in branch.parts:
        check_followed(part, root, place, seen)
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref not in seen and (target := local_target(root, ref)) is not None:
        seen.add(ref)
        check_followed(target, root, ref, seen)


# what each keyword's value must be: the converter trips on others with Python's own errors ("'int'
# object has no attribute 'startswith'"), or takes them as something else (additionalProperties 5 as
# no property at all)
KEYWORD_KINDS = {
    "$ref": (str, "a text (#/$defs/NAME)"), "format": (str, "a text"), "pattern": (str, "a text"),
    "type": ((str, list), "a type's name or a list of them"), "required": (list, "a list of property names"),
    "enum": (list, "a list of values"), "properties": (dict, "an object of schemas"),
    "$defs": (dict, "an object of schemas"), "definitions": (dict, "an object of schemas"),
    "anyOf": (list, "a non-empty list of schemas"), "oneOf": (list, "a non-empty list of schemas"),
    "allOf": (list, "a non-empty list of schemas"), "prefixItems": (list, "a list of schemas"),
    "items": ((dict, list), "a schema"), "additionalProperties": ((bool, dict), "true, false or a schema"),
}


MAX_OPTIONAL = 256  # optional properties in one object (500 take the converter 0.6 s; 1,000 its recursion limit)


def check_shapes(schema, where: str = "#", max_optional: int | None = None) -> None:
    """Each keyword's value of the kind JSON Schema gives it (KEYWORD_KINDS), at every depth, $defs no
    schema refers to included (the converter reads them all): a ToolError naming the first that is not.
    `max_optional`: at most that many optional properties in an object (a response format's schema: a
    tool's parameters are the agent's, not the user's to change)."""
    if not isinstance(schema, dict):
        raise ToolError(f"the JSON schema at {where} must be an object, got {json.dumps(schema, default=str)[:40]}")
    for key, (kind, wanted) in KEYWORD_KINDS.items():
        value = schema.get(key, kind)
        names = key in ("type", "required") and isinstance(value, list)  # lists of texts
        if value is not kind and (not isinstance(value, kind) or value == [] and wanted.startswith("a non-empty")
                                  or names and not all(isinstance(name, str) for name in value)):
            raise ToolError(f"the JSON schema's {key} at {where} must be {wanted}, got "
                            f"{json.dumps(value, default=str)[:40]}")
    optional = set(schema.get("properties", {})) - set(schema.get("required", []))
    if max_optional is not None and len(optional) > max_optional:
        raise ToolError(f"the JSON schema's object at {where} has {len(optional)} optional properties: the grammar "
                        f"chains each after the others (as llama.cpp's converter does), past {max_optional} at a cost "
                        f"that grows as their square; list more of them in required")
    for key, value in schema.items():
        places = (enumerate(value) if key in SCHEMA_LISTS and isinstance(value, list) else
                  [(None, value)] if key in ONE_SCHEMA and isinstance(value, dict) else
                  value.items() if key in SCHEMA_MAPS and isinstance(value, dict) else ())
        for name, sub in places:
            check_shapes(sub, f"{where}/{key}" + ("" if name is None else f"/{name}"), max_optional)


def check_keyword_values(schema: dict, root: dict, where: str) -> None:
    """Values the converter would follow in a loop (a $ref to itself), or write as what no JSON has (a
    const NaN as a literal)."""
    for key in ("const", "enum"):
        try:
            json.dumps(schema.get(key), allow_nan=False)
        except (ValueError, TypeError):  # NaN, or (from Python) an object
            raise ToolError(f"the JSON schema's {key} at {where} holds a value JSON cannot write (NaN, Infinity, "
                            f"an object that is no JSON)") from None
    ref, refs = schema.get("$ref"), []
    while isinstance(ref, str) and ref not in refs:  # the converter follows a $ref beside all else
        refs.append(ref)
        target = local_target(root, ref)
        ref = target.get("$ref") if isinstance(target, dict) else None
    if ref in refs:
        raise ToolError(f"the JSON schema's $ref at {where} leads back to itself ({' -> '.join(refs + [ref])}) "
                        f"without a schema to follow")


def constrains(keyword: str, kind) -> bool:
    """Whether `keyword` constrains a schema of type `kind` (a list of types, or None: any)."""
    if keyword not in CONSTRAINTS:
        return False  # an annotation, or no keyword of JSON Schema's
    types = CONSTRAINTS[keyword]
    kinds = kind if isinstance(kind, list) else [kind]
    return types is ANY_TYPE or any(k is None or k in types for k in kinds)


def converter_branch(schema: dict, root: dict, where: str) -> Branch:
    """The branch of SchemaConverter.visit that `schema` takes (the same tests, in the same order)."""
    kind = schema.get("type")
    if "$ref" in schema:
        return Branch(frozenset({"$ref"}), beside=" next to $ref")
    if "oneOf" in schema or "anyOf" in schema:
        key = "oneOf" if schema.get("oneOf") else "anyOf"
        alternatives = schema[key]
        if not isinstance(alternatives, list) or not alternatives:
            raise ToolError(f"the JSON schema's {key} at {where} must be a non-empty list of schemas")
        return Branch(frozenset({key}), tuple((a, f"{where}/{key}/{i}") for i, a in enumerate(alternatives)),
                      f" next to {key}")
    if isinstance(kind, list):
        return Branch(frozenset({"type"}), beside=" next to a list of types (use anyOf: one schema per type)")
    if kind is not None and kind not in JSON_TYPES:
        raise ToolError(f"the JSON schema's type at {where} must be one of {', '.join(JSON_TYPES)}, got {kind!r}")
    if "const" in schema:
        return Branch(frozenset({"const", "type"}), beside=" next to const")
    if "enum" in schema:
        if not isinstance(schema["enum"], list) or not schema["enum"]:
            raise ToolError(f"the JSON schema's enum at {where} is empty: no value can follow it")
        return Branch(frozenset({"enum", "type"}), beside=" next to enum")
    if kind in (None, "object") and ("properties" in schema or schema.get("additionalProperties", True) is not True):
        return object_branch(schema, where)
    if kind in (None, "object") and "allOf" in schema:
        return Branch(frozenset({"type", "allOf"}), all_of_parts(schema["allOf"], root, where), " next to allOf")
    if kind in (None, "array") and ("items" in schema or "prefixItems" in schema):
        return array_branch(schema, where)
    if kind in (None, "string") and "pattern" in schema:
        check_pattern(schema["pattern"], where)
        return Branch(frozenset({"type", "pattern"}), beside=" next to pattern")
    if kind in (None, "string") and schema.get("format") in STRING_FORMATS:
        return Branch(frozenset({"type", "format"}), beside=" next to format")
    if kind == "string":
        length_bounds(schema, ("minLength", "maxLength"), where)
        return Branch(frozenset({"type", "minLength", "maxLength"}))
    if kind == "integer":  # its bounds are followed (`BoundedConverter`), multipleOf is not
        integer_range(schema, where)  # bounds that leave no integer: said here, with the place
        return Branch(frozenset({"type", *INT_BOUNDS}))
    if kind == "number":  # its bounds are followed, but one of 1e300 or "5" (refused by name), and multipleOf
        number_range(schema, where)  # bounds that leave no number: said here, with the place
        return Branch(frozenset({"type", *(key for key in INT_BOUNDS if number_bound(schema.get(key)))}))
    return Branch(frozenset({"type", "additionalProperties"} if kind == "object" else {"type"}))


def check_pattern(pattern, where: str) -> None:
    """A string's pattern: a regular expression (Python's re reads the syntax JSON Schema's ECMA-262
    shares with it) that the converter writes as a grammar, or a ToolError naming its place. The
    converter alone took "^(a|b$" as a|b and wrote "^a**$" as a grammar llama.cpp refuses, and its
    own errors say neither which schema nor where."""
    if not isinstance(pattern, str):
        raise ToolError(f"the JSON schema's pattern at {where} must be a text, got {json.dumps(pattern)[:40]}")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ToolError(f"the JSON schema's pattern at {where} is not a regular expression: {exc}") from None
    try:
        BoundedConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)._visit_pattern(pattern, "p")
    except Exception as exc:  # the converter's assertions and ValueErrors, and class_escapes' ToolErrors
        raise ToolError(f"the JSON schema's pattern at {where} cannot be followed: {exc}") from None


def object_branch(schema: dict, where: str) -> Branch:
    properties = schema.get("properties") or {}
    if not isinstance(properties, dict):
        raise ToolError(f"the JSON schema's properties at {where} must be an object of schemas")
    required = schema.get("required") or []
    if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
        raise ToolError(f"the JSON schema's required at {where} must be a list of property names")
    missing = [name for name in required if name not in properties]
    if missing:  # the grammar writes the listed properties only: a required one not listed never comes
        raise ToolError(f"the JSON schema's required at {where} names {', '.join(map(repr, missing))}, which "
                        f"its properties do not define: an answer could not have it")
    parts = [(sub, f"{where}/properties/{name}") for name, sub in properties.items()]
    extra = schema.get("additionalProperties")
    if extra not in (None, False) and properties:  # its rule takes any key, a declared one too
        raise ToolError(f"the JSON schema's additionalProperties at {where} allows more keys beside properties: "
                        f"the grammar would let a declared property come back as one of them, of another "
                        f"type; leave it out (the answer then has the declared properties) or set it false")
    if isinstance(extra, dict):
        parts.append((extra, f"{where}/additionalProperties"))
    return Branch(OBJECT_PART, tuple(parts), " next to properties")


def all_of_parts(parts, root: dict, where: str) -> tuple:
    """allOf's parts: the converter merges the properties of objects (all of them required), nothing else."""
    checked = []
    for i, part in enumerate(parts if isinstance(parts, list) else []):
        place = f"{where}/allOf/{i}"
        resolved = local_target(root, part["$ref"]) if isinstance(part, dict) and "$ref" in part else part
        if (not isinstance(resolved, dict) or not isinstance(resolved.get("properties"), dict)
                or resolved.get("type", "object") != "object" or "anyOf" in resolved or "oneOf" in resolved):
            raise ToolError(f"the JSON schema's allOf at {where} can only merge objects with properties; "
                            f"{place} is not one")
        if resolved.get("additionalProperties") is False and len(parts) > 1:  # the merge adds the others'
            raise ToolError(f"the JSON schema's allOf at {where} merges {place}, whose additionalProperties "
                            f"is false, with other parts' properties: no object could follow both")
        checked.append((part, place))
    return tuple(checked)


def array_branch(schema: dict, where: str) -> Branch:
    # the converter takes items when it is truthy, else prefixItems (a list: a tuple of exactly those)
    key = "items" if schema.get("items") else "prefixItems"
    items = schema.get(key)
    if items is None:  # "items": {} and no prefixItems
        raise ToolError(f"the JSON schema's items at {where} is empty: give the schema of the array's items")
    if isinstance(items, list):  # exactly those items: bounds that take their number say nothing more
        length_bounds(schema, ("minItems", "maxItems"), where)  # (pydantic's tuple[int, str] has 2 and 2)
        bounds = {"minItems"} if schema.get("minItems", 0) <= len(items) else set()
        bounds |= {"maxItems"} if schema.get("maxItems", len(items)) >= len(items) else set()
        return Branch(frozenset({"type", key, "items", *bounds}),
                      tuple((s, f"{where}/{key}/{i}") for i, s in enumerate(items)), f" next to {key} as a list")
    length_bounds(schema, ("minItems", "maxItems"), where)
    return Branch(frozenset({"type", key, "minItems", "maxItems"}), ((items, f"{where}/{key}"),))


def length_bounds(schema: dict, keys: tuple[str, str], where: str) -> None:
    """A string's or an array's bounds, checked where the place is known (`repetition` checks them
    again, without it: llama-cpp-python's converter passes them on as they are)."""
    bounds = [schema.get(key) for key in keys]
    for key, bound in zip(keys, bounds):
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 0):
            raise ToolError(f"the JSON schema's {key} at {where} must be a whole number >= 0, got {json.dumps(bound)}")
    if None not in bounds and bounds[1] < bounds[0]:
        raise ToolError(f"the JSON schema's {keys[0]} {bounds[0]} and {keys[1]} {bounds[1]} at {where} leave no "
                        f"length")


def local_target(root: dict, ref: str):
    """What a `#/...` $ref points at in `root`, or None (the converter says what is wrong with it)."""
    if not ref.startswith("#/"):
        return None
    target = root
    for key in ref[2:].split("/"):
        if not isinstance(target, dict) or key not in target:
            return None
        target = target[key]
    return target



def normalized(schema):
    """`schema` with three shapes the converter mishandles rewritten, at every depth: a list of types
    as an anyOf of one schema per type (each with the keywords that constrain its type), a type beside
    enum or const dropped, and a schema of annotations alone (pydantic's {"title": ...} for Any) as {}."""
    if not isinstance(schema, dict):
        return schema
    schema = {key: nested(key, value) for key, value in schema.items()}
    if not any(key in CONSTRAINTS for key in schema):
        return {key: value for key, value in schema.items() if key in SCHEMA_MAPS}  # any value ($defs kept)
    kind = schema.get("type")
    if ("enum" in schema or "const" in schema) and kind is not None:
        return {key: value for key, value in schema.items() if key != "type"}
    if isinstance(kind, list) and kind and "anyOf" not in schema and "oneOf" not in schema and "$ref" not in schema:
        shared = {key: value for key, value in schema.items() if key != "type" and key not in CONSTRAINTS}
        return {**shared, "anyOf": [length_in_pattern({"type": t, **{
            key: value for key, value in schema.items() if key != "type" and key in CONSTRAINTS and constrains(key, t)}})
            for t in kind]}
    return length_in_pattern(schema)


def nested(key: str, value, visit=None):
    """A keyword's value with the schemas in it passed through `visit` (`normalized`); data kept as it is."""
    visit = visit or normalized
    if key in SCHEMA_LISTS and isinstance(value, list):
        return [visit(item) for item in value]
    if key in ONE_SCHEMA and isinstance(value, dict):
        return visit(value)
    if key in SCHEMA_MAPS and isinstance(value, dict):
        return {name: visit(sub) for name, sub in value.items()}
    return value


def patterns_it_can_follow(schema):
    """A tool's parameters with each pattern the grammar cannot write (a lookahead, \\s) left out, its
    string then any string: a tool's schema is not refused as response_format's is (agents send large
    ones, and check the arguments), and one such pattern refused the whole request."""
    if not isinstance(schema, dict):
        return schema
    schema = {key: nested(key, value, patterns_it_can_follow) for key, value in schema.items()}
    try:
        if "pattern" in schema:
            check_pattern(schema["pattern"], "#")
    except ToolError:
        return {key: value for key, value in schema.items() if key != "pattern"}
    return schema


# ---------------------------------------------------------------- the converter with bounds and calendar dates

BRANCHES_BEFORE_TYPE = frozenset({"$ref", "oneOf", "anyOf", "const", "enum"})
# format "date" (RFC 3339's full-date) as a day its month has: the converter's rule took 02-30 and 04-31.
# 29 February in leap years only: a year whose last two digits are a multiple of 4 other than 00, or a
# century (..00) whose first two are.
CALENDAR_DATE = BuiltinRule(
    '[0-9]{4} "-" (("0" [13578] | "1" [02]) "-" ("0" [1-9] | [12] [0-9] | "3" [01])'
    ' | ("0" [469] | "11") "-" ("0" [1-9] | [12] [0-9] | "30") | "02-" ("0" [1-9] | "1" [0-9] | "2" [0-8]))'
    ' | ([0-9] [0-9] ([02468] [48] | [13579] [26] | [2468] "0") | ([02468] [048] | [13579] [26]) "00") "-02-29"',
    [])


def literal_values(schema) -> list | None:
    """The values a schema is a list of, where the converter's branch for it is an enum, or an anyOf or
    oneOf of nothing but consts and enums; else None."""
    if not isinstance(schema, dict) or not isinstance(schema.get("type"), (str, type(None))):
        return None
    keywords = schema.keys() & BRANCHES_BEFORE_TYPE
    if "$ref" in keywords or "const" in keywords and not keywords & {"anyOf", "oneOf"}:
        return None
    if "anyOf" in keywords or "oneOf" in keywords:
        parts = schema.get("oneOf") or schema.get("anyOf")  # the converter's choice
        if not isinstance(parts, list) or not parts or not all(
                isinstance(part, dict) and part.keys() & CONSTRAINTS in ({"const"}, {"enum"}) for part in parts):
            return None
        return [value for part in parts for value in ([part["const"]] if "const" in part else part["enum"])]
    return schema["enum"] if isinstance(schema.get("enum"), list) and schema["enum"] else None


class BoundedConverter(SchemaConverter):
    """llama-cpp-python's converter, but an integer's bounds are followed (`int_range_rule`), as
    llama.cpp's own converter has done since: pydantic's Field(ge=0) is the common case; and a
    number's (`number_range_rule`: a float's Field(ge=0, le=1) or gt=0.5)."""

    def visit(self, schema, name):
        if (values := literal_values(schema)) is not None:  # as a tree (gbnftrie: one stack per value, else)
            rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
            tree = TrieWriter(self._format_literal, self._add_rule, rule_name)
            return self._add_rule(rule_name, tree.choice([(json.dumps(value), "") for value in values]))
        kind = schema.get("type")
        if kind not in ("integer", "number") or BRANCHES_BEFORE_TYPE & schema.keys():
            return super().visit(schema, name)
        if kind == "integer":
            bounds = integer_range(schema, name or "#")
            rule = bounds and int_range_rule(*bounds)
        else:
            bounds = number_range(schema, name or "#")
            rule = bounds and number_range_rule(*bounds)
        if not rule:
            return super().visit(schema, name)
        rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
        return self._add_rule(rule_name, f"({rule}) space")

    def resolve_refs(self, schema, url):
        return resolve_refs(self, schema, url)  # at the schemas only: a const {"$ref": "x"} is data

    def _add_primitive(self, name, rule):
        return super()._add_primitive(name, CALENDAR_DATE if name == "date" else rule)

    def _format_literal(self, literal):
        # a backslash too (llama.cpp's converter escapes it; this copy did not, and an enum value with a
        # quote, JSON-escaped as \", ended the GBNF literal: "the grammar does not parse")
        return super()._format_literal(literal.replace("\\", "\\\\"))

    def _visit_pattern(self, pattern, name):
        return super()._visit_pattern(class_escapes(anchored(pattern)), name)


# ---------------------------------------------------------------- repetitions: {m,n} that llama.cpp parses
# llama-cpp-python writes x{0,n} as n nested groups, "(x (x (x ...)?)?)?": llama.cpp's grammar parser
# recurses once per group, so a maxLength of 2,000 was refused as a grammar that does not parse and one
# of 20,000 (an agent's write_file tool) overflowed the server's stack. llama.cpp's own converter
# writes x{m,n}, which its parser expands into a chain of rules without recursing; but it takes at most
# REPEAT_LIMIT repetitions (a larger maximum it silently drops, a larger minimum it refuses). Larger
# bounds are written here in blocks of BLOCK items, exactly, whatever their size.
REPEAT_LIMIT = 2000
BLOCK = 1000


def repetition(item: str, least: int, most: int | None, separator_rule: str | None = None,
               item_rule_is_literal: bool = False) -> str:
    """GBNF for `least` to `most` (None: any number) of `item`, `separator_rule` between them
    (llama_grammar._build_repetition's signature; it is replaced by this one)."""
    for bound in (least, most):
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 0):
            raise ToolError(f"a JSON schema's length or item bound must be a whole number >= 0, got {bound!r}")
    if most is not None and most < least:
        raise ToolError(f"a JSON schema's bounds leave no length (at least {least}, at most {most})")
    if separator_rule:  # item (sep item){least-1,most-1}, all of it optional where least is 0
        if most == 0:
            return ""
        rest = repetition(f"({separator_rule} {item})", max(least - 1, 0), None if most is None else most - 1)
        # an empty alternative, not "(...)?": llama.cpp counts a group's inner rules against "?" too
        return f"{item} {rest}" if least else f"({item} {rest} | )"
    if most is None:
        return f"{exactly(item, least)} {item}*".strip()
    return f"{exactly(item, least)} {up_to(item, most - least)}".strip()


def exactly(item: str, n: int) -> str:
    if n <= REPEAT_LIMIT:
        return "" if n == 0 else item if n == 1 else f"{item}{{{n}}}"
    blocks, rest = divmod(n, BLOCK)
    return f"{exactly(f'({item}{{{BLOCK}}})', blocks)} {exactly(item, rest)}".strip()


def up_to(item: str, n: int) -> str:
    """0 to n items, unambiguously enough for a grammar sampler: fewer than `blocks` whole blocks and
    then under a block, or all of them and then at most the rest (two parses at most share a prefix)."""
    if n <= REPEAT_LIMIT:
        return "" if n == 0 else f"{item}?" if n == 1 else f"{item}{{0,{n}}}"
    blocks, rest = divmod(n, BLOCK)
    block = f"({item}{{{BLOCK}}})"
    fewer = f"{up_to(block, blocks - 1)} {up_to(item, BLOCK - 1)}".strip()
    return f"(({fewer}) | ({exactly(block, blocks)} {up_to(item, rest)}".rstrip() + "))"


llama_cpp.llama_grammar._build_repetition = repetition  # the converter's strings, arrays and patterns


def grammar_for(schema: dict) -> str:
    """GBNF for a schema already normalized and checked (llama-cpp-python's json_schema_to_gbnf, bounded)."""
    converter = BoundedConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    converter.visit(converter.resolve_refs(root_ref_inlined(schema), "stdin"), "")
    return converter.format_grammar()


def root_ref_inlined(schema: dict) -> dict:
    """The schema with a $ref at its root replaced by what it points at, its $defs kept: the converter's
    resolve_refs stops at a $ref and never reaches the $defs beside it, so a $ref inside them was left
    unresolved ("cannot be followed: '#/$defs/Node'"): pydantic's schema of a recursive model."""
    target, seen = schema, set()
    while isinstance(ref := target.get("$ref"), str) and ref not in seen:
        seen.add(ref)
        if not isinstance(found := local_target(schema, ref), dict):
            return schema  # the converter says what is wrong with it
        target = found
    if target is schema:
        return schema
    return {**target, **{key: schema[key] for key in ("$defs", "definitions") if key in schema}}

