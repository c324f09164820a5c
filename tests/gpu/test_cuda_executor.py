"""The compiled tiny sm90 plan on the GPU: every call against its op's reference on the GPU's own
inputs (bench/runtime_sm90.local_check), and offline generation through LLM(plan=...) with the
decode buckets captured as CUDA graphs. Needs an sm90 GPU and TileLang (the plan is compiled
here, into a temporary directory). Run: python -m pytest -m gpu tests/gpu/test_cuda_executor.py
"""
import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):  # pragma: no cover
    pytest.skip("needs an sm90 GPU", allow_module_level=True)
pytest.importorskip("tilelang")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import runtime_sm90 as rt  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.models.checkpoint import make_checkpoint  # noqa: E402
from deepinfer.passes.driver import CompileOptions, compile_model  # noqa: E402

# bf16 outputs of these fp32-accumulating Triton kernels have been seen 2 ulp from the fp64
# reference at single elements (docs/kernels.md); anything else is a failure
TWO_ULP_KNOWN = {"triton_hc_pre", "triton_hc_expand", "triton_engram_gate"}


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    root = tmp_path_factory.mktemp("sm90")
    opts = CompileOptions("sm90", max_model_len=2048, max_num_seqs=8, decode_batches=(1, 2, 4, 8),
                          prefill_tokens=(512,), jobs=os.cpu_count() or 1)
    return compile_model("v4.1-flash-tiny", opts, root / "plan").plan_dir, make_checkpoint(
        "v4.1-flash-tiny", root / "ckpt", seed=11)


def test_every_call_matches_its_reference(plan):
    res = rt.local_check(str(plan[0]))
    bad = [f for f in res["failures"]
           if not (f["template"] in TWO_ULP_KNOWN and "beyond 1 ulp" in f["why"]
                   and int(f["why"].split(":")[1].split()[0]) <= 3)]
    assert not bad, bad[:5]
    assert sum(r["calls"] for r in res["per_template"].values()) > 1000


def test_generate_through_the_engine(plan):
    llm = LLM(plan=plan[0], weights=plan[1], max_num_seqs=4, max_model_len=1024, max_num_batched_tokens=512)
    outs = llm.generate(prompt_token_ids=[[5, 6, 7, 8], list(range(100, 160))],
                        sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [8, 8]
    ex = llm.engine.executor
    assert ex.graph_status and all(v == "captured" for v in ex.graph_status.values()), ex.graph_status
