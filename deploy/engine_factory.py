"""Build an engine from `EngineArgs`: the factory `build_app` hands to each Replica.

Engines are imported inside the function, so importing this module (and pickling the
factory into a replica) never loads torch or TensorRT-LLM in the process that deploys.
"""

from functools import partial
from typing import Callable

from deploy.config import EngineArgs
from replicas.engine import Engine, SpeculationConfig


def build_engine(args: EngineArgs, speculation: SpeculationConfig) -> Engine:
    """A fresh, unstarted engine of `args.kind` with the initial speculation settings."""
    if args.kind == "torch":
        from replicas.torch_engine.engine import TorchEngine, TorchEngineConfig

        return TorchEngine(TorchEngineConfig(
            model=args.model, max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
            device=args.device, num_threads=args.num_threads, mtp_weights=args.mtp_weights,
            sa_global_pool_tokens=args.sa_global_pool_tokens, prefix_cache_bytes=args.prefix_cache_bytes,
            kv_cache_bytes=args.kv_cache_bytes,
            max_prefill_tokens=args.max_prefill_tokens, speculation=speculation,
        ))
    from replicas.trtllm_engine import TrtllmEngine

    return TrtllmEngine(args.trtllm_config(speculation))


def engine_factory(args: EngineArgs) -> Callable[[SpeculationConfig], Engine]:
    """A picklable `speculation -> Engine` callable bound to `args`."""
    return partial(build_engine, args)
