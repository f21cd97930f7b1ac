"""Strict validation of a Serve config file (deploy.yaml and friends).

Serve's own schema silently drops keys it does not know, so a typo in deploy.yaml
(`max_ongoing_request`, `batch_gates`) would deploy with defaults. This walks the file
against Serve's pydantic models and our own `AppArgs` (an application's `args`), reporting
every unknown key by its path, then validates the values, the Replica's `user_config`
(`SpeculationConfig`) included, with the engine they will build.
`python -m deploy.config_check deploy.yaml` runs it.
"""

from __future__ import annotations

import json
import sys
import typing
from pathlib import Path
from typing import Any, Iterable, Optional

from pydantic import BaseModel, ValidationError

from deploy.config import AppArgs
from replicas.engine import DEFAULT_MODEL, SpeculationConfig

DEPLOYMENT_NAMES = ("Ingress", "Replica", "ResponseStore")


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """Pydantic models anywhere inside a (possibly nested) type annotation."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def unknown_keys(data: Any, model: type[BaseModel], path: str,
                 overrides: Optional[dict[str, type[BaseModel]]] = None) -> list[str]:
    """Paths of keys in `data` that `model` (recursively) does not define.

    `overrides` maps a field name to the model that checks its free-form dict
    (e.g. `args` -> AppArgs), at this level only.
    """
    if isinstance(data, list):
        return [p for i, item in enumerate(data) for p in unknown_keys(item, model, f"{path}[{i}]", overrides)]
    if not isinstance(data, dict):
        return []
    by_key = {}
    for name, info in model.model_fields.items():
        by_key[name] = (name, info)
        if info.alias:
            by_key[info.alias] = (name, info)
    problems = []
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in by_key:
            problems.append(where)
            continue
        name, info = by_key[key]
        nested = (overrides or {}).get(name)
        candidates = [nested] if nested else _models_in(info.annotation)
        if candidates:
            problems += unknown_keys(value, candidates[0], where, _child_overrides(candidates[0]))
    return problems


def _child_overrides(model: type[BaseModel]) -> Optional[dict[str, type[BaseModel]]]:
    from ray.serve.schema import ServeApplicationSchema

    return {"args": AppArgs} if model is ServeApplicationSchema else None


def check_serve_config(document: dict[str, Any]) -> list[str]:
    """Every problem found, as readable lines; an empty list means the file is sound."""
    from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

    from deploy.app import build_app

    if not isinstance(document, dict):
        return [f"the file must be a mapping (Serve's config: applications, http_options, ...), "
                f"got {type(document).__name__}"]
    try:
        problems = [f"unknown key: {p}" for p in unknown_keys(document, ServeDeploySchema, "")]
        for i, app in enumerate(document.get("applications") or []):
            if isinstance(app, dict) and "runtime_env" in app:
                problems += _runtime_env_problems(app["runtime_env"], f"applications[{i}].runtime_env")
    except (AttributeError, TypeError):  # a value of another shape than the schema's: its check says where
        problems = []
    problems += _policy_import_problems(document)
    if problems:
        return problems
    try:
        ServeDeploySchema.model_validate(document)
    except ValidationError as exc:
        return _validation_lines(exc)
    except Exception as exc:  # noqa: BLE001 - report, don't raise
        return [f"serve schema: {exc}"]
    problems += _converted_values(ServeDeploySchema, document)
    for section in ("http_options", "grpc_options"):  # Serve's schema takes any int; binding fails at start
        port = (document.get(section) or {}).get("port")
        if isinstance(port, int) and not 0 < port < 65536:
            problems.append(f"{section}.port: must be in [1, 65535], got {port}")
    for i, app in enumerate(document.get("applications", [])):
        parsed = ServeApplicationSchema.model_validate(app)
        if parsed.route_prefix is not None and not parsed.route_prefix.startswith("/"):  # Serve's rule at deploy
            problems.append(f"applications[{i}].route_prefix: must start with '/', got {parsed.route_prefix!r}")
        if parsed.import_path != "deploy.app:build_app":
            problems.append(f"applications[{i}].import_path: expected deploy.app:build_app")
            continue
        try:
            args = AppArgs.model_validate(app.get("args") or {})
        except ValidationError as exc:
            problems += _validation_lines(exc, f"applications[{i}].args")
            args = None
        else:
            try:
                build_app(args)  # a ValidationError here is of Serve's models, not of the args' paths
            except Exception as exc:  # noqa: BLE001
                problems.append(f"applications[{i}].args: {exc}")
            problems += _engine_size_problems(args, f"applications[{i}].args")
        for j, deployment in enumerate(app.get("deployments") or []):
            where = f"applications[{i}].deployments[{j}]"
            problems += _autoscaling_problems(deployment, where)
            if deployment.get("name") not in DEPLOYMENT_NAMES:
                problems.append(f"{where}.name: {deployment.get('name')!r} is not one of {DEPLOYMENT_NAMES}")
            elif "user_config" in deployment and deployment["user_config"] is None:
                # Serve calls no reconfigure for it: running replicas keep theirs, new ones take the defaults
                problems.append(f"{where}.user_config: null is not applied to running replicas; leave the key "
                                "out, or give {} for the defaults")
            elif deployment.get("user_config") is not None:
                if deployment["name"] != "Replica":
                    problems.append(f"{where}.user_config: only the Replica takes one")
                else:
                    problems += _speculation_problems(deployment["user_config"], args, where)
        if not any(d.get("name") == "Replica" and d.get("user_config") is not None for d in app.get("deployments") or []):
            # the Replica then starts with the default speculation, which a TensorRT-LLM build must take
            problems += _speculation_problems({}, args, f"applications[{i}] (no Replica user_config: the defaults)")
    return problems


def _validation_lines(exc: ValidationError, where: str = "") -> list[str]:
    """One line per failed field, named by its path under `where` (list items as `[i]`)."""
    def path(loc: tuple) -> str:
        return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)

    return [(where + path(error["loc"])).removeprefix(".") + ": " + error["msg"].removeprefix("Value error, ")
            for error in exc.errors()]


def _converted_values(model: type[BaseModel], data: Any, where: str = "") -> list[str]:
    """Values Serve's `model` takes only by converting them (a quoted number): the args refuse
    those (AppArgs), so one file would take a "2" in one place and not in the next."""
    try:  # (a YAML date or bytes as text: its own check names what it should be)
        model.model_validate_json(json.dumps(data, default=str), strict=True)
    except ValidationError as exc:
        return [f"{line} (Serve would convert it; write it as that type)" for line in _validation_lines(exc, where)]
    return []


def _policy_import_problems(document: dict[str, Any]) -> list[str]:
    """Each deployment's `autoscaling_config.policy.policy_function` that does not import:
    Serve's schema imports it while validating and raises the bare ImportError, no key named."""
    from ray._common.utils import import_module_and_attr

    def items(node: Any, key: str) -> list:
        found = node.get(key) if isinstance(node, dict) else None
        return found if isinstance(found, list) else []

    problems = []
    for i, app in enumerate(items(document, "applications")):
        for j, deployment in enumerate(items(app, "deployments")):
            config = deployment.get("autoscaling_config") if isinstance(deployment, dict) else None
            policy = config.get("policy") if isinstance(config, dict) else None
            function = policy.get("policy_function") if isinstance(policy, dict) else None
            if isinstance(function, str):
                try:
                    import_module_and_attr(function)
                except (ImportError, AttributeError, ValueError) as exc:
                    problems.append(f"applications[{i}].deployments[{j}].autoscaling_config.policy.policy_function: "
                                    f"cannot import {function!r}: {exc}")
    return problems


