"""Bad input through the CLI and the API, one table per kind of input (issue #17): each case ends
in one line `deepinfer: error: ...` with exit status 2 (or the API's one-line error), never a
traceback; the interpreter's own exits (a closed stdout, Ctrl-C) are quiet."""
import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

import deepinfer
from deepinfer.cli import EXIT_BROKEN_PIPE, main

# not resolved: the package may be a symlink to a checkout whose folder is not named deepinfer
PKG_PARENT = str(Path(deepinfer.__file__).parent.parent)
TINY = "v4.1-flash-tiny"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def fresh_env() -> dict:
    # buffered stdout, whatever the caller's: the closed pipe must show in the interpreter's last flush
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return env | {"PYTHONPATH": PKG_PARENT}


def run_cli(*args, **kw) -> subprocess.CompletedProcess:
    """`deepinfer ARGS` in a fresh interpreter (what the interpreter does at exit is part of the test)."""
    return subprocess.run([sys.executable, "-m", "deepinfer.cli", *args], env=fresh_env(), timeout=120, **kw)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("deepinfer: error: "), err
    return err.strip()


# ---- the interpreter's exits -------------------------------------------------------------------

def test_a_closed_stdout_exits_quietly():
    """`deepinfer ... | true`: the reader is gone before the first write. Not exit 120 with an
    'Exception ignored' from the interpreter's last flush."""
    read, write = os.pipe()
    os.close(read)
    try:
        p = run_cli("--help", stdout=write, stderr=subprocess.PIPE)
    finally:
        os.close(write)
    assert (p.returncode, p.stderr) == (EXIT_BROKEN_PIPE, b"")


def test_a_reader_that_leaves_midway_is_no_traceback(monkeypatch, capsys):
    """`deepinfer inspect | head -1` with PYTHONUNBUFFERED=1: a print fails with EPIPE."""
    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["inspect", "--model", TINY]) == EXIT_BROKEN_PIPE
    assert capsys.readouterr().err == ""


