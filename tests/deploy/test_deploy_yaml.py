"""deploy.yaml validated strictly: an unknown key anywhere fails, values are checked."""

from __future__ import annotations

import copy
import os
import datetime
from pathlib import Path

import pytest
import yaml

from deploy.config_check import check_serve_config, unknown_keys
from tests.serve_support import dict_paths

DEPLOY_YAML = Path(__file__).resolve().parents[2] / "deploy.yaml"


@pytest.fixture(scope="module")
def document():
    return yaml.safe_load(DEPLOY_YAML.read_text())


def test_deploy_yaml_is_sound(document):
    assert check_serve_config(document) == []


def test_speculation_is_the_replicas_hot_user_config(document):
    from replicas.engine import SpeculationConfig

    replica = next(d for d in document["applications"][0]["deployments"] if d["name"] == "Replica")
    assert SpeculationConfig.from_user_config(replica["user_config"]) == SpeculationConfig()
    assert "speculation" not in document["applications"][0]["args"]  # one way in: user_config


def _with_extra_key(document, path):
    doc = copy.deepcopy(document)
    node = doc
    for part in path:
        node = node[part]
    node["bogus_key"] = 1
    return doc


def test_an_unknown_key_at_every_level_is_reported(document):
    paths = list(dict_paths(document))
    assert len(paths) >= 8  # top, http_options, app, args and its five sections
    for path in paths:
        problems = check_serve_config(_with_extra_key(document, path))
        assert problems and all("bogus_key" in p for p in problems), (path, problems)


OVERRIDES = [
    ("a valid Replica override", {"name": "Replica", "max_ongoing_requests": 24,
                                  "user_config": {"batch_gate": 2}}, True),
    ("autoscaling with a policy", {"name": "Replica", "autoscaling_config": {
        "min_replicas": 1, "max_replicas": 2,
        "policy": {"policy_function": "ray.serve.autoscaling_policy:replica_queue_length_autoscaling_policy"}}},
     True),
    ("our policy's kwargs", {"name": "Replica", "autoscaling_config": {"policy": {
        "policy_function": "autoscaling.policy:AcceptanceAwarePolicy", "policy_kwargs": {"gate_fill": 0.75}}}}, True),
    ("a typo in our policy's kwargs", {"name": "Replica", "autoscaling_config": {"policy": {
        "policy_function": "autoscaling.policy:AcceptanceAwarePolicy", "policy_kwargs": {"gate_fil": 0.75}}}}, False),
    ("a bad value in our policy's kwargs", {"name": "Replica", "autoscaling_config": {"policy": {
        "policy_function": "autoscaling.policy:AcceptanceAwarePolicy", "policy_kwargs": {"gate_fill": 2}}}}, False),
    ("typo in a Serve option", {"name": "Replica", "max_ongoing_request": 24}, False),
    ("typo in autoscaling", {"name": "Replica", "autoscaling_config": {"max_replica": 2}}, False),
    ("typo in the router config", {"name": "Replica", "request_router_config": {"request_router_clas": "x"}},
     False),
    ("typo in user_config", {"name": "Replica", "user_config": {"batch_gates": 2}}, False),
    ("bad user_config value", {"name": "Replica", "user_config": {"mode": "turbo"}}, False),
    ("unknown deployment", {"name": "Engine", "num_replicas": 2}, False),
    ("user_config on the ingress", {"name": "Ingress", "user_config": {"batch_gate": 2}}, False),
    ("no replica at most", {"name": "Replica", "autoscaling_config": {"min_replicas": 0, "max_replicas": 0}}, False),
    ("fewer at most than at least", {"name": "Replica", "autoscaling_config": {"min_replicas": 3, "max_replicas": 2}},
     False),
    # num_replicas "auto": Serve's defaults (max_replicas 100) under the mapping's own keys
    ("auto, at least 2", {"name": "Replica", "num_replicas": "auto", "autoscaling_config": {"min_replicas": 2}}, True),
    ("auto, fewer at most than at least", {"name": "Replica", "num_replicas": "auto",
                                           "autoscaling_config": {"min_replicas": 200}}, False),
]


def test_a_bad_policy_kwarg_is_named_by_its_path(document):
    doc = copy.deepcopy(document)
    replica = next(d for d in doc["applications"][0]["deployments"] if d["name"] == "Replica")
    kwargs = replica["autoscaling_config"]["policy"]["policy_kwargs"]
    where = "applications[0].deployments[0].autoscaling_config.policy.policy_kwargs"
    kwargs["gate_fill"] = 2
    assert check_serve_config(doc) == [f"{where}.gate_fill: must be in (0, 1], got 2"]
    kwargs["gate_fill"], kwargs["gate_fil"] = 0.5, 0.5
    [problem] = check_serve_config(doc)
    assert problem.startswith(f"{where}: unknown keys ['gate_fil']")


