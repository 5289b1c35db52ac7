"""Token mixers, one file each; files starting with ``_`` are cores the mixers share (the
scalar-decay recurrence, the attention masks), not parts."""
