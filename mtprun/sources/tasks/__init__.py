"""Task sources: one unit module each (contract: mtprun.spec.sources.TaskSource)."""
