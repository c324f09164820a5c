"""Expert parallelism and data-parallel attention on CPU with gloo (runtime/distributed.py): a
plan laid out over 2 or 4 ranks gives the single-process greedy tokens, token for token, through
the real launch paths (torchrun + the CLI, and LLM(plan=...) in each rank), with preemption and
after an EPLB re-placement; a world-size mismatch and a killed rank stop with one line."""
from __future__ import annotations

import json
import re
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

from multirank import finish, free_port, rank_env, run_ranks, start_ranks, wait_for

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


RANK_SCRIPT = r"""
import json, sys
from deepinfer import LLM, SamplingParams
plan, ckpt, prompts, n = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
# 2 pages per attention group: two sequences of one group crossing 128 tokens cannot both grow
llm = LLM(plan=plan, weights=ckpt, max_model_len=256, num_pages=2)  # ranks > 0 serve rank 0 in here
params = SamplingParams(temperature=0, max_tokens=n)
ask = [{"prompt_token_ids": p} for p in prompts]
first = [o.token_ids for o in llm.generate(ask, params)]
ex = llm.engine.executor
preempted = llm.engine.scheduler.num_preemptions
moved = ex.rebalance()  # EPLB from the first run's load window; weights re-read between steps
second = [o.token_ids for o in llm.generate(ask, params)]
print(json.dumps({"first": first, "second": second, "preemptions": preempted, "moved": sorted(moved),
                  "placement": ex.runner.shard.placements["layers.0.ffn"]}))
"""

LONG_TOKENS = 6


