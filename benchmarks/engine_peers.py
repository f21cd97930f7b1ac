"""The peers `benchmarks/engine.py` runs beside our engine on the same prompts: transformers'
`generate` (plain, prompt lookup) in this process, and llama.cpp's server on the same GGUF
through `xllamacpp` in the bench venv (benchmarks/llamacpp_peer.py)."""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor

import torch

from benchmarks.llamacpp_peer import peer_available, run_peer
from replicas.torch_engine.loader import packaged_gguf_path, resolve_model_dir

MIN_DECODE_SHARE = 0.1  # of a generation's time, the least its decode must take to be told apart


def bench_transformers(prompts: dict[str, list[str]], max_tokens: int, threads: int) -> dict:
    """HF generate, plain and with prompt lookup, on `threads` threads and exactly `max_tokens`
    tokens (EOS ignored, as ours and llama.cpp's): decode rate = (N-1) tokens over time(N) -
    time(1), summed over the prompts; None where that difference is under MIN_DECODE_SHARE of
    time(N)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Set here: the engine set torch's threads to 1 when it started (its own ops between native
    # steps), and torch's setting is per process.
    torch.set_num_threads(threads)

    model_dir = resolve_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = {}
    for workload, texts in prompts.items():
        for name, extra in (("hf_plain", {}), ("hf_prompt_lookup", {"prompt_lookup_num_tokens": 10})):
            tokens, first_s, whole_s = 0, 0.0, 0.0
            for text in texts:
                ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    model.generate(ids, max_new_tokens=1, do_sample=False)
                    t1 = time.perf_counter()
                    gen = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                         **extra)
                    t2 = time.perf_counter()
                tokens += gen.shape[1] - ids.shape[1] - 1
                first_s, whole_s = first_s + t1 - t0, whole_s + t2 - t1
            # decode: the whole generation less its prefill and first token (timed apart); where
            # that is lost in the noise (few tokens), no figure rather than an absurd one
            decode_s = whole_s - first_s
            rate = tokens / decode_s if decode_s > MIN_DECODE_SHARE * whole_s else None
            out[f"{workload}/{name}"] = {"tokens_per_s": rate, "threads": torch.get_num_threads()}
            shown = f"{rate:7.2f} tok/s" if rate is not None else "not measurable (decode lost in the prefill's noise)"
            print(f"  batch 1 {workload:9s} {name:17s} {shown}", flush=True)
    return out


def bench_transformers_apart(prompts: dict[str, list[str]], max_tokens: int, threads: int) -> dict:
    """`bench_transformers` in a fresh process that starts without the Makefile's
    OMP_WAIT_POLICY=PASSIVE (torch's OpenMP reads it once, at start, and passive teams sleep
    between generate's many small ops), as the llama.cpp peer imports its OpenMP."""
    saved = os.environ.pop("OMP_WAIT_POLICY", None)
    try:
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(bench_transformers, prompts, max_tokens, threads).result()
    finally:
        if saved is not None:
            os.environ["OMP_WAIT_POLICY"] = saved


def bench_llamacpp(prompts: dict[str, list[str]], max_tokens: int, threads: int) -> dict | None:
    """llama.cpp's server (xllamacpp, the bench venv) on the same GGUF and prompts, batch 1 and 8."""
    if not peer_available("bench-engine"):
        return None
    out = {}
    for batch in (1, 8):
        run = run_peer(str(packaged_gguf_path()), "--prompts-json", prompts, "--max-tokens", str(max_tokens),
                       "--threads", str(threads), "--batch", str(batch))
        out[f"batch{batch}"] = run
        for mode, entry in run["modes"].items():
            for workload, figures in entry["workloads"].items():
                print(f"  batch {batch} {workload:9s} {mode:11s} {figures['decode_throughput_tok_s']:7.2f} tok/s decode, "
                      f"{figures['throughput_tok_s']:7.2f} end-to-end, acceptance {figures['acceptance']}", flush=True)
    return out


def llamacpp_figures(result: dict, batch: str, workload: str, mode: str) -> tuple[float, float]:
    """(decode tok/s, end-to-end tok/s) of one llama.cpp run, counted as ours: decode tokens over
    first-to-last-token time of each wave of concurrent requests, and all tokens over wall time."""
    figures = result["llamacpp"][batch]["modes"][mode]["workloads"][workload]
    return figures["decode_throughput_tok_s"], figures["throughput_tok_s"]
