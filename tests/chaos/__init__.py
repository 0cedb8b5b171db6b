"""Process-level chaos campaigns: real workers, real signals, an external record of effects."""
