"""The ``comera`` torch.compile backend and whole-step CUDA Graph capture of training."""

from comera_compile.compile.backend import comera_backend, graphs_compiled, tensorized_nodes
from comera_compile.compile.model import compile_model
from comera_compile.compile.options import BackendOptions, parse_options
from comera_compile.compile.train_step import TrainStep, capture_train_step
from comera_compile.planner.ops import traced_plans

__all__ = [
    "BackendOptions",
    "TrainStep",
    "capture_train_step",
    "comera_backend",
    "compile_model",
    "graphs_compiled",
    "parse_options",
    "tensorized_nodes",
    "traced_plans",
]