@pytest.mark.parametrize("name,override,ok", OVERRIDES, ids=[row[0] for row in OVERRIDES])
def test_deployment_overrides(document, name, override, ok):
    doc = copy.deepcopy(document)
    doc["applications"][0]["deployments"] = [override]
    assert (check_serve_config(doc) == []) is ok, check_serve_config(doc)


BAD_VALUES = [
    ("engine.kind", "tensorflow"),
    ("engine.max_batch_size", 0),
    ("engine.max_batch_size", 10**9),  # more slots than kv_cache_bytes' pages: ran the replica out of memory
    ("engine.max_batch_size", True),  # strict types: YAML's `true` or a quoted "8" was taken as a number
    ("limits.stream_idle_timeout_s", "300"),
    ("engine.max_seq_len", 4),
    ("engine.max_prefill_tokens", 0),
    ("limits.max_tokens", 0),
    ("limits.max_prompt_tokens", 999999),
    ("limits.default_max_tokens", 5000),  # over limits.max_tokens
    # sizes against the model's own (the embedded default: 8,192 positions, 0.7 MB a page)
    ("engine.max_seq_len", 16384),
    ("engine.kv_cache_bytes", 1 << 20),
    ("engine.prefix_cache_bytes", 1 << 20),
    ("engine.mtp_weights", "/nonexistent/mtp-head"),  # the model is on this machine: its head must be too
    ("engine.sa_global_pool_tokens", 2),  # the native pool's range: it failed at start, under its own name
    ("engine.sa_global_pool_tokens", 10**13),
    ("engine.model", "smollm2-135m"),  # neither the default nor a path: it failed only at start
    ("replica.num_replicas", "two"),
    ("replica.gate_hold_s", -1),
    ("replica.gate_hold_min_acceptance", 0.5),
    ("replica.graceful_shutdown_timeout_s", -1),
]


def test_the_router_gets_its_gate_hold_and_affinity_settings(document):
    from deploy.app import replica_deployment
    from deploy.config import AppArgs

    args = AppArgs.model_validate(copy.deepcopy(document["applications"][0]["args"]))
    router = replica_deployment(args)._deployment_config.request_router_config
    assert router.request_router_class == "deploy.router:SpeculationGateRouter"
    assert router.request_router_kwargs == {
        "gate_hold_s": args.replica.gate_hold_s, "gate_hold_min_acceptance": args.replica.gate_hold_min_acceptance,
        "prefix_affinity_chars": args.replica.prefix_affinity_chars,
        "prefix_affinity_max_extra_load": args.replica.prefix_affinity_max_extra_load, "sole_router": True}
    several = args.model_copy(update={"ingress_replicas": 2})  # several routers: none sees every request
    assert replica_deployment(several)._deployment_config.request_router_config.request_router_kwargs[
        "sole_router"] is False
    assert args.replica.prefix_affinity_chars > 0  # deploy.yaml routes by prefix
    assert args.replica.gate_hold_s > 0  # deploy.yaml holds
    plain_args = args.model_copy(update={"replica": args.replica.model_copy(update={"gate_router": False})})
    plain = replica_deployment(plain_args)._deployment_config.request_router_config  # one the Ingress counts
    assert (plain.request_router_class, plain.request_router_kwargs) == ("deploy.router:PowerOfTwoRouter", {})


def test_failure_settings_reach_serve(document):
    """deploy.yaml pins the Ingress to the head and gives stopping Replicas their grace;
    `ingress_placement: any` leaves the Ingress to Ray."""
    from deploy.app import ON_HEAD_NODE, ingress_deployment, replica_deployment
    from deploy.config import AppArgs

    raw = copy.deepcopy(document["applications"][0]["args"])
    args = AppArgs.model_validate(raw)
    assert args.ingress_placement == "head"
    assert ingress_deployment(args).ray_actor_options["resources"] == ON_HEAD_NODE
    grace = replica_deployment(args)._deployment_config.graceful_shutdown_timeout_s
    assert grace == args.replica.graceful_shutdown_timeout_s > 0
    anywhere = AppArgs.model_validate({**raw, "ingress_placement": "any"})
    assert not ingress_deployment(anywhere).ray_actor_options.get("resources")


@pytest.mark.parametrize("dotted,value", BAD_VALUES)
def test_bad_values_in_args(document, dotted, value):
    doc = copy.deepcopy(document)
    section, key = dotted.split(".")
    doc["applications"][0]["args"][section][key] = value
    problems = check_serve_config(doc)
    assert problems and f"{key}:" in problems[0], problems  # the key named, not only quoted


