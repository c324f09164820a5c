"""The last resort on device targets: an op no generated template covers yet runs its torch
reference on the device's tensors. Kernel selection takes it only when nothing else supports the
call (this module is imported last), and the compile summary and docs/kernels.md count these
calls, so what is not a generated kernel is visible."""
from ..targets import device_targets
from ..template import register
from .torch_ref import reference_template

register(reference_template("torch_device", device_targets()))
