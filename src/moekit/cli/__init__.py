"""The `moekit` command line: one module per command (info, demo, bench, tune, eplb)."""
