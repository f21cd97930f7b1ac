"""Prefix affinity: send a prompt where its prefix is most likely cached, as pure functions.

A replica's prefix cache only helps the prompts that reach it, so turns of one
conversation (each resends the last one's prompt and answer) should reach the same
replica. A chat's key is its conversation's opening, which every turn starts with (the
ingress computes it: `GenerationRequest.affinity_key`); another prompt's is its first
`prefix_chars` characters (a prompt of token ids: its first `prefix_chars // 4` ids, about
as many tokens), and a prompt shorter than that gets no affinity (cheap to prefill anyway).
The replica is chosen by rendezvous hashing over the candidates: the one with the highest
hash of (key, replica id). It needs no state and no client cooperation: every router
instance (one per Ingress replica) picks the same replica for the same key, a replica
joining or leaving moves only the keys it wins or held, and it works with every OpenAI
client unmodified, where a session header would need each client to send one.

Affinity never overrides speculation or load: the preferred replica goes first only if a
request there would speculate whenever one anywhere would (it is not over its gate while
another replica is under), and it holds at most `max_extra_load` requests more than the
least loaded candidate. Otherwise `rank_replicas` decides alone. Many conversations behind
one long shared system prompt hash to one replica; the load bound spreads them, and the
replicas they spill to cache the shared part too. Standard library only.
"""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence

from replicas.speculation.ranking import ReplicaLoad, rank_replicas

AFFINITY_PREFIX_CHARS = 512  # about 2-4 blocks of 32 tokens of English or code
AFFINITY_MAX_EXTRA_LOAD = 2  # requests the preferred replica may hold beyond the least loaded


def prefix_key(prompt: str | Sequence[int], prefix_chars: int = AFFINITY_PREFIX_CHARS) -> Optional[bytes]:
    """The affinity key of a prompt (text or token ids); None when it is shorter than the key."""
    if isinstance(prompt, str):
        return prompt[:prefix_chars].encode() if len(prompt) >= prefix_chars else None
    prefix_tokens = max(1, prefix_chars // 4)
    if len(prompt) < prefix_tokens:
        return None
    return b"ids:" + ",".join(str(int(t)) for t in prompt[:prefix_tokens]).encode()


def preferred_replica(key: bytes, replica_ids: Sequence[str]) -> Optional[str]:
    """Rendezvous hashing: the replica id with the highest hash of (key, id); None for no ids."""
    def score(replica_id: str) -> bytes:
        return hashlib.blake2b(key + b"\0" + replica_id.encode(), digest_size=8).digest()

    return max(replica_ids, key=score, default=None)


def affinity_holds(preferred: ReplicaLoad, loads: Sequence[ReplicaLoad],
                   max_extra_load: int = AFFINITY_MAX_EXTRA_LOAD) -> bool:
    """May the preferred replica go first? Not over its gate while another would speculate
    the request, and at most `max_extra_load` above the least loaded candidate."""
    if not preferred.speculates_next and any(r.speculates_next for r in loads):
        return False
    return preferred.load <= min(r.load for r in loads) + max_extra_load


def rank_with_affinity(loads: Sequence[ReplicaLoad], key: Optional[bytes],
                       max_extra_load: int = AFFINITY_MAX_EXTRA_LOAD) -> list[ReplicaLoad]:
    """`rank_replicas`, with the key's preferred replica moved first when affinity holds."""
    ranked = rank_replicas(loads)
    if key is None or not loads:
        return ranked
    preferred_id = preferred_replica(key, [r.replica_id for r in loads])
    preferred = next(r for r in loads if r.replica_id == preferred_id)
    if not affinity_holds(preferred, loads, max_extra_load):
        return ranked
    return [preferred] + [r for r in ranked if r is not preferred]