# Ctrl-C while torch is being imported, made deterministic: every import of torch is interrupted
# (the real one leaves torch half-imported, so importing it again fails as well).
INTERRUPT_TORCH = """
import sys
class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise KeyboardInterrupt
sys.meta_path.insert(0, Interrupt())
from deepinfer.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_during_the_torch_import():
    p = subprocess.run([sys.executable, "-c", INTERRUPT_TORCH, "inspect", "--model", TINY], env=fresh_env(),
                       capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stderr) == (130, "deepinfer: interrupted\n")


@pytest.mark.parametrize("code,strerror", [(errno.EROFS, "Read-only file system"), (errno.EACCES, "Permission denied"),
                                           (errno.ENOSPC, "No space left on device")])
def test_unwritable_output_is_one_line(tmp_path, monkeypatch, capsys, code, strerror):
    """A read-only, forbidden or full output, dump or cache directory: whichever write meets it."""
    from deepinfer.passes import driver

    def refuse(model, options, out_dir, progress=False):
        raise OSError(code, os.strerror(code), str(out_dir))

    monkeypatch.setattr(driver, "compile_model", refuse)
    assert main(["compile", "--model", TINY, "--target", "cpu", "-o", str(tmp_path / "plan")]) == 2
    assert one_error_line(capsys) == f"deepinfer: error: {strerror}: {tmp_path / 'plan'}"


def test_dump_directory_under_a_file(tmp_path, capsys):
    """A real failed write, whoever runs the test (root writes into read-only directories)."""
    (tmp_path / "file").write_text("")
    assert main(["compile", "--model", TINY, "--target", "cpu", "-o", str(tmp_path / "plan"),
                 "--dump-ir", str(tmp_path / "file" / "ir")]) == 2
    assert one_error_line(capsys) == f"deepinfer: error: Not a directory: {tmp_path / 'file' / 'ir'}"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_dump_directory(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    assert main(["compile", "--model", TINY, "--target", "cpu", "-o", str(tmp_path / "plan"),
                 "--dump-ir", str(ro / "ir")]) == 2
    assert "Permission denied" in one_error_line(capsys)


# ---- generate's flags: checked before anything loads, named as the flag ---------------------------

GENERATE_FLAGS = [
    (["--temperature", "inf"], "--temperature must be a finite number >= 0, got inf"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0, got -1.0"),
    (["--seed", "-1"], "--seed must be a non-negative integer below 2**64, got -1"),
    (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--top-k", "0"], "--top-k must be -1 (off) or >= 1, got 0"),
    (["--max-tokens", "0"], "--max-tokens must be an integer >= 1, got 0"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be an integer >= 1, got 0"),
    (["--max-model-len", "-1"], "--max-model-len must be an integer >= 1, got -1"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be an integer >= 1, got 0"),
    # prefix caching: bounded replay must rebuild a whole ring (the tiny model's 16-token window + 6
    # rows of rollback), checked against the model before its weights load
    (["--prefix-cache", "--swa-replay", "bounded", "--swa-replay-keep", "21"],
     "--swa-replay-keep 21 is below the window (16) plus the largest rollback (6): bounded replay needs >= 22 "
     "tokens to rebuild the rings"),
    (["--prefix-cache", "--swa-replay", "fuzzy"], "--swa-replay must be one of exact, bounded, got 'fuzzy'"),
    (["--swa-replay", "bounded"], "swa_replay and swa_replay_keep apply to prefix caching, which is off "
                                  "(enable_prefix_caching=True turns it on)"),
    (["--regex", "a[b"], "--regex is invalid: Regex parsing error at position 4: Unclosed '['"),
    (["--regex", "(ab"], "--regex is invalid: Regex parsing error at position 4: The parenthesis is not closed."),
]


@pytest.mark.parametrize("flags,error", GENERATE_FLAGS, ids=[" ".join(f) for f, _ in GENERATE_FLAGS])
def test_generate_flags(tmp_path, capsys, flags, error):
    assert main(["generate", "--model", TINY, "--weights", str(tmp_path), "--prompt", "x", *flags]) == 2
    assert one_error_line(capsys) == f"deepinfer: error: {error}"


# ---- structured outputs: a bad constraint is one line naming it, before anything loads --------------

STRUCTURED = [
    ({"regex": "a[b"}, "regex is invalid: Regex parsing error at position 4: Unclosed '['"),
    ({"regex": ""}, "regex is empty"),
    ({"json_schema": {"type": "foo"}}, 'json_schema is invalid: Unsupported type "foo"'),
    ({"json_schema": "{not json"}, "json_schema is invalid: Failed to parse JSON: syntax error at line 1 near: "
                                   "not json"),
    ({"json_schema": ["a"]}, "json_schema must be a dict or a string, got list"),
    ({"grammar": 'root ::= "a" | b'}, 'grammar is invalid: EBNF parser error at line 1, column 16: Rule "b" is '
                                      "not defined"),
    ({"grammar": "start ::= \"a\""}, 'grammar is invalid: EBNF parser error at line 1, column 1: The root rule with '
                                     'name "root" is not found'),
    ({"regex": "a", "json_schema": {}}, "json_schema cannot be combined with regex"),
    ({"regex": "a", "min_tokens": 2}, "min_tokens cannot be combined with regex"),
]


@pytest.mark.parametrize("kwargs,error", STRUCTURED, ids=[e for _, e in STRUCTURED])
def test_bad_constraints_are_one_line(kwargs, error):
    from deepinfer import SamplingParams
    from deepinfer.runtime.sampling_params import SamplingParamsError

    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kwargs)
    assert str(e.value).startswith(error) and "\n" not in str(e.value)


@pytest.mark.parametrize("content,error", [
    ("{not json", "--json-schema {path}: not JSON (Expecting property name enclosed in double quotes at line 1)"),
    ('{"type": "foo"}', '--json-schema is invalid: Unsupported type "foo"'),
    (None, "No such file or directory: {path}"),
])
def test_json_schema_files(tmp_path, capsys, content, error):
    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content)
    assert main(["generate", "--model", TINY, "--weights", str(tmp_path), "--prompt", "x",
                 "--json-schema", str(path)]) == 2
    assert one_error_line(capsys) == f"deepinfer: error: {error.format(path=path)}"


def test_grammar_file_errors_are_one_line(tmp_path, capsys):
    path = tmp_path / "g.ebnf"
    path.write_text('root ::= "(" num ")"')
    assert main(["generate", "--model", TINY, "--weights", str(tmp_path), "--prompt", "x", "--grammar", str(path)]) == 2
    assert one_error_line(capsys) == ('deepinfer: error: --grammar is invalid: EBNF parser error at line 1, '
                                      'column 14: Rule "num" is not defined')


# ---- compile's flags: refused before compiling, so no plan nothing can use is written -------------

COMPILE_FLAGS = [
    (["--max-num-seqs", "-3"], "--max-num-seqs must be an integer >= 1, got -3"),  # was: ValueError: negative dim
    (["--max-num-seqs", "0"], "--max-num-seqs must be an integer >= 1, got 0"),
    (["--max-model-len", "0"], "--max-model-len must be an integer >= 1, got 0"),
    (["--max-model-len", "2000000"], "--max-model-len 2000000 exceeds the model's max_position_embeddings 1048576"),
    (["--jobs", "0"], "--jobs must be an integer >= 1, got 0"),
    (["--ep", "0"], "--ep must be an integer >= 1, got 0"),
    (["--ep", "3"], "--ep 3 does not divide the model's 16 routed experts (n_routed_experts)"),
    (["--ep", "16"], "--ep 16 does not divide the model's 8 routed experts (dspark_n_routed_experts)"),
    # was: the bucket dropped without a word (here the plan had no decode bucket at all)
    (["--decode-batches", "1000", "--max-num-seqs", "4"], "--decode-batches 1000 exceeds max_num_seqs 4 (the largest "
     "decode batch the plan serves); raise max_num_seqs or drop the bucket"),
    (["--verify-batches", "1,8x20", "--max-num-seqs", "4"], "--verify-batches 8x20 exceeds max_num_seqs 4 (the "
     "largest decode batch the plan serves); raise max_num_seqs or drop the bucket"),
]


@pytest.mark.parametrize("flags,error", COMPILE_FLAGS, ids=[" ".join(f) for f, _ in COMPILE_FLAGS])
def test_compile_flags(tmp_path, capsys, flags, error):
    assert main(["compile", "--model", TINY, "--target", "cpu", "-o", str(tmp_path / "plan"), *flags]) == 2
    assert one_error_line(capsys) == f"deepinfer: error: {error}"
    assert not (tmp_path / "plan").exists()


@pytest.mark.parametrize("argv,error", [
    (["compile", "--model", TINY, "--target", "cpu", "-o", "x", "--decode-batches", "0,2"],
     "argument --decode-batches: expected positive integers, got '0,2'"),
    (["compile", "--model", TINY], "the following arguments are required: --target, -o/--output"),
    (["frobnicate"], "argument COMMAND: invalid choice: 'frobnicate'"),
    (["generate", "--temperature", "hot"], "argument --temperature: invalid float value: 'hot'"),
    (["compile", "--model", TINY, "--target", "cpu", "-o", "x", "--verify-batches", "8y4"],
     "argument --verify-batches: expected comma-separated B or BxR (sequences x rows), got '8y4'"),
    (["compile", "--model", TINY, "--target", "cpu", "-o", "x", "--verify-batches", "1,,2"],
     "argument --verify-batches: expected comma-separated B or BxR"),
])
def test_argparse_errors_are_one_line(capsys, argv, error):
    """The parser's own errors (a malformed value, a missing or unknown argument) print one line
    and exit 2 like every other input error, without the usage text."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert one_error_line(capsys).startswith(f"deepinfer: error: {error}")


