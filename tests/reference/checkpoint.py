"""Reading a checkpoint in the real format (spec §8): tensors by name, dequantised per §3.5."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from . import numerics as nx


class Checkpoint:
    """`model.safetensors.index.json` + shards; names carry no `model.` prefix (§8.1)."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        index = json.loads((self.dir / "model.safetensors.index.json").read_text())
        self.weight_map: dict[str, str] = index["weight_map"]
        self._files: dict[str, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def raw(self, name: str) -> torch.Tensor:
        shard = self.weight_map[name]
        if shard not in self._files:
            self._files[shard] = safe_open(str(self.dir / shard), framework="pt")
        return self._files[shard].get_tensor(name)

    def linear(self, prefix: str) -> torch.Tensor:
        """The exact value of `prefix.weight` (FP8 32x32 blocks (§3.5), FP4 experts, or plain BF16/F32),
        held as fp64 because nx.mm32 accumulates in fp64 (every value is exact in fp32 too)."""
        w = self.raw(prefix + ".weight")
        if w.dtype == torch.float8_e4m3fn:
            return nx.dequant_fp8_weight(w, self.raw(prefix + ".scale")).double()
        if w.dtype in (torch.int8, torch.uint8):
            return nx.dequant_fp4_weight(w, self.raw(prefix + ".scale")).double()
        assert w.dtype in (torch.bfloat16, torch.float32), (prefix, w.dtype)
        return w.double()

    def engram_table(self, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(e4m3 rows [R, d], UE8M0 bytes [R, d/32]) of an Engram table; rows are gathered at use."""
        return self.raw(prefix + ".weight"), self.raw(prefix + ".scale").view(torch.uint8)