def test_a_null_user_config_and_a_route_prefix_without_a_slash_are_reported(document):
    """Both passed the check: Serve applies no null user_config to running replicas (they kept
    their settings while new ones took the defaults), and refuses the prefix only at deploy."""
    doc = copy.deepcopy(document)
    app = doc["applications"][0]
    next(d for d in app["deployments"] if d["name"] == "Replica")["user_config"] = None
    app["route_prefix"] = "v1"
    problems = check_serve_config(doc)
    assert any(p.startswith("applications[0].route_prefix: must start with '/'") for p in problems), problems
    assert any(".user_config: null is not applied" in p for p in problems), problems


def test_values_that_fail_only_at_deploy_or_do_nothing_are_reported(document):
    """Serve's own checks: a value of the wrong type, a policy_function that does not import
    (Serve's schema raised the bare ImportError) and a port no socket takes; and mode mtp with
    no MTP head, which drafts nothing."""
    doc = copy.deepcopy(document)
    replica = next(j for j, d in enumerate(doc["applications"][0]["deployments"]) if d["name"] == "Replica")
    doc["applications"][0]["deployments"][replica]["max_ongoing_requests"] = "many"
    assert check_serve_config(doc) == [f"applications[0].deployments[{replica}].max_ongoing_requests: Input should "
                                       "be a valid integer, unable to parse string as an integer"]
    doc = copy.deepcopy(document)
    doc["applications"][0]["deployments"][replica]["autoscaling_config"]["policy"]["policy_function"] = "nosuch:fn"
    assert check_serve_config(doc) == [f"applications[0].deployments[{replica}].autoscaling_config.policy."
                                       "policy_function: cannot import 'nosuch:fn': No module named 'nosuch'"]
    doc = copy.deepcopy(document)
    doc["applications"][0]["args"]["engine"]["mtp_weights"] = None
    doc["applications"][0]["deployments"][replica]["user_config"]["mode"] = "mtp"
    assert check_serve_config(doc) == [f"applications[0].deployments[{replica}].user_config.mode: mtp drafts with "
                                       "the MTP head, and engine.mtp_weights is null: nothing would be drafted "
                                       "(hybrid drafts with the suffix automaton alone there)"]
    doc = copy.deepcopy(document)
    doc["http_options"]["port"] = 70000
    assert check_serve_config(doc) == ["http_options.port: must be in [1, 65535], got 70000"]


def test_a_quoted_number_in_serves_fields_is_reported_as_in_the_args(document):
    """Serve's schema converts a "2" where the args refuse one (strict types): the check named
    the one and passed the other."""
    doc = copy.deepcopy(document)
    replica = next(j for j, d in enumerate(doc["applications"][0]["deployments"]) if d["name"] == "Replica")
    doc["http_options"]["port"] = "8000"
    doc["applications"][0]["deployments"][replica]["graceful_shutdown_timeout_s"] = "5"
    doc["applications"][0]["deployments"][replica]["autoscaling_config"]["max_replicas"] = "4"
    unquoted = " (Serve would convert it; write it as that type)"
    assert check_serve_config(doc) == [
        "http_options.port: Input should be a valid integer" + unquoted,
        f"applications[0].deployments[{replica}].graceful_shutdown_timeout_s: Input should be a valid number" + unquoted,
        f"applications[0].deployments[{replica}].autoscaling_config.max_replicas: Input should be a valid integer"
        + unquoted]
    doc = copy.deepcopy(document)
    doc["applications"][0]["args"]["served_model_name"] = datetime.date(2024, 5, 1)  # YAML's 2024-05-01: no JSON
    assert check_serve_config(doc) == ["applications[0].args.served_model_name: Input should be a valid string"]


def test_the_model_identity_is_the_model_as_read_not_as_spelt():
    """What a Replica refuses a request for (another model): a trailing slash or a tokenizer
    named as the model's own is the same model; another directory or tokenizer is not."""
    from deploy.config import EngineArgs

    home = os.path.expanduser("~")
    same = [EngineArgs(model="/m/x"), EngineArgs(model="/m/x/"), EngineArgs(model="/m/./x"),
            EngineArgs(kind="trtllm", model="/m/x", trtllm={"tokenizer": "/m/x/"})]
    assert {args.identity for args in same} == {"/m/x"}
    assert EngineArgs(model="~/x").identity == f"{home}/x"
    assert EngineArgs(model="/m/y").identity != "/m/x"
    assert EngineArgs(kind="trtllm", model="/m/x", trtllm={"tokenizer": "/t"}).identity == "/m/x (tokenizer /t)"


