"""Megatron-MD: Magnitude–Direction decoupling inside megatron-core's optimizers.

Importing the package changes nothing. On a machine without CUDA, entry points call
``megatron.md.cpu_mode.maybe_activate()`` first (before megatron is imported): it redirects
megatron-core's CUDA calls to the CPU (see cpu_mode).
"""
