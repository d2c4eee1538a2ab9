"""Names vulture reports as unused that are called where it cannot see (scripts/dead_code.py).

Never executed: each line only names what is used, with why. Add a name here only when it is called
by name from outside Python's view (a library callback, a string, a user's notebook), never to hide
code that nothing calls.
"""
# ruff: noqa: B018, F821

# A user's own readers of the run archive: docs/archive.md shows them (DuckDB, Polars, pandas).
archive_url
polars_storage_options
duckdb_connect

# The simulated engine's length distribution as its module docstring defines it
# (astraflow/engines/simulated.py: "see SimulatedEngineConfig.quantile"), for sizing max_tokens.
_.quantile

# kafka-python calls a ConsumerRebalanceListener's callbacks on every rebalance.
_.on_partitions_revoked
_.on_partitions_assigned

# Archiver.before_commit is a hook: its argument is for the subclasses that override it.
uploaded

# Megatron builds the core attention with these keyword arguments and calls forward with them; our
# SDPACoreAttention takes them to keep Megatron's signature.
layer_number
attn_mask_type
attention_type
attention_mask
# Megatron's RotaryEmbedding.forward calls get_emb, which _HostRotaryEmbedding overrides.
_.get_emb

# vLLM loads the worker extension by its dotted name (connectors/vllm/launch.py WORKER_EXTENSION) and
# the node calls its methods by name through collective_rpc (connectors/vllm/server.py).
AstraFlowWorker
_.astraflow_info
_.astraflow_fetch
_.astraflow_apply

