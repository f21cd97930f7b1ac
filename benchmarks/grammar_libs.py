"""Grammar libraries for constrained decoding on our CPU engine: llguidance against xgrammar.

Both libraries get the same tokenizer (the embedded SmolLM2, 49,152 tokens) and the same six
JSON schemas (flat, nested with arrays, enums and integer ranges, a tool call, an anyOf, any
JSON object), with JSON written as models write it (", " and ": ", no free whitespace):

- install weight: the wheels each adds beyond torch, transformers, numpy and pydantic
  (sizes from the wheel cache the Makefile fills), and its declared Requires-Dist;
- tokenizer-info build time and per-schema compile time (single-threaded, median of 3);
- CPU time per full next-token bitmask, walking a valid document token by token (mask,
  then consume): the first mask of a fresh matcher, then median and p99 over warm walks;
- checks: where the two libraries' masks differ, and which admits more; whether rolling back
  N tokens and replaying them reproduces the masks; the forced text opening the tool call.

xgrammar stays out of the project's dependencies, so this runs in the bench venv. Writes
benchmarks/results/grammar_libs.json and prints a markdown table:

    make bench-grammar
    PYTHONPATH=. .venv-bench/bin/python benchmarks/grammar_libs.py [--tokenizer DIR] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # llguidance's batch helpers; we time one matcher

import numpy as np
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.machine import cpu_description  # noqa: E402

CACHE_DIR = Path(os.environ.get("SPECSERVE_CACHE_DIR", Path.home() / ".cache" / "specserve"))
VOCAB_SIZE, EOS_ID = 49152, 2
MASK_SHAPE = (1, (VOCAB_SIZE + 31) // 32)  # one bit per token in int32 words, in both libraries
SEPARATORS = (", ", ": ")
BASELINE = ("torch", "transformers", "numpy", "pydantic")  # what the engine already ships
ROLLBACK_TOKENS = 8


def obj(properties: dict) -> dict:
    """A closed object, every property required: both libraries then admit the same JSON
    (xgrammar's strict_mode default closes objects, llguidance's default leaves them open)."""
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


STR, INT, NUM = {"type": "string"}, {"type": "integer"}, {"type": "number"}
SCHEMAS = {  # name -> (schema, a valid instance); increasing complexity
    "flat": (obj({"id": INT, "name": STR, "active": {"type": "boolean"}, "score": NUM}),
             {"id": 42, "name": "Ada Lovelace", "active": True, "score": 9.5}),
    "nested_arrays": (obj({"order_id": STR, "customer": obj({"name": STR, "email": STR}),
                           "items": {"type": "array", "items": obj({"sku": STR, "qty": INT, "price": NUM})},
                           "tags": {"type": "array", "items": STR}}),
                      {"order_id": "A-1001", "customer": {"name": "Grace", "email": "grace@example.com"},
                       "items": [{"sku": "KB-01", "qty": 2, "price": 49.99}, {"sku": "MS-7", "qty": 1, "price": 19.5}],
                       "tags": ["gift", "express"]}),
    "enum_ranges": (obj({"status": {"enum": ["active", "suspended", "closed"]},
                         "age": {"type": "integer", "minimum": 0, "maximum": 130},
                         "priority": {"type": "integer", "minimum": 1, "maximum": 5},
                         "retries": {"type": "integer", "minimum": 0}}),
                    {"status": "suspended", "age": 37, "priority": 3, "retries": 12}),
    "tool_call": (obj({"name": {"const": "get_weather"},
                       "arguments": obj({"city": STR, "unit": {"enum": ["celsius", "fahrenheit"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 14}})}),
                  {"name": "get_weather", "arguments": {"city": "San Francisco", "unit": "celsius", "days": 3}}),
    "any_of": ({"anyOf": [obj({"kind": {"const": "circle"}, "radius": NUM}),
                          obj({"kind": {"const": "rectangle"}, "width": NUM, "height": NUM})]},
               {"kind": "rectangle", "width": 3.5, "height": 2}),
    "json_object": ({"type": "object"},
                    {"query": "weather in Paris", "filters": {"days": [1, 2, 3], "metric": True}, "limit": None}),
}


class LLGuidance:
    name, rollback_api, forced_api = "llguidance", "LLMatcher.rollback(n)", "LLMatcher.compute_ff_tokens()"

    def __init__(self, tokenizer):
        import llguidance.hf
        import llguidance.numpy
        self.info = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB_SIZE, eos_token=EOS_ID)
        self.fill = llguidance.numpy.fill_next_token_bitmask  # (matcher, mask)
        self.accept = llguidance.LLMatcher.consume_token  # (matcher, token) -> ok

    def matcher(self, schema: dict):
        from llguidance import LLMatcher
        layout = {"whitespace_flexible": False, "item_separator": SEPARATORS[0], "key_separator": SEPARATORS[1]}
        matcher = LLMatcher(self.info, LLMatcher.grammar_from_json_schema(schema, defaults=layout))
        if matcher.is_error():
            raise ValueError(f"llguidance rejected the schema: {matcher.get_error()}")
        return matcher

    def forced(self, matcher, tokenizer) -> dict:
        tokens = matcher.compute_ff_tokens()
        return {"tokens": len(tokens), "text": tokenizer.decode(tokens)}


class XGrammar:
    name, rollback_api, forced_api = ("xgrammar", "GrammarMatcher.rollback(n), always unlimited",
                                      "GrammarMatcher.find_jump_forward_string()")

    def __init__(self, tokenizer):
        import xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB_SIZE, stop_token_ids=EOS_ID)
        # Cache off, so each compile is timed from scratch; one thread, like llguidance.
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.new_matcher = xgrammar.GrammarMatcher  # max_rollback_tokens is deprecated: unlimited
        # Takes any int32 array as well as its own torch bitmask, equally fast.
        self.fill = xgrammar.GrammarMatcher.fill_next_token_bitmask
        self.accept = xgrammar.GrammarMatcher.accept_token

    def matcher(self, schema: dict):
        return self.new_matcher(self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=SEPARATORS))

    def forced(self, matcher, tokenizer) -> dict:
        text = matcher.find_jump_forward_string()
        return {"characters": len(text), "text": text}


def walk(lib, matcher, token_ids: list[int], keep_masks: bool = False):
    """Mask, then consume, each token; per-position mask and consume ns (and the masks)."""
    mask = np.zeros(MASK_SHAPE, dtype=np.int32)
    mask_ns, consume_ns, masks = [], [], []
    for position, token in enumerate(token_ids):
        started = time.perf_counter_ns()
        lib.fill(matcher, mask)
        mask_ns.append(time.perf_counter_ns() - started)
        words = mask.reshape(-1)
        if not (words[token // 32] >> (token % 32)) & 1:
            raise RuntimeError(f"{lib.name}: token {token} at position {position} is masked out")
        if keep_masks:
            masks.append(words.copy())
        started = time.perf_counter_ns()
        if not lib.accept(matcher, token):
            raise RuntimeError(f"{lib.name}: token {token} at position {position} rejected")
        consume_ns.append(time.perf_counter_ns() - started)
    return mask_ns, consume_ns, masks


def rollback_reproduces(lib, matcher, token_ids: list[int], masks: list[np.ndarray]) -> bool:
    """Consume all but EOS, roll back the last few, replay them: the same masks again?"""
    matcher.reset()
    start = len(token_ids) - 1 - ROLLBACK_TOKENS
    for token in token_ids[:-1]:
        lib.accept(matcher, token)
    matcher.rollback(ROLLBACK_TOKENS)
    replayed = walk(lib, matcher, token_ids[start:], keep_masks=True)[2]
    return all(np.array_equal(a, b) for a, b in zip(replayed, masks[start:], strict=True))


def mask_agreement(masks: dict[str, list[np.ndarray]], special_ids: list[int]) -> dict:
    """Positions where the masks are equal, and where each library admits tokens the other does not
    (a special token such as <|im_start|> counted apart: inside a JSON string it is not text)."""
    (a, masks_a), (b, masks_b) = masks.items()
    out = dict.fromkeys(["equal", f"{a}_admits_more", f"{b}_admits_more", f"{a}_admits_special",
                         f"{b}_admits_special"], 0) | {"positions": len(masks_a)}
    for pair in zip(masks_a, masks_b):
        bits_a, bits_b = (np.unpackbits(w.view(np.uint8), bitorder="little").astype(bool) for w in pair)
        out["equal"] += bool((bits_a == bits_b).all())
        for name, more in ((a, bits_a & ~bits_b), (b, bits_b & ~bits_a)):
            out[f"{name}_admits_more"] += bool(more.any())
            out[f"{name}_admits_special"] += bool(more[special_ids].any())
    return out


def median_s(fn, repeats: int = 3) -> tuple[float, object]:
    """Median seconds of `fn()` over `repeats` calls, and its last result."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def bench_schema(lib, schema: dict, token_ids: list[int], repeats: int) -> dict:
    """Compile, one cold walk (its masks kept for the checks), then `repeats` warm walks."""
    compile_s, matcher = median_s(lambda: lib.matcher(schema))
    first_ns, _, masks = walk(lib, matcher, token_ids, keep_masks=True)  # cold: lazy work lands here
    mask_ns, consume_ns = [], []
    for _ in range(repeats):
        matcher.reset()  # keeps what the first walk built lazily
        for into, sample in zip((mask_ns, consume_ns), walk(lib, matcher, token_ids)):
            into += sample
    return {"compile_ms": compile_s * 1e3, "first_mask_us": first_ns[0] / 1e3,
            "mask_us_median": float(np.median(mask_ns)) / 1e3,
            "mask_us_p99": float(np.percentile(mask_ns, 99)) / 1e3,
            "consume_us_median": float(np.median(consume_ns)) / 1e3,
            "rollback_ok": rollback_reproduces(lib, matcher, token_ids, masks), "_masks": masks}