def _runtime_env_problems(runtime_env: Any, where: str) -> list[str]:
    """An application's `runtime_env`, which Serve's schema takes as a free-form dict: Ray
    reads an unknown key as a plugin name and ignores it, and a misspelt env var is unset."""
    from ray.runtime_env import RuntimeEnv

    if not isinstance(runtime_env, dict):
        return [f"{where}: must be a mapping"]
    problems = [f"unknown key: {where}.{key}" for key in runtime_env if key not in RuntimeEnv.known_fields]
    env_vars = runtime_env.get("env_vars") or {}
    if not isinstance(env_vars, dict):
        return problems + [f"{where}.env_vars: must be a mapping of names to strings"]
    return problems + [f"{where}.env_vars.{name}: must be a string, got {value!r}"
                       for name, value in env_vars.items() if not isinstance(value, str)]


def _speculation_problems(user_config: Any, args: Optional[AppArgs], where: str) -> list[str]:
    """The Replica's `user_config`, checked as the replica will read it and, for an engine
    that builds its speculation in (TensorRT-LLM), built into that engine's config."""
    try:
        speculation = SpeculationConfig.from_user_config(user_config)  # names user_config.<key>
    except ValueError as exc:
        return [f"{where}.{exc}"]
    if args is not None and args.engine.kind == "trtllm":
        try:
            args.engine.trtllm_config(speculation)
        except ValueError as exc:
            return [f"{where}.user_config: {exc}"]
    if args is not None and args.engine.kind == "torch" and speculation.mode == "mtp" and not args.engine.mtp_weights:
        return [f"{where}.user_config.mode: mtp drafts with the MTP head, and engine.mtp_weights is null: "
                "nothing would be drafted (hybrid drafts with the suffix automaton alone there)"]
    return []


