"""llama.cpp peer for the engine benchmark: plain decoding and its two model-free drafters.

Runs llama.cpp's server in process through the `xllamacpp` wheel (prebuilt, no compiler) on
the same GGUF our engine serves, and reports per request and as medians: decode tokens/s,
end-to-end tokens/s, TTFT and, for `ngram_mod` / `ngram_map_k`, the draft acceptance
llama.cpp itself counts. Lives in the bench venv only; xllamacpp is imported on first use,
so importing this module needs nothing and does nothing.

    .venv-bench/bin/python benchmarks/llamacpp_peer.py --gguf M.gguf --prompts-json P.json \
        [--max-tokens 64] [--threads 2] [--batch 1] [--modes plain,ngram_mod,ngram_map_k] [--slot-ctx 0]

    .venv-bench/bin/python benchmarks/llamacpp_peer.py --gguf M.gguf --conversations-json C.json \
        [--max-tokens 32] [--threads 2]

    .venv-bench/bin/python benchmarks/llamacpp_peer.py --gguf M.gguf --step-costs-json S.json [--threads 2]

P.json maps a workload name to raw, already chat-templated prompts: {"chat": ["<|im_start|>..."]},
or, for constrained output, to {"prompts": [...], "json_schema": {...}} or {"prompts": [...],
"grammar": "..."} (llama.cpp's own request fields; this build takes `%llguidance` grammars):
those requests stop at EOS, since a schema output ends when complete.
C.json is a list of conversations, each a list of raw turn prompts (each turn's prompt
holding the earlier turns): they run at once, one slot each, turns in order, with llama.cpp's
prompt cache on (`cache_prompt`), and each turn reports how many prompt tokens the slot's
cache supplied (`timings.cache_n`).
S.json is {"context": [token ids], "rows": [1, 2, 8, ...], "repeats": 9}: the time llama.cpp takes
for one forward step of each row count on top of that cached context (its prompt path: a batch
of new tokens after `cache_prompt` supplied the context, timed by its own `timings.prompt_ms`;
unlike a verify it computes logits for the batch's last row only).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MODES = ("plain", "ngram_mod", "ngram_map_k")
BENCH_PYTHON = Path(__file__).resolve().parents[1] / ".venv-bench" / "bin" / "python"  # where xllamacpp lives
_SPEC_TYPE = {"ngram_mod": "COMMON_SPECULATIVE_TYPE_NGRAM_MOD", "ngram_map_k": "COMMON_SPECULATIVE_TYPE_NGRAM_MAP_K"}
_WARMUP_PROMPT = "<|im_start|>user\nHi.<|im_end|>\n<|im_start|>assistant\n"
# In this build predicted_per_second is (predicted_n - 1) / predicted_ms, timed from the first
# sampled token: exactly "tokens after the first / first token to last" (streams agree).
DECODE_RATE_SOURCE = ("decode_tok_s = llama.cpp timings.predicted_per_second = (predicted_n - 1) / predicted_ms; "
                      "decode_tok_s_stream = the same ratio from streamed chunk times (a cross-check); "
                      "ttft_s and e2e_tok_s from our clock around the in-process call")


def _xllamacpp():
    """Import xllamacpp with libgomp's default wait policy; returns (module, policy note).

    The Makefile exports OMP_WAIT_POLICY=PASSIVE for torch's sake; llama.cpp's OpenMP barriers
    then sleep between ops and decode halves (measured 115 -> 50-65 tok/s). libgomp reads the
    variable once, when xllamacpp loads it, so it is hidden for the import alone. torch bundles
    its own libgomp, which keeps whatever it read.
    """
    if "xllamacpp" in sys.modules:
        return sys.modules["xllamacpp"], "unknown: xllamacpp was imported before this module"
    with open("/proc/self/maps") as maps:
        gomp_loaded = any(line.rstrip().endswith("/libgomp.so.1") for line in maps)
    saved = os.environ.pop("OMP_WAIT_POLICY", None)
    try:
        import xllamacpp
    finally:
        if saved is not None:
            os.environ["OMP_WAIT_POLICY"] = saved
    note = f"inherited {saved}: libgomp was already loaded" if gomp_loaded and saved else "libgomp default"
    return xllamacpp, note


def llamacpp_version() -> str:
    """The xllamacpp wheel's version and revision (it reports llama.cpp's own build as unknown)."""
    xllamacpp, _ = _xllamacpp()
    from xllamacpp import _version

    build = xllamacpp.BUILD_INFO
    return (f"xllamacpp {xllamacpp.__version__} ({_version.get_versions()['full-revisionid'][:12]}), "
            f"llama.cpp build {build['build_number']}/{build['commit']}")


def _start_server(gguf_path: str, mode: str, threads: int, n_parallel: int, slot_ctx: int):
    xllamacpp, _ = _xllamacpp()
    params = xllamacpp.CommonParams()
    params.model.path = gguf_path
    params.n_parallel = n_parallel
    params.n_ctx = slot_ctx * n_parallel  # split evenly between the slots (kv_unified is off)
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = threads
    params.verbosity = -1  # the default level logs every request to stderr
    if mode != "plain":
        params.speculative.types = [getattr(xllamacpp.common_speculative_type, _SPEC_TYPE[mode])]
    return xllamacpp.Server(params), _spec_settings(params.speculative, mode)


def _spec_settings(spec, mode: str) -> dict:
    """llama.cpp's defaults for the drafter, recorded because they decide acceptance."""
    if mode == "ngram_mod":
        return {k: getattr(spec.ngram_mod, k) for k in ("n_match", "n_min", "n_max")}
    if mode == "ngram_map_k":
        return {k: getattr(spec.ngram_map_k, k) for k in ("size_n", "size_m", "min_hits")}
    return {}