def test_unknown_keys_walks_lists_and_unions():
    from ray.serve.schema import ServeDeploySchema

    doc = {"applications": [{"import_path": "x:y", "deployments": [
        {"name": "Replica", "autoscaling_config": {"policy": {"policy_function": "a:b", "nope": 1}}}]}]}
    assert unknown_keys(doc, ServeDeploySchema, "") == [
        "applications[0].deployments[0].autoscaling_config.policy.nope"]


def test_a_default_max_tokens_left_out_stays_within_max_tokens():
    from deploy.config import AppArgs, IngressConfig

    assert IngressConfig.from_args(AppArgs()).default_max_tokens == 256
    assert IngressConfig.from_args(AppArgs(limits={"max_tokens": 64})).default_max_tokens == 64
    assert IngressConfig.from_args(AppArgs(limits={"max_tokens": 64, "default_max_tokens": 32})).default_max_tokens == 32


def test_sizes_are_checked_as_the_device_named_holds_them(document):
    """`device: cuda` keeps fp32 KV (a prefix block near twice the CPU's fp16 one) in whole
    windows per slot (kv_cache_bytes unread); `auto` is checked as on CPU."""
    def problems(**engine):
        doc = copy.deepcopy(document)
        doc["applications"][0]["args"]["engine"].update(engine)
        return check_serve_config(doc)

    at_8k = {"max_seq_len": 8192, "prefix_cache_bytes": 256 << 20, "kv_cache_bytes": 256 << 20}
    assert problems(device="cpu", **at_8k) == problems(device="auto", **at_8k) == []
    on_gpu = problems(device="cuda", **at_8k)
    assert len(on_gpu) == 1 and ".engine.prefix_cache_bytes:" in on_gpu[0], on_gpu
    small_kv = {"kv_cache_bytes": 1 << 20, "prefix_cache_bytes": 0}
    assert problems(device="cuda", **small_kv) == []
    assert [p.split(": ")[0] for p in problems(device="cpu", **small_kv)] == [
        "applications[0].args.engine.kv_cache_bytes"]


def test_a_checkpoint_of_another_shape_needs_its_own_mtp_head(document, tmp_path):
    """The shipped head drafts for the default model only: another checkpoint with
    `mtp_weights: default` is named (the replica failed at start), and null passes."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096).save_pretrained(tmp_path)
    doc = copy.deepcopy(document)
    engine = doc["applications"][0]["args"]["engine"]
    engine.update(model=str(tmp_path), mtp_weights="default", prefix_cache_bytes=0)
    (problem,) = check_serve_config(doc)
    assert problem.startswith("applications[0].args.engine.mtp_weights: the MTP head in") and "another target" in problem
    engine["mtp_weights"] = None
    assert check_serve_config(doc) == []


def test_a_checkpoint_the_cpu_forward_cannot_run_is_named_before_a_deploy(document, tmp_path):
    """The native kernels take hidden and MLP widths in blocks of 32 (and head_dim in lanes of
    8): such a checkpoint passed the check, then every Replica failed at start with the cause
    deep in a traceback (QA). A vocabulary of any size is padded, so it passes."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=32001, hidden_size=80, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096).save_pretrained(tmp_path)
    doc = copy.deepcopy(document)
    engine = doc["applications"][0]["args"]["engine"]
    engine.update(model=str(tmp_path), mtp_weights=None, prefix_cache_bytes=0)
    (problem,) = check_serve_config(doc)
    assert problem.startswith("applications[0].args.engine.model: the CPU forward cannot run this checkpoint: "
                              "hidden_size (80) is not a multiple of 32; head_dim (20) is not a multiple of 8")
    engine["device"] = "cuda"  # the torch forward takes it
    assert check_serve_config(doc) == []


def test_a_file_that_is_no_serve_config_is_reported_and_the_next_is_still_checked(tmp_path, capsys):
    """Empty, a list, a wrong shape, broken YAML, missing: each a line naming the file (they
    were tracebacks, which stopped the check of the files after them)."""
    from deploy.config_check import main

    files = {"empty.yaml": "", "list.yaml": "- a\n", "int.yaml": "applications: 5\n", "broken.yaml": "a: [b\nc: 1\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    paths = [str(tmp_path / name) for name in (*files, "missing.yaml")]
    paths.append(str(Path(__file__).parents[2] / "deploy.yaml"))
    assert main(paths) == 1
    out = capsys.readouterr().out
    assert "empty.yaml: the file must be a mapping" in out and "list.yaml: the file must be a mapping" in out
    assert "int.yaml: applications: Input should be a valid list" in out
    assert "broken.yaml: cannot read it:" in out and "missing.yaml: cannot read it:" in out
    assert out.rstrip().endswith("deploy.yaml: OK")
