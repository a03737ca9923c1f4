"""Rank-adaptive training inside the training loops people already use.

- ``comera_compile.integrations.huggingface``: ``RankAdaptiveCallback`` and
  ``RankAdaptiveHFTrainer`` for ``transformers.Trainer``;
- ``comera_compile.integrations.lightning``: ``RankAdaptation``, a Lightning callback
  (``pip install comera_compile[lightning]``).

Each module imports its framework only when imported itself.
"""