def _workload(entry) -> tuple[list[str], dict]:
    """A workload's prompts and its constraint fields: a plain list, or {"prompts", "json_schema" | "grammar"}."""
    if isinstance(entry, list):
        return entry, {}
    return entry["prompts"], {k: entry[k] for k in ("json_schema", "grammar") if k in entry}


def _complete(server, prompt: str, max_tokens: int, constraint: dict | None = None,
              cache_prompt: bool = False) -> dict:
    """One streamed greedy completion; figures from llama.cpp's timings plus our own clock.
    `constraint` ({"json_schema": ...} or {"grammar": ...}) constrains it, and then EOS ends it.
    `cache_prompt` off by default: the same prompts recur across modes and batches, so each
    prefills cold unless the run is about the prompt cache."""
    request = {
        "prompt": prompt,  # the server tokenises prompt text with special tokens parsed
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,  # exactly max_tokens, so every mode decodes the same length
        "cache_prompt": cache_prompt,
        "stream": True,
        **(constraint or {}),
    }
    if constraint:
        request["ignore_eos"] = False  # a schema output is over when the grammar is complete
    chunk_times: list[float] = []
    chunks: list[dict] = []

    def on_chunk(chunk: dict) -> bool:
        chunk_times.append(time.perf_counter())
        chunks.append(chunk)
        return False  # True would tell the server to stop streaming

    start = time.perf_counter()
    server.handle_completions(request, on_chunk)  # blocks, with the GIL released
    final = chunks[-1] if chunks else {}
    if "timings" not in final:  # errors arrive through the same callback, without timings
        raise RuntimeError(f"llama.cpp returned no timings: {json.dumps(final)[:500]}")
    timings, usage = final["timings"], final["usage"]
    # One chunk per token, then a last one with only finish_reason, usage and timings.
    token_times = [t for t, c in zip(chunk_times, chunks) if c.get("choices") and c["choices"][0]["text"]]
    span_s = token_times[-1] - token_times[0] if token_times else 0.0
    wall_s = chunk_times[-1] - start
    new_tokens = usage["completion_tokens"]
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "new_tokens": new_tokens,
        "finish_reason": final["choices"][0]["finish_reason"] if final.get("choices") else None,
        "ttft_s": (token_times or chunk_times)[0] - start,
        "first_token_at": token_times[0] if token_times else None,  # perf_counter, for wave spans
        "last_token_at": token_times[-1] if token_times else None,
        "wall_s": wall_s,
        "prompt_ms": timings["prompt_ms"],
        "cache_n": timings.get("cache_n", 0),  # prompt tokens the slot's cache supplied
        "predicted_ms": timings["predicted_ms"],
        "decode_tok_s": timings["predicted_per_second"],
        "decode_tok_s_stream": (len(token_times) - 1) / span_s if span_s > 0 else None,
        "e2e_tok_s": new_tokens / wall_s,
        "draft_n": timings.get("draft_n", 0),  # absent when nothing was drafted
        "draft_n_accepted": timings.get("draft_n_accepted", 0),
        "text": "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")),
    }


