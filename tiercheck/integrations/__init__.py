"""Plugins for training frameworks: ``tiercheck.integrations.deepspeed`` and ``tiercheck.integrations.megatron``.

Each is imported on its own and needs its framework installed; ``import tiercheck`` imports neither.
"""
