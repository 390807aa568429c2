"""Bridges to other trainers: :mod:`emapg.integrations.trl` (``EMAPGTrainer`` for TRL's GRPO, extra ``emapg[trl]``)."""
