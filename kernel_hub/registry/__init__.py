"""The registry (registry.yaml: op names -> kernels) and kernel manifests (kernel.yaml)."""