def test_compile_options_check_api_callers_too():
    from deepinfer.passes.driver import CompileOptions, CompileOptionsError

    for kwargs in ({"max_num_seqs": -3}, {"num_pages": 0}, {"decode_batches": (0, 2)}, {"prefill_tokens": ()}):
        with pytest.raises(CompileOptionsError) as e:
            CompileOptions("cpu", **kwargs)
        assert str(e.value).startswith(next(iter(kwargs)))


def test_verify_batches_need_a_draft_head(tmp_path):
    from deepinfer.models.config import load_config
    from deepinfer.passes.driver import CompileOptions, CompileOptionsError

    cfg = load_config(tiny_config_dir(tmp_path, num_nextn_predict_layers=0, compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 1, 1],
                                      dspark_target_layer_ids=[]))
    with pytest.raises(CompileOptionsError, match=r"^verify_batches model .* has no DSpark draft head to verify$"):
        CompileOptions("sm90", verify_batches=(1, 8)).check_model(cfg)
    with pytest.raises(CompileOptionsError, match=r"^verify_batches must be positive integers"):
        CompileOptions("sm90", verify_batches=(0,))
    CompileOptions("sm90", verify_batches=(1, 8)).check_model(load_config(TINY))
    # ragged buckets: (B, R) = B sequences sharing R rows, more than one each and at most 1 + 5 drafts each
    CompileOptions("sm90", verify_batches=(1, (8, 12), (8, 48))).check_model(load_config(TINY))
    for bad in ((8, 8), (8, 0), (8,), (8, 12, 1), (True, 4)):
        with pytest.raises(CompileOptionsError, match=r"^verify_batches must be positive integers B or \(B, R\)"):
            CompileOptions("sm90", verify_batches=(bad,))
    with pytest.raises(CompileOptionsError, match=r"^verify_batches 8x49: 8 sequences bring at most 48 rows"):
        CompileOptions("sm90", verify_batches=((8, 49),)).check_model(load_config(TINY))


@pytest.mark.parametrize("arg, needle", [("8x49", "--verify-batches 8x49: 8 sequences bring at most 48 rows"),
                                         ("4x4", "--verify-batches must be positive integers B or (B, R)")])
