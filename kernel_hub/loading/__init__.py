"""From an op name to a loaded kernel: resolution (in-tree, hub, lock), import, per-op overrides."""
