"""The TensorRT-LLM adapter's parts: import surface, config, translation, the gate mapping, outputs, stats.

`replicas/trtllm_engine.py` is the entry point; nothing here imports `tensorrt_llm` at
import time.
"""
