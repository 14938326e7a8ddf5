"""Tensor parallelism across processes: process groups named after the cluster, and the
executor through which one rank drives the others."""
