"""The pretraining entry point's pieces: flags, presets, model/data providers, megatron patches,
metrics. ``pretrain_gpt.py`` at the repository root wires them into ``megatron.training``."""