def _median(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _run_workload(server, prompts: list[str], max_tokens: int, batch: int, constraint: dict | None = None) -> dict:
    """Run the prompts `batch` at a time; fewer prompts than `batch` are repeated to fill it."""
    indices = [i % len(prompts) for i in range(max(batch, len(prompts)))]
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=batch) as pool:
        rows = list(pool.map(lambda i: _complete(server, prompts[i], max_tokens, constraint), indices))
    wall_s = time.perf_counter() - start
    for i, row in zip(indices, rows):
        row["prompt_index"] = i
    # As ours counts it: decode tokens (after each first) over the time from a wave's first
    # token to its last, waves being the `batch` requests that run together.
    waves = [rows[i:i + batch] for i in range(0, len(rows), batch)]
    decode_span_s = sum(max(r["last_token_at"] for r in w) - min(r["first_token_at"] for r in w) for w in waves)
    drafted = sum(r["draft_n"] for r in rows)
    accepted = sum(r["draft_n_accepted"] for r in rows)
    return {
        "median": {key: _median([r[key] for r in rows]) for key in
                   ("decode_tok_s", "decode_tok_s_stream", "e2e_tok_s", "ttft_s", "prompt_ms")},
        "draft_n": drafted,
        "draft_n_accepted": accepted,
        "acceptance": accepted / drafted if drafted else None,
        "wall_s": wall_s,
        "throughput_tok_s": sum(r["new_tokens"] for r in rows) / wall_s,  # all requests together
        "decode_throughput_tok_s": sum(r["new_tokens"] - 1 for r in rows) / decode_span_s,
        "requests": rows,
    }


