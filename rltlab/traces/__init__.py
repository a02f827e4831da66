"""Trace collection (engine observer hook), sharded safetensors storage with checksums, and a
streaming dataset. See docs/workbench.md ("Trace format")."""
from rltlab.traces.collect import (TraceCollector, collect_traces, collection_overhead,
                                   random_projection)
from rltlab.traces.size import (NotEnoughDiskSpace, check_disk, trace_bytes,
                                written_bytes)
from rltlab.traces.stats import round_stats, stats_from_logprobs
from rltlab.traces.storage import (ALL_FIELDS, TraceCorruptError, TraceDataset,
                                   TraceDirectoryLocked, TraceWriter, iter_shards, load_projection,
                                   load_traces, read_manifest, verify_traces)

__all__ = [
    "ALL_FIELDS", "NotEnoughDiskSpace", "TraceCollector", "TraceCorruptError", "TraceDataset", "TraceDirectoryLocked",
    "TraceWriter",
    "check_disk", "collect_traces", "collection_overhead", "iter_shards", "load_projection", "load_traces",
    "random_projection", "read_manifest", "round_stats", "stats_from_logprobs", "trace_bytes",
    "verify_traces", "written_bytes",
]
