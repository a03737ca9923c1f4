"""comera_compile: train PyTorch models directly in tensor-train compressed form (CoMERA)."""

__version__ = "0.1.0"
