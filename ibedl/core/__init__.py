"""The shared evidential core: Dirichlet math, option heads, prompts, artifacts and the predictor.

Light on purpose (torch, safetensors, transformers, peft): both ``ibedl.training`` and ``ibedl.serve`` import
it, and it imports neither.
"""

__version__ = "0.1.0"
