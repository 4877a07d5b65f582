"""The compiler stages, each a function of the previous stage's output (see stages.py)."""
