"""Where every durable byte of a task lives: the store seam (see base.py)."""
