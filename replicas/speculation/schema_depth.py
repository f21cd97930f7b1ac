"""How deep the grammar engine recurses to compile a JSON schema, bounded before it is asked to.

llguidance compiles a schema by recursion on the native stack, a `$ref` entering the schema it
names. Its JSON reader refuses a schema nested more than ~128 levels as written, but a chain of
definitions each holding the next (`"a1": {"items": {"$ref": "#/$defs/a2"}}`, ...) is flat
JSON: about a thousand of them overflowed an 8 MB stack and killed the process (a segfault,
which no `except` catches) from a 40 kB request body. So a schema is measured here first,
without recursion, and refused past MAX_SCHEMA_DEPTH.
"""

from __future__ import annotations

from urllib.parse import unquote

MAX_SCHEMA_DEPTH = 256  # objects and arrays within each other, references entered: ~1 MB of its stack
MAX_REFERENCE_LOOKUPS = 100_000  # what measuring may cost (a few per reference in any real schema)
_REFS = ("$ref", "$dynamicRef", "$recursiveRef")
DATA_KEYWORDS = ("const", "enum", "default", "examples")  # JSON values, not schemas
NAME_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
_START = -1  # the root as compiled first, before any reference may enter it again


def too_deep(schema: object) -> str | None:
    """Why llguidance must not be given `schema` (None: it may)."""
    try:
        depth = schema_depth(schema)
    except ValueError as exc:
        return f"too entangled to measure: {exc}"
    if depth > MAX_SCHEMA_DEPTH:
        return (f"nested too deep: up to {depth} levels of objects and arrays, its references followed "
                f"(at most {MAX_SCHEMA_DEPTH})")
    return None


def schema_depth(schema: object) -> int:
    """An upper bound on how deep the compiler nests on `schema`: objects and arrays within each
    other, a reference entering what it names (every reading the compiler could take: a JSON
    pointer from the root or from any schema with an `$id`, however the URI before it is spelt;
    an anchor of the name).

    A descent enters a target at most once per spelling of its reference (one being compiled is
    referred back to, not entered again), so targets that reach one another (a recursive
    schema) are bounded together by the heights of as many of them as one descent can pass
    (`_cycle_weight`). ValueError past MAX_REFERENCE_LOOKUPS."""
    # Every object and array, parents first, with its role: a schema (its keywords read), a map
    # of names to schemas, a list (of schemas, or of strings), or data (nothing in it read).
    order, role, parent, scope = [schema], {id(schema): "schema"}, {id(schema): None}, {id(schema): schema}
    anchors: dict[str, list] = {}  # name -> the schemas it anchors
    resources = [schema]  # the root (its URI by default "json-schema:///") and the schemas with an `$id`
    refs = []  # (the referring schema's id, its reference, the `$id` in scope there: part of its spelling)
    for node in order:
        kind = role[id(node)]
        if kind == "schema" and isinstance(node, dict):
            for key in ("$id", "id", "$anchor", "$dynamicAnchor"):
                name = node.get(key)
                if not isinstance(name, str):
                    continue
                if key in ("$id", "id") and not name.startswith("#"):
                    resources += [node] if node is not schema else []
                    scope[id(node)] = node
                else:  # an `$id` "#name" anchors too (drafts 6 and 7)
                    anchors.setdefault(name.removeprefix("#"), []).append(node)
            refs += [(id(node), node[key], scope[id(node)]) for key in _REFS if isinstance(node.get(key), str)]
        for key, value in node.items() if isinstance(node, dict) else enumerate(node):
            if not isinstance(value, (dict, list)):
                continue
            if kind == "data" or kind == "schema" and key in DATA_KEYWORDS:
                role[id(value)] = "data"
            elif kind == "schema" and key in NAME_MAPS and isinstance(value, dict):
                role[id(value)] = "names"
            else:
                role[id(value)] = "schema" if isinstance(value, dict) else "list"
            parent[id(value)], scope[id(value)] = id(node), scope[id(node)]
            order.append(value)

    height = dict.fromkeys(parent, 1)  # levels from a node down to its deepest leaf, itself included
    for node in reversed(order):  # children before their parents
        if parent[id(node)] is not None:
            height[parent[id(node)]] = max(height[parent[id(node)]], height[id(node)] + 1)

    spellings: dict[int, set] = {}  # target id -> the references that enter it, as the compiler keys them
    entered = []  # (the referring schema's id, its target's id)
    lookups = 0
    for node_id, ref, base in refs:
        fragment = ref.partition("#")[2]
        pointer = fragment.startswith("/") or not fragment
        # the $id in scope, which one a URI names (relative ones resolve against others, and the
        # compiler may drop an $id beside a $ref): any; a fragment names an anchor or points from it
        bases = resources if pointer else [n for name in {fragment, unquote(fragment)} for n in anchors.get(name, [])]
        for start in bases:
            lookups += 1 + fragment.count("/")
            if lookups > MAX_REFERENCE_LOOKUPS:
                raise ValueError(f"its references name more than {MAX_REFERENCE_LOOKUPS} places to measure")
            target = _pointer(start, fragment) if pointer else start
            if id(target) in parent:
                spellings.setdefault(id(target), set()).add((ref, id(base)))
                entered.append((node_id, id(target)))

    # The descent's graph: the root compiled first, then each target, owning the nodes below it
    # up to the next target; an edge where one reaches another (holds it, or refers to it).
    owner, edges = {}, {_START: set(), **{t: set() for t in spellings}}
    for node in order:
        i = id(node)
        owner[i] = i if i in spellings else _START if parent[i] is None else owner[parent[i]]
        if i in spellings:
            edges[_START if parent[i] is None else owner[parent[i]]].add(i)
    for node_id, target in entered:
        edges[owner[node_id]].add(target)
    entries = {t: len(s) for t, s in spellings.items()}
    weight = {t: height[t] * n for t, n in entries.items()}
    entries[_START], weight[_START] = 1, height[id(schema)]
    return _heaviest_path(edges, weight, entries)


