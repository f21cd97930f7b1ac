"""deploy-gpu.yaml validated strictly, with the same validator as deploy.yaml.

`deploy/config_check.py` checks every key against Serve's schema and our AppArgs, which
builds the `engine.trtllm` block through `TrtllmEngineConfig.from_mapping` (strict too),
with the speculation settings of the Replica's `user_config`.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from deploy.config import AppArgs
from deploy.config_check import check_serve_config
from replicas.engine import SpeculationConfig
from replicas.stats import NOT_GATED
from replicas.trtllm.config import TrtllmEngineConfig
from replicas.trtllm.translate import worker_env
from tests.serve_support import dict_paths
from tests.trtllm.conftest import EAGLE3_HEAD, fake_api, run

DEPLOY_GPU_YAML = Path(__file__).resolve().parents[2] / "deploy-gpu.yaml"
TRTLLM_PATH = ("applications", 0, "args", "engine", "trtllm")


@pytest.fixture(scope="module")
def document():
    return yaml.safe_load(DEPLOY_GPU_YAML.read_text())


def user_config(document) -> dict:
    return next(d for d in document["applications"][0]["deployments"] if d["name"] == "Replica")["user_config"]


def engine_config(document) -> TrtllmEngineConfig:
    """The TrtllmEngineConfig the yaml describes: shared engine keys + the trtllm block,
    built with the Replica's user_config, as the replica builds it."""
    args = AppArgs.model_validate(document["applications"][0]["args"])
    return args.engine.trtllm_config(SpeculationConfig.from_user_config(user_config(document)))


def test_deploy_gpu_yaml_is_sound(document):
    assert check_serve_config(document) == []


def test_an_unknown_key_at_every_level_is_rejected(document):
    paths = list(dict_paths(document))
    assert TRTLLM_PATH in paths and len(paths) >= 9
    for path in paths:
        doc = copy.deepcopy(document)
        node = doc
        for part in path:
            node = node[part]
        node["bogus_key"] = 1
        if path[: len(TRTLLM_PATH)] == TRTLLM_PATH:
            with pytest.raises(ValueError, match="bogus_key"):
                engine_config(doc)
        else:
            problems = check_serve_config(doc)
            assert problems and all("bogus_key" in p for p in problems), (path, problems)


def test_the_trtllm_block_builds_the_hybrid_engine(document):
    from replicas.trtllm_engine import TrtllmEngine

    config = engine_config(document)
    assert (config.drafter, config.draft_model, config.tensor_parallel_size) == ("eagle3", EAGLE3_HEAD, 1)

    async def go():
        engine = TrtllmEngine(config, api=fake_api())
        await engine.start()
        args, gate = engine._llm.args, engine.stats().batch_gate
        await engine.shutdown()
        return args, gate

    args, gate = run(go())
    spec = args.speculative_config
    assert args.model == "meta-llama/Llama-3.1-8B-Instruct" and args.max_batch_size == 64
    assert spec.decoding_type == "Eagle3" and spec.speculative_model == EAGLE3_HEAD
    assert spec.sa_config.threshold == 4 and spec.max_draft_len == 4
    # EAGLE-3 + SA cannot stop drafting: K up to the gate, 1 token above it, reported as not gated
    assert spec.draft_len_schedule == {16: 4, 64: 1} and gate == NOT_GATED


def test_the_replica_process_keeps_tensorrt_llms_worker(document):
    env = document["applications"][0]["runtime_env"]["env_vars"]
    assert env == worker_env(engine_config(document)) == {"TLLM_WORKER_USE_SINGLE_PROCESS": "1"}


def test_the_startup_downloads_are_stated(document):
    text = DEPLOY_GPU_YAML.read_text()
    trtllm = document["applications"][0]["args"]["engine"]["trtllm"]
    for needed in ("HF_TOKEN", document["applications"][0]["args"]["engine"]["model"], trtllm["draft_model"]):
        assert text.count(needed) >= 2, needed  # the setting, and the comment saying where it comes from


def test_user_config_is_checked_against_the_engine_it_builds(document):
    doc = copy.deepcopy(document)
    del doc["applications"][0]["args"]["engine"]["trtllm"]["draft_model"]
    user_config(doc)["mode"] = "sa"
    assert check_serve_config(doc) == []  # the SA alone needs no EAGLE-3 head
    user_config(doc)["mode"] = "hybrid"
    problems = check_serve_config(doc)
    assert len(problems) == 1 and "user_config: engine.trtllm.draft_model" in problems[0], problems
    user_config(doc)["batch_gates"] = 16
    assert check_serve_config(doc) == [
        "applications[0].deployments[0].user_config.batch_gates: Unexpected keyword argument"]


def test_the_replica_requests_one_gpu(document):
    replica = document["applications"][0]["args"]["replica"]
    assert replica["num_gpus"] == 1 and replica["num_replicas"] == 1


def test_the_default_speculation_is_checked_where_no_user_config_sets_one(document):
    doc = copy.deepcopy(document)
    del doc["applications"][0]["args"]["engine"]["trtllm"]["draft_model"]
    doc["applications"][0]["deployments"] = [d for d in doc["applications"][0]["deployments"] if d["name"] != "Replica"]
    problems = check_serve_config(doc)  # the Replica starts in hybrid, which needs the EAGLE-3 head
    assert len(problems) == 1 and "no Replica user_config" in problems[0] and "draft_model" in problems[0], problems


@pytest.mark.parametrize("key, value, named", [
    ("speculation", {"mode": "off"}, "engine.trtllm: ['speculation']"),  # was dropped
    ("max_batch_size", 8, "engine.trtllm: ['max_batch_size']"),  # took the engine's, not Serve's or the limits'
    ("cuda_graphs", "false", "cuda_graphs: must be bool"),  # a truthy string
    ("cuda_graph", True, "engine.trtllm: unknown keys ['cuda_graph']; known: ['cuda_graphs', "),  # listed model too
    ("free_gpu_memory_fraction", "0.85", "engine.trtllm.free_gpu_memory_fraction: must be float"),  # a TypeError
    ("draft_len_taper", {16: 4}, "engine.trtllm.draft_len_taper: a list of [batch_size, draft_len]"),  # a TypeError
    ("draft_len_taper", [[1.5, True]], "engine.trtllm.draft_len_taper: a list of [batch_size, draft_len]"),
])
def test_a_trtllm_key_that_would_not_do_what_it_says_is_named(document, key, value, named):
    doc = copy.deepcopy(document)
    doc["applications"][0]["args"]["engine"]["trtllm"][key] = value
    problems = check_serve_config(doc)
    assert len(problems) == 1 and named in problems[0], problems
    assert "'model'" not in problems[0] and "'speculation'" not in problems[0].partition("known:")[2]


def test_the_embedded_engines_keys_are_refused_beside_trtllm(document):
    doc = copy.deepcopy(document)
    doc["applications"][0]["args"]["engine"].update(num_threads=4, prefix_cache_bytes=0)
    problems = check_serve_config(doc)
    assert len(problems) == 1 and "['num_threads', 'prefix_cache_bytes']" in problems[0], problems


def test_a_trtllm_replica_without_a_gpu_is_refused(document):
    doc = copy.deepcopy(document)
    doc["applications"][0]["args"]["replica"]["num_gpus"] = 0
    problems = check_serve_config(doc)
    assert len(problems) == 1 and "replica.num_gpus: a TensorRT-LLM replica needs a GPU" in problems[0], problems
