"""Lazy-init checks: shared parameters across groups, models that differ across ranks."""