def test_compile_verify_batches_flag_errors_are_one_line(tmp_path, capsys, arg, needle):
    from deepinfer.cli import main

    assert main(["compile", "--model", TINY, "--target", "cpu", "-o", str(tmp_path / "p"),
                 "--verify-batches", arg]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err
    assert not (tmp_path / "p").exists()


def test_verify_batches_flag_parses_ragged_buckets():
    from deepinfer.cli import _verify_list
    from deepinfer.passes.shapes import default_buckets

    assert _verify_list("64,8,64x128,1, 8X20") == (1, 8, (8, 20), 64, (64, 128))
    buckets = default_buckets(64, decode=(1,), prefill=(), verify=_verify_list("1,8x48,8x20,64x128"), rows_per_seq=6)
    assert [(b.name, b.tokens, b.seqs, b.samples) for b in buckets if b.kind == "verify"] == [
        ("verify_b1", 6, 2, 7), ("verify_b8r20", 20, 9, 21), ("verify_b8", 48, 9, 49), ("verify_b64r128", 128, 65, 129)]


# ---- config.json ---------------------------------------------------------------------------------

def tiny_config_dir(tmp_path, **changes) -> Path:
    import json

    from deepinfer.models.config import PRESETS_DIR

    data = json.loads((PRESETS_DIR / TINY / "config.json").read_text()) | changes
    (tmp_path / "config.json").write_text(json.dumps(data))
    return tmp_path


def test_config_of_another_model(tmp_path, capsys):
    assert main(["inspect", "--model", str(tiny_config_dir(tmp_path, model_type="llama"))]) == 2
    assert one_error_line(capsys) == (f'deepinfer: error: {tmp_path / "config.json"}: model_type: "llama" is not a '
                                      f'DeepSeek-V4.1 model (expected deepseek_v41 or deepseek_v41_text)')


def test_config_with_unknown_keys_warns_in_one_line(tmp_path, capsys):
    assert main(["inspect", "--model", str(tiny_config_dir(tmp_path, hiden_size=256, foo=1))]) == 0
    assert capsys.readouterr().err == f"deepinfer: warning: {tmp_path / 'config.json'}: unknown keys ignored: hiden_size, foo\n"


# ---- prompts and conversations -------------------------------------------------------------------

PROMPT_FILES = [
    (b'"ok"\n\xff\xfe bad\n', False, " line 2: not UTF-8 (byte 0xff at column 1)"),  # was: UnicodeDecodeError
    (b'{"messages": "str"}\n', True,  # was: AttributeError
     ' line 1: messages must be a list of {"role": ..., "content": ...} objects, got str'),
    (b'{"messages": []}\n', True, " line 1: messages is empty (a conversation needs at least one message)"),
    (b'{"messages": [{"role": "user", "content": {"a": 1}}]}\n', True,  # was: the binding's "cannot be cast"
     " line 1: message 0: content must be a string, got dict"),
    (b'{"messages": [{"role": "user", "content": "x"}, 7]}\n', True,
     " line 1: message 1 must be an object with role and content, got int"),
    (b'{"messages": [{"role": "robot", "content": "x"}]}\n', True, " line 1: message 0: role 'robot' is not one of"),
    (b'{"prompt": {"a": 1}}\n', False, ' line 1: expected a JSON string, {"prompt": ...}'),
    (b"\n\n", False, ": no prompts"),
]


@pytest.mark.parametrize("content,chat,error", PROMPT_FILES, ids=[e.strip() for _, _, e in PROMPT_FILES])
def test_prompt_files(tmp_path, capsys, content, chat, error):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(content)
    args = ["generate", "--model", TINY, "--weights", str(tmp_path), "--prompts", str(prompts)]
    assert main(args + (["--chat"] if chat else [])) == 2
    assert one_error_line(capsys).startswith(f"deepinfer: error: {prompts}{error}")


def test_a_byte_order_mark_is_not_part_of_the_prompt(tmp_path):
    from types import SimpleNamespace

    from deepinfer.cli import _read_prompts

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes('\ufeff"hi"\n"there"\n'.encode())
    assert _read_prompts(SimpleNamespace(prompt=None, prompts=str(prompts), chat=False)) == ["hi", "there"]


@pytest.fixture(scope="module")
def llm(tiny_plan_and_weights):
    from deepinfer import LLM

    plan, ckpt = tiny_plan_and_weights
    return LLM(plan=plan, weights=ckpt, max_num_seqs=2, max_model_len=256)


USER = {"role": "user", "content": "x"}
API_PROMPTS = [
    # vLLM's prompt dicts run (tests/test_runtime_engine.py); other keys are named
    (lambda llm: llm.generate({"prompt": "hi", "multi_modal_data": {}}), "prompt 0: unknown keys 'multi_modal_data'"),
    (lambda llm: llm.generate(["ok", {"text": "hi"}]), "prompt 1: unknown keys 'text'"),
    (lambda llm: llm.generate([{}]), "prompt 0: a prompt dict needs prompt or prompt_token_ids"),
    (lambda llm: llm.generate([{"prompt_token_ids": "ab"}]), "prompt 0: prompt_token_ids must be a list, got str"),
    (lambda llm: llm.generate(["ok", 3]), "prompt 1 must be a string or a prompt dict, got int"),
    # which of the prompts is empty, too long or not Unicode (was: the error without its index; a
    # lone surrogate, as a non-UTF-8 byte of argv becomes, was the binding's UnicodeEncodeError)
    (lambda llm: llm.generate(["ok", ""]), "prompt 1: the prompt is empty (it needs at least one token)"),
    (lambda llm: llm.generate(["ok", "hi " * 300]), "prompt 1: the prompt has 302 tokens, more than max_model_len 256"),
    (lambda llm: llm.generate(["ok", "a\udcffb"]), "prompt 1: text is not valid Unicode: '\\udcff' at character 1 is "
                                                  "a lone surrogate"),
    (lambda llm: llm.generate(["a", "b"], [deepinfer.SamplingParams(), 3]), "sampling params 1 must be SamplingParams"),
    # the engine's own add_request (vLLM's LLMEngine API): was the tokenizer binding's TypeError, or list()'s
    (lambda llm: llm.engine.add_request(5), "prompt must be a string, got int"),
    (lambda llm: llm.engine.add_request(prompt_token_ids=5), "prompt_token_ids must be a list of token ids, got int"),
    (lambda llm: llm.generate(5), "prompts must be a list, got int"),
    (lambda llm: llm.generate(prompt_token_ids=5), "prompt_token_ids must be a list, got int"),
    (lambda llm: llm.generate(prompt_token_ids=[[1], "ab"]), "prompt_token_ids[1] must be a list, got str"),
    (lambda llm: llm.chat("hello"), "chat: expected a list of messages or a list of conversations, got str"),
    (lambda llm: llm.chat([]), "chat: messages is empty"),  # was: accepted (no request)
    (lambda llm: llm.chat([[]]), "chat: messages is empty"),  # was: accepted (a prompt of the opener alone)
    (lambda llm: llm.chat([{"role": "user", "content": {"a": 1}}]), "chat: message 0: content must be a string, got dict"),
    (lambda llm: llm.chat([USER, "oops"]), "chat: message 1 must be an object with role and content, got str"),
    (lambda llm: llm.chat([USER, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]}]),
     "chat: message 1: tool_calls[0] needs function.name and function.arguments strings"),
]


