"""Microbenchmarks, the roofline table, recorded reports and the deviceless TPU compile matrix."""
