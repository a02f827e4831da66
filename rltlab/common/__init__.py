"""Helpers every stage uses: atomic file writes and strict JSON (atomic), where the shipped
artifacts live (paths), environment facts for metrics (environment), and data-parallel
primitives over accelerate (distributed)."""