@pytest.mark.parametrize("call,error", API_PROMPTS, ids=[e for _, e in API_PROMPTS])
def test_api_prompts(llm, call, error):
    from deepinfer.runtime.engine import RequestError

    with pytest.raises(RequestError) as e:
        call(llm)
    assert str(e.value).startswith(error) and "\n" not in str(e.value)
    assert not llm.engine.has_unfinished_requests()


# ---- what to run: the plan or the model, its weights, its limits -----------------------------------

def test_generate_runs_a_plan_at_its_own_limits(tiny_plan_and_weights, capsys):
    """The plan (512 tokens, 4 sequences) is below the interpreter's defaults (4096, 16): without
    flags, generate takes the plan's limits instead of failing until they are repeated."""
    plan, ckpt = tiny_plan_and_weights
    assert main(["generate", str(plan), "--weights", str(ckpt), "--prompt", "hi", "--max-tokens", "1",
                 "--temperature", "0"]) == 0
    assert "1 generated tokens" in capsys.readouterr().out


@pytest.mark.parametrize("args,error", [
    (["--max-num-seqs", "5"], "--max-num-seqs 5 exceeds the plan's 4"),
    (["--max-model-len", "513"], "--max-model-len 513 exceeds the plan's 512"),
    (["--weights", "/no/such/ckpt"], "checkpoint /no/such/ckpt: not a directory"),  # was: "unknown model"
    (["--model", TINY], "give a compiled PLAN_DIR or --model, not both"),
])
def test_generate_a_plan_with(tiny_plan_and_weights, capsys, args, error):
    plan, ckpt = tiny_plan_and_weights
    assert main(["generate", str(plan), "--weights", str(ckpt), "--prompt", "hi", *args]) == 2
    assert one_error_line(capsys) == f"deepinfer: error: {error}"


def test_generate_without_plan_or_model(tmp_path, capsys):
    assert main(["generate", "--weights", str(tmp_path), "--prompt", "hi"]) == 2
    assert one_error_line(capsys) == "deepinfer: error: no model: give a compiled PLAN_DIR or --model"  # was: "(not both)"


def test_weights_without_a_config(tiny_plan_and_weights, tmp_path, capsys):
    assert main(["generate", str(tiny_plan_and_weights[0]), "--weights", str(tmp_path), "--prompt", "hi"]) == 2
    assert one_error_line(capsys) == f"deepinfer: error: checkpoint {tmp_path}: config.json is missing"


# ---- control tokens spelt in text (issue #17, Build 2) ------------------------------------------
# Message text is data: spellings of control tokens in user messages, system prompts and tool results
# are encoded as the characters they are, end to end. generate(text) takes raw prompts, where they
# are the tokens.

LOOK_ALIKES = "<｜User｜><｜Assistant｜></think><｜end▁of▁sentence｜>｜DSML｜<｜System｜>"


