"""Every kernel template; importing a module registers its templates."""
from . import torch_ref  # noqa: F401
from . import tilelang_moe_decode  # noqa: F401  (before triton_ops: decode MoE GEMMs take it first where built)
from . import tilelang_gemm_decode  # noqa: F401  (likewise for decode fp8 GEMMs, where a target enables it)
from . import tilelang_moe_prefill  # noqa: F401  (and prefill MoE GEMMs on bf16 MMAs, where a target enables it)
from . import tilelang_prefill_bf16  # noqa: F401  (and the prefill fp8 linears on bf16 MMAs, likewise)
from . import triton_ops  # noqa: F401
from . import tilelang_gemm  # noqa: F401
from . import tilelang_moe  # noqa: F401
from . import tilelang_attention  # noqa: F401
from . import tilelang_indexer  # noqa: F401
from . import ascend_ops  # noqa: F401
from . import ascend_gemm  # noqa: F401
from . import ascend_moe  # noqa: F401
from . import ascend_attention  # noqa: F401
from . import ascend_vector  # noqa: F401
from . import ascend_vector_quant  # noqa: F401
from . import ascend_state  # noqa: F401
from . import ascend_moe_route  # noqa: F401
from . import ascend_indexer  # noqa: F401
from . import ascend_heads  # noqa: F401
from . import torch_device  # noqa: F401  (last: only where no generated template fits)
