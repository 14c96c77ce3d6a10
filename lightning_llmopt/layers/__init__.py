"""layers: see docs/architecture.md. Filled in by later issues."""