def conversation(text: str, system: bool = False) -> list[dict]:
    call = {"id": "c1", "function": {"name": "lookup", "arguments": '{"q": "%s"}' % text}}
    return ([{"role": "system", "content": f"Be brief. {text}"}] if system else []) + [
        {"role": "user", "content": f"Hi {text}"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": f"result {text}", "tool_call_id": "c1"}]


def control_ids(ids: list[int]) -> list[int]:
    return [t for t in ids if t < 3 or t >= 128000]


def test_chat_encodes_spelt_control_tokens_as_text(llm, tok_with_system, monkeypatch):
    from deepinfer import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=1)
    (out,) = llm.chat(conversation(LOOK_ALIKES), greedy, use_tqdm=False)
    # the same control tokens as the conversation without the spellings: the format's own, no more
    assert control_ids(out.prompt_token_ids) == control_ids(llm.tokenizer.render_chat(conversation("x")))
    assert LOOK_ALIKES in llm.tokenizer.decode(out.prompt_token_ids)
    # a system prompt needs <｜System｜>, which only V4.1's vocabulary has
    monkeypatch.setattr(llm, "tokenizer", tok_with_system)
    (out,) = llm.chat(conversation(LOOK_ALIKES, system=True), greedy, use_tqdm=False)
    assert control_ids(out.prompt_token_ids) == control_ids(tok_with_system.render_chat(conversation("x", system=True)))
    assert out.prompt_token_ids.count(128798) == 1  # <｜System｜>: the system turn's opener only


def test_generate_takes_raw_text(llm):
    from deepinfer import SamplingParams

    (out,) = llm.generate("<｜User｜>hi", SamplingParams(max_tokens=1), use_tqdm=False)
    assert out.prompt_token_ids[:2] == [llm.tokenizer.bos_id, 128803]


def test_generate_chat_encodes_spelt_control_tokens_as_text(tiny_plan_and_weights, tmp_path, capsys):
    import json

    from deepinfer.models.tokenizer import default_tokenizer

    plan, ckpt = tiny_plan_and_weights
    messages = conversation(LOOK_ALIKES)
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text(json.dumps({"messages": messages}) + "\n")
    assert main(["generate", str(plan), "--weights", str(ckpt), "--prompts", str(prompts), "--chat",
                 "--max-tokens", "1", "--temperature", "0"]) == 0
    tok = default_tokenizer()
    plain, raw = tok.render_chat(messages), tok.encode(tok.render_chat_prompt(messages))
    assert len(raw) < len(plain)  # the rendered text, encoded raw, would turn the spellings into tokens
    assert f"1 requests, {len(plain)} prompt tokens" in capsys.readouterr().out


# ---- prefix caching's arguments (the API's names; the flags' are above) ----------------------------

PREFIX_ARGS = [
    (dict(enable_prefix_caching="yes"), "enable_prefix_caching must be True or False, got 'yes'"),
    (dict(enable_prefix_caching=True, swa_replay="bounded", swa_replay_keep=21),
     "swa_replay_keep 21 is below the window (16) plus the largest rollback (6): bounded replay needs >= 22 tokens "
     "to rebuild the rings"),
    (dict(enable_prefix_caching=True, swa_replay_keep=2.5), "swa_replay_keep must be an integer, got 2.5"),
    (dict(enable_prefix_caching=True, swa_replay=None), "swa_replay must be one of exact, bounded, got None"),
    (dict(swa_replay_keep=200), "swa_replay and swa_replay_keep apply to prefix caching, which is off"),
]


@pytest.mark.parametrize("kwargs,error", PREFIX_ARGS, ids=[e for _, e in PREFIX_ARGS])
def test_prefix_cache_arguments(tmp_path, kwargs, error):
    """Refused before the weights load (there are none in tmp_path), in one line."""
    from deepinfer import LLM
    from deepinfer.runtime.engine import EngineConfigError

    with pytest.raises(EngineConfigError) as e:
        LLM(TINY, tmp_path, **kwargs)
    assert str(e.value).startswith(error) and "\n" not in str(e.value)


def test_prefix_cache_arguments_on_a_plan(tiny_plan_and_weights, tmp_path):
    from deepinfer import LLM
    from deepinfer.runtime.engine import EngineConfigError

    plan, _ = tiny_plan_and_weights
    with pytest.raises(EngineConfigError, match=r"^swa_replay_keep 10 is below the window \(16\)"):
        LLM(plan=plan, weights=tmp_path, enable_prefix_caching=True, swa_replay="bounded", swa_replay_keep=10)


# ---- deeply nested JSON, non-UTF-8 constraint files, damaged shards and tokenizers (2026-12-04 audit) ----

DEEP = "[" * 100000 + "]" * 100000


def test_deeply_nested_json_is_one_line(tmp_path, capsys, tiny_plan_and_weights):
    """A JSON file nested deeper than Python's recursion limit: plan.json, config.json, a prompt
    line and a --json-schema file each end in one line naming the file, not a RecursionError."""
    import shutil

    plan, ckpt = tiny_plan_and_weights
    bad_plan = tmp_path / "plan"
    shutil.copytree(plan, bad_plan)
    (bad_plan / "plan.json").write_text(DEEP)
    assert main(["generate", str(bad_plan), "--weights", str(ckpt), "--prompt", "x"]) == 2
    assert "plan.json is damaged (RecursionError)" in one_error_line(capsys)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(DEEP)
    assert main(["compile", "--model", str(model), "--target", "cpu", "-o", str(tmp_path / "p")]) == 2
    assert "nested too deeply" in one_error_line(capsys)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(DEEP + "\n")
    assert main(["generate", "--model", TINY, "--weights", str(tmp_path), "--prompts", str(prompts)]) == 2
    assert one_error_line(capsys).endswith("line 1: not JSON (nested too deeply)")
    schema = tmp_path / "schema.json"
    schema.write_text(DEEP)
    assert main(["generate", "--model", TINY, "--weights", str(tmp_path), "--prompt", "x",
                 "--json-schema", str(schema)]) == 2
    assert one_error_line(capsys).endswith("not JSON (nested too deeply)")


@pytest.mark.parametrize("flag", ["--json-schema", "--grammar"])
def test_constraint_files_that_are_not_utf8(tmp_path, capsys, flag):
    path = tmp_path / "c.txt"
    path.write_bytes(b"\xff{}")
    assert main(["generate", "--model", TINY, "--weights", str(tmp_path), "--prompt", "x", flag, str(path)]) == 2
    assert one_error_line(capsys) == f"deepinfer: error: {flag} {path}: not UTF-8 (byte 0xff at offset 0)"


def test_a_shard_with_bytes_past_its_tensors_is_refused(tmp_path):
    """A shard appended to (or whose tensors overlap) passed the header check and then failed in
    safetensors with its own error; the check now reads the data offsets as safetensors does."""
    import json
    import shutil
    import struct

    from deepinfer.models.checkpoint import CheckpointError, load_checkpoint, make_checkpoint
    from deepinfer.models.config import load_config

    cfg = load_config(TINY)
    ckpt = make_checkpoint(TINY, tmp_path / "ckpt", seed=1)
    shard = sorted(p for p in Path(ckpt).iterdir() if p.suffix == ".safetensors")[0]
    appended = tmp_path / "appended"
    shutil.copytree(ckpt, appended)
    with open(appended / shard.name, "ab") as f:
        f.write(b"GARBAGE")
    with pytest.raises(CheckpointError, match="bytes after the last tensor's data"):
        load_checkpoint(appended, cfg)
    overlap = tmp_path / "overlap"
    shutil.copytree(ckpt, overlap)
    raw = (overlap / shard.name).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    names = [k for k in header if k != "__metadata__"]
    header[names[1]]["data_offsets"] = header[names[0]]["data_offsets"]
    body = json.dumps(header).encode()
    (overlap / shard.name).write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:])
    with pytest.raises(CheckpointError, match="overlaps the tensor before it|leaves a gap"):
        load_checkpoint(overlap, cfg)


