"""Built-in tasks of the real backend beyond the toy agent task (gyre.real.agent)."""
