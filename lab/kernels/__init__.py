"""Kernels: attention (every implementation, one dispatch), the collective matmul, and the
pipeline schedule. shard_map and Pallas code with no model in it: each is checked against a
plain reference in tests/.
"""
