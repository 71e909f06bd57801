"""What a worker may report of itself on the wire: the names its HEARTBEAT figures and its
measured figures (PLACE, REGISTER) may have. A message keeps only these (wire_types'
``scalar_map``): a newer peer's other figures are not carried on, and every map that
reaches STATUS stays bounded.
"""

from __future__ import annotations

from zmqllm.config.weighted_split import FIGURE_FIELDS

__all__ = ["FIGURE_KEYS", "MEASURED_KEYS"]

# What a worker's HEARTBEAT may report (Stage.heartbeat_figures); nothing else is carried on.
FIGURE_KEYS = frozenset(
    {
        "sessions",
        "kv_tokens_reserved",
        "kv_bytes_reserved",
        "forwards",
        "tokens",
        "last_batch",
        "max_batch",
        "mean_batch",
        "mean_forward_ms",
        "last_forward_ms",
        "busy_s",
        "rss_bytes",
        "cuda_allocated_bytes",
        "cuda_reserved_bytes",
        # The node's health (worker/health.py): CPU seconds of the process so far, bytes
        # it received and sent on the bus, KV bytes holding tokens (of those reserved),
        # the GPU's memory in use and in all (every process's, as the driver counts it).
        "cpu_s",
        "net_rx_bytes",
        "net_tx_bytes",
        "kv_bytes_used",
        "cuda_used_bytes",
        "cuda_total_bytes",
        # Prefix caching (engine/prefix_cache.py): tokens held now; prompt tokens asked
        # for and found since the start.
        "prefix_cached_tokens",
        "prefix_query_tokens",
        "prefix_hit_tokens",
        # Speculative decoding (engine/prompt_lookup.py, a last stage that speculates):
        # tokens proposed and accepted, passes of speculating sessions and their tokens.
        "spec_proposed",
        "spec_accepted",
        "spec_passes",
        "spec_tokens",
        "spec_tokens_per_pass",
        # What a worker dropped or failed on, by reason (worker/faults.py's FAULT_REASONS).
        "fault_malformed",
        "fault_unexpected",
        "fault_bad_request",
        "fault_internal",
        "fault_forward_failed",
        "fault_unsent",
        "fault_overloaded",
        "fault_peer_refused",
    }
)


# What a worker measured of itself (Place.figures, Register.measured).
MEASURED_KEYS = frozenset(FIGURE_FIELDS)