def run_llamacpp(gguf_path: str, prompts: dict[str, list[str] | dict], max_tokens: int, threads: int = 2,
                 batch: int = 1, modes=MODES, slot_ctx: int = 0) -> dict:
    """Benchmark llama.cpp's server on `prompts` (workload -> raw prompts) in each mode.

    Greedy, `max_tokens` new tokens per request (EOS ignored; a constrained workload, see the
    module docstring, stops at EOS). `batch` requests run at once
    against one server with `batch` slots; batch 1 runs them one after another. Each
    (mode, workload) gets a fresh server, so ngram_mod's hash pool, which outlives a request,
    learns nothing from another workload or batch size. `slot_ctx` (tokens per slot; 0: just
    enough for the longest prompt) sizes each slot's KV cache. Returns
    {"llamacpp_version", "system_info", "omp_wait_policy", "threads", "batch", "max_tokens",
     "slot_ctx", "decode_rate_source", "peak_rss_mb" (this process's), "modes": {mode:
     {"spec_settings": {...}, "workloads": {name: {"median": {...}, "draft_n", "draft_n_accepted",
     "acceptance", "wall_s", "throughput_tok_s", "decode_throughput_tok_s", "requests": [{...}, ...]}}}}}.
    """
    xllamacpp, omp_note = _xllamacpp()
    if not slot_ctx:
        longest = max(len(p) for entry in prompts.values() for p in _workload(entry)[0])
        # A token covers at least one character of prompt text, so this always fits; 256-aligned.
        slot_ctx = -(-(longest + max_tokens + 16) // 256) * 256
    result = {
        "llamacpp_version": llamacpp_version(),
        "system_info": xllamacpp.get_system_info().strip(),
        "omp_wait_policy": omp_note,
        "threads": threads, "batch": batch, "max_tokens": max_tokens, "slot_ctx": slot_ctx,
        "decode_rate_source": DECODE_RATE_SOURCE,
        "modes": {},
    }
    for mode in modes:
        entry = {"workloads": {}}
        for name, workload in prompts.items():
            group, constraint = _workload(workload)
            server, entry["spec_settings"] = _start_server(gguf_path, mode, threads, batch, slot_ctx)
            _complete(server, _WARMUP_PROMPT, 8)  # first-request allocations stay out of the figures
            entry["workloads"][name] = _run_workload(server, group, max_tokens, batch, constraint)
            if constraint:
                entry["workloads"][name]["constraint"] = sorted(constraint)
            del server  # joins llama.cpp's loop and frees the model before the next one loads
        result["modes"][mode] = entry
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def run_conversations(gguf_path: str, conversations: list[list[str]], max_tokens: int, threads: int = 2) -> dict:
    """Every conversation at once, one server slot each, its turns in order, prompt cache on.
    Returns {"llamacpp_version", "threads", "max_tokens", "wall_s", "conversations":
    [[{turn row: ttft_s, prompt_tokens, cache_n, ...}, ...], ...]}."""
    longest = max(len(p) for turns in conversations for p in turns)
    slot_ctx = -(-(longest + max_tokens + 16) // 256) * 256
    server, _ = _start_server(gguf_path, "plain", threads, len(conversations), slot_ctx)
    _complete(server, _WARMUP_PROMPT, 8)

    def converse(turns: list[str]) -> list[dict]:
        rows = [_complete(server, prompt, max_tokens, cache_prompt=True) for prompt in turns]
        for row in rows:
            del row["text"]
        return rows

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(conversations)) as pool:
        rows = list(pool.map(converse, conversations))
    result = {"llamacpp_version": llamacpp_version(), "threads": threads, "max_tokens": max_tokens,
              "wall_s": time.perf_counter() - start, "conversations": rows}
    return result


def run_step_costs(gguf_path: str, context: list[int], rows: list[int], repeats: int, threads: int = 2) -> dict:
    """Median ms of a step of each row count on the cached `context`, rounds interleaved.
    Returns {"llamacpp_version", "threads", "step_ms": {rows: ms}}."""
    server, _ = _start_server(gguf_path, "plain", threads, 1, -(-(len(context) + max(rows) + 16) // 256) * 256)
    rng = random.Random(0)

    def step(new_tokens: int) -> float:
        chunks: list[dict] = []
        extra = [rng.randrange(100, 40000) for _ in range(new_tokens)]
        request = {"prompt": context + extra, "max_tokens": 1, "temperature": 0.0, "cache_prompt": True}
        server.handle_completions(request, lambda chunk: chunks.append(chunk) or False)
        timings = chunks[-1].get("timings") if chunks else None
        if not timings or timings["prompt_n"] != new_tokens:
            raise RuntimeError(f"llama.cpp did not reuse the cached context: {json.dumps(chunks[-1:])[:500]}")
        return timings["prompt_ms"]

    server.handle_completions({"prompt": context, "max_tokens": 1, "cache_prompt": True}, lambda chunk: False)
    samples: dict[int, list[float]] = {n: [] for n in rows}
    for _ in range(repeats):
        for n in rows:
            samples[n].append(step(n))
    return {"llamacpp_version": llamacpp_version(), "threads": threads,
            "step_ms": {n: round(statistics.median(v), 2) for n, v in samples.items()}}


def peer_available(make_target: str) -> bool:
    """Is the bench venv here? If not, say the llama.cpp peer is skipped and what installs it."""
    if BENCH_PYTHON.exists():
        return True
    print(f"llama.cpp skipped: {BENCH_PYTHON} missing (`make {make_target}` installs it)", flush=True)
    return False


def run_peer(gguf_path: str, input_flag: str, payload: Any, *args: str) -> dict:
    """Run this module in the bench venv (from the project's venv, where xllamacpp is not):
    `payload` goes in as a JSON file named by `input_flag` (--prompts-json, --conversations-json
    or --step-costs-json), `args` are further flags; returns its JSON output."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(payload, f)
        f.flush()
        proc = subprocess.run([str(BENCH_PYTHON), __file__, "--gguf", gguf_path, input_flag, f.name, *args],
                              capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"llama.cpp peer failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", required=True)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompts-json",
                       help='{"workload": ["raw prompt", ...] or {"prompts": [...], "json_schema": {...}}}')
    group.add_argument("--conversations-json", help='[["turn 1 prompt", "turn 2 prompt", ...], ...]')
    group.add_argument("--step-costs-json", help='{"context": [ids], "rows": [1, 8, ...], "repeats": 9}')
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--slot-ctx", type=int, default=0, help="KV tokens per slot (0: fit the longest prompt)")
    parser.add_argument("--with-text", action="store_true", help="keep each request's generated text")
    args = parser.parse_args()
    if args.step_costs_json:
        with open(args.step_costs_json, encoding="utf-8") as f:
            spec = json.load(f)
        print(json.dumps(run_step_costs(args.gguf, spec["context"], spec["rows"], spec["repeats"], args.threads)))
        return
    if args.conversations_json:
        with open(args.conversations_json, encoding="utf-8") as f:
            print(json.dumps(run_conversations(args.gguf, json.load(f), args.max_tokens, args.threads), indent=1))
        return
    with open(args.prompts_json, encoding="utf-8") as f:
        prompts = json.load(f)
    result = run_llamacpp(args.gguf, prompts, args.max_tokens, args.threads, args.batch,
                          tuple(args.modes.split(",")), args.slot_ctx)
    if not args.with_text:
        for entry in result["modes"].values():
            for workload in entry["workloads"].values():
                for row in workload["requests"]:
                    del row["text"]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
