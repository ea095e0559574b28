"""mptrain: a Hydra-driven training runner where numerical precision is the subject."""

__version__ = "0.1.0"
