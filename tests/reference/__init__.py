"""Plain PyTorch reference of DeepSeek-V4.1-Flash (HF-REF semantics), the oracle of the project's
graph interpreter and compiled plans.  Independent of deepinfer.ir / deepinfer.models / deepinfer.passes."""
from .config import Config, Role, layer_role
from .engram import engram_constants
from .model import ReferenceModel, SequenceState

__all__ = ["Config", "Role", "layer_role", "engram_constants", "ReferenceModel", "SequenceState"]