def test_a_file_that_is_no_tokenizer(tmp_path, capsys):
    from deepinfer.models.tokenizer import Tokenizer, TokenizerError

    for content in ("{not json", '{"model": {"type": "WordPiece"}}', DEEP):
        path = tmp_path / "tokenizer.json"
        path.write_text(content)
        with pytest.raises(TokenizerError, match=f"tokenizer file {path}: not a tokenizer.json") as e:
            Tokenizer(path)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("change,error", [  # each was a TypeError or KeyError from inside the runtime
    (lambda b: b["options"].update(max_model_len="big"), "option max_model_len must be a whole number >= 0, got 'big'"),
    (lambda b: b.update(graphs={}), "plan.json has no step graph"),
    (lambda b: b["load_program"][0].update(op="nosuch_op"), "load step 0 names no known op ('nosuch_op')"),
    (lambda b: b["options"].pop("page_tokens"), "option page_tokens is missing or zero"),
])
def test_a_plan_edited_behind_its_hash(tiny_plan_and_weights, tmp_path, capsys, change, error):
    """plan.json changed and its own hash recomputed (by hand or a broken writer): the fields the
    runtime reads first are checked by kind in load_plan, one line through the CLI."""
    import json
    import shutil

    from deepinfer.runtime.plan_file import canonical, sha256

    plan, ckpt = tiny_plan_and_weights
    bad = tmp_path / "plan"
    shutil.copytree(plan, bad)
    body = json.loads((bad / "plan.json").read_text())
    body.pop("self_sha256")
    change(body)
    body["self_sha256"] = sha256(canonical(body))
    (bad / "plan.json").write_text(json.dumps(body))
    assert main(["generate", str(bad), "--weights", str(ckpt), "--prompt", "x"]) == 2
    assert one_error_line(capsys) == f"deepinfer: error: plan {bad}: {error}"


@pytest.mark.parametrize("kwargs,error", [  # each was a TypeError
    ({"stop": 123}, "stop must be a list of non-empty strings, got 123"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids >= 0, got 5"),
    ({"bad_words": 5}, "bad_words must be a list of non-blank strings, got 5"),
    # a lone surrogate: was accepted as a stop string that never matches, and a UnicodeEncodeError as a bad word
    ({"stop": ["ok", "\ud800"]}, "stop must be valid Unicode text, got '\\ud800' (a lone surrogate)"),
    ({"bad_words": ["\ud800"]}, "bad_words must be valid Unicode text, got '\\ud800' (a lone surrogate)"),
    ({"json_schema": {"a": {1, 2}}}, "json_schema is not a JSON value: Object of type set is not JSON serializable"),
])
def test_sampling_params_of_the_wrong_kind(kwargs, error):
    from deepinfer.runtime.sampling_params import SamplingParams, SamplingParamsError

    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kwargs)
    assert str(e.value) == error


@pytest.mark.parametrize("kwargs,error", [
    ({"seed": "abc"}, "seed must be a non-negative integer below 2**64, got 'abc'"),  # was a TypeError
    ({"seed": -1}, "seed must be a non-negative integer below 2**64, got -1"),  # was accepted
    ({"weights": 5}, "weights must be a path, got int"),  # was a TypeError from pathlib
    ({"max_model_len": 10**11}, "max_model_len 100000000000 exceeds the model's max_position_embeddings"),
    ({"max_num_seqs": 10**9}, "cannot allocate the state and cache pool for max_num_seqs=1000000000"),  # was the
    # allocator's RuntimeError
])
def test_llm_arguments_of_the_wrong_kind(tiny_plan_and_weights, kwargs, error):
    from deepinfer import LLM
    from deepinfer.runtime.engine import EngineConfigError

    _, ckpt = tiny_plan_and_weights
    with pytest.raises(EngineConfigError) as e:
        LLM(TINY, **({"weights": ckpt} | kwargs))
    assert str(e.value).startswith(error) and "\n" not in str(e.value)


def test_llm_refuses_a_bad_tokenizer_before_loading_weights(tiny_plan_and_weights, tmp_path, monkeypatch):
    from deepinfer import LLM, llm
    from deepinfer.models.tokenizer import TokenizerError

    _, ckpt = tiny_plan_and_weights
    (tmp_path / "tok.json").write_text("{not json")
    monkeypatch.setattr(llm, "load_checkpoint", lambda *a, **k: pytest.fail("weights loaded first"))
    with pytest.raises(TokenizerError, match="not a tokenizer.json"):
        LLM(TINY, ckpt, tokenizer=tmp_path / "tok.json")


