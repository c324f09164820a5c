"""Expert parallelism and data-parallel attention on CPU with gloo (runtime/distributed.py): a
plan laid out over 2 or 4 ranks gives the single-process greedy tokens, token for token, through
the real launch paths (torchrun + the CLI, and LLM(plan=...) in each rank), with preemption and
after an EPLB re-placement; a world-size mismatch and a killed rank stop with one line."""
from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.ir.ops.expert_parallel import initial_slots
from deepinfer.passes.driver import CompileOptions, compile_model
from deepinfer.runtime.eplb import imbalance, rebalance
from deepinfer.runtime.plan_file import PlanError

from multirank import finish, free_port, rank_env, run_ranks, start_ranks

PROMPTS = ["The sky is", "Hello there", "One two three four"]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def plans(tiny_plan_and_weights, tmp_path_factory):
    """The session's single-process tiny plan and its checkpoint, and the same model laid out
    for 2 ranks (replicated attention), 2 ranks of data-parallel attention with 2 redundant
    expert slots, and 4 ranks."""
    single, ckpt = tiny_plan_and_weights
    root = tmp_path_factory.mktemp("ep_plans")
    out = {"single": single, "ckpt": ckpt}
    for name, ep, dp, red in (("ep2", 2, 1, 0), ("ep2dp2", 2, 2, 2), ("ep4", 4, 1, 0)):
        opts = CompileOptions("cpu", max_model_len=512, max_num_seqs=4, ep=ep, dp=dp, redundant_experts=red)
        out[name] = compile_model("v4.1-flash-tiny", opts, root / name).plan_dir
    return out


def generated(stdout: str) -> list[str]:
    return [json.loads(m) for m in re.findall(r'^\[\d+\] output: (".*")  \(', stdout, flags=re.M)]


def package_env(**extra) -> dict:
    env = rank_env(0, 1, 0, **extra)
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        env.pop(k)
    return env


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


@pytest.fixture(scope="module")
def single_outputs(plans, one_torch_thread):
    """The single-process greedy generations: (token ids, text) per prompt."""
    llm = LLM(plan=plans["single"], weights=plans["ckpt"], speculative=0)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return [(o.token_ids, o.text) for o in outs]


def test_layout_is_recorded_and_each_rank_holds_its_experts(plans):
    plan = json.loads((Path(plans["ep2dp2"]) / "plan.json").read_text())
    lay = plan["layout"]
    assert (lay["world_size"], lay["ep"], lay["dp"], lay["exchange"]) == (2, 2, 2, "all-to-all")
    block = lay["moe_blocks"]["layers.0.ffn"]
    assert (block["experts"], block["slots"]) == (16, 18)  # 16 experts + 2 redundant, 9 per rank
    assert plan["params"]["layers.0.ffn.experts.w1"]["type"].startswith("fp4e2m1[9,")
    assert json.loads((Path(plans["ep2"]) / "plan.json").read_text())["layout"]["exchange"] == "all-gather"
    single = json.loads((Path(plans["single"]) / "plan.json").read_text())
    assert single["layout"]["world_size"] == 1 and not single["layout"]["moe_blocks"]


def test_a_plan_under_another_world_size_is_refused_in_one_line(plans, tmp_path):
    with pytest.raises(PlanError, match=r"laid out for 2 ranks \(ep 2, dp 1\); this run has 1 process"):
        LLM(plan=plans["ep2"], weights=plans["ckpt"])
    p = subprocess.run([sys.executable, "-m", "deepinfer", "generate", str(plans["ep4"]), "--weights",
                        str(plans["ckpt"]), "--prompt", "x", "--max-tokens", "1"], capture_output=True, text=True,
                       env=package_env(), cwd=tmp_path, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "laid out for 4 ranks" in p.stderr
    assert "torchrun --nproc-per-node 4" in p.stderr


def cli_args(plan, ckpt, prompts_file, max_tokens=MAX_TOKENS) -> list[str]:
    return ["-m", "deepinfer", "generate", str(plan), "--weights", str(ckpt), "--prompts", str(prompts_file),
            "--max-tokens", str(max_tokens), "--temperature", "0"]


def test_ep2_torchrun_generate_equals_single_process(plans, single_outputs, prompts_file, tmp_path):
    """The real launch: torchrun, two processes of the CLI, experts sharded 8 + 8."""
    torchrun = Path(sys.executable).parent / "torchrun"
    args = [str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()),
            *cli_args(plans["ep2"], plans["ckpt"], prompts_file)]
    p = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=300, env=package_env())
    assert p.returncode == 0, p.stderr[-3000:]
    assert generated(p.stdout) == [text for _, text in single_outputs]


def test_ep4_generate_equals_single_process(plans, single_outputs, prompts_file, tmp_path):
    """Four ranks of four experts each, started as torchrun starts them (its environment)."""
    outs = run_ranks(cli_args(plans["ep4"], plans["ckpt"], prompts_file), 4, tmp_path, timeout=400)
    assert [rc for rc, _, _ in outs] == [0] * 4, outs[0][2][-3000:]
    assert generated(outs[0][1]) == [text for _, text in single_outputs]
    assert not any(generated(o) for _, o, _ in outs[1:])  # rank 0 owns the outputs