@pytest.fixture(scope="module")
def long_prompts():
    """A prompt of 126 tokens, which needs a second page at 128, and two short ones: the first
    and the third share attention group 0 (PartitionedCache: most free slots, then the lowest)."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 129000, (n,), generator=g).tolist() for n in (126, 3, 4)]


def test_dp2_ep2_with_preemption_and_replacement_equals_single_process(plans, long_prompts, tmp_path):
    """LLM(plan=...) in each of two ranks, each running its own sequences (data-parallel
    attention) with the experts split 9 + 9 slots; the pool is small enough to preempt. Then EPLB
    re-places the experts from the load it saw, and the same requests give the same tokens."""
    argv = ["-c", RANK_SCRIPT, str(plans["ep2dp2"]), str(plans["ckpt"]), json.dumps(long_prompts), str(LONG_TOKENS)]
    ranks = start_ranks(argv, 2, tmp_path)
    llm = LLM(plan=plans["single"], weights=plans["ckpt"], max_model_len=256, speculative=0)
    want = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in long_prompts],
                                              SamplingParams(temperature=0, max_tokens=LONG_TOKENS))]
    outs = finish(ranks, timeout=400)
    assert [rc for rc, _, _ in outs] == [0, 0], outs[0][2][-3000:] + outs[1][2][-3000:]
    got = json.loads(outs[0][1].strip().splitlines()[-1])
    assert got["preemptions"] >= 1
    assert got["first"] == want
    assert got["moved"] and got["placement"] != initial_slots(16, 18)  # the placement did change
    assert got["second"] == want


EP_BENCH = Path(__file__).parent.parent / "bench" / "ep_multigpu.py"
EP_BENCH_ARGS = ["--batches", "2", "--prompt-len", "8", "--tokens", "3", "--skew", "3", "--check-prompts", "2",
                 "--check-tokens", "3"]


def test_the_ep_bench_agrees_with_the_single_process_run(plans, tmp_path):
    """bench/ep_multigpu.py (issue #16's run, here on gloo): the single-process run and two ranks of
    data-parallel attention with EPLB every 2 steps on a skewed mix; --compare finds the same
    greedy tokens, and says so when they differ."""
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    p = subprocess.run([sys.executable, str(EP_BENCH), "--plan", str(plans["single"]), "--weights", str(plans["ckpt"]),
                        "--out", str(one), *EP_BENCH_ARGS], capture_output=True, text=True, env=package_env(),
                       cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    outs = run_ranks([str(EP_BENCH), "--plan", str(plans["ep2dp2"]), "--weights", str(plans["ckpt"]), "--out", str(two),
                      *EP_BENCH_ARGS], 2, tmp_path, timeout=300, DEEPINFER_EPLB_INTERVAL=2)
    assert [rc for rc, _, _ in outs] == [0, 0], outs[0][2][-3000:]
    res = json.loads(two.read_text())
    row = res["batches"][0]
    assert (res["world_size"], res["attention_groups"], row["requests"], row["decode_tokens"]) == (2, 2, 4, 8)
    assert row["rebalances"] >= 1 and row["imbalance"] <= row["imbalance_first_placement"]
    cmp = [sys.executable, str(EP_BENCH), "--compare", str(one), str(two)]
    r = subprocess.run(cmp, capture_output=True, text=True, env=package_env(), timeout=60)
    assert r.returncode == 0 and "2 of 2 prompts equal" in r.stdout, r.stdout + r.stderr
    res["tokens"][1] = res["tokens"][1][:-1] + [res["tokens"][1][-1] + 1]
    two.write_text(json.dumps(res))
    r = subprocess.run(cmp, capture_output=True, text=True, env=package_env(), timeout=60)
    assert r.returncode == 1 and "1 of 2 prompts equal" in r.stdout, r.stdout + r.stderr


def test_eplb_lowers_the_busiest_rank_on_a_skewed_trace():
    """A Zipf-skewed routing trace (16 experts, 4 ranks, 50 steps of 1024 rows): the busiest
    rank's load over the mean, before and after re-placement. Measured: 2.12 -> 1.05 with 4
    redundant slots, 1.97 -> 1.64 with none (a hot expert alone then outweighs a rank's share)."""
    g = torch.Generator().manual_seed(0)
    n, ranks = 16, 4
    popularity = (1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** 1.2)[torch.randperm(n, generator=g)]
    trace = torch.stack([torch.bincount(torch.multinomial(popularity, 1024, replacement=True, generator=g),
                                        minlength=n) for _ in range(50)]).double()
    ratios = {}
    for redundant in (0, 4):
        slots = rebalance(trace, n + redundant, ranks)
        assert sorted(set(slots)) == list(range(n)) and len(slots) == n + redundant
        ratios[redundant] = (imbalance(trace, initial_slots(n, n + redundant), ranks), imbalance(trace, slots, ranks))
    print("max/mean rank load before -> after:", {k: tuple(round(x, 3) for x in v) for k, v in ratios.items()})
    assert ratios[0][1] < ratios[0][0] - 0.2
    assert ratios[4][0] > 1.9 and ratios[4][1] < 1.1


def test_a_killed_rank_stops_the_others_with_one_line(plans, prompts_file, tmp_path):
    procs = start_ranks(cli_args(plans["ep2"], plans["ckpt"], prompts_file, max_tokens=400), 2, tmp_path,
                        logs=tmp_path, DEEPINFER_DIST_TIMEOUT=30)
    wait_for(tmp_path / "rank0.err", "requests:", procs, timeout=300)  # both loaded, generating
    time.sleep(1)
    procs[1].send_signal(signal.SIGKILL)
    t = time.monotonic()
    (rc, _, _), _ = finish(procs, timeout=90)
    assert time.monotonic() - t < 60
    lines = [ln for ln in (tmp_path / "rank0.err").read_text().replace("\r", "\n").splitlines() if ln.strip()]
    assert rc == 2 and not any("Traceback" in ln for ln in lines), lines[-20:]
    assert re.match(r"deepinfer: error: rank 0: .* failed: another rank died or did not answer", lines[-1]), lines[-3:]


def test_sigint_stops_every_rank_cleanly(plans, prompts_file, tmp_path):
    procs = start_ranks(cli_args(plans["ep2"], plans["ckpt"], prompts_file, max_tokens=400), 2, tmp_path,
                        logs=tmp_path, DEEPINFER_DIST_TIMEOUT=30)
    wait_for(tmp_path / "rank0.err", "requests:", procs, timeout=300)
    for p in procs:  # as a terminal's Ctrl-C reaches every process torchrun started
        p.send_signal(signal.SIGINT)
    outs = finish(procs, timeout=60)
    assert [rc for rc, _, _ in outs] == [130, 130]
    for r in range(2):
        text = (tmp_path / f"rank{r}.err").read_text()
        assert "deepinfer: interrupted" in text and "Traceback" not in text, text[-2000:]
