"""Python face of the native suffix automaton (built from csrc/ by `make native`).

`SuffixAutomatonPool` keeps one online suffix automaton per live request in fixed-capacity
slots and answers, in one batched call per step, "feed these accepted tokens, then give me
the longest repeated suffix and the tokens that followed its first occurrence":

    pool = SuffixAutomatonPool(max_slots=32, max_seq_len=16384, global_pool_tokens=0)
    pool.add_request(request_id, prompt_tokens)
    match_len, draft = pool.extend(request_ids,    # [B] int64
                                   accepted,       # [B, W] int32, C-contiguous
                                   accepted_lens,  # [B] int32, <= W
                                   draft_len)      # -> [B] int32, [B, draft_len] int32 (-1 pad)
    pool.remove_request(request_id, keep_in_global_pool=True)

Bad input raises ValueError (KeyError for an id that is not live) and changes nothing.
Importing this module only loads the extension; nothing is allocated until a pool is made.
"""

try:
    from replicas.speculation import _sa_native
except ImportError as err:  # pragma: no cover - depends on the build state
    raise ImportError(
        "the native suffix automaton (replicas/speculation/_sa_native*.so) is not built; "
        "run `make native` in the repository root"
    ) from err

SuffixAutomatonPool = _sa_native.SuffixAutomatonPool
UnknownRequestError = _sa_native.UnknownRequestError
longest_repeated_suffix = _sa_native.longest_repeated_suffix

#: True when the extension was compiled with nvcc (a GPU may still be absent at run time).
CUDA_COMPILED: bool = _sa_native.cuda_compiled

__all__ = [
    "CUDA_COMPILED",
    "SuffixAutomatonPool",
    "UnknownRequestError",
    "longest_repeated_suffix",
]