def installed_closure(names) -> tuple[set[str], set[str]]:
    """Installed distributions reachable from `names`, and declared ones that are not installed."""
    seen, missing, todo = set(), set(), list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen or name in missing:
            continue
        try:
            requires = map(Requirement, metadata.requires(name) or [])
        except metadata.PackageNotFoundError:
            missing.add(name)
            continue
        seen.add(name)
        todo += [r.name for r in requires if r.marker is None or r.marker.evaluate({"extra": ""})]
    return seen, missing


def install_weight(dist: str, wheels_dir: Path) -> dict:
    """What `dist` adds to an environment that already has BASELINE, by wheel and on disk."""
    added, not_installed = installed_closure([dist])
    added -= installed_closure(BASELINE)[0]
    rows = []
    for name in sorted(added):
        found = metadata.distribution(name)
        wheels = sorted(wheels_dir.glob(f"{name.replace('-', '_')}-{found.version}-*.whl"))
        on_disk = sum(found.locate_file(f).stat().st_size for f in found.files or [] if found.locate_file(f).is_file())
        rows.append({"name": name, "version": found.version, "installed_bytes": on_disk,
                     "wheel_bytes": wheels[0].stat().st_size if wheels else None})
    return {"requires_dist": [r for r in metadata.requires(dist) or [] if "extra ==" not in r],
            "declared_but_not_installed": sorted(not_installed), "adds": rows,
            "wheel_mb_total": sum(r["wheel_bytes"] or 0 for r in rows) / 1e6,
            "installed_mb_total": sum(r["installed_bytes"] for r in rows) / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", type=Path, default=CACHE_DIR / "models" / "smollm2-135m-instruct")
    parser.add_argument("--wheels", type=Path, default=CACHE_DIR / "wheels")
    parser.add_argument("--repeats", type=int, default=20, help="warm walks per schema")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "grammar_libs.json")
    args = parser.parse_args()
    if not (args.tokenizer / "tokenizer.json").is_file():
        sys.exit(f"no tokenizer.json in {args.tokenizer}: run `make bench-grammar`, or pass --tokenizer DIR")
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)

    result = {"machine": cpu_description(), "load_average_1m_at_start": os.getloadavg()[0],
              "settings": {"repeats": args.repeats, "separators": SEPARATORS, "vocab_size": VOCAB_SIZE,
                           "rollback_tokens": ROLLBACK_TOKENS, "threads": 1},
              "libraries": {}, "schemas": {}}
    libs = []
    for cls, dist in ((LLGuidance, "llguidance"), (XGrammar, "xgrammar")):
        build_s, lib = median_s(lambda: cls(tokenizer))
        libs.append(lib)
        # One-time lazy set-up (token tries, caches) lands on the first mask ever; kept apart.
        warmup_s, _ = median_s(lambda: lib.fill(lib.matcher(STR), np.zeros(MASK_SHAPE, np.int32)), repeats=1)
        result["libraries"][lib.name] = {"version": metadata.version(dist), "tokenizer_info_ms": build_s * 1e3,
                                         "first_ever_mask_ms": warmup_s * 1e3,
                                         "rollback_api": lib.rollback_api, "forced_api": lib.forced_api,
                                         "install": install_weight(dist, args.wheels)}
    for name, (schema, instance) in SCHEMAS.items():
        text = json.dumps(instance, separators=SEPARATORS)
        token_ids = tokenizer.encode(text, add_special_tokens=False) + [EOS_ID]
        row = {"document": text, "tokens": len(token_ids)}
        for lib in libs:
            row[lib.name] = bench_schema(lib, schema, token_ids, args.repeats)
        row["masks"] = mask_agreement({lib.name: row[lib.name].pop("_masks") for lib in libs},
                                      sorted(tokenizer.added_tokens_decoder))
        result["schemas"][name] = row
    for lib in libs:
        result["libraries"][lib.name]["forced_at_tool_call_start"] = lib.forced(
            lib.matcher(SCHEMAS["tool_call"][0]), tokenizer)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"wrote {args.out}")


