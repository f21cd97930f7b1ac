"""Drafters side by side behind one batched interface, and the protocol that replays them.

`drafter.Drafter` is the interface, `replay` the teacher-forced protocol. `ours` wraps the
project's native suffix automaton pool; `arctic` and `vllm_ngram` wrap the peers, installed
only in the benchmark venv (`make bench-drafters`), never in the project's dependencies;
`sa_policies` is a slow pure-numpy ablation of which occurrence a draft continues from.
Importing this package imports none of them.
"""