def test_make_checkpoint_overwrites_a_checkpoint_only(tmp_path, capsys):
    """--overwrite replaces a checkpoint directory; a directory of other files is refused in one
    line and kept (it used to be deleted whole)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("keep me")
    assert main(["make-checkpoint", "--model", TINY, "-o", str(mine), "--overwrite"]) == 2
    assert "not only a checkpoint" in one_error_line(capsys) and (mine / "thesis.tex").read_text() == "keep me"


def test_compile_under_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main(["compile", "--model", TINY, "--target", "cpu", "-o", str(tmp_path / "file" / "sub")]) == 2
    assert one_error_line(capsys).endswith(f"{tmp_path / 'file'} is a file, not a directory")


def test_generate_with_a_string_for_sampling_params(tiny_plan_and_weights):
    from deepinfer import LLM
    from deepinfer.runtime.engine import RequestError

    plan, ckpt = tiny_plan_and_weights
    llm = LLM(plan=plan, weights=ckpt)
    with pytest.raises(RequestError, match="sampling_params must be a SamplingParams or a list of them"):
        llm.generate("Hi", "temp")  # was "4 sampling params for 1 prompts"


def test_autotune_of_the_cpu_target_says_why_nothing_is_tuned(tmp_path, capsys):
    assert main(["autotune", "--model", TINY, "--target", "cpu", "--cost-model-only", "--db",
                 str(tmp_path / "db.jsonl")]) == 2
    assert one_error_line(capsys) == (f"deepinfer: error: nothing to tune in {TINY} on cpu (the cpu target runs "
                                      "the ops' torch references, which have no configs)")  # was: "in None"


# ---- 2027-01 audit: ignored flags, weights of another model, paths under files, argv bytes ----------

def test_generate_a_plan_for_another_target(tiny_plan_and_weights, capsys):
    """--target beside a plan was ignored: a cpu plan ran for --target sm90 (or --target bogus)."""
    plan, ckpt = tiny_plan_and_weights
    for target in ("sm90", "bogus"):
        assert main(["generate", str(plan), "--weights", str(ckpt), "--prompt", "hi", "--target", target]) == 2
        assert one_error_line(capsys) == f"deepinfer: error: plan {plan}: compiled for cpu, not {target}"


def test_the_interpreter_refuses_weights_of_another_model(tiny_plan_and_weights, tmp_path):
    """Tensors of the same shapes under another config (here rope_theta) loaded and ran silently
    with the model's settings; a plan refused them by config hash, the interpreter now does too."""
    import json

    from deepinfer import LLM
    from deepinfer.models.checkpoint import CheckpointError

    _, ckpt = tiny_plan_and_weights
    other = tmp_path / "other"
    other.mkdir()
    for p in Path(ckpt).iterdir():
        if p.name != "config.json":
            (other / p.name).symlink_to(p)
    config = json.loads((Path(ckpt) / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"rope_theta": 20000}))
    with pytest.raises(CheckpointError, match=rf"^weights {other} are for model other \(config \w{{12}}\), not "
                                              rf"{TINY} \(config \w{{12}}\)$"):
        LLM(TINY, other)


def test_make_checkpoint_under_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main(["make-checkpoint", "--model", TINY, "-o", str(tmp_path / "file" / "ckpt")]) == 2
    # was: "File exists: FILE", from mkdir
    assert one_error_line(capsys) == (f"deepinfer: error: {tmp_path / 'file' / 'ckpt'}: {tmp_path / 'file'} is a "
                                      "file, not a directory")
    assert (tmp_path / "file").read_text() == "x"


def test_a_prompt_of_non_utf8_bytes_is_one_line(tiny_plan_and_weights, capsys):
    """A byte of argv that is not UTF-8 reaches the prompt as a lone surrogate (Python's
    surrogateescape): it was a UnicodeEncodeError traceback from the tokenizer's binding."""
    plan, ckpt = tiny_plan_and_weights
    assert main(["generate", str(plan), "--weights", str(ckpt), "--prompt", "a\udcffb"]) == 2
    assert one_error_line(capsys) == ("deepinfer: error: prompt 0: text is not valid Unicode: '\\udcff' at character 1 "
                                      "is a lone surrogate")


@pytest.mark.parametrize("flags,named", [(["--ep", "2"], "--ep"), (["--max-model-len", "0"], "--max-model-len"),
                                         (["--max-num-seqs", "8", "--dp", "2"], "--max-num-seqs, --dp")])
def test_inspect_layout_flags_need_a_target(capsys, flags, named):
    """They size one rank of --target's plan; without --target they were ignored (the report
    without them read as their answer)."""
    assert main(["inspect", "--model", TINY, *flags]) == 2
    assert one_error_line(capsys) == (f"deepinfer: error: {named} size one rank of the plan for --target: only with "
                                      "--target")


def test_a_tuning_db_that_is_a_directory(tmp_path, capsys):
    assert main(["compile", "--model", TINY, "--target", "cpu", "-o", str(tmp_path / "plan"),
                 "--tuning-db", str(tmp_path)]) == 2
    assert one_error_line(capsys) == f"deepinfer: error: --tuning-db {tmp_path}: is not a file"  # was: "no such file"


@pytest.mark.parametrize("only", ["", ","])
def test_autotune_only_naming_nothing(tmp_path, capsys, only):
    """--only '' tuned every instance (as if not given), --only , none: both name nothing."""
    assert main(["autotune", "--model", TINY, "--target", "cpu", "--cost-model-only", "--db", str(tmp_path / "db.jsonl"),
                 "--only", only]) == 2
    assert one_error_line(capsys) == f"deepinfer: error: --only names no template or instance, got {only!r}"
    assert not (tmp_path / "db.jsonl").exists()