def print_table(result: dict) -> None:
    names = list(result["libraries"])
    print(f"{result['machine']['model']}, load {result['load_average_1m_at_start']:.1f}, 1 thread\n")
    print("| schema | tokens | library | compile ms | first mask µs | mask µs p50 | mask µs p99 "
          "| consume µs p50 | rollback ok | masks equal | admits more |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for schema, row in result["schemas"].items():
        for name in names:
            r = row[name]
            print(f"| {schema} | {row['tokens']} | {name} | {r['compile_ms']:.1f} | {r['first_mask_us']:.0f} "
                  f"| {r['mask_us_median']:.1f} | {r['mask_us_p99']:.1f} | {r['consume_us_median']:.1f} "
                  f"| {r['rollback_ok']} | {row['masks']['equal']}/{row['masks']['positions']} "
                  f"| {row['masks'][name + '_admits_more']} ({row['masks'][name + '_admits_special']} special) |")
    print()
    for name, lib in result["libraries"].items():
        weight = lib["install"]
        print(f"- {name} {lib['version']}: tokenizer info {lib['tokenizer_info_ms']:.0f} ms, first mask ever "
              f"{lib['first_ever_mask_ms']:.1f} ms; adds {[r['name'] for r in weight['adds']]}: "
              f"{weight['wheel_mb_total']:.1f} MB of wheels, {weight['installed_mb_total']:.1f} MB installed "
              f"(declared, not installed: {weight['declared_but_not_installed']}); forced at the tool call's "
              f"start: {lib['forced_at_tool_call_start']}")


if __name__ == "__main__":
    main()