def _engine_size_problems(args: AppArgs, where: str) -> list[str]:
    """The embedded engine's sizes and MTP head against its model's config, as the engine checks
    them when it starts: for `device: cuda` as on a GPU, else as on CPU (`auto` on a GPU host is
    checked as on CPU). A checkpoint directory or GGUF file, or the default model's package,
    not on this machine is not checked; where the model is, the MTP head's directory must be too."""
    engine = args.engine
    if engine.kind != "torch" or (engine.model != DEFAULT_MODEL and not Path(engine.model).expanduser().exists()):
        return []
    from replicas.torch_engine.loader import model_config
    from replicas.torch_engine.mtp import setting_problems
    from replicas.torch_engine.sizes import size_problems

    try:
        model = model_config(engine.model)
    except (OSError, ValueError) as exc:
        if engine.model == DEFAULT_MODEL and isinstance(exc, FileNotFoundError):
            return []  # its package is not installed here
        return [f"{where}.engine.model: {exc}"]
    problems = size_problems(engine.max_seq_len, engine.kv_cache_bytes, engine.prefix_cache_bytes,
                             engine.mtp_weights is not None, model, cuda=engine.device == "cuda",
                             max_batch_size=engine.max_batch_size)
    return [f"{where}.engine.{problem}" for problem in problems + setting_problems(engine.mtp_weights, model)]


def autoscaling_in_force(deployment: dict[str, Any]) -> Optional[dict[str, Any]]:
    """A deployment's `autoscaling_config` as Serve builds it: with num_replicas "auto", laid
    over Serve's own defaults (max_replicas 100 ...); None where it autoscales not at all."""
    config = deployment.get("autoscaling_config")
    if deployment.get("num_replicas") != "auto":
        return config
    from ray.serve.config import AutoscalingConfig

    return {**AutoscalingConfig.default().model_dump(exclude_unset=True), **(config or {})}


def _autoscaling_problems(deployment: dict[str, Any], where: str) -> list[str]:
    """An `autoscaling_config` as Serve builds it at deploy time (its schema keeps the mapping
    unchecked until then), and our policy's `policy_kwargs` as the policy reads them."""
    config = deployment.get("autoscaling_config")
    if not isinstance(config, dict):
        return []
    from ray.serve.config import AutoscalingConfig

    try:
        AutoscalingConfig.model_validate(autoscaling_in_force(deployment))
    except ValidationError as exc:
        return _validation_lines(exc, f"{where}.autoscaling_config")
    converted = _converted_values(AutoscalingConfig, autoscaling_in_force(deployment), f"{where}.autoscaling_config")
    policy = config.get("policy") or {}
    if not str(policy.get("policy_function", "")).startswith("autoscaling.policy:"):
        return converted
    from autoscaling.decision import PolicyConfig, PolicySettingError

    where = f"{where}.autoscaling_config.policy.policy_kwargs"
    try:
        PolicyConfig.from_kwargs(policy.get("policy_kwargs") or {})
    except PolicySettingError as exc:
        return converted + [f"{where}: {exc.message}" if exc.key == "policy_kwargs"
                            else f"{where}.{exc.key}: {exc.message}"]
    except (TypeError, ValueError) as exc:
        return converted + [f"{where}: {exc}"]
    return converted


def main(paths: Iterable[str]) -> int:
    import yaml

    failed = 0
    for path in paths:
        try:
            with open(path) as f:
                problems = check_serve_config(yaml.safe_load(f))
        except (OSError, yaml.YAMLError) as exc:  # each file is reported, the others still checked
            problems = [f"cannot read it: {exc}"]
        for problem in problems:
            print(f"{path}: {problem}")
        if not problems:
            print(f"{path}: OK")
        failed += bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m deploy.config_check", description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", default=["deploy.yaml"], help="Serve config files (default: deploy.yaml)")
    sys.exit(main(parser.parse_args().files))
