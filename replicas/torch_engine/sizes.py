"""What the embedded engine's sizes must hold for its model, in bytes and positions.

The engine checks them when it starts (each ValueError names the key); `deploy.config_check`
runs the same checks before a deploy, on the model's config alone (`loader.model_config`). No
torch here.
"""

from __future__ import annotations

from replicas.torch_engine.model_config import ModelConfig

PAGE_TOKENS = 32  # positions per page: the native K layout's block


def whole_pages(positions: int) -> int:
    """`positions` rounded up to whole pages of PAGE_TOKENS (a cache's window)."""
    return -(-positions // PAGE_TOKENS) * PAGE_TOKENS


def page_bytes(num_layers: int, num_kv_heads: int, head_dim: int, element_size: int = 2) -> int:
    """Bytes of 32 positions' K and V in every layer: one page of the paged (fp16) cache."""
    return PAGE_TOKENS * 2 * num_layers * num_kv_heads * head_dim * element_size


def check_native_shape(model: ModelConfig) -> None:
    """The shapes the native CPU forward's kernels take (blocks of 32 values, reductions of 8
    lanes; csrc/cpu/llama_forward.cpp checks them again): a ValueError naming the model's
    config.json fields, before a weight is read. (A vocabulary of any size is padded.)"""
    wrong = [f"{name} ({value}) is not a multiple of {multiple}"
             for name, value, multiple in (("hidden_size", model.hidden_size, 32),
                                           ("intermediate_size", model.intermediate_size, 32),
                                           ("head_dim", model.head_dim, 8),
                                           ("num_attention_heads * head_dim", model.q_size, 32))
             if value % multiple]
    if wrong:
        raise ValueError(f"model: the CPU forward cannot run this checkpoint: {'; '.join(wrong)} (its config.json); "
                         "serve it with engine.device: cuda")


def check_context(max_seq_len: int, model: ModelConfig) -> None:
    """A context window the model has positions for (RoPE's tables stop at its last one)."""
    if max_seq_len > model.max_position_embeddings:
        raise ValueError(f"max_seq_len: {max_seq_len} is past the model's {model.max_position_embeddings} positions "
                         f"(its max_position_embeddings)")


def _window_of(key: str, budget: int, unit_bytes: int, unit: str, max_seq_len: int, zero: str) -> int:
    """How many `unit`s of 32 positions `budget` bytes buy; ValueError naming `key` when fewer
    than one context window needs."""
    units, need = budget // unit_bytes, -(-max_seq_len // PAGE_TOKENS)
    if units < need:
        raise ValueError(f"{key}: {budget} bytes hold {units} {unit} of {PAGE_TOKENS} tokens ({unit_bytes} bytes "
                         f"each); one context window (max_seq_len {max_seq_len}) needs {need}, so at least "
                         f"{need * unit_bytes} bytes (or 0 {zero})")
    return units


def kv_pages(max_seq_len: int, kv_cache_bytes: int, model: ModelConfig) -> int | None:
    """Pages of the paged KV cache that `kv_cache_bytes` buys (None: 0, every slot's whole
    window); ValueError naming the key when they would not hold one context window."""
    if not kv_cache_bytes:
        return None
    page = page_bytes(model.num_layers, model.num_kv_heads, model.head_dim)
    return _window_of("kv_cache_bytes", kv_cache_bytes, page, "pages", max_seq_len, "for every slot's whole window")


def prefix_blocks(max_seq_len: int, budget_bytes: int, block_bytes: int) -> int:
    """Blocks of `block_bytes` that the prefix cache's `prefix_cache_bytes` buys; ValueError
    naming the key when they would not hold one request's context window."""
    return _window_of("prefix_cache_bytes", budget_bytes, block_bytes, "blocks", max_seq_len, "to turn the cache off")


def prefix_block_bytes(page: int, hidden_size: int) -> int:
    """One prefix-cache block: a page of K and V (`page` bytes) and, where the MTP head drafts
    (hidden_size > 0), its fp32 hidden states."""
    return page + PAGE_TOKENS * hidden_size * 4


def check_slots(max_batch_size: int, pages: int | None) -> None:
    """No more request slots than the paged KV cache's `pages` (None: a whole window per slot)
    can run: each running request holds a page at least, so slots past them only cost memory
    (a slot's page table and bookkeeping: 10^9 of them ran a replica out of memory)."""
    if pages is not None and max_batch_size > pages:
        raise ValueError(f"max_batch_size: {max_batch_size} requests at once, but kv_cache_bytes buys {pages} pages "
                         f"of {PAGE_TOKENS} tokens, and a running request holds one at least")


def check_memory(max_batch_size: int, max_seq_len: int, kv_cache_bytes: int, prefix_cache_bytes: int,
                 page: int, memory_bytes: int) -> None:
    """The KV cache (`kv_cache_bytes`, or 0: every slot's whole window) and the prefix cache
    within `memory_bytes`, the memory of the device that holds them: past it, the replica
    would run out of memory, and Serve restart it to run out again."""
    kv = kv_cache_bytes or max_batch_size * (whole_pages(max_seq_len) // PAGE_TOKENS) * page
    if kv + prefix_cache_bytes > memory_bytes:
        kv_keys = "kv_cache_bytes" if kv_cache_bytes else "max_batch_size x max_seq_len (kv_cache_bytes 0)"
        raise ValueError(f"{kv_keys}: the KV cache's {kv / 2**30:.1f} GiB and prefix_cache_bytes' "
                         f"{prefix_cache_bytes / 2**30:.1f} GiB are more than this device's {memory_bytes / 2**30:.1f} "
                         f"GiB of memory")


def size_problems(max_seq_len: int, kv_cache_bytes: int, prefix_cache_bytes: int, with_mtp: bool,
                  model: ModelConfig, cuda: bool = False, max_batch_size: int = 1,
                  memory_bytes: int | None = None) -> list[str]:
    """What the checks above say of the engine's sizes, every one: on CPU its fp16 pages within
    `kv_cache_bytes`, and no more slots than pages; on CUDA (`cuda`) fp32 KV in whole windows
    per slot, and `kv_cache_bytes` not read; both caches within `memory_bytes` where it is given."""
    page = page_bytes(model.num_layers, model.num_kv_heads, model.head_dim, 4 if cuda else 2)
    checks = [lambda: check_context(max_seq_len, model)]
    if not cuda:
        checks.append(lambda: check_native_shape(model))
        checks.append(lambda: check_slots(max_batch_size, kv_pages(max_seq_len, kv_cache_bytes, model)))
    if memory_bytes is not None:
        checks.append(lambda: check_memory(max_batch_size, max_seq_len, 0 if cuda else kv_cache_bytes,
                                           prefix_cache_bytes, page, memory_bytes))
    if prefix_cache_bytes:
        hidden = model.hidden_size if with_mtp else 0
        checks.append(lambda: prefix_blocks(max_seq_len, prefix_cache_bytes, prefix_block_bytes(page, hidden)))
    problems = []
    for check in checks:
        try:
            check()
        except ValueError as exc:
            problems.append(str(exc))
    return problems