def _pointer(node: object, pointer: str) -> object:
    """What a JSON pointer ("/$defs/a", percent-encoded as in a URI fragment) names in `node`, or None."""
    for part in pointer.split("/")[1:]:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _heaviest_path(edges: dict[int, set], weight: dict[int, int], entries: dict[int, int]) -> int:
    """The heaviest path from _START, a cycle's vertices counted as `_cycle_weight` bounds them
    (Tarjan's strongly connected components, which come out after every component they reach)."""
    index, low, stack, on_stack, component, best = {}, {}, [], set(), {}, {}
    work = [(_START, iter(edges[_START]))]
    index[_START] = low[_START] = 0
    stack.append(_START)
    on_stack.add(_START)
    while work:
        v, successors = work[-1]
        for w in successors:
            if w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on_stack.add(w)
                work.append((w, iter(edges[w])))
                break
            if w in on_stack:
                low[v] = min(low[v], index[w])
        else:
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                members = set()
                while v not in members:
                    members.add(stack.pop())
                on_stack -= members
                after = max((best[component[w]] for m in members for w in edges[m] if w not in members), default=0)
                best[v] = _cycle_weight(members, edges, weight, entries) + after
                component.update(dict.fromkeys(members, v))
    return best[_START]


def _cycle_weight(members: set, edges: dict[int, set], weight: dict[int, int], entries: dict[int, int]) -> int:
    """The most one descent can weigh through a strongly connected component: its heaviest
    members, as many as a descent can pass through. Two members a descent passes in turn are
    joined by an edge, so one of them is in any vertex cover C (here the ends of a maximal
    matching, and every member with an edge to itself): a descent enters C's members at most
    `entries` times each, and the others between and around those, so it passes through at
    most 2 x (C's entries) + 1 members. A hub the others refer back to (a tree of node kinds)
    weighs a few members, not all of them; a chain closed into a cycle weighs them all."""
    cover = {m for m in members if m in edges[m]}
    for m in members:
        if m not in cover:
            partner = next((w for w in edges[m] if w in members and w not in cover), None)
            if partner is not None:
                cover |= {m, partner}
    most = 2 * sum(entries[m] for m in cover) + 1
    return sum(sorted((weight[m] for m in members), reverse=True)[:most])
