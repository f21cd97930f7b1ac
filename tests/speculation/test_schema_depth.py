"""The schema depth bound: how deep llguidance's compiler may recurse on a schema, references
followed. The oracle for a chain is its unrolled copy, whose depth is plain JSON nesting."""

from __future__ import annotations

import pytest

from replicas.speculation.schema_depth import MAX_REFERENCE_LOOKUPS, schema_depth, too_deep


def chain(n: int, step=lambda ref: {"type": "array", "items": {"$ref": ref}}, name="a") -> dict:
    """`n` definitions each holding the next: flat JSON, nested n deep once references are followed."""
    defs = {f"{name}{i}": step(f"#/$defs/{name}{i + 1}") for i in range(n)}
    defs[f"{name}{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": f"#/$defs/{name}0"}


def unrolled(n: int) -> dict:
    schema = {"type": "string"}
    for _ in range(n):
        schema = {"type": "array", "items": schema}
    return schema


TREE = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}


@pytest.mark.parametrize("schema, depth", [
    ({"type": "string"}, 1),
    (unrolled(3), 4),  # objects within objects: every one a level
    ({"type": "object", "properties": {"a": {"type": "string"}}}, 3),  # the properties map is one too
    (TREE, 8),  # the root, then once more through "#": a reference entered is not entered again
    ({"const": {"$ref": "#"}, "type": "object"}, 2),  # data is not read for references
    ({"properties": {"$ref": {"type": "string"}}}, 3),  # nor a property's name
    ({"$defs": {"a b": unrolled(2)}, "$ref": "#/$defs/a%20b"}, 8),  # a URI fragment's escapes
    ({"$defs": {"a/b": unrolled(2)}, "$ref": "#/$defs/a~1b"}, 8),  # a pointer's
    ({"$defs": {"a": unrolled(2)}, "$ref": "#/$defs/missing"}, 5),  # what names nothing enters nothing
])
def test_depth_table(schema, depth):
    assert schema_depth(schema) == depth


@pytest.mark.parametrize("n", [1, 10, 300])
def test_a_chain_of_definitions_is_at_least_as_deep_as_its_unrolled_copy(n):
    assert schema_depth(chain(n)) >= schema_depth(unrolled(n))
    assert schema_depth(chain(n)) <= 2 * n + 5  # and not much deeper: the root, its $defs, two levels a link


@pytest.mark.parametrize("schema", [
    chain(300),
    # entered in any order: the compiler may meet the chain's far end first or last
    {**chain(300), "$ref": None, "anyOf": [{"$ref": f"#/$defs/a{i}"} for i in reversed(range(301))]},
    # named by anchors, by other schemas' $id, by a pointer from the $id in scope
    {"$defs": {f"a{i}": {"$anchor": f"n{i}", "items": {"$ref": f"#n{i + 1}"}} for i in range(300)}, "$ref": "#n0"},
    chain(300, lambda ref: {"items": {"$ref": "json-schema:///" + ref}}),  # the root's URI when it has no $id
    chain(300, lambda ref: {"items": {"$ref": "/" + ref}}),
    {"$defs": {f"a{i}": {"$id": f"http://x/s{i}", "items": {"$ref": f"s{i + 1}"}} for i in range(300)}, "$ref": "s0"},
    {"$defs": {f"a{i}": {"$id": f"http://x/s{i}", "$defs": {"n": {"items": {"$ref": f"s{i + 1}#/$defs/n"}}},
                         "$ref": "#/$defs/n"} for i in range(300)}, "$ref": "s0"},
    # a cycle holding a chain: every member counted
    {"$defs": {**chain(300)["$defs"], "a300": {"items": {"$ref": "#/$defs/a0"}}}, "$ref": "#/$defs/a0"},
])
def test_chains_however_named_are_refused(schema):
    assert too_deep(schema) is not None  # too deep, or too many places their references may name


def test_a_bundle_of_schemas_naming_one_another_by_id_is_taken():
    address = {"$id": "https://example.com/address", "type": "object", "properties": {"city": {"type": "string"}}}
    person = {"$id": "https://example.com/person", "type": "object",
              "properties": {"home": {"$ref": "address"}, "friends": {"type": "array", "items": {"$ref": "#"}}}}
    assert too_deep({"$id": "https://example.com/root", "$defs": {"a": address, "p": person},
                     "type": "array", "items": {"$ref": "person"}}) is None


def kinds(n: int) -> dict:
    """A tree of `n` node kinds, each holding children of any kind: one hub they all refer back to."""
    defs = {f"T{i}": {"type": "object", "properties": {"kind": {"const": f"t{i}"},
                                                      "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}}
            for i in range(n)}
    return {"$defs": {**defs, "Node": {"anyOf": [{"$ref": f"#/$defs/T{i}"} for i in range(n)]}}, "$ref": "#/$defs/Node"}


def test_a_tree_of_many_node_kinds_is_as_deep_as_one_of_few():
    """Every kind refers back to the hub, which is being compiled: a descent passes the hub and one
    kind, not all of them (the whole cycle's sum refused an AST-like schema of 60 kinds)."""
    assert schema_depth(kinds(1000)) == schema_depth(kinds(10)) < 40
    assert too_deep(kinds(1000)) is None
    from llguidance import LLMatcher  # and the grammar engine compiles it, whole

    assert not LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(kinds(1000)))


def test_measuring_is_bounded():
    defs = {f"s{i}": {"$id": f"http://x/{i}/s", "type": "string"} for i in range(400)}
    refs = [{"$ref": f"s#/p{i}"} for i in range(400)]  # each may be in any of 400 resources
    with pytest.raises(ValueError, match=str(MAX_REFERENCE_LOOKUPS)):
        schema_depth({"$defs": defs, "anyOf": refs})
