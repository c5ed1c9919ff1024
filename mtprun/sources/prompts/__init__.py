"""Prompt sources: one unit module each (contract: mtprun.spec.sources.PromptSource)."""
