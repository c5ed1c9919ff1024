"""Reward sources: one unit module each (contract: mtprun.spec.sources.RewardSource)."""
